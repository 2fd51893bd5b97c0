"""The classification extension (Triton's protocol extension, `"parameters": {"classification": K}`
on a requested output; over gRPC an int64_param): the output comes back as a BYTES tensor of its K
highest values, each the string "value:index:label", or "value:index" where the class has no name;
shape [rows, K] for a batched model (top K of each row), [K] for one that runs each request alone
(top K of the whole tensor); K past the number of classes is the number of classes. Labels come from
what the model's export recorded, or from its config.pbtxt's label file. A real server,
tritonclient's clients (their `class_count`), and plain JSON.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from serving_fixtures import (
    ServerProcess,
    double_model,
    free_port,
    run_onnx,
    text_model,
    tiny_model,
    triton_config,
    two_input_model,
)
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow
LABELS = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("classes")
    repo = tmp / "repo"
    (repo / "named" / "1").mkdir(parents=True)
    tiny_model(repo / "named" / "1" / "model.onnx", name=None, seed=3)
    triton_config(
        repo / "named",
        'max_batch_size: 8\noutput [ { name: "logits" label_filename: "logits.txt" } ]\n',
        # fewer names than classes: the third has none
        labels={"logits.txt": ["zero", "one"]},
    )
    grpc_port = free_port()
    srv = ServerProcess(
        "--model",
        f"tiny={tiny_model(tmp / 'tiny.onnx', labels=LABELS)}",
        "--model",
        f"two={two_input_model(tmp / 'two.onnx')}",
        "--batching",
        "two=on",
        "--model",
        f"double={double_model(tmp / 'double.onnx')}",
        "--model",
        f"text={text_model(tmp / 'text.onnx')}",
        "--repository",
        str(repo),
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    )
    with srv:
        srv.grpc, srv.http = f"127.0.0.1:{grpc_port}", srv.url.removeprefix("http://")
        srv.tiny, srv.named = tmp / "tiny.onnx", repo / "named" / "1" / "model.onnx"
        yield srv


def images(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).random((rows, 1, 8, 8), dtype=np.float32)


def expected(scores: np.ndarray, k: int, labels=None) -> list[list[str]]:
    """Each row's top k as the server must write them: highest first, the value as its dtype
    prints."""
    rows = []
    for row in scores.reshape(len(scores), -1):
        order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
        rows.append(
            [
                f"{row[i]}:{i}" + (f":{labels[i]}" if labels and i < len(labels) else "")
                for i in order
            ]
        )
    return rows


def ask_json(server, model: str, inputs: list[dict], outputs: list[dict]) -> requests.Response:
    return requests.post(
        f"{server.url}/v2/models/{model}/infer",
        json={"inputs": inputs, "outputs": outputs},
        timeout=30,
    )


def image_input(x: np.ndarray) -> dict:
    return {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}


def test_json_top_k_with_the_labels_export_recorded(server):
    x = images(2)
    probabilities = run_onnx(server.tiny, x)["probabilities"]
    r = ask_json(
        server,
        "tiny",
        [image_input(x)],
        [{"name": "probabilities", "parameters": {"classification": 2}}, {"name": "logits"}],
    )
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["probabilities"]["datatype"] == "BYTES"
    assert outputs["probabilities"]["shape"] == [2, 2]
    got = np.array(outputs["probabilities"]["data"]).reshape(2, 2).tolist()
    assert got == expected(probabilities, 2, LABELS)
    for row, want in zip(got, probabilities):
        # as Triton's clients read them: the value is the output's at that index
        for entry in row:
            value, index, label = entry.split(":")
            assert np.float32(value) == want[int(index)] and label == LABELS[int(index)]
    assert outputs["logits"]["datatype"] == "FP32" and outputs["logits"]["shape"] == [2, 3]


def test_k_past_the_classes_is_clamped_and_zero_is_the_tensor(server):
    x = images(1)
    r = ask_json(
        server, "tiny", [image_input(x)], [{"name": "logits", "parameters": {"classification": 10}}]
    )
    (out,) = r.json()["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [1, 3] and len(out["data"]) == 3
    r = ask_json(
        server, "tiny", [image_input(x)], [{"name": "logits", "parameters": {"classification": 0}}]
    )
    assert r.json()["outputs"][0]["datatype"] == "FP32"


def test_index_only_where_the_model_has_no_labels_and_the_whole_tensor_when_unbatched(server):
    features = np.array([[4, 1, 3, 2], [0, 5, 5, 1]], np.float32)
    inputs = [
        {
            "name": "features",
            "shape": [2, 4],
            "datatype": "FP32",
            "data": features.ravel().tolist(),
        },
        {"name": "code", "shape": [2], "datatype": "INT64", "data": [0, 1]},
    ]
    r = ask_json(server, "two", inputs, [{"name": "output", "parameters": {"classification": 3}}])
    (out,) = r.json()["outputs"]
    assert out["shape"] == [2, 3]
    # ties in index order: 6.0 at 1 and 2 in the second row
    assert out["data"] == ["4.0:0", "3.0:2", "2.0:3", "6.0:1", "6.0:2", "2.0:3"]
    values = {"name": "VALUES", "shape": [5], "datatype": "FP32", "data": [1, 9, 3, 7, 5]}
    r = ask_json(
        server, "double", [values], [{"name": "TWICE", "parameters": {"classification": 2}}]
    )
    assert r.json()["outputs"][0]["shape"] == [2]
    assert r.json()["outputs"][0]["data"] == ["18.0:1", "14.0:3"]


def test_labels_from_the_config_label_file(server):
    x = images(3)
    logits = run_onnx(server.named, x)["logits"]
    with triton_http.InferenceServerClient(server.http) as client:
        tensor = triton_http.InferInput("input", [3, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(x)
        asked = triton_http.InferRequestedOutput("logits", binary_data=True, class_count=3)
        got = client.infer("named", [tensor], outputs=[asked]).as_numpy("logits")
    assert got.shape == (3, 3)
    want = expected(logits, 3, ["zero", "one"])
    assert [[e.decode() for e in row] for row in got] == want


def test_top_k_over_grpc_and_binary_http_with_tritonclient(server):
    x = images(4)
    want = expected(run_onnx(server.tiny, x)["probabilities"], 2, LABELS)
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        tensor = triton_grpc.InferInput("input", [4, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(x)
        asked = triton_grpc.InferRequestedOutput("probabilities", class_count=2)
        result = client.infer("tiny", [tensor], outputs=[asked])
        assert result.get_output("probabilities").datatype == "BYTES"
        got = result.as_numpy("probabilities")
    assert [[e.decode() for e in row] for row in got] == want
    with triton_http.InferenceServerClient(server.http) as client:
        tensor = triton_http.InferInput("input", [4, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        asked = triton_http.InferRequestedOutput("probabilities", binary_data=True, class_count=2)
        got = client.infer("tiny", [tensor], outputs=[asked]).as_numpy("probabilities")
    assert [[e.decode() for e in row] for row in got] == want


def test_what_cannot_be_classified_is_a_400(server):
    x = images(1)
    for value in (-1, 1.5, "2", True):
        r = ask_json(
            server,
            "tiny",
            [image_input(x)],
            [{"name": "logits", "parameters": {"classification": value}}],
        )
        assert r.status_code == 400 and "parameters.classification must be a whole number" in r.text
    r = ask_json(
        server,
        "tiny",
        [image_input(x)],
        [
            {
                "name": "logits",
                "parameters": {
                    "classification": 2,
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 12,
                },
            }
        ],
    )
    assert r.status_code == 400 and "classification and shared memory" in r.text
    text = {"name": "TEXT", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}
    r = ask_json(server, "text", [text], [{"name": "ECHO", "parameters": {"classification": 1}}])
    assert r.status_code == 400 and "classification needs numbers" in r.text, r.text
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        tensor = triton_grpc.InferInput("input", [1, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(x)
        asked = triton_grpc.InferRequestedOutput("logits", class_count=0)
        asked._output.parameters["classification"].int64_param = 0
        with pytest.raises(InferenceServerException, match="at least 1"):
            client.infer("tiny", [tensor], outputs=[asked])


def test_the_server_says_it_offers_classification(server):
    assert "classification" in requests.get(f"{server.url}/v2", timeout=10).json()["extensions"]
