"""Triton's raw binary request, and inputs of unknown rank.

Raw binary (Triton's binary data extension): `Inference-Header-Content-Length: 0` says the body has
no JSON header: it is all the data of a model's single input. Its shape is deduced from the byte
count (one row of a batched model; the one dynamic axis, if any, from the count; a BYTES input of
shape [1] takes the body as its one element), and every output comes back as binary data behind a
JSON header. A model of several inputs, or a count that fills no shape, is a 400.

An ONNX input declared without any shape (not even a rank) takes a tensor of whatever shape the
graph computes on; its metadata says [-1]. A real server; hand-made bodies (no client library sends
raw binary requests).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from serving_fixtures import (
    ServerProcess,
    any_rank_model,
    double_model,
    run_onnx,
    text_model,
    tiny_model,
    two_axes_model,
    two_input_model,
    word_model,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raw")
    with ServerProcess(
        "--model",
        f"tiny={tiny_model(tmp / 'tiny.onnx')}",
        "--model",
        f"double={double_model(tmp / 'double.onnx')}",
        "--model",
        f"word={word_model(tmp / 'word.onnx')}",
        "--model",
        f"two={two_input_model(tmp / 'two.onnx')}",
        "--model",
        f"any={any_rank_model(tmp / 'any.onnx')}",
        "--model",
        f"text={text_model(tmp / 'text.onnx')}",
        "--model",
        f"dyn={two_axes_model(tmp / 'dyn.onnx')}",
        log_path=tmp / "server.log",
    ) as srv:
        srv.tiny = tmp / "tiny.onnx"
        yield srv


def raw(server, model: str, body: bytes) -> requests.Response:
    return requests.post(
        f"{server.url}/v2/models/{model}/infer",
        data=body,
        headers={
            "Inference-Header-Content-Length": "0",
            "Content-Type": "application/octet-stream",
        },
        timeout=30,
    )


def outputs_of(r: requests.Response) -> dict[str, tuple[dict, bytes]]:
    """The binary answer: each output's JSON entry and its bytes."""
    assert r.status_code == 200, r.text
    length = int(r.headers["Inference-Header-Content-Length"])
    header, at, found = json.loads(r.content[:length]), length, {}
    for out in header["outputs"]:
        size = out["parameters"]["binary_data_size"]
        found[out["name"]] = (out, r.content[at : at + size])
        at += size
    assert at == len(r.content)
    return found


def test_a_raw_body_is_one_row_of_a_batched_models_only_input(server):
    x = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
    found = outputs_of(raw(server, "tiny", x.tobytes()))
    want = run_onnx(server.tiny, x)
    for name in ("logits", "probabilities"):
        out, data = found[name]
        assert out["shape"] == [1, 3] and out["datatype"] == "FP32"
        np.testing.assert_allclose(np.frombuffer(data, "<f4").reshape(1, 3), want[name], rtol=1e-6)


def test_the_one_dynamic_axis_is_deduced_from_the_byte_count(server):
    values = np.array([1.5, -2, 4, 0.25, 8], np.float32)
    out, data = outputs_of(raw(server, "double", values.tobytes()))["TWICE"]
    assert out["shape"] == [5] and np.frombuffer(data, "<f4").tolist() == (values * 2).tolist()


def test_a_bytes_input_of_shape_1_takes_the_body_as_its_element(server):
    text = "a whole body, not length-prefixed: ünïcode".encode()
    out, data = outputs_of(raw(server, "word", text))["SAME"]
    assert out["datatype"] == "BYTES" and out["shape"] == [1]
    assert data == len(text).to_bytes(4, "little") + text


def test_raw_bodies_that_fit_no_shape_are_a_400(server):
    cases = {
        ("tiny", b"\x00" * 100): "100 bytes, but [-1,1,8,8] FP32 takes 256 bytes (one row)",
        ("double", b"\x00" * 6): "6 bytes is not a whole number of FP32 values (4 bytes each)",
        (
            "two",
            b"\x00" * 16,
        ): "a raw binary request (Inference-Header-Content-Length: 0) carries one input. Raw "
        "request must only have 1 input (found 1) to be deduced but got 2 inputs in 'two' model "
        "configuration",
        # Triton's words for what is wrong are in each message, beside ours
        ("text", b"abc"): "For BYTE datatype raw input 'TEXT', the model must have input shape [1]",
        ("dyn", b"\x00" * 8): "The shape of the raw input 'x' can not be deduced because there are "
        "more than one variable-sized dimension in [-1,-1] FP32",
    }
    for (model, body), needle in cases.items():
        r = raw(server, model, body)
        assert r.status_code == 400 and needle in r.json()["error"], (model, r.text)


def test_an_input_of_unknown_rank_takes_any_shape_the_graph_computes_on(server):
    meta = requests.get(f"{server.url}/v2/models/any", timeout=10).json()
    assert meta["inputs"] == [{"name": "ANY", "datatype": "FP32", "shape": [-1]}]
    for shape in ([2, 3], [5], [1, 2, 2]):
        values = np.arange(np.prod(shape), dtype=np.float32).tolist()
        r = requests.post(
            f"{server.url}/v2/models/any/infer",
            json={"inputs": [{"name": "ANY", "shape": shape, "datatype": "FP32", "data": values}]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        assert out["shape"] == shape and out["data"] == values


def test_a_request_missing_an_input_names_what_it_sent_and_what_it_lacks(server):
    """Not a raw body: a V2 request (JSON, or a JSON header and binary data) without every input,
    refused in Triton's words too (its clients look for them) with the inputs the model takes."""
    url = f"{server.url}/v2/models/two/infer"
    features = {"name": "features", "shape": [1, 4], "datatype": "FP32"}
    said = (
        "expected 2 inputs but got 1 inputs for model 'two'. Got input(s) ['features'], but missing "
        "required input(s) ['code']. Please provide all required input(s). This model takes "
        "'features' [-1,4] FP32, 'code' [-1] INT64"
    )
    r = requests.post(url, json={"inputs": [{**features, "data": [1, 2, 3, 4]}]}, timeout=30)
    assert r.status_code == 400 and said in r.json()["error"], r.text
    header = json.dumps({"inputs": [{**features, "parameters": {"binary_data_size": 16}}]}).encode()
    r = requests.post(
        url,
        data=header + np.zeros(4, np.float32).tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
        timeout=30,
    )
    assert r.status_code == 400 and said in r.json()["error"], r.text
