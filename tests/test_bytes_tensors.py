"""BYTES tensors (KServe V2's string type, onnxruntime's STRING) in and out, over every encoding the
protocols have.

KServe V2 and Triton's binary data extension: a BYTES tensor is a JSON array of strings; as binary
data each element is a 4-byte little-endian length and then its bytes, elements in row-major order;
over gRPC the same serialization in raw_input_contents / raw_output_contents, or `bytes_contents`
(one entry an element). A length that runs past the data, or data left over after the last element,
is a 400. The metadata names the datatype BYTES (and the configuration TYPE_STRING, as Triton's). A
real `python -m serving`; tritonclient's clients, which serialize BYTES themselves, and hand-made
bodies for what they never send.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from serving_fixtures import ServerProcess, free_port, metric, text_model
from tritonclient.utils import InferenceServerException

from serving.grpc import schema

pytestmark = pytest.mark.slow
STRINGS = np.array([["12", "-7"], ["ünï©ödé", ""]], dtype=object)


def serialized(elements) -> bytes:
    """Triton's binary form of a BYTES tensor: each element's 4-byte little-endian length, then its
    bytes."""
    data = [e.encode() if isinstance(e, str) else e for e in elements]
    return b"".join(len(d).to_bytes(4, "little") + d for d in data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bytes")
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        f"text={text_model(tmp / 'text.onnx')}",
        "--model",
        f"number={text_model(tmp / 'number.onnx', number=True)}",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{grpc_port}"
        srv.http = srv.url.removeprefix("http://")
        yield srv


def test_a_model_with_string_inputs_is_served_and_its_metadata_says_bytes(server):
    meta = requests.get(f"{server.url}/v2/models/text", timeout=10).json()
    assert meta["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [-1, 2]}]
    assert meta["outputs"] == [{"name": "ECHO", "datatype": "BYTES", "shape": [-1, 2]}]
    config = requests.get(f"{server.url}/v2/models/text/config", timeout=10).json()
    assert config["input"][0]["data_type"] == "TYPE_STRING" and config["max_batch_size"] == 32
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        assert client.get_model_metadata("number").inputs[0].datatype == "BYTES"


def test_bytes_in_and_out_as_json(server):
    body = {
        "inputs": [
            {"name": "TEXT", "shape": [2, 2], "datatype": "BYTES", "data": STRINGS.ravel().tolist()}
        ]
    }
    answer = requests.post(f"{server.url}/v2/models/text/infer", json=body, timeout=30).json()
    assert answer["outputs"] == [
        {"name": "ECHO", "datatype": "BYTES", "shape": [2, 2], "data": STRINGS.ravel().tolist()}
    ]
    # nested, as V2 allows
    body["inputs"][0]["data"] = [["1", "2"], ["30", "-4"]]
    answer = requests.post(f"{server.url}/v2/models/number/infer", json=body, timeout=30).json()
    assert answer["outputs"][0]["datatype"] == "INT32" and answer["outputs"][0]["data"] == [
        1,
        2,
        30,
        -4,
    ]
    body["inputs"][0]["data"] = [1, 2, 30, -4]
    r = requests.post(f"{server.url}/v2/models/number/infer", json=body, timeout=30)
    assert r.status_code == 400 and "BYTES data must be strings" in r.json()["error"], r.text


def test_bytes_in_and_out_as_binary_data_with_tritonclient_http(server):
    sent = np.array([[s.encode() for s in row] for row in STRINGS], dtype=object)
    with triton_http.InferenceServerClient(server.http) as client:
        tensor = triton_http.InferInput("TEXT", [2, 2], "BYTES")
        tensor.set_data_from_numpy(sent, binary_data=True)
        asked = triton_http.InferRequestedOutput("ECHO", binary_data=True)
        result = client.infer("text", [tensor], outputs=[asked])
        assert result.get_output("ECHO")["parameters"]["binary_data_size"] == len(
            serialized(sent.ravel())
        )
        np.testing.assert_array_equal(result.as_numpy("ECHO"), sent)
        tensor = triton_http.InferInput("TEXT", [1, 2], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"8", b"9"]], dtype=object), binary_data=True)
        assert client.infer("number", [tensor]).as_numpy("NUMBER").tolist() == [[8, 9]]


def test_bytes_in_and_out_over_grpc_raw_and_typed(server):
    sent = np.array([[s.encode() for s in row] for row in STRINGS], dtype=object)
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        tensor = triton_grpc.InferInput("TEXT", [2, 2], "BYTES")
        # raw_input_contents, serialized
        tensor.set_data_from_numpy(sent)
        np.testing.assert_array_equal(client.infer("text", [tensor]).as_numpy("ECHO"), sent)
    request = schema.ModelInferRequest(model_name="number")
    typed = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 2])
    typed.contents.bytes_contents.extend([b"5", b"-6"])
    with grpc.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        answer = schema.ModelInferResponse.FromString(
            infer(request.SerializeToString(), timeout=30)
        )
    assert answer.outputs[0].datatype == "INT32"
    assert np.frombuffer(answer.raw_output_contents[0], "<i4").tolist() == [5, -6]


def binary_request(
    url: str, model: str, shape: list[int], data: bytes, declared: int | None = None
):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "shape": shape,
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data) if declared is None else declared},
                }
            ]
        }
    ).encode()
    return requests.post(
        f"{url}/v2/models/{model}/infer",
        data=header + data,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
        timeout=30,
    )


def test_bad_lengths_are_a_400_naming_the_element(server):
    good = serialized([b"a", b"bc"])
    assert binary_request(server.url, "text", [1, 2], good).status_code == 200
    cases = {
        # a length past the data
        good[:-1]: "BYTES element 1 of input 'TEXT' declares 2 bytes, but only 1 remain",
        # the data ends inside a length
        good[:7]: "BYTES element 1 of input 'TEXT': the data ends inside its 4-byte length",
        # bytes no element claims
        good + b"\x00": "1 bytes follow the 2 BYTES elements of input 'TEXT'",
    }
    for data, needle in cases.items():
        r = binary_request(server.url, "text", [1, 2], data)
        assert r.status_code == 400 and needle in r.json()["error"], r.text
    r = binary_request(server.url, "text", [1, 2], good, declared=len(good) + 5)
    assert r.status_code == 400 and "the body ends before" in r.json()["error"], r.text
    request = schema.ModelInferRequest(model_name="text")
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 2])
    request.raw_input_contents.append(good[:-1])
    with grpc.insecure_channel(server.grpc) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                request.SerializeToString(), timeout=30
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declares 2 bytes, but only 1 remain" in refused.value.details()


def test_a_string_that_is_not_utf8_is_refused_for_a_string_input(server):
    r = binary_request(server.url, "text", [1, 2], serialized([b"ok", b"\xff\xfe"]))
    assert (
        r.status_code == 400 and "input 'TEXT': an element is not UTF-8 text" in r.json()["error"]
    )
    with triton_http.InferenceServerClient(server.http) as client:
        tensor = triton_http.InferInput("TEXT", [1, 2], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"ok", b"\xff"]], dtype=object), binary_data=True)
        with pytest.raises(InferenceServerException, match="not UTF-8 text"):
            client.infer("text", [tensor])


def test_concurrent_bytes_requests_share_runs_and_each_gets_its_own_strings(server):
    """The model's rows are independent (its file says so): requests are batched, strings and all,
    outside the fixed-size batch buffers."""
    start = threading.Barrier(12)

    def ask(i):
        sent = np.array(
            [[f"{i}-a".encode(), f"{i}".encode() * (i + 1)]] * (1 + i % 3), dtype=object
        )
        with triton_http.InferenceServerClient(server.http) as client:
            tensor = triton_http.InferInput("TEXT", list(sent.shape), "BYTES")
            tensor.set_data_from_numpy(sent, binary_data=i % 2 == 0)
            start.wait()
            return sent, client.infer("text", [tensor]).as_numpy("ECHO")

    runs = metric(
        requests.get(f"{server.url}/metrics", timeout=10).text,
        "trainserve_batch_size_count",
        model="text",
    )
    with ThreadPoolExecutor(12) as pool:
        for sent, got in pool.map(ask, range(12)):
            np.testing.assert_array_equal(got, sent)
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    # runs were shared
    assert metric(text, "trainserve_batch_size_count", model="text") - runs < 12


def test_bytes_in_and_out_of_shared_memory_in_their_binary_form(server):
    """Triton's shared-memory extension: a BYTES tensor's region holds its serialized elements, in
    and out; the answer names the bytes written (shared_memory_byte_size), and tritonclient reads
    them back. An output region too small for them is a 400 naming both sizes."""
    import tritonclient.utils.shared_memory as shm

    sent = np.array([[b"3", b"14"]], dtype=object)
    data = serialized(sent.ravel())
    handle = shm.create_shared_memory_region("bytes_in", "/trainserve_bytes_in", len(data))
    out = shm.create_shared_memory_region("bytes_out", "/trainserve_bytes_out", 64)
    try:
        shm.set_shared_memory_region(handle, [np.frombuffer(data, np.uint8)])
        for module, client in (
            (triton_http, triton_http.InferenceServerClient(server.http)),
            (triton_grpc, triton_grpc.InferenceServerClient(server.grpc)),
        ):
            client.register_system_shared_memory("bytes_in", "/trainserve_bytes_in", len(data))
            client.register_system_shared_memory("bytes_out", "/trainserve_bytes_out", 64)
            tensor = module.InferInput("TEXT", [1, 2], "BYTES")
            tensor.set_shared_memory("bytes_in", len(data))
            assert client.infer("number", [tensor]).as_numpy("NUMBER").tolist() == [[3, 14]]
            asked = module.InferRequestedOutput("ECHO")
            asked.set_shared_memory("bytes_out", 64)
            result = client.infer("text", [tensor], outputs=[asked])
            output = result.get_output("ECHO")
            parameters = (
                output["parameters"]
                if module is triton_http
                else {k: v.int64_param or v.string_param for k, v in output.parameters.items()}
            )
            assert parameters["shared_memory_byte_size"] == len(data), parameters
            got = shm.get_contents_as_numpy(out, np.object_, [1, 2])
            assert got.tolist() == sent.tolist()
            small = module.InferRequestedOutput("ECHO")
            small.set_shared_memory("bytes_out", len(data) - 1)
            with pytest.raises(InferenceServerException, match=f"{len(data)} bytes .* do not fit"):
                client.infer("text", [tensor], outputs=[small])
            client.unregister_system_shared_memory()
            client.close()
    finally:
        shm.destroy_shared_memory_region(handle)
        shm.destroy_shared_memory_region(out)
