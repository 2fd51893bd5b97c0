"""A model's weights in an ONNX external data file (model.onnx.data), the way a model past
protobuf's 2 GB goes through export, the registry, the server and `pipeline verify`, forced on a
small recommender (examples/recommender/, 4000 x 16 table) with `export.external_data=always`: the
same code path as the 2.5 GB run of benchmarks/big_model.py, in seconds. A real SQLite MLflow store,
real onnxruntime, a real server."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import requests
import torch
from conftest import REPO
from safetensors.torch import save_file
from serving_fixtures import ServerProcess

from pipeline import verify
from pipeline.components.build import build_data, instantiate_model, model_spec
from pipeline.config import load_config
from pipeline.export import main as export
from pipeline.tasks import build_task
from serving import lineage
from serving.lineage import file_sha256
from serving.loader import SourceError, load_model

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "recommender_big_embedding.yaml"
NAME = "recommender-external"
TRUST = ["examples.recommender.*"]
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """The small recommender, its weights written as `pipeline consolidate` writes them, exported
    with its weights in a data file and registered in a fresh store."""
    root = tmp_path_factory.mktemp("external")
    uri = f"sqlite:///{root}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment(
        "external", artifact_location=(root / "artifacts").as_uri()
    )
    cfg = load_config(
        CONFIG,
        [
            "data.args.rows=4000",
            "model.args.dim=16",
            "model.args.blocks=2",
            "data.args.train_samples=256",
            "data.args.val_samples=128",
            f"tracking.tracking_uri={uri}",
            "tracking.experiment=external",
            f"export.registered_model_name={NAME}",
        ],
    )
    splits = build_data(cfg.data, cfg.task.name)
    spec, _ = model_spec(cfg.model, splits, build_task(cfg.task, splits.classes))
    torch.manual_seed(0)
    model = instantiate_model(spec)
    with mlflow.start_run(experiment_id=experiment) as run:
        pass
    weights = root / "consolidated"
    weights.mkdir()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights / "model.safetensors"))
    (weights / "model.json").write_text(
        json.dumps(
            {
                "format": "trainserve-weights/2",
                "config": cfg.model_dump(mode="json"),
                "model": spec.to_json(),
                "task": {"name": "classification", "num_classes": 2, "labels": splits.classes},
                "labels": splits.classes,
                "inputs": [{"name": "input", "dtype": "int64", "shape": [8]}],
                "single_input": True,
                "sha256": file_sha256(weights / "model.safetensors"),
                "dtype": "float32",
                "source": {
                    "checkpoint": str(root / "checkpoints" / "step_00000001"),
                    "step": 1,
                    "world_size": 1,
                    "strategy": "fsdp",
                    "mlflow_run_id": run.info.run_id,
                },
            }
        )
    )
    # untrained weights (what is tested is where they go): the baseline gate is told to let them
    # through
    result = export(
        weights,
        overrides=["export.external_data=always", "export.allow_below_baseline=true"],
        trusted=TRUST,
    )
    return {"result": result, "uri": uri, "root": root, "val": splits.val}


def test_the_weights_go_to_a_data_file_named_by_the_graph_and_every_gate_passes(registered):
    result = registered["result"]
    assert result.passed and result.model_version == "1", result.report["failures"]
    data = result.onnx_path.with_name("model.onnx.data")
    table = 4000 * 16 * 4
    # the graph and metadata
    assert data.stat().st_size >= table and result.onnx_path.stat().st_size < table // 4
    graph = onnx.load(str(result.onnx_path), load_external_data=False)
    locations = {
        e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"
    }
    # renamed from the candidate's with the file
    assert locations == {"model.onnx.data"}
    assert not list(result.onnx_path.parent.glob("model.candidate.onnx*"))
    tags = mlflow.MlflowClient().get_model_version(NAME, "1").tags
    assert (
        lineage.recorded_sha256(tags, "model.onnx.data")
        == file_sha256(data)
        == result.report["sha256"]["model.onnx.data"]
    )
    assert lineage.recorded_sha256(tags, "model.onnx") == file_sha256(result.onnx_path)


def test_the_server_loads_the_pair_from_the_registry_and_answers_as_onnxruntime_does(
    registered, tmp_path
):
    result, val = registered["result"], registered["val"]
    items = val.items[:5].numpy()
    expected = ort.InferenceSession(str(result.onnx_path)).run(["probabilities"], {"input": items})[
        0
    ]
    with ServerProcess(
        "--model",
        f"models:/{NAME}@champion",
        env={**ENV, "MLFLOW_TRACKING_URI": registered["uri"]},
        log_path=tmp_path / "server.log",
    ) as server:
        body = {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "INT64",
                    "shape": list(items.shape),
                    "data": items.ravel().tolist(),
                }
            ]
        }
        answer = requests.post(f"{server.url}/v2/models/{NAME}/infer", json=body, timeout=30).json()
    served = next(o for o in answer["outputs"] if o["name"] == "probabilities")
    np.testing.assert_allclose(
        np.array(served["data"]).reshape(expected.shape), expected, rtol=1e-6, atol=1e-7
    )


def test_a_data_file_changed_in_the_store_is_refused_by_the_servers_loader_and_by_verify(
    registered, tmp_path
):
    stored = next((registered["root"] / "artifacts").rglob("model.onnx.data"))
    original = stored.read_bytes()
    tags = mlflow.MlflowClient().get_model_version(NAME, "1").tags
    reports: list = []
    try:
        # one weight changed, the graph untouched
        stored.write_bytes(original[:-4] + b"\0\0\0\1")
        mlflow.set_tracking_uri(registered["uri"])
        # The server's loader, as the server at its start calls it (a server process was started
        # above).
        with pytest.raises(
            SourceError, match="model.onnx.data of models:/recommender-external/1 has sha256"
        ):
            load_model(f"models:/{NAME}@champion", device="cpu", threads=1)
        verify.onnx_link(NAME, "1", tags, tmp_path / "verify", reports.append)
    finally:
        stored.write_bytes(original)
    assert reports[0].status == "FAIL" and "model.onnx.data sha256" in reports[0].detail
    assert (
        f"!= the version's recorded {lineage.recorded_sha256(tags, 'model.onnx.data')[:16]}"
        in reports[0].detail
    )
    again: list = []
    verify.onnx_link(NAME, "1", tags, tmp_path / "verify-again", again.append)
    assert again[0].status == "ok", again[0].detail


def test_the_exporter_lets_go_of_the_weights_once_they_are_written(tmp_path):
    """onnxscript's rewrite rules keep the last graph they matched, and the graph the module's
    tensors: unless export drops them, the exporter's copy of a 2.5 GB table stays in memory beside
    onnxruntime's."""
    import gc
    import weakref

    from pipeline.artifact import onnx_export
    from pipeline.components.build import ModelSpec
    from pipeline.tasks.classification import Classification

    model = instantiate_model(
        ModelSpec("examples.recommender.model:BagOfItems", {"rows": 1000, "dim": 8, "blocks": 2})
    ).eval()
    weight = weakref.ref(model.table[0].embedding.weight)
    head = onnx_export.ExportHead(
        model, Classification(["no_click", "click"], top_k=1), ["input"], True
    )
    exported = onnx_export.export(
        head,
        {"input": torch.randint(0, 1000, (2, 8))},
        {},
        18,
        {},
        tmp_path / "model.onnx",
        "always",
    )
    assert (
        exported.exporter == "dynamo" and onnx_export.data_file(tmp_path / "model.onnx").is_file()
    )
    del model, head
    gc.collect()
    assert weight() is None


