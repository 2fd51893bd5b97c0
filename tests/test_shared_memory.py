"""The V2 system shared-memory extension as an unmodified tritonclient uses it, over HTTP and gRPC, against a real
`python -m serving` process: register, status, infer with the input and the output in shared memory, unregister;
and every misuse a clear 4xx (a region too small, an unknown one, another token's, a key that does not exist, the
extension off, CUDA regions on a server without a GPU)."""

from __future__ import annotations

import base64
import os

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
    return {
        "authorization": f"Bearer {token}"
    }  # (gRPC metadata keys are lower case; HTTP takes any case)


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
    """An inference with each input (name, region, byte size, offset) in shared memory; the output too if given."""
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
    shm.set_shared_memory_region(inp, [np.zeros(16, np.float32), x])  # the tensor at offset 64
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
        # an input's byte size that is not its tensor's
        message = refused(lambda: infer(server, protocol, ALICE, [("big", x.nbytes - 4, 0)], None))
        assert "shared_memory_byte_size 508, but its shape takes 512 bytes" in message, message
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
        message = refused(lambda: c.unregister_system_shared_memory("big", headers=auth(BOB)))
        assert "no system shared memory region 'big' is registered by this client" in message, (
            message
        )
        # a name registered twice, a key that does not exist, a key that is a path
        message = refused(
            lambda: c.register_system_shared_memory("big", big_key, 8, headers=auth(ALICE))
        )
        assert "'big' is already registered" in message, message
        message = refused(
            lambda: c.register_system_shared_memory(
                "gone", "/no-such-key-here", 8, headers=auth(ALICE)
            )
        )
        assert "cannot open shared memory key '/no-such-key-here'" in message, message
        message = refused(
            lambda: c.register_system_shared_memory("etc", "/../etc/passwd", 8, headers=auth(ALICE))
        )
        assert "is not a POSIX shared memory name" in message, message
        # a region larger than the object it names
        message = refused(
            lambda: c.register_system_shared_memory("huge", big_key, 1 << 20, headers=auth(ALICE))
        )
        assert "passes the end of shared memory key" in message, message
        # no token: 401 before anything
        message = refused(lambda: c.get_system_shared_memory_status())
        assert "bearer token" in message, message
        # CUDA regions on a server without a GPU (the handle base64-encoded, as cuda_shared_memory.get_raw_handle gives it)
        handle = base64.b64encode(b"\0" * 64)
        handle = handle.decode() if protocol == "http" else handle
        message = refused(
            lambda: c.register_cuda_shared_memory("gpu", handle, 0, 64, headers=auth(ALICE))
        )
        assert "this server runs on the CPU" in message, message
    finally:
        c.unregister_system_shared_memory(headers=auth(ALICE))
    assert "Traceback" not in server.log()


def test_shared_memory_off_refuses_it_with_403(tmp_path, regions):
    model = tiny_model(tmp_path / "tiny.onnx")
    handle, key = regions("r", 64)
    with ServerProcess(
        "--model", str(model), "--shared-memory", "off", log_path=tmp_path / "log"
    ) as srv:
        c = triton_http.InferenceServerClient(srv.url.removeprefix("http://"))
        with pytest.raises(InferenceServerException) as caught:
            c.register_system_shared_memory("r", key, 64)
        assert caught.value.status() == "403" and "--shared-memory off" in caught.value.message()
        extensions = c.get_server_metadata()["extensions"]
        assert "system_shared_memory" not in extensions and "binary_tensor_data" in extensions
