"""The V2 system shared-memory extension as an unmodified tritonclient uses it, over HTTP and gRPC,
against a real `python -m serving` process: register, status, infer with the input and the output in
shared memory, unregister; and every misuse a clear 4xx (a region too small, an unknown one, another
token's, a key that does not exist, the extension off, CUDA regions on a server without a GPU)."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import time

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from serving_fixtures import ServerProcess, free_port, run_onnx, tiny_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow
ALICE, BOB = "alice-token", "bob-token"
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("shm")
    model = tiny_model(d / "tiny.onnx")
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        str(model),
        "--grpc-port",
        str(grpc_port),
        env={"TRAINSERVE_AUTH_TOKEN": f"{ALICE},{BOB}"},
        log_path=d / "server.log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{grpc_port}"
        srv.model = model
        yield srv


def client(server, protocol: str):
    if protocol == "http":
        return triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    return triton_grpc.InferenceServerClient(server.grpc)


def auth(token: str) -> dict[str, str]:
    # (gRPC metadata keys are lower case; HTTP takes any case)
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def regions(request):
    """POSIX shared memory regions made as a client makes them, destroyed after the test."""
    made = []

    def make(name: str, size: int):
        key = f"/trainserve-test-{os.getpid()}-{request.node.name[-20:]}-{name}".replace(
            "[", ""
        ).replace("]", "")
        handle = shm.create_shared_memory_region(name, key, size)
        made.append(handle)
        return handle, key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def infer(
    server,
    protocol: str,
    token: str,
    inputs: list[tuple[str, int, int]],
    output: tuple[str, int] | None,
    shape=(2, 1, 8, 8),
):
    """An inference with each input (name, region, byte size, offset) in shared memory; the output
    too if given."""
    mod = triton_http if protocol == "http" else triton_grpc
    tensors = []
    for region, size, offset in inputs:
        tensor = mod.InferInput("input", list(shape), "FP32")
        tensor.set_shared_memory(region, size, offset)
        tensors.append(tensor)
    outputs = None
    if output is not None:
        wanted = mod.InferRequestedOutput(
            "probabilities", **({"binary_data": True} if protocol == "http" else {})
        )
        wanted.set_shared_memory(*output)
        outputs = [wanted]
    return client(server, protocol).infer("tiny", tensors, outputs=outputs, headers=auth(token))


def names(c, protocol: str, token: str) -> list[str]:
    """The names of the system regions `token` has registered, as the status call lists them."""
    status = c.get_system_shared_memory_status(headers=auth(token))
    return sorted(r["name"] for r in status) if protocol == "http" else sorted(status.regions)


def refused(call) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    status = str(caught.value.status())
    assert (
        status.startswith("4") or status.startswith("StatusCode.") and "INTERNAL" not in status
    ), status
    return caught.value.message()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_inputs_and_outputs_through_shared_memory_as_tritonclient_does_it(
    server, protocol, regions
):
    x = np.random.default_rng(3).random((2, 1, 8, 8), dtype=np.float32)
    want = run_onnx(server.model, x)["probabilities"]
    inp, in_key = regions("in", x.nbytes + 64)
    out, out_key = regions("out", 64)
    # the tensor at offset 64
    shm.set_shared_memory_region(inp, [np.zeros(16, np.float32), x])
    c = client(server, protocol)
    c.register_system_shared_memory("in", in_key, x.nbytes + 64, headers=auth(ALICE))
    c.register_system_shared_memory("out", out_key, 64, headers=auth(ALICE))
    status = c.get_system_shared_memory_status(headers=auth(ALICE))
    listed = (
        status
        if protocol == "http"
        else [
            dict(name=k, key=v.key, byte_size=v.byte_size, offset=v.offset)
            for k, v in status.regions.items()
        ]
    )
    assert sorted((r["name"], r["key"], int(r["byte_size"])) for r in listed) == [
        ("in", in_key, x.nbytes + 64),
        ("out", out_key, 64),
    ]
    try:
        result = infer(server, protocol, ALICE, [("in", x.nbytes, 64)], ("out", 64, 0))
        meta = result.get_output("probabilities")
        shape = meta["shape"] if protocol == "http" else list(meta.shape)
        assert shape == [2, 3]
        np.testing.assert_allclose(
            shm.get_contents_as_numpy(out, np.float32, shape), want, rtol=1e-5, atol=1e-6
        )
        # the input by region, the output in the answer
        result = infer(server, protocol, ALICE, [("in", x.nbytes, 64)], None)
        np.testing.assert_allclose(result.as_numpy("probabilities"), want, rtol=1e-5, atol=1e-6)
    finally:
        c.unregister_system_shared_memory(headers=auth(ALICE))
    assert (
        len(
            c.get_system_shared_memory_status(headers=auth(ALICE))
            if protocol == "http"
            else c.get_system_shared_memory_status(headers=auth(ALICE)).regions
        )
        == 0
    )
    message = refused(lambda: infer(server, protocol, ALICE, [("in", x.nbytes, 64)], None))
    assert "no shared memory region 'in' is registered by this client" in message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_misuse_of_shared_memory_is_a_clear_4xx(server, protocol, regions):
    x = np.ones((2, 1, 8, 8), np.float32)
    small, small_key = regions("small", 100)
    big, big_key = regions("big", x.nbytes)
    shm.set_shared_memory_region(big, [x])
    c = client(server, protocol)
    c.register_system_shared_memory("small", small_key, 100, headers=auth(ALICE))
    c.register_system_shared_memory("big", big_key, x.nbytes, headers=auth(ALICE))
    try:
        # an input that runs past its region
        message = refused(lambda: infer(server, protocol, ALICE, [("small", x.nbytes, 0)], None))
        assert "pass the end of region 'small' (100 bytes registered)" in message, message
        # (Triton's words for it too, which its clients look for)
        assert "Invalid offset + byte size for shared memory region 'small'" in message, message
        message = refused(lambda: infer(server, protocol, ALICE, [("small", x.nbytes, 100)], None))
        assert "Invalid offset for shared memory region 'small'" in message, message
        # (gRPC's offsets are int64)
        if protocol == "http":
            far = [("small", x.nbytes, 2**64 - 32)]
            message = refused(lambda: infer(server, protocol, ALICE, far, None))
            assert "Invalid offset for shared memory region 'small'" in message, message
            out = ("small", 2**64 - 32, 32)
            message = refused(lambda: infer(server, protocol, ALICE, [("big", x.nbytes, 0)], out))
            assert (
                "Integer overflow detected: byte_size 18446744073709551584 + offset 32" in message
            )
        # an input's byte size that is not its tensor's
        message = refused(lambda: infer(server, protocol, ALICE, [("big", x.nbytes - 4, 0)], None))
        assert (
            "input byte size mismatch for input 'input' for model 'tiny'. Expected 512, got 508: "
            "shared_memory_byte_size must be the 512 bytes its shape takes of FP32" in message
        ), message
        # an output region too small for the answer
        message = refused(
            lambda: infer(server, protocol, ALICE, [("big", x.nbytes, 0)], ("small", 8, 0))
        )
        assert "do not fit the 8 bytes given in shared memory region 'small'" in message, message
        # an unknown region
        message = refused(lambda: infer(server, protocol, ALICE, [("nowhere", x.nbytes, 0)], None))
        assert "no shared memory region 'nowhere' is registered by this client" in message, message
        # another token's region: not seen, not used, not unregistered
        message = refused(lambda: infer(server, protocol, BOB, [("big", x.nbytes, 0)], None))
        assert "no shared memory region 'big' is registered by this client" in message, message
        bobs = c.get_system_shared_memory_status(headers=auth(BOB))
        assert len(bobs if protocol == "http" else bobs.regions) == 0
        # bob's unregister of the name succeeds, as any unknown name's does, and leaves alice's
        # region be
        c.unregister_system_shared_memory("big", headers=auth(BOB))
        assert "big" in names(c, protocol, ALICE)
        # a name registered twice, a key that does not exist, a key that is a path
        message = refused(
            lambda: c.register_system_shared_memory("big", big_key, 8, headers=auth(ALICE))
        )
        assert "'big' already in manager: unregister it first or register" in message, message
        # (over HTTP the name is in the path: no route has an empty one)
        if protocol == "grpc":
            message = refused(
                lambda: c.register_system_shared_memory("", big_key, 8, headers=auth(ALICE))
            )
            assert (
                "failed to register shared memory region '': invalid args: a system shared memory "
                "region needs a name of 1 to 256 characters" in message
            ), message
        message = refused(
            lambda: c.register_system_shared_memory(
                "gone", "/no-such-key-here", 8, headers=auth(ALICE)
            )
        )
        assert "cannot open shared memory key '/no-such-key-here'" in message, message
        message = refused(
            lambda: c.register_system_shared_memory("etc", "/../etc/passwd", 8, headers=auth(ALICE))
        )
        assert (
            "cannot register shared memory region 'etc' - invalid shm key '/../etc/passwd': not a "
            "POSIX shared memory name" in message
        ), message
        # a region larger than the object it names
        message = refused(
            lambda: c.register_system_shared_memory("huge", big_key, 1 << 20, headers=auth(ALICE))
        )
        assert (
            "failed to register shared memory region 'huge': invalid args: offset 0 + byte_size "
            "1048576 passes the end of shared memory key" in message
        ), message
        # no token: 401 before anything
        message = refused(lambda: c.get_system_shared_memory_status())
        assert "bearer token" in message, message
        # CUDA regions on a server without a GPU (the handle base64-encoded, as
        # cuda_shared_memory.get_raw_handle gives it)
        handle = base64.b64encode(b"\0" * 64)
        handle = handle.decode() if protocol == "http" else handle
        message = refused(
            lambda: c.register_cuda_shared_memory("gpu", handle, 0, 64, headers=auth(ALICE))
        )
        assert "this server runs on the CPU" in message, message
    finally:
        c.unregister_system_shared_memory(headers=auth(ALICE))
    assert "Traceback" not in server.log()


def test_shared_memory_off_lists_none_and_refuses_registering_with_403(tmp_path, regions):
    """As Triton with client shared memory off: status answers an empty list, register and
    unregister are refused, over HTTP and gRPC."""
    model = tiny_model(tmp_path / "tiny.onnx")
    handle, key = regions("r", 64)
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        str(model),
        "--shared-memory",
        "off",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp_path / "log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{grpc_port}"
        for protocol in PROTOCOLS:
            c = client(srv, protocol)
            assert names(c, protocol, "any") == []
            for call in (
                lambda: c.register_system_shared_memory("r", key, 64),
                lambda: c.unregister_system_shared_memory("r"),
            ):
                with pytest.raises(InferenceServerException) as caught:
                    call()
                assert caught.value.status() in ("403", "StatusCode.PERMISSION_DENIED")
                assert (
                    "Client shared memory is disabled on this server (--shared-memory off)"
                    in caught.value.message()
                )
        extensions = client(srv, "http").get_server_metadata()["extensions"]
        assert "system_shared_memory" not in extensions and "binary_tensor_data" in extensions


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_object_shrunk_under_its_region_is_a_400_naming_it_and_the_server_lives(
    server, protocol, regions
):
    """A client shrinks (ftruncate) the object under its registered region: an input read from it,
    or an output written to it, is a 400 naming the region, and the server goes on (it died of
    SIGBUS, exit 135)."""
    x = np.random.default_rng(5).random((2, 1, 8, 8), dtype=np.float32)
    handle, key = regions("shrunk", 1 << 16)
    whole, whole_key = regions("whole", x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    shm.set_shared_memory_region(whole, [x])
    c = client(server, protocol)
    c.register_system_shared_memory("shrunk", key, 1 << 16, headers=auth(ALICE))
    c.register_system_shared_memory("whole", whole_key, x.nbytes, headers=auth(ALICE))
    try:
        infer(server, protocol, ALICE, [("shrunk", x.nbytes, 0)], ("shrunk", 24, 40960))
        os.truncate("/dev/shm" + key, 0)
        message = refused(lambda: infer(server, protocol, ALICE, [("shrunk", x.nbytes, 0)], None))
        assert "input 'input': shared memory region 'shrunk'" in message, message
        assert "holds 0 bytes now" in message, message
        # the output alone there: the same, and nothing written past the object's end
        message = refused(
            lambda: infer(server, protocol, ALICE, [("whole", x.nbytes, 0)], ("shrunk", 24, 40960))
        )
        assert "output 'probabilities': shared memory region 'shrunk'" in message, message
        assert os.stat("/dev/shm" + key).st_size == 0
        assert server.proc.poll() is None
        want = run_onnx(server.model, x)["probabilities"]
        result = infer(server, protocol, ALICE, [("whole", x.nbytes, 0)], None)
        np.testing.assert_allclose(result.as_numpy("probabilities"), want, rtol=1e-5, atol=1e-6)
    finally:
        c.unregister_system_shared_memory(headers=auth(ALICE))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unregistering_a_region_not_registered_succeeds_as_triton_answers_it(server, protocol):
    """Triton's client helper (shm_util.py) unregisters a name before it registers it: no error."""
    c = client(server, protocol)
    c.unregister_system_shared_memory("never-registered", headers=auth(ALICE))
    c.unregister_cuda_shared_memory("never-registered", headers=auth(ALICE))
    assert "never-registered" not in names(c, protocol, ALICE)