def test_the_reference_model_uses_the_weights_file_mapped_not_copied(registered):
    """load_model assigns the tensors safetensors maps: a model of N GB costs N GB once, as pages
    are read."""
    from pipeline.artifact.weights import load_model, read_weights

    weights = read_weights(registered["root"] / "consolidated")
    model = load_model(weights)
    assert all(
        p.data_ptr() == weights.state_dict[k].data_ptr() for k, p in model.state_dict().items()
    )


def test_a_failed_dynamo_attempt_leaves_no_bytes_in_the_fallbacks_data_file(tmp_path, monkeypatch):
    """The dynamo exporter writes graph + data file, then a check of its result fails: the
    TorchScript fallback saves to the same names, and onnx appends to a data file that is there (a
    file twice the size, dead bytes hashed and uploaded) unless the attempt's files are removed
    first."""
    from pipeline.artifact import onnx_export
    from pipeline.components.build import ModelSpec
    from pipeline.tasks.classification import Classification

    checked = onnx_export._check_opset

    def dynamo_fails_its_check(proto, opset, exporter):
        if exporter == "dynamo":
            raise RuntimeError("the dynamo graph failed a check after it was saved")
        return checked(proto, opset, exporter)

    monkeypatch.setattr(onnx_export, "_check_opset", dynamo_fails_its_check)
    model = instantiate_model(
        ModelSpec("examples.recommender.model:BagOfItems", {"rows": 1000, "dim": 8, "blocks": 2})
    ).eval()
    head = onnx_export.ExportHead(
        model, Classification(["no_click", "click"], top_k=1), ["input"], True
    )
    path = tmp_path / "model.onnx"
    exported = onnx_export.export(
        head, {"input": torch.randint(0, 1000, (2, 8))}, {}, 18, {}, path, "always"
    )
    assert exported.exporter == "torchscript"
    data = onnx_export.data_file(path)
    assert data.stat().st_size < 1.2 * onnx_export.weights_size(head), (
        data.stat().st_size,
        onnx_export.weights_size(head),
    )
