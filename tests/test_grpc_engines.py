"""Both engines of the gRPC port, `--grpc-engine native` (grpc's C++ server, serving/grpc/native.cc)
and `aio` (grpc.aio), answer alike where a transport could differ: the receipt as initial metadata
on an answer and on a refusal, an unknown method, a message over --max-body-bytes, a client that
gives up mid-call, a stream. The rest of the gRPC tests run on `auto`, which is native wherever it
is built, as CI's machine builds it. A real `python -m serving` process each, real grpc clients."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import types

import grpc
import numpy as np
import pytest
import requests
from serving_fixtures import ServerProcess, free_port, metric, tiny_model

from serving.grpc import native, schema

pytestmark = pytest.mark.slow
METHOD = "/inference.GRPCInferenceService/"


def test_the_native_engine_is_built_wherever_grpcs_cpp_library_is_installed():
    """So that a failed build (setup.py marks it optional) does not leave CI quietly testing
    grpc.aio twice."""
    installed = (
        subprocess.run(["pkg-config", "--exists", "grpc++"], capture_output=True).returncode == 0
    )
    if not installed:
        pytest.skip(
            "grpc's C++ library is not installed here (apt-get install libgrpc++-dev pkg-config)"
        )
    assert native.available(), native.WHY_NOT


@pytest.fixture(scope="module", params=["native", "aio"])
def server(request, tmp_path_factory):
    if request.param == "native" and not native.available():
        pytest.skip(native.WHY_NOT)
    tmp = tmp_path_factory.mktemp(request.param)
    model = tiny_model(tmp / "tiny.onnx")
    port = free_port()
    # --max-delay-ms: a lone request waits for company, so a client can give up while it is in the
    # server
    with ServerProcess(
        "--model",
        str(model),
        "--grpc-port",
        str(port),
        "--grpc-engine",
        request.param,
        "--max-body-bytes",
        str(1 << 20),
        "--max-delay-ms",
        "1500",
        log_path=tmp / "server.log",
    ) as srv:
        srv.grpc, srv.engine = f"127.0.0.1:{port}", request.param
        yield srv


def infer_request(rows: int = 1, shape_tail=(1, 8, 8), **fields) -> bytes:
    r = schema.ModelInferRequest(model_name="tiny", **fields)
    r.inputs.add(name="input", datatype="FP32", shape=[rows, *shape_tail])
    r.raw_input_contents.append(np.full(rows * int(np.prod(shape_tail)), 0.1, np.float32).tobytes())
    return r.SerializeToString()


def test_the_log_names_the_engine(server):
    engine = "grpc's C++ server" if server.engine == "native" else "grpc.aio"
    assert f"KServe V2 gRPC on {server.grpc} ({engine})" in server.log()


def test_receipt_as_initial_metadata_on_an_answer_and_on_a_refusal(server):
    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary(METHOD + "ModelInfer")
        body, call = infer.with_call(infer_request(id="r-1"), timeout=30)
        assert schema.ModelInferResponse.FromString(body).id == "r-1"
        assert dict(call.initial_metadata())["x-request-id"] == "r-1"
        # the version was chosen, then the shape refused
        with pytest.raises(grpc.RpcError) as refused:
            infer(infer_request(shape_tail=(1, 4, 8), id="r-2"), timeout=30)
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "does not fit" in refused.value.details()
    )
    receipt = dict(refused.value.initial_metadata())
    assert receipt["x-request-id"] == "r-2" and receipt["x-model-name"] == "tiny", receipt


def test_an_unknown_method_is_unimplemented_at_once(server):
    with grpc.insecure_channel(server.grpc) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(METHOD + "NoSuchMethod")(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # a streaming client that sends nothing yet: answered before it does
        def later():
            time.sleep(5)
            yield b""

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(channel.stream_stream(METHOD + "NoSuchStream")(later(), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and time.monotonic() - started < 3


def test_a_name_with_a_nul_is_not_found_and_the_server_still_stops(server):
    """The review: the NUL in the status message (which names the unknown model) made the native
    engine's status fail, and the call hung until its deadline."""
    with grpc.insecure_channel(server.grpc) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(METHOD + "ModelReady")(
                schema.ModelReadyRequest(name="a\x00b").SerializeToString(), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value


def test_a_message_over_max_body_bytes_is_resource_exhausted_and_the_next_one_is_answered(server):
    with grpc.insecure_channel(
        server.grpc, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        infer = channel.unary_unary(METHOD + "ModelInfer")
        with pytest.raises(grpc.RpcError) as refused:
            # 1.3 MB against 1 MiB
            infer(infer_request(rows=5000), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            schema.ModelInferResponse.FromString(infer(infer_request(), timeout=30)).model_name
            == "tiny"
        )


def test_a_client_that_gives_up_mid_call_leaves_the_server_answering(server):
    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary(METHOD + "ModelInfer")
        with pytest.raises(grpc.RpcError) as gone:
            # it waits 1.5 s in the batcher for company
            infer(infer_request(), timeout=0.3)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (
            schema.ModelInferResponse.FromString(infer(infer_request(), timeout=30)).model_name
            == "tiny"
        )
    assert requests.get(server.url + "/v2/health/ready", timeout=10).status_code == 200
    assert "Traceback" not in server.log()


def test_a_stream_answers_in_order_and_a_refusal_does_not_end_it(server):
    requests_ = [
        infer_request(id="s-0"),
        infer_request(shape_tail=(1, 4, 8), id="s-1"),
        infer_request(id="s-2"),
    ]
    with grpc.insecure_channel(server.grpc) as channel:
        stream = channel.stream_stream(METHOD + "ModelStreamInfer")
        answers = [
            schema.ModelStreamInferResponse.FromString(m)
            for m in stream(iter(requests_), timeout=30)
        ]
    assert [a.infer_response.id for a in answers] == ["s-0", "s-1", "s-2"]
    assert [bool(a.error_message) for a in answers] == [False, True, False]
    assert answers[1].error_message.startswith("INVALID_ARGUMENT: ")
    assert answers[0].infer_response.parameters["x-model-name"].string_param == "tiny"
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert (
        metric(
            text,
            "trainserve_requests_total",
            route="grpc ModelStreamInfer",
            status="OK",
            model="tiny",
        )
        >= 2
    )


# ---- the native transport on its own, in this process: what a black-box server cannot provoke at will ----


def native_front_end(handle) -> tuple:
    port = free_port()
    front_end = native.NativeFrontEnd(
        f"127.0.0.1:{port}",
        {"Echo": grpc.unary_unary_rpc_method_handler(handle)},
        "test.Echo",
        {},
        100,
        types.SimpleNamespace(close=lambda: None),
    )
    return front_end, f"127.0.0.1:{port}"


def test_native_calls_cancelled_before_their_handler_began_are_ended_and_stop_returns():
    """The review: calls whose client gave up while the event loop was busy came in with their
    cancellation in one batch; their tasks were cancelled before they began, nothing ended the
    calls, and grpc's Shutdown waited for them for ever."""
    if not native.available():
        pytest.skip(native.WHY_NOT)

    async def handle(data, context):
        if data == b"block":
            # the loop is stuck: meanwhile two calls arrive and their clients give up
            time.sleep(1.0)
        return b"ok"

    def client(target: str) -> list:
        codes = []
        with grpc.insecure_channel(target) as channel:
            echo = channel.unary_unary("/test.Echo/Echo")
            blocker = threading.Thread(target=lambda: echo(b"block", timeout=10))
            blocker.start()
            time.sleep(0.2)
            for _ in range(2):
                try:
                    echo(b"x", timeout=0.3)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            blocker.join()
            codes.append(grpc.StatusCode.OK if echo(b"x", timeout=10) == b"ok" else None)
        return codes

    async def scenario():
        front_end, target = native_front_end(handle)
        codes = await asyncio.to_thread(client, target)
        started = time.monotonic()
        await asyncio.wait_for(front_end.stop(0.5), 10)
        return codes, time.monotonic() - started

    codes, took = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2 + [grpc.StatusCode.OK], codes
    assert took < 3, f"stop took {took:.1f} s"


def test_native_metadata_grpc_would_abort_on_is_refused_in_python():
    """grpc's C++ core aborts the process on metadata it cannot send; the handler gets a ValueError
    instead, and its call ends UNKNOWN, as a handler's failure does."""
    if not native.available():
        pytest.skip(native.WHY_NOT)

    async def handle(data, context):
        await context.send_initial_metadata((("x-receipt", "a\nb"),))
        return b"ok"

    async def scenario():
        front_end, target = native_front_end(handle)

        def call():
            with grpc.insecure_channel(target) as channel:
                try:
                    channel.unary_unary("/test.Echo/Echo")(b"x", timeout=10)
                except grpc.RpcError as exc:
                    return exc.code(), exc.details()
                return grpc.StatusCode.OK, ""

        try:
            return await asyncio.to_thread(call)
        finally:
            await front_end.stop(0.5)

    code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNKNOWN and "not valid gRPC metadata" in details, (code, details)


def test_native_stream_answers_queued_in_cpp_give_their_places_back_written_or_dropped(monkeypatch):
    """A stream's answers wait in C++ behind the write in flight, each holding one of the front
    end's places (native.UNWRITTEN over all streams). A client that goes away mid-stream drops its
    queued answers: their places must come back, or the next stream waits for ever. Here 40 places:
    two streams of 64 KiB answers cut after 5 (the rest pile up behind HTTP/2 flow control), then a
    whole stream of 300."""
    if not native.available():
        pytest.skip(native.WHY_NOT)
    monkeypatch.setattr(native, "UNWRITTEN", 40)

    async def stream(unused, context):
        for i in range(300):
            await context.write(b"%06d" % i + bytes(64 << 10))

    def client(target: str) -> tuple[list, int]:
        with grpc.insecure_channel(target) as channel:
            talk = channel.stream_stream("/test.Echo/Talk")
            firsts = []
            for _ in range(2):
                cut = talk(iter([b"go"]), timeout=30)
                firsts.append(len([next(cut) for _ in range(5)]))
                # the handler fills its queue
                time.sleep(0.3)
                cut.cancel()
            whole = list(talk(iter([b"go"]), timeout=30))
            return firsts, len(whole)

    async def scenario():
        port = free_port()
        front_end = native.NativeFrontEnd(
            f"127.0.0.1:{port}",
            {"Talk": grpc.stream_stream_rpc_method_handler(stream)},
            "test.Echo",
            {},
            100,
            types.SimpleNamespace(close=lambda: None),
        )
        try:
            got = await asyncio.wait_for(asyncio.to_thread(client, f"127.0.0.1:{port}"), 60)
            # the last events
            await asyncio.sleep(0.5)
            # (asyncio.Semaphore's count: every place back?)
            return (
                got,
                front_end.unwritten_places._value,
            )
        finally:
            await asyncio.wait_for(front_end.stop(0.5), 10)

    assert asyncio.run(scenario()) == (([5, 5], 300), 40)


def _half_sent_call(port: int, message: bytes, metadata: tuple = ()):
    """A ModelInfer call on a raw HTTP/2 connection with only the first half of its message sent;
    `finish()` sends the rest and returns its grpc-status, `abandon()` closes the connection."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    stream = c.get_next_available_stream_id()
    c.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", METHOD + "ModelInfer"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ],
    )
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    c.send_data(stream, framed[: len(framed) // 2])
    s.sendall(c.data_to_send())

    def finish() -> str:
        c.send_data(stream, framed[len(framed) // 2 :], end_stream=True)
        s.sendall(c.data_to_send())
        try:
            while True:
                data = s.recv(1 << 16)
                if not data:
                    return "closed"
                for event in c.receive_data(data):
                    if isinstance(event, h2.events.TrailersReceived):
                        return dict(event.headers).get(b"grpc-status", b"?").decode()
                s.sendall(c.data_to_send())
        finally:
            s.close()

    return types.SimpleNamespace(finish=finish, abandon=s.close)


@pytest.mark.parametrize(
    "setup", ["one model", "one model, two front ends", "two models", "a token required"]
)
def test_a_batch_waits_for_a_modelinfer_message_still_on_its_way_where_one_model_is_loaded(
    tmp_path, setup
):
    """As for an HTTP body arriving (serving/batcher.py): a complete request's batch waits, at most
    --arrival-wait-ms, for a ModelInfer message the native engine is still receiving, and they run
    as one batch (what that gained: docs/benchmarks.md#teststest_grpc_enginespy). A message names
    its model inside, so only a server of one model version waits: with two, one on its way to a
    model must not hold the other's batches. Nor where a token is required: a call is counted from
    its headers, before its token is checked. With front-end processes, the message may be on its
    way to either (serving/receiving.py) and the lone call taken by the other."""
    if not native.available():
        pytest.skip(native.WHY_NOT)
    model = tiny_model(tmp_path / "tiny.onnx")
    args = (
        ["--model", f"tiny={model}"]
        + (["--model", f"other={model}"] if setup == "two models" else [])
        + (["--auth-token", "sesame"] if setup == "a token required" else [])
        + (["--front-ends", "2"] if "front ends" in setup else [])
    )
    metadata = (("authorization", "Bearer sesame"),) if setup == "a token required" else ()
    port = free_port()
    with ServerProcess(
        *args,
        "--grpc-port",
        str(port),
        "--arrival-wait-ms",
        "1000",
        log_path=tmp_path / "server.log",
    ) as srv:
        half = _half_sent_call(port, infer_request(), metadata)
        # its first half in: the call has begun
        time.sleep(0.3)
        answered = {}

        def lone_call() -> float:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                begun = time.monotonic()
                channel.unary_unary(METHOD + "ModelInfer")(
                    infer_request(), timeout=30, metadata=metadata
                )
                return time.monotonic() - begun

        caller = threading.Thread(target=lambda: answered.update(after=lone_call()))
        caller.start()
        # (the wait's cap, 1 s, leaves a loaded machine 0.55 s to send the rest)
        time.sleep(0.45)
        status = half.finish()
        caller.join(30)
        headers = {"Authorization": "Bearer sesame"} if metadata else {}
        text = requests.get(srv.url + "/metrics", headers=headers).text
        runs = metric(text, "trainserve_batch_size_count", model="tiny")
        rows = metric(text, "trainserve_batch_size_sum", model="tiny")
        # a call given up half-sent is no longer waited for
        _half_sent_call(port, infer_request(), metadata).abandon()
        time.sleep(0.3)
        # nothing on its way now: a lone call waits for nothing
        alone = lone_call()
    assert status == "0" and alone < 0.6, (status, alone)
    if setup.startswith("one model"):
        # one run of both
        assert answered["after"] > 0.3 and (runs, rows) == (1, 2), (
            answered,
            runs,
            rows,
        )
    else:
        # no wait, one run each
        assert answered["after"] < 0.3 and (runs, rows) == (2, 2), (
            answered,
            runs,
            rows,
        )