def test_a_region_in_use_stays_listed_until_its_request_ends_and_one_namespace_without_tokens(
    tmp_path, regions
):
    """Unregistered while a request reads and writes it, a region stays listed (and its output is
    written) until that request ends, then goes, over HTTP and gRPC as Triton does it. On a server
    without a token every client shares one namespace, whatever Authorization header it makes up
    (each made-up one had 256 regions of its own, one descriptor each)."""
    model = tiny_model(tmp_path / "tiny.onnx")
    grpc_port = free_port()
    x = np.random.default_rng(6).random((2, 1, 8, 8), dtype=np.float32)
    want = run_onnx(model, x)["probabilities"]
    # a lone request waits this long for more rows: in flight while the regions are unregistered
    with ServerProcess(
        "--model",
        str(model),
        "--grpc-port",
        str(grpc_port),
        "--max-delay-ms",
        "1500",
        log_path=tmp_path / "log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{grpc_port}"
        for protocol in PROTOCOLS:
            c = client(srv, protocol)
            inp, in_key = regions(f"in-{protocol}", x.nbytes)
            out, out_key = regions(f"out-{protocol}", want.nbytes)
            shm.set_shared_memory_region(inp, [x])
            c.register_system_shared_memory("in", in_key, x.nbytes, headers=auth("one"))
            c.register_system_shared_memory("out", out_key, want.nbytes, headers=auth("two"))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    infer, srv, protocol, "three", [("in", x.nbytes, 0)], ("out", want.nbytes, 0)
                )
                time.sleep(0.5)
                c.unregister_system_shared_memory(headers=auth("four"))
                assert names(c, protocol, "five") == ["in", "out"], protocol
                assert not pending.done()
                pending.result(timeout=30)
            np.testing.assert_allclose(
                shm.get_contents_as_numpy(out, np.float32, want.shape), want, rtol=1e-5, atol=1e-6
            )
            assert names(c, protocol, "six") == [], protocol
        # one namespace: a name taken is taken for every made-up token, and 256 regions in all
        c = client(srv, "http")
        handle, key = regions("many", 64)
        for i in range(256):
            c.register_system_shared_memory(f"r{i}", key, 64, headers=auth(f"made-up-{i}"))
        message = refused(
            lambda: c.register_system_shared_memory("r0", key, 64, headers=auth("made-up-x"))
        )
        assert "'r0' already in manager" in message, message
        with pytest.raises(InferenceServerException) as caught:
            c.register_system_shared_memory("r256", key, 64, headers=auth("made-up-y"))
        assert caught.value.status() == "429", caught.value
        c.unregister_system_shared_memory(headers=auth("made-up-z"))
        assert names(c, "http", "") == []


