"""The shared batch rows (serving/arena.py) across real processes: the engine's process makes an
arena, child processes map it from its descriptor and reserve, fill and abandon places in it as
front ends do, and the parent takes spans as the engine does. What must hold between processes:
the lock excludes, no two live places share a row, each run reads exactly what each request's
process wrote, and a process killed at any point (holding the lock, or with a body half in) leaves
no place alive and no buffer lost."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from serving import arena as shared
from serving.placements import DEAD, RESERVED

pytestmark = pytest.mark.skipif(bool(shared.WHY_NOT), reason=shared.WHY_NOT or "built")
ROOT = Path(__file__).resolve().parents[1]
X = shared.Spec("x", np.float32, (-1, 4))
OWNER = types.SimpleNamespace(ended=lambda arrival: None)

# A front end's part, in a child process: the arena's descriptor is inherited (argv[1]), its layout
# in argv[2], then what to do.
OPEN = """
import json, sys, time, types
import numpy as np
from serving.arena import Arena
arena = Arena.open(int(sys.argv[1]), json.loads(sys.argv[2]))
owner = types.SimpleNamespace(ended=lambda arrival: None)
"""
COUNT = (
    OPEN
    + """
words, at = arena.table.words, arena.table.header + 7
# both at once: each begins at the same moment
time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
for _ in range(int(sys.argv[3])):
    with arena.lock:
        value = words[at]
        words[at] = value + 1
"""
)
RESERVE = (
    OPEN
    + """
me, n, capacity = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
p = arena.placements(capacity, owner=me)
rng = np.random.default_rng(me)
sent = 0
while sent < n:
    rows = int(rng.integers(1, 4))
    arrival = p.arriving(owner, rows)
    if arrival.place is None:
        # every buffer taken: this arrival goes no further (the engine forgets it), and a later try
        print("none", flush=True)
        time.sleep(0.002)
        continue
    value = me * 1_000_000 + sent
    arrival.views["x"][:] = value
    place = arrival.place
    print(place.group.index, place.k, place.ticket, rows, value, flush=True)
    sent += 1
print("done", flush=True)
"""
)
HOLD = (
    OPEN
    + """
arena.lock.acquire()
print("holding", flush=True)
time.sleep(60)
"""
)
HALF = (
    OPEN
    + """
p = arena.placements(8, owner=int(sys.argv[3]))
arrival = p.arriving(owner, 2)
arrival.views["x"][0] = 5.0
print(arrival.place.group.index, arrival.place.k, flush=True)
time.sleep(60)
"""
)
TURN = (
    OPEN
    + """
p = arena.placements(8, owner=int(sys.argv[3]))
p.turn_begun()
print("in a turn", flush=True)
time.sleep(60)
"""
)


def child(arena: shared.Arena, code: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, str(arena.fd), json.dumps(arena.layout), *map(str, args)],
        pass_fds=[arena.fd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_the_lock_excludes_between_processes(processes):
    """Two processes add 1 to a shared word 100,000 times each, at the same time, read and written
    under the lock: none of the 200,000 is lost (without the lock, thousands are)."""
    arena = shared.Arena.create([X], 8)
    start = time.time() + 3
    processes += [child(arena, COUNT, 100_000, start) for _ in range(2)]
    for proc in processes:
        assert proc.wait(120) == 0
    assert arena.table.words[arena.table.header + 7] == 200_000


def test_descriptors_pass_to_another_process_and_it_writes_the_same_rows(processes):
    """The engine's descriptor goes over a Unix socket (SCM_RIGHTS), not inherited: the other
    process's rows are the engine's."""
    arena = shared.Arena.create([X], 8)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    code = """
import json, socket, sys
from serving import arena
sock = socket.socket(fileno=int(sys.argv[1]))
fd, = arena.receive(sock)
rows = arena.Arena.open(fd, json.loads(sys.argv[2]))
rows.buffers.make(2)["x"][5] = [1, 2, 3, 4]
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(theirs.fileno()), json.dumps(arena.layout)],
        pass_fds=[theirs.fileno()],
        cwd=ROOT,
    )
    processes.append(proc)
    theirs.close()
    shared.send(ours, [arena.fd])
    assert proc.wait(60) == 0
    assert arena.buffers.make(2)["x"][5].tolist() == [1, 2, 3, 4]


