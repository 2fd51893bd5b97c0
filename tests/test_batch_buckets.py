"""Batch buckets: a run padded up to a fixed batch size, run by a session that only ever sees that
size.

On the CUDA provider (the server's default there) they keep dynamic batching from handing
onnxruntime a new input shape nearly every run, each of which reruns cuDNN's set-up of every
convolution (scripts/gpu-check measures it). Here, on the CPU, the padding itself is proven with
explicit buckets: the rows a client sent come back, computed as without buckets, by the bucket's own
session; and the server's flag and warm-up."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
import requests
from onnx import TensorProto, helper
from serving_fixtures import (
    ROOT,
    ServerProcess,
    gather_model,
    run_onnx,
    tiny_model,
    two_axes_model,
    two_input_model,
)

from serving.batcher import NotRowWise
from serving.engine import BatchBuckets, Engine, ModelInputError


def test_a_run_is_padded_to_its_bucket_by_that_buckets_session_and_answers_only_its_rows(tmp_path):
    path = str(tiny_model(tmp_path / "m.onnx"))
    plain = Engine(path, device="cpu", threads=1)
    engine = Engine(path, device="cpu", threads=1, batch_buckets=BatchBuckets((4, 2)))
    assert engine.buckets == (2, 4) and plain.buckets == ()
    assert [engine.bucket_for(n) for n in (1, 2, 3, 4)] == [2, 2, 4, 4]

    seen: list[tuple[str, int]] = []

    def recording(label, session):
        run = session.run
        return lambda names, feeds: seen.append((label, len(feeds["input"]))) or run(names, feeds)

    engine._bucket_sessions[2].run = recording("bucket 2", engine._bucket_sessions[2])
    engine.session.run = recording("largest", engine.session)
    x = np.random.default_rng(0).random((9, 1, 8, 8), dtype=np.float32)
    for rows in (1, 2, 3, 4, 5, 9):
        got = engine.run({"input": x[:rows]})
        want = plain.run({"input": x[:rows]})
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
    # Past the largest bucket: chunks of it, the last one padded to its own bucket. No session sees
    # a new shape.
    assert seen == [
        ("bucket 2", 2),
        ("bucket 2", 2),
        ("largest", 4),
        ("largest", 4),
        ("largest", 4),
        ("bucket 2", 2),
        ("largest", 4),
        ("largest", 4),
        ("bucket 2", 2),
    ]
    engine.close()
    assert engine.session is None and engine._bucket_sessions == {}


def test_padding_keeps_every_input_and_a_bad_value_is_still_the_clients_error(tmp_path):
    engine = Engine(
        str(two_input_model(tmp_path / "two.onnx")),
        device="cpu",
        threads=1,
        # a hand-made model: its rows are independent, said here
        batching=True,
        batch_buckets=BatchBuckets((4,)),
    )
    features = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = engine.run({"features": features, "code": np.array([1, 2, 3])})["output"]
    np.testing.assert_array_equal(got, features + np.array([[1], [2], [3]], np.float32))

    gather = Engine(
        str(gather_model(tmp_path / "gather.onnx")),
        device="cpu",
        threads=1,
        # a hand-made model: its rows are independent, said here
        batching=True,
        batch_buckets=BatchBuckets((2, 8)),
    )
    assert gather.run({"ids": np.array([4, 0, 1])})["vectors"].tolist() == [
        [12, 13, 14],
        [0, 1, 2],
        [3, 4, 5],
    ]
    with pytest.raises(ModelInputError, match="the model cannot compute on these input values"):
        # an id past the table, padded or not
        gather.run({"ids": np.array([1, 7, 2])})


def test_buckets_only_for_a_model_whose_one_dynamic_axis_in_and_out_is_the_batch(tmp_path, caplog):
    caplog.set_level("INFO", logger="serving.engine")
    engine = Engine(
        str(two_axes_model(tmp_path / "m.onnx")),
        device="cpu",
        threads=1,
        # a hand-made model: its rows are independent, said here
        batching=True,
        batch_buckets=BatchBuckets((2, 4)),
    )
    assert engine.buckets == () and engine._bucket_sessions == {}
    # An output without a batch axis (a sum over the batch): cutting padded rows off it is not
    # possible.
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0)],
        "sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [4])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(tmp_path / "sum.onnx"))
    engine = Engine(
        str(tmp_path / "sum.onnx"),
        device="cpu",
        threads=1,
        batch_buckets=BatchBuckets((2, 4)),
        batching=True,
    )
    assert engine.buckets == ()
    # Declared batchable, it is not: the first run of 3 rows says so (its output has 4 values, not 3
    # rows), and from then on it runs as sent, unbatched.
    with pytest.raises(
        NotRowWise, match=r"a batched run of 3 rows gave output\(s\) 'total' of shape \[4\]"
    ):
        engine.run({"x": np.ones((3, 4), np.float32)})
    assert not engine.batchable and not engine.inputs[0].batched
    assert engine.run({"x": np.ones((3, 4), np.float32)})["total"].tolist() == [3.0] * 4
    said = [r.getMessage() for r in caplog.records]
    assert (
        "no batch buckets for m.onnx: an input has a dynamic axis besides the batch axis" in said[0]
    )
    assert "no batch buckets for sum.onnx: an input or output has no dynamic batch axis" in said[1]
    # auto's rule: the CUDA provider only (here the session runs on the CPU).
    tiny = str(tiny_model(tmp_path / "tiny.onnx"))
    assert (
        Engine(
            tiny, device="cpu", threads=1, batch_buckets=BatchBuckets((2, 4), cuda_only=True)
        ).buckets
        == ()
    )


def test_the_server_pads_to_the_buckets_asked_and_refuses_bad_ones(tmp_path):
    model = tiny_model(tmp_path / "m.onnx")

    def refused(*flags):
        proc = subprocess.run(
            [sys.executable, "-m", "serving", "--model", str(model), *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        return proc.stderr

    for value in ("0,4", "8", "two", "2,,4", "\u00b2"):
        said = refused("--batch-buckets", value, "--max-batch-size", "4")
        assert (
            "--batch-buckets must be auto, off, or batch sizes from 1 to --max-batch-size (4) like 1,4, got"
            in said
        )
        assert repr(value) in said
    assert "do not apply to --device tensorrt" in refused(
        "--batch-buckets", "2", "--device", "tensorrt"
    )

    x = np.random.default_rng(1).random((3, 1, 8, 8), dtype=np.float32)
    want = run_onnx(model, x)["probabilities"]
    with ServerProcess(
        "--model",
        str(model),
        "--device",
        "cpu",
        "--batch-buckets",
        "2",
        "--max-batch-size",
        "4",
        log_path=tmp_path / "log",
    ) as server:
        url = f"{server.url}/v2/models/tiny/infer"

        def ask(rows):
            body = {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [rows, 1, 8, 8],
                        "datatype": "FP32",
                        "data": x[:rows].ravel().tolist(),
                    }
                ]
            }
            return requests.post(url, json=body, timeout=30).json()["outputs"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, [1, 2, 3] * 8))
        log = server.log()
    assert "batch buckets 2,4 (a session each)" in log
    # each bucket once: the size its session will only ever see
    assert "warm-up of 2 batch sizes" in log
    for rows, outputs in zip([1, 2, 3] * 8, answers):
        probabilities = next(o for o in outputs if o["name"] == "probabilities")
        assert probabilities["shape"] == [rows, 3]
        np.testing.assert_allclose(
            np.asarray(probabilities["data"], np.float32).reshape(rows, 3),
            want[:rows],
            rtol=1e-5,
            atol=1e-6,
        )