def test_the_server_bounds_every_client_s_regions_together_by_its_descriptors(tmp_path, regions):
    """Regions over all tokens are bounded by a quarter of the server's open-files limit (and 4096):
    past it a registration is a 429 naming the bound, never a 500, and the server's descriptors stay
    bounded."""
    model = tiny_model(tmp_path / "tiny.onnx")
    handle, key = regions("r", 64)
    with ServerProcess(
        "--model",
        str(model),
        env={"TRAINSERVE_AUTH_TOKEN": f"{ALICE},{BOB}"},
        log_path=tmp_path / "log",
        prefix=["prlimit", "--nofile=256:256"],
    ) as srv:
        c = client(srv, "http")
        before = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
        statuses = []
        for token in (ALICE, BOB):
            for i in range(40):
                try:
                    c.register_system_shared_memory(f"r{i}", key, 64, headers=auth(token))
                    statuses.append(200)
                except InferenceServerException as exc:
                    statuses.append(int(exc.status()))
                    assert "the most it takes from all clients together" in exc.message()
        assert statuses == [200] * 64 + [429] * 16, statuses
        # one descriptor a region (and a few for the client's connections)
        assert len(os.listdir(f"/proc/{srv.proc.pid}/fd")) <= before + 64 + 4
        c.unregister_system_shared_memory(headers=auth(ALICE))
        c.register_system_shared_memory("again", key, 64, headers=auth(BOB))
        c.unregister_system_shared_memory(headers=auth(BOB))
        assert len(os.listdir(f"/proc/{srv.proc.pid}/fd")) <= before + 4
        assert "Traceback" not in srv.log()