def test_places_reserved_by_two_processes_run_with_their_own_rows(processes):
    """Two front-end processes reserve places of 1-3 rows as fast as they can, write their
    request's value into them and hand each over; the engine adopts, fills and runs spans
    meanwhile. Every run reads each request's own value in each of its rows (no place shared a row
    with another, none was handed out under a run, a place moved next to others carried its rows),
    and at the end nothing is on its way and every buffer is back."""
    arena = shared.Arena.create([X], 8)
    p = arena.placements(8)
    n = 300
    processes += [child(arena, RESERVE, owner, n, 8) for owner in (1, 2)]
    streams = {proc.stdout.fileno(): (owner, proc) for owner, proc in zip((1, 2), processes)}
    checked, finished, deadline = 0, set(), time.monotonic() + 120
    while len(finished) < 2 or p.pending():
        assert time.monotonic() < deadline, "the front ends did not finish"
        ready = select.select(list(streams), [], [], 0.001)[0] if len(finished) < 2 else []
        for fd in ready:
            owner, proc = streams[fd]
            line = proc.stdout.readline().split()
            if line == ["done"]:
                finished.add(owner)
                del streams[fd]
                continue
            if line == ["none"]:
                p.forget(shared_arrival(p, owner))
                continue
            index, k, ticket, rows, value = map(int, line)
            arrival = p.adopt(OWNER, owner, index, k, ticket)
            assert arrival.place is not None
            p.forget(arrival)
            place = p.fill(arrival.place, (value, rows))
            assert place is not None
        span = p.next_span()
        if span is None:
            continue
        jobs = p.take(span)
        feeds = p.batch(span).feeds
        for place in span.places:
            if place.job is not None:
                value, rows = place.job
                got = feeds["x"][place.start - span.start : place.start - span.start + rows]
                assert (got == value).all(), (value, got)
                checked += 1
        assert len(jobs) == sum(p.job is not None for p in span.places)
        p.done(span)
    for proc in processes:
        assert proc.wait(30) == 0
    assert checked == 2 * n
    assert not p.on_the_way()
    assert p.free_buffers() == list(range(arena.table.count))


def shared_arrival(p, owner: int):
    """An arrival a front end counted and gave up before it had a place (handed over to be
    forgotten: the engine forgets arrivals)."""
    return p.adopt(OWNER, owner, -1, 0, 0)


def test_a_process_killed_holding_the_lock_leaves_it_to_the_next(processes):
    """A front end SIGKILLed while it holds the lock: the next taker gets it (robust mutex), and
    says it took it from a dead holder."""
    arena = shared.Arena.create([X], 8)
    proc = child(arena, HOLD)
    processes.append(proc)
    assert proc.stdout.readline().strip() == "holding"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    taken = threading.Event()

    def take():
        with arena.lock:
            taken.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(10)
    assert taken.is_set(), "the lock of a dead holder was never given to anyone else"
    assert arena.lock.recovered == 1


def test_a_process_killed_with_a_body_half_in_leaves_no_place_and_no_buffer(processes):
    """A front end SIGKILLed while a body arrives into its place: `gone` kills its place and forgets
    its arrival, its buffer goes back once the engine's own request in it ran, and no shared-memory
    file was ever made (a memfd has no name in /dev/shm)."""
    arena = shared.Arena.create([X], 8)
    # (not a /dev/shm listing before and after: another test worker may make files there meanwhile)
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:trainserve-")
    p = arena.placements(8)
    ours = p.arriving(OWNER, 1)
    proc = child(arena, HALF, 3)
    processes.append(proc)
    index, k = map(int, proc.stdout.readline().split())
    p.forget(ours)
    assert p.on_the_way()
    place = p.fill(ours.place, "ours")
    span = p.next_span()
    # the place still arriving ends the span
    assert [q.job for q in span.places] == ["ours"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert p.gone(3)
    assert not p.on_the_way()
    theirs = p._group(index).places[k]
    assert theirs.state == DEAD and place.state != RESERVED
    p.take(span)
    assert p.free_buffers() == [1, 2]
    p.done(span)
    assert p.free_buffers() == [0, 1, 2]


def test_a_process_killed_in_a_turn_of_handing_requests_over_holds_no_batch_back(processes):
    """A front end SIGKILLed between handing a request over and the end of its event loop's turn:
    while it lives the engine leaves a batch to the turn's records (turns_under_way); once `gone`
    forgets it, no turn is under way and the batch is the engine's to run."""
    arena = shared.Arena.create([X], 8)
    p = arena.placements(8)
    proc = child(arena, TURN, 4)
    processes.append(proc)
    assert proc.stdout.readline().strip() == "in a turn"
    assert p.turns_under_way()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    p.gone(4)
    assert not p.turns_under_way()
