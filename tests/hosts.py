"""Hosts for multi-machine tests, made as Linux network namespaces on one machine.

Each host is a network namespace with its own address on a private /24, joined to a bridge in the
root namespace through a veth pair, and its own empty working directory. Services started in the
root namespace and bound to `network.gateway` (the bridge's address) are reachable from every host;
hosts reach each other by address. Nothing names a host: these names do not resolve, as on machines
without DNS, so a test passes addresses.

    def test_two_machines(hosts):
        network = hosts(2)                      # skips, with the reason, where namespaces can't be made
        a, b = network.hosts
        server = a.popen(["python", "-m", "http.server", "--bind", a.address, "8000"])
        b.run(["curl", f"http://{a.address}:8000/"], timeout=10)

The API, kept small on purpose (other tests run server replicas on these hosts):
  - `hosts(n)` (fixture): a `Network` of n hosts, all torn down when the test ends, failed or not
  - `Network.gateway`: the bridge's address in the root namespace; `Network.hosts`: the hosts
  - `Host.name`, `.address`, `.interface` (the host's side of its link: "eth0", for
    GLOO_SOCKET_IFNAME), `.workdir` (empty, the host's own)
  - `Host.command(cmd)`: the argv that runs `cmd` inside the host (`ip netns exec NAME ...`)
  - `Host.popen(cmd, env=..., **kw)` / `Host.run(cmd, env=..., timeout=...)`: start / run it there,
    in `workdir` unless `cwd` is given; processes started with `popen` are killed at teardown.

Trap: namespace, bridge and veth names are global to the machine, shared with every other test
session running here, and interface names are at most 15 bytes. Each network takes a random tag for
its names and a /24 no interface of the machine has yet.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOST_INTERFACE = "eth0"


def ip(*args: str, netns: str | None = None) -> None:
    """`ip ARGS` in the root namespace, or inside `netns`; raises with ip's message on failure."""
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


# a host is itself, not its fields: usable as a dict key
@dataclass(eq=False)
class Host:
    """One machine: a network namespace, its address, its own working directory."""

    name: str
    address: str
    workdir: Path
    interface: str = HOST_INTERFACE
    started: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def popen(
        self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, **kwargs
    ) -> subprocess.Popen:
        """`cmd` started inside this host, in a session of its own (so teardown can kill its
        children)."""
        proc = subprocess.Popen(
            self.command(cmd), env=env, cwd=cwd or self.workdir, start_new_session=True, **kwargs
        )
        self.started.append(proc)
        return proc

    def run(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 300,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """`cmd` run to its end inside this host, its output captured as text."""
        proc = subprocess.run(
            self.command(cmd),
            env=env,
            cwd=cwd or self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"on {self.name}: {' '.join(cmd)} exited {proc.returncode}\n"
                f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
            )
        return proc


@dataclass
class Network:
    """A bridge in the root namespace (address `gateway`) and the hosts on it."""

    bridge: str
    gateway: str
    hosts: list[Host]


def namespaces_unavailable() -> str | None:
    """Why network namespaces can't be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the test as root, as CI does)"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available on this machine"
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface of this machine is on (other sessions' networks included)."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True
    ).stdout
    taken = {
        ipaddress.ip_interface(word).network
        for word in shown.split()
        if "/" in word and word[0].isdigit()
    }
    for _ in range(100):
        subnet = ipaddress.ip_network(
            f"10.{secrets.randbelow(56) + 200}.{secrets.randbelow(256)}.0/24"
        )
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError("no free 10.200-255.x.0/24 on this machine")


def make_network(count: int, root: Path, teardown: list) -> Network:
    """`count` hosts on a fresh bridge; every undo step is appended to `teardown` as soon as it is
    needed, so a failure half-way still removes what was made."""
    tag = secrets.token_hex(3)
    subnet = free_subnet()
    addresses = [str(a) for a in subnet.hosts()]
    gateway, bridge = addresses[0], f"tsbr{tag}"
    ip("link", "add", bridge, "type", "bridge")
    teardown.append(lambda: ip("link", "del", bridge))
    ip("addr", "add", f"{gateway}/24", "dev", bridge)
    ip("link", "set", bridge, "up")
    hosts = []
    for index in range(count):
        name, outside = f"ts{tag}h{index}", f"tsv{tag}{index}"
        ip("netns", "add", name)
        host = Host(name, addresses[index + 1], root / name)
        teardown.append(lambda host=host: remove_host(host))
        # Created with its peer inside the namespace already, so no other session ever sees a stray
        # "eth0".
        ip("link", "add", outside, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", name)
        ip("link", "set", outside, "master", bridge)
        ip("link", "set", outside, "up")
        ip("addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE, netns=name)
        ip("link", "set", HOST_INTERFACE, "up", netns=name)
        ip("link", "set", "lo", "up", netns=name)
        host.workdir.mkdir(parents=True)
        hosts.append(host)
    return Network(bridge, gateway, hosts)


def remove_host(host: Host) -> None:
    """Kill what the test started there, then whatever is left inside the namespace (only our
    processes can be in it), then the namespace; its veth pair goes with it."""
    for proc in host.started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    left = subprocess.run(
        ["ip", "netns", "pids", host.name], capture_output=True, text=True
    ).stdout.split()
    for pid in left:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    ip("netns", "del", host.name)


@pytest.fixture
def hosts(tmp_path):
    """`hosts(n)`: a Network of n namespace hosts, removed at teardown; skips where they can't be
    made."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    teardown: list = []

    def make(count: int) -> Network:
        return make_network(count, tmp_path / f"hosts{len(teardown)}", teardown)

    try:
        yield make
    finally:
        errors = []
        for undo in reversed(teardown):
            try:
                undo()
            except Exception as exc:
                # keep tearing down: one stuck host must not leave the rest behind
                errors.append(exc)
        if errors:
            raise errors[0]
