"""The HTTP/1.1 front end (serving/http/) as raw clients see it, against a real server process: the
head's size cap, pipelining, chunked bodies, 100-continue, HEAD, V2 binary bodies received in place
(split anywhere, with a NaN, cut short), and several event loops (--http-threads)."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import numpy as np
import onnx
import pytest
import requests
from serving_fixtures import ServerProcess, heavy_model, run_onnx, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    # Two event loops (not the default for so small a model): what the tests below send crosses
    # loops as it would on a server of large rows, answers coming back to the loop that asked.
    with ServerProcess(
        "--model",
        str(model),
        "--max-header-bytes",
        "8192",
        "--http-threads",
        "2",
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    ) as srv:
        yield srv


def responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` responses read off `sock`: (status, headers, body) each."""
    data, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])
        }
        length = (
            int(headers.get("content-length", 0)) if not lines[0].startswith("HTTP/1.1 100") else 0
        )
        while len(data) < length:
            data += sock.recv(65536)
        out.append((int(lines[0].split()[1]), headers, data[:length]))
        data = data[length:]
    return out


def connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def image(rows: int = 1) -> np.ndarray:
    return np.random.default_rng(rows).random((rows, 1, 8, 8), dtype=np.float32)


def binary_request(x: np.ndarray, *, model: str = "tiny", extra_headers: str = "") -> bytes:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()
    body = header + x.tobytes()
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n{extra_headers}\r\n"
    ).encode() + body


def probabilities(body: bytes) -> np.ndarray:
    out = next(o for o in json.loads(body)["outputs"] if o["name"] == "probabilities")
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def test_a_head_past_max_header_bytes_is_a_431_without_a_token_and_the_connection_closes(server):
    before = requests.get(server.url + "/metrics").text
    with connect(server) as s:
        s.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"x-pad: "
            + b"a" * 9000
            + b"\r\n\r\n"
        )
        ((status, headers, body),) = responses(s, 1)
        assert (
            status == 431 and b"--max-header-bytes" in body and headers.get("connection") == "close"
        )
        # closed: its framing can't be trusted
        assert s.recv(10) == b""
    # A head that never ends is refused as soon as it passes the cap, not buffered
    with connect(server) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        for _ in range(20):
            try:
                s.sendall(b"x-pad: " + b"a" * 1000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        ((status, _, _),) = responses(s, 1)
        assert status == 431
    assert requests.get(server.url + "/v2/health/live").status_code == 200
    assert "Traceback" not in server.log() and before


def test_pipelined_requests_are_answered_in_order_on_one_connection(server, model):
    xs = [image(1), image(3), image(2)]
    with connect(server) as s:
        s.sendall(
            b"".join(binary_request(x) for x in xs)
            + b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        got = responses(s, 4)
    assert [g[0] for g in got] == [200, 200, 200, 200]
    for x, (_, _, body) in zip(xs, got):
        np.testing.assert_allclose(
            probabilities(body), run_onnx(model, x)["probabilities"], atol=1e-6
        )


def test_a_binary_body_split_anywhere_is_received_whole(server, model):
    """A binary V2 body lands straight in its batch rows, read by read: a read that ends mid-header,
    mid-value or between the header and the tensor must not matter."""
    x = image(2)
    request = binary_request(x)
    head_end = request.index(b"\r\n\r\n") + 4
    with connect(server) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for cut in (head_end - 7, head_end + 5, head_end + 60, len(request) - 3):
            s.sendall(request[:cut])
            time.sleep(0.05)
            s.sendall(request[cut:])
            ((status, _, body),) = responses(s, 1)
            assert status == 200, body
            np.testing.assert_allclose(
                probabilities(body), run_onnx(model, x)["probabilities"], atol=1e-6
            )


def test_a_nan_in_a_binary_body_is_a_400_that_names_it_and_the_connection_goes_on(server):
    x = image(2)
    x[1, 0, 3, 4] = np.nan
    with connect(server) as s:
        s.sendall(binary_request(x) + binary_request(image(1)))
        (bad, _, body), (good, _, _) = responses(s, 2)
    assert bad == 400 and re.search(rb"NaN|Inf|finite", body), body
    assert good == 200


def test_chunked_bodies_100_continue_and_head_are_http_as_clients_send_them(server, model):
    x = image(1)
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 1, 8, 8],
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()
    chunks = (
        b"".join(
            f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:100], body[100:])
        )
        + b"0\r\n\r\n"
    )
    with connect(server) as s:
        s.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks
        )
        ((status, _, answer),) = responses(s, 1)
    assert status == 200
    np.testing.assert_allclose(
        probabilities(answer), run_onnx(model, x)["probabilities"], atol=1e-6
    )

    # the client waits for 100 Continue before it sends the body
    with connect(server) as s:
        s.sendall(
            f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        ((status, _, _),) = responses(s, 1)
        assert status == 100
        s.sendall(body)
        ((status, _, answer),) = responses(s, 1)
    assert status == 200

    with connect(server) as s:
        s.sendall(
            b"HEAD /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        )
        s.settimeout(5)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2:
            data += s.recv(4096)
        first, second = data.split(b"HTTP/1.1 200")[1:3]
        # HEAD: the headers, no body (the next response follows at once)
        assert first.endswith(b"\r\n\r\n")


def test_a_body_cut_short_by_a_client_that_leaves_frees_its_rows_for_the_next(server, model):
    request = binary_request(image(4))
    # more than the batch buffers a version has: a place that leaked would run them out
    for _ in range(8):
        with connect(server) as s:
            s.sendall(request[: len(request) - 100])
        time.sleep(0.05)
    with connect(server) as s:
        s.sendall(binary_request(image(3)))
        ((status, _, body),) = responses(s, 1)
    assert status == 200
    np.testing.assert_allclose(
        probabilities(body), run_onnx(model, image(3))["probabilities"], atol=1e-6
    )


def test_how_many_event_loops_by_row_size_and_cpus(monkeypatch):
    import serving.cpus
    from serving.config import LARGE_ROW_BYTES, Settings

    monkeypatch.setattr(serving.cpus, "usable_cpus", lambda: 16)
    assert [Settings().http_loops(n) for n in (0, LARGE_ROW_BYTES - 1, LARGE_ROW_BYTES)] == [
        1,
        1,
        8,
    ]
    assert Settings(http_threads=3).http_loops(0) == 3
    monkeypatch.setattr(serving.cpus, "usable_cpus", lambda: 1)
    assert Settings().http_loops(LARGE_ROW_BYTES) == 1


@pytest.mark.parametrize("batch_axis", ["dynamic", "fixed"])
def test_one_event_loop_by_default_and_one_per_cpu_for_models_of_large_rows(
    model, tmp_path, batch_axis
):
    """The loops share the GIL: for small requests a second one costs more than it takes in
    (Settings.http_loops); only a model whose rows are 512 KiB or more gets one per CPU unasked,
    with a batch axis or without one (a plain torch.onnx.export of one image). The batch rows'
    size decides the front-end processes too (Settings.front_end_processes): from 8 CPUs, a front
    end per 4 of them in place of the loops."""
    cpus = len(os.sched_getaffinity(0))
    with ServerProcess("--model", str(model), log_path=tmp_path / "small.log") as srv:
        assert (
            "HTTP on 1 event loop (no model loaded at start has rows of 512 KiB or more"
            in srv.log()
            or cpus == 1
        )
        assert (
            "front ends: none, one process (no model loaded at start has batch rows of 512 KiB"
            in srv.log()
        )
    # 384x384 FP32: 576 KiB a row
    large = heavy_model(tmp_path / "large.onnx", size=384, channels=1, layers=0)
    if batch_axis == "fixed":
        graph = onnx.load(large)
        for value in (*graph.graph.input, *graph.graph.output):
            value.type.tensor_type.shape.dim[0].dim_value = 1
        onnx.save(graph, large)
    with ServerProcess("--model", str(large), log_path=tmp_path / "large.log") as srv:
        if batch_axis == "fixed":
            # run alone, its rows come inline: no front end would receive them into batch rows
            assert "front ends: none, one process (no model loaded at start has batch" in srv.log()
        elif cpus < 8:
            assert f"front ends: none, one process ({cpus} CPU" in srv.log()
        else:
            assert f"front ends: {min(8, cpus // 4)} processes ({cpus} CPUs usable" in srv.log()
        if batch_axis == "fixed" or cpus < 8:
            assert f"HTTP on {min(8, cpus)} event loop" in srv.log()
        x = np.random.default_rng(0).random((1, 1, 384, 384), dtype=np.float32)
        with connect(srv) as s:
            s.sendall(binary_request(x, model="heavy"))
            ((status, _, body),) = responses(s, 1)
        assert status == 200, body


def test_several_event_loops_share_the_port_and_say_so(model, tmp_path):
    with ServerProcess(
        "--model", str(model), "--http-threads", "3", log_path=tmp_path / "log"
    ) as srv:
        assert "HTTP on 3 event loops" in srv.log()
        sockets = [connect(srv) for _ in range(12)]
        try:
            xs = [image(1 + i % 4) for i in range(12)]
            for s, x in zip(sockets, xs):
                s.sendall(binary_request(x))
            for s, x in zip(sockets, xs):
                ((status, _, body),) = responses(s, 1)
                assert status == 200
                np.testing.assert_allclose(
                    probabilities(body), run_onnx(model, x)["probabilities"], atol=1e-6
                )
        finally:
            for s in sockets:
                s.close()
        # the repository API runs on the server's own loop, whichever loop took the connection
        assert requests.get(srv.url + "/v2/models/tiny").json()["name"] == "tiny"


@pytest.fixture(scope="module")
def large_rows_server(tmp_path_factory):
    """One event loop and a model of 256 KiB rows (1x256x256 FP32): bodies large enough to be waited
    for whole."""
    model = tiny_model(tmp_path_factory.mktemp("large") / "large.onnx", size=256)
    with ServerProcess(
        "--model",
        str(model),
        "--http-threads",
        "1",
        "--read-timeout",
        "2",
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    ) as srv:
        srv.model = model
        yield srv


def read_calls(pid: int) -> int:
    """The read system calls of every thread of process `pid` so far (the kernel's count)."""
    return int(re.search(r"syscr: (\d+)", open(f"/proc/{pid}/io").read()).group(1))


def test_a_large_body_trickling_in_is_read_once_it_is_in_not_piece_by_piece(large_rows_server):
    """A 512 KiB body sent in 16 pieces 10 ms apart: the loop is woken for it once the rest is in
    (SO_RCVLOWAT), not for each piece (a read, a wake-up and two calls into the connection a
    piece)."""
    srv = large_rows_server
    x = np.random.default_rng(5).random((2, 1, 256, 256), dtype=np.float32)
    request = binary_request(x)
    head_end = request.index(b"\r\n\r\n") + 4
    pieces = [request[: head_end + 200]] + [
        request[at : at + 32768] for at in range(head_end + 200, len(request), 32768)
    ]
    assert len(pieces) >= 16
    with connect(srv) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        requests_sent, before = 3, read_calls(srv.proc.pid)
        for _ in range(requests_sent):
            for piece in pieces:
                s.sendall(piece)
                time.sleep(0.01)
            ((status, _, body),) = responses(s, 1)
            assert status == 200, body
            np.testing.assert_allclose(
                probabilities(body), run_onnx(srv.model, x)["probabilities"], atol=1e-5
            )
        reads = (read_calls(srv.proc.pid) - before) / requests_sent
        # The body's first 100 KB, a pause (the server reads them and waits for the rest), then the
        # rest at once: the last read ends the body while the server waits for that much. A small
        # request after it on the same connection is read at once (the wait was for the body only),
        # not when the 2 s --read-timeout ends it.
        s.sendall(b"".join(pieces[:4]))
        time.sleep(0.1)
        s.sendall(b"".join(pieces[4:]))
        assert responses(s, 1)[0][0] == 200
        started = time.monotonic()
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert responses(s, 1)[0][0] == 200
        assert time.monotonic() - started < 1.0
    assert reads < 8, f"{reads:.1f} reads a request for a body sent in {len(pieces)} pieces"


def test_a_large_body_cut_short_or_stalled_is_still_ended(large_rows_server):
    """The read waits for the rest of the body, never for more: a client that leaves half-way frees
    the request's rows; one that stalls half-way gets its 408 at --read-timeout."""
    srv = large_rows_server
    x = np.random.default_rng(6).random((1, 1, 256, 256), dtype=np.float32)
    request = binary_request(x)
    # more than the batch buffers a version has: a place that leaked would run them out
    for _ in range(8):
        with connect(srv) as s:
            s.sendall(request[: len(request) // 2])
            time.sleep(0.05)
    with connect(srv) as s:
        s.sendall(request)
        ((status, _, body),) = responses(s, 1)
    assert status == 200, body
    with connect(srv) as s:
        s.sendall(request[: len(request) // 2])
        started = time.monotonic()
        ((status, _, body),) = responses(s, 1)
        assert status == 408 and time.monotonic() - started < 5, body


@pytest.mark.parametrize(
    "release, wakes",
    [
        ("6.18.44-fc-v1045", True),
        ("5.10.0-28-amd64", True),
        ("5.4.0-150-generic", False),
        ("4.14.336-257.562.amzn2.x86_64", False),
        ("3.10.0-1160.el7.x86_64", False),
    ],
)
def test_bodies_are_waited_for_whole_only_on_kernels_that_do_it_without_hanging(
    monkeypatch, release, wakes
):
    """A container runs on its host's kernel: below Linux 5.10 a body is not waited for with
    SO_RCVLOWAT (why: docs/benchmarks.md#servinghttpconnectionpy)."""
    from serving.http import connection

    monkeypatch.setattr(connection.platform, "system", lambda: "Linux")
    monkeypatch.setattr(connection.platform, "release", lambda: release)
    assert connection._kernel_wakes_on_body() is wakes
