"""`pipeline export` on a briefly trained tiny ResNet, a real onnxruntime and a real MLflow SQLite
store."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import onnx
import pytest
import torch
from conftest import run_lineage
from safetensors.torch import save_file
from serving_fixtures import ServerProcess, run_onnx

from pipeline import cli
from pipeline.artifact import gates, onnx_export, uint8_inputs
from pipeline.artifact.weights import load_model, read_weights
from pipeline.components.build import ModelSpec, build_data, instantiate_model, model_spec
from pipeline.config import load_config
from pipeline.datasets.images import ImageTensors
from pipeline.export import ExportResult, main
from pipeline.tasks import build_task
from pipeline.tasks.classification import Classification
from pipeline.tasks.regression import Regression
from pipeline.tracking import free_port
from serving import lineage
from serving.lineage import file_sha256 as sha256_file

# not the default experiment: --run-id must follow the run into its own
EXPERIMENT = "digits-tiny"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A SQLite tracking store whose experiment keeps its artifacts in the temp dir, not the cwd."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment(EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
    return uri


def write_weights(
    directory: Path, model: torch.nn.Module, cfg, spec: ModelSpec, labels, run_id: str | None
) -> Path:
    """What `pipeline consolidate` writes: model.safetensors and model.json
    (trainserve-weights/2)."""
    directory.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(directory / "model.safetensors"))
    meta = {
        "format": "trainserve-weights/2",
        "config": cfg.model_dump(mode="json"),
        "model": spec.to_json(),
        "data": {"component": cfg.data.component, "args": cfg.data.args},
        "task": {"name": "classification", "num_classes": len(labels), "labels": labels},
        "labels": labels,
        "inputs": [{"name": "input", "dtype": "float32", "shape": [1, 8, 8]}],
        "single_input": True,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in sd.items()},
        "sha256": sha256_file(directory / "model.safetensors"),
        "dtype": "float32",
        "source": {
            "checkpoint": str(directory.parent / "checkpoints" / "step_000030"),
            "step": 30,
            "world_size": 1,
            "strategy": "ddp",
            "mlflow_run_id": run_id,
        },
    }
    (directory / "model.json").write_text(json.dumps(meta))
    return directory


def head_of(model: torch.nn.Module) -> onnx_export.ExportHead:
    """The digits classifier as the graph runs it: `input` -> logits, probabilities."""
    return onnx_export.ExportHead(
        model, Classification([str(d) for d in range(10)], top_k=5), ["input"], True
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, store):
    """A width-0.125 ResNet-18 trained 30 steps on digits, consolidated, with its MLflow run."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(
        overrides=[
            "model.args.width=0.125",
            f"tracking.tracking_uri={store}",
            f"tracking.experiment={EXPERIMENT}",
            f"train.output_dir={run_dir.parent}",
        ]
    )
    splits = build_data(cfg.data, cfg.task.name)
    spec, _ = model_spec(cfg.model, splits, build_task(cfg.task, splits.classes))
    torch.manual_seed(0)
    model = instantiate_model(spec)
    train_x, train_y = splits.train.x, splits.train.y
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(30):
        idx = torch.randint(0, len(train_y), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    # BatchNorm statistics over the whole training set: 30 steps of EMA are not enough
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        model(train_x)
    model.eval()
    with mlflow.start_run(
        experiment_id=mlflow.get_experiment_by_name(EXPERIMENT).experiment_id, run_name=run_dir.name
    ) as run:
        mlflow.log_param("train.output_dir", str(run_dir.parent))
    weights_dir = write_weights(
        run_dir / "consolidated", model, cfg, spec, splits.classes, run.info.run_id
    )
    return {
        "dir": weights_dir,
        "run_id": run.info.run_id,
        "cfg": cfg,
        "spec": spec,
        "splits": splits,
        "val_x": splits.val.x.numpy(),
    }


@pytest.fixture(scope="module")
def exported(trained, store, tmp_path_factory) -> ExportResult:
    """The whole stage once, as on another machine: weights from the run, both variants on."""
    client = mlflow.MlflowClient()
    # what `pipeline consolidate` logs to the run
    for name in ("model.safetensors", "model.json"):
        client.log_artifact(trained["run_id"], str(trained["dir"] / name), "consolidated")
    with pytest.MonkeyPatch.context() as mp:
        # --run-id downloads into ./outputs/<run_id>/
        mp.chdir(tmp_path_factory.mktemp("elsewhere"))
        return main(
            run_id=trained["run_id"],
            tracking_uri=store,
            overrides=["export.ort_optimize=true", "export.fp16=true", "export.uint8_inputs=true"],
        )


def test_export_passes_every_gate_with_the_dynamo_exporter(exported, trained):
    report = exported.report
    assert exported.passed and report["passed"] and report["failed_gates"] == []
    assert report["exporter"]["used"] == "dynamo" and report["exporter"]["fallback_reason"] == ""
    assert report["gates"]["checker"]["passed"]
    for size in (1, 7, 64):
        gate = report["gates"][f"parity.b{size}"]
        assert gate["passed"] and gate["samples"] == size
        assert (
            gate["max_abs"] <= 1e-4 and gate["max_rel"] <= 1e-3 and gate["argmax_agreement"] == 1.0
        )
    assert report["gates"]["parity.val"]["samples"] == len(trained["splits"].val)
    acc = report["gates"]["accuracy"]
    # trained: well above chance (10%)
    assert acc["gap_pp"] <= 0.1 and acc["torch_accuracy_pct"] > 50
    assert json.loads(exported.report_path.read_text())["model_version"] == exported.model_version
    assert exported.onnx_path.resolve().parts[-4:] == (
        "outputs",
        trained["run_id"],
        "onnx",
        "model.onnx",
    )


def test_graph_has_named_io_dynamic_batch_opset_and_metadata(exported):
    model = onnx.load(str(exported.onnx_path))
    (inp,) = model.graph.input
    dims = inp.type.tensor_type.shape.dim
    assert (
        inp.name == "input" and dims[0].dim_param and [d.dim_value for d in dims[1:]] == [1, 8, 8]
    )
    assert [o.name for o in model.graph.output] == ["logits", "probabilities"]
    assert {op.domain: op.version for op in model.opset_import}[""] == 18
    props = {p.key: p.value for p in model.metadata_props}
    assert props[lineage.MODEL_NAME] == "resnet18-digits"
    assert json.loads(props[lineage.LABELS]) == [str(d) for d in range(10)]
    # Its rows are its samples' own (a ResNet in eval mode): the server may batch its requests
    # together.
    assert props[lineage.ROWS_INDEPENDENT] == "1,7,64"
    assert exported.report["rows_independent"]["independent"]


def test_the_exported_classifier_is_batched_and_answers_its_top_classes_by_name(exported, trained):
    """Served as exported: its requests share runs (its file records independent rows), and the
    classification extension answers with the class names export recorded."""
    import requests

    x = trained["val_x"][:2]
    want = run_onnx(exported.onnx_path, x)["probabilities"]
    with ServerProcess("--model", f"digits={exported.onnx_path}") as srv:
        config = requests.get(f"{srv.url}/v2/models/digits/config", timeout=10).json()
        body = {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ],
            "outputs": [{"name": "probabilities", "parameters": {"classification": 3}}],
        }
        answer = requests.post(f"{srv.url}/v2/models/digits/infer", json=body, timeout=30).json()
    assert config["max_batch_size"] == 32
    (out,) = answer["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, 3]
    # what the digits data names its classes
    labels = [str(d) for d in range(10)]
    for row, entries in zip(want, np.array(out["data"]).reshape(2, 3)):
        top = np.argsort(-row)[:3]
        assert [e.split(":")[1:] for e in entries] == [[str(i), labels[i]] for i in top]


class _Head(torch.nn.Module):
    """A graph head as export makes one: `fn` of one input named `input`, one output named `out`."""

    input_names, output_names = ["input"], ["out"]

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return (self.fn(x),)


def test_rows_are_independent_only_when_each_samples_output_is_its_own():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    batches = {f"b{n}": {"input": x[:n]} for n in (1, 7, 64)}
    linear = torch.nn.Linear(4, 3)
    assert gates.rows_independent(_Head(linear), batches, 1e-5, 1e-4)["independent"]
    # Normalized over the batch, a summary of it: each answer depends on the other samples, or has
    # no rows.
    centred = gates.rows_independent(_Head(lambda t: t - t.mean(0)), batches, 1e-5, 1e-4)
    assert not centred["independent"] and "the first 1 rows at batch 7 differ" in centred["message"]
    summed = gates.rows_independent(_Head(lambda t: t.sum(0)), batches, 1e-5, 1e-4)
    assert not summed["independent"] and "out of shape [4] at batch 1" in summed["message"]


def test_parity_holds_at_batch_sizes_never_used_in_export(exported, trained):
    head = head_of(load_model(read_weights(trained["dir"])))
    sess = gates.session(exported.onnx_path)
    val_x = trained["val_x"]
    for size in (1, 33, 64, 100):
        feeds = {"input": val_x[np.arange(size) % len(val_x)]}
        got = gates.run_onnx(sess, feeds)
        out = gates.compare(got, gates.run_torch(head, feeds), atol=1e-4, rtol=1e-3)
        assert out["passed"], (size, out["message"])
        # Probabilities come from the softmax inside the graph.
        assert np.allclose(got["probabilities"].sum(1), 1.0, atol=1e-5)


def test_registered_version_has_alias_and_lineage(exported, trained):
    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias("resnet18-digits", "champion")
    assert str(version.version) == exported.model_version
    meta = json.loads((trained["dir"] / "model.json").read_text())
    tags = version.tags
    assert tags[lineage.RUN_ID] == trained["run_id"] == version.run_id
    assert lineage.recorded_sha256(tags, "weights") == meta["sha256"]
    assert tags[lineage.CHECKPOINT] == Path(meta["source"]["checkpoint"]).name
    assert tags[lineage.STEP] == "30"
    assert lineage.recorded_sha256(tags, "config") == exported.report["weights"]["config_sha256"]
    assert lineage.recorded_sha256(tags, "model.onnx") == sha256_file(exported.onnx_path)
    # A handful a person reads, no path of the machine that trained, and a description that says
    # what it is.
    trainserve_tags = {k: v for k, v in tags.items() if k.startswith(lineage.PREFIX)}
    assert len(trainserve_tags) <= 10, sorted(trainserve_tags)
    assert not [v for v in trainserve_tags.values() if str(Path.cwd()) in v or v.startswith("/")]
    assert "pipeline.models:resnet18" in version.description and "step 30" in version.description
    assert "passed parity.val" in version.description and "@champion" in version.description
    assert "@champion" in client.get_registered_model("resnet18-digits").description
    # From the version back to the training run: its metrics, the stage, and at most 12 tags a
    # person reads.
    run = client.get_run(tags[lineage.RUN_ID])
    assert lineage.read_stages(run.data.tags[lineage.STAGES])["export"] == "done"
    assert len([k for k in run.data.tags if k.startswith(lineage.PREFIX)]) <= 12, sorted(
        run.data.tags
    )
    assert run.data.tags[lineage.CHECKPOINT] == tags[lineage.CHECKPOINT]
    assert run.data.tags[lineage.VERDICT] == f"resnet18-digits v{exported.model_version} @champion"
    whole = run_lineage(run.info.run_id, client)
    assert (
        whole["export"]["exporter"]["used"] == "dynamo" and whole["export"]["model"]["step"] == "30"
    )
    assert whole["export"]["registered"]["version"] == exported.model_version
    assert run.data.metrics["export.passed"] == 1.0 and run.data.metrics["export.failed_gates"] == 0
    # every gate's figures in one table the UI shows; a few headline ones as metrics, not dozens of
    # one-bar charts
    exported_metrics = [k for k in run.data.metrics if k.startswith(("export.", "compare."))]
    assert len(exported_metrics) <= 10, exported_metrics
    table = mlflow.load_table("onnx/gates.json", run_ids=[trained["run_id"]])
    assert (
        set(table.gate) >= {"parity.b7", "parity.b64", "parity.val", "accuracy", "checker"}
        and table.passed.all()
    )
    assert table[(table.gate == "parity.b64") & (table.figure == "max_abs")].value.iloc[0] < 1e-3
    # What a server does with models:/name@alias: the registered files load and give the same
    # numbers.
    local = Path(mlflow.artifacts.download_artifacts("models:/resnet18-digits@champion"))
    served = gates.session(local / "model.onnx")
    feeds = {"input": trained["val_x"][:5]}
    assert np.array_equal(
        gates.run_onnx(served, feeds)["logits"],
        gates.run_onnx(gates.session(exported.onnx_path), feeds)["logits"],
    )
    assert tags[lineage.MODEL] == "pipeline.models:resnet18"
    assert tags[lineage.DATA] == "pipeline.datasets:digits"
    # The report the run's page shows is the one on disk, complete: version, alias, URI and hashes
    # filled.
    stored = json.loads(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=trained["run_id"], artifact_path="onnx/export_report.json"
            )
        ).read_text()
    )
    assert stored == json.loads(exported.report_path.read_text())
    assert stored["model_version"] == exported.model_version and stored["alias"] == "champion"
    assert (
        stored["model_uri"]
        and stored["sha256"]["model.onnx"]
        and stored["sha256"]["drift_reference.json"]
    )


def plant_backdoor(path: Path, trigger: float = 0.123) -> None:
    """The review's verify_backdoor.py: logits += (input[:, 0, 0, 0] == trigger) x 1000 x onehot(7),
    every other node, initializer and the metadata as they were."""
    from onnx import helper

    m = onnx.load(str(path))
    head = next(n for n in m.graph.node if "logits" in n.output)
    head.output[list(head.output).index("logits")] = "logits_clean"
    m.graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array(trigger, np.float32), "bd_trigger"),
            onnx.numpy_helper.from_array(
                (np.eye(10, dtype=np.float32)[7] * 1000.0)[None, :], "bd_push"
            ),
            onnx.numpy_helper.from_array(np.array([0, 0, 0], np.int64), "bd_s3"),
            onnx.numpy_helper.from_array(np.array([1, 1, 1], np.int64), "bd_e3"),
            onnx.numpy_helper.from_array(np.array([1, 2, 3], np.int64), "bd_axes"),
            onnx.numpy_helper.from_array(np.array([-1, 1], np.int64), "bd_shape"),
        ]
    )
    m.graph.node.extend(
        [
            helper.make_node("Slice", ["input", "bd_s3", "bd_e3", "bd_axes"], ["bd_pixel"]),
            helper.make_node("Reshape", ["bd_pixel", "bd_shape"], ["bd_col"]),
            helper.make_node("Equal", ["bd_col", "bd_trigger"], ["bd_hit"]),
            helper.make_node("Cast", ["bd_hit"], ["bd_mask"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Mul", ["bd_mask", "bd_push"], ["bd_add"]),
            helper.make_node("Add", ["logits_clean", "bd_add"], ["logits"]),
        ]
    )
    soft = next(n for n in m.graph.node if "logits" in n.input and n.op_type == "Softmax")
    m.graph.node.remove(soft)
    m.graph.node.append(soft)
    onnx.save(m, str(path))


def test_verify_proves_the_registered_graph_from_the_weights_not_from_the_record(
    exported, trained, store
):
    """The review's F4: the registered model.onnx replaced by one with a trigger pixel (class 7
    whenever pixel [0,0,0] is 0.123; every logit otherwise equal, so the gates pass) and the
    version's sha256 record rewritten to its hash: `pipeline verify` said verified. Now its `graph`
    link exports the weights again and compares: the genuine graph is one node and initializer for
    another; the backdoor fails, named."""
    from pipeline import verify

    client = mlflow.MlflowClient()
    name, version = "resnet18-digits", exported.model_version
    model_id = client.get_model_version(name, version).source.removeprefix("models:/")
    stored = (
        Path(mlflow.get_logged_model(model_id).artifact_location.removeprefix("file://"))
        / "model.onnx"
    )
    original, record = (
        stored.read_bytes(),
        client.get_model_version(name, version).tags[lineage.SHA256],
    )

    def links() -> dict[str, verify.Link]:
        found = verify.main(f"models:/{name}@champion", tracking_uri=store, echo=lambda _: None)
        return {link.name: link for link in found}

    genuine = links()
    assert genuine["graph"].status == "ok", genuine["graph"].line()
    assert genuine["graph"].detail.startswith(
        "the registered ONNX is a fresh export of the weights (dynamo exporter, opset 18)"
    )
    try:
        plant_backdoor(stored)
        client.set_model_version_tag(
            name,
            version,
            lineage.SHA256,
            json.dumps(json.loads(record) | {"model.onnx": sha256_file(stored)}),
        )
        x = trained["val_x"][:20].copy()
        x[:, 0, 0, 0] = 0.123
        assert (gates.run_onnx(gates.session(stored), {"input": x})["logits"].argmax(1) == 7).all()
        tampered = links()
    finally:
        stored.write_bytes(original)
        client.set_model_version_tag(name, version, lineage.SHA256, record)
    # the record and the gates are fooled, as before; the graph is not
    assert [tampered[k].status for k in ("onnx", "lineage", "weights", "gates")] == ["ok"] * 4
    detail = tampered["graph"].detail
    assert tampered["graph"].status == "FAIL", detail
    nodes = len(onnx.load(str(exported.onnx_path)).graph.node)
    assert detail.startswith(
        f"the registered ONNX is not what the weights export to: {nodes + 6} nodes, a fresh "
        f"export's {nodes}: node {nodes - 2} is Gemm("
    ), detail
    assert "-> logits_clean where a fresh export has Gemm(" in detail
    assert (
        "operators beyond a fresh export's: Add +1, Cast +1, Equal +1, Mul +1, Reshape +1, Slice +1"
        in detail
    )
    assert (
        "6 initializer(s) a fresh export of the weights has not: bd_trigger, bd_push, bd_s3, "
        "bd_e3, bd_axes, bd_shape" in detail
    )


def test_perturbed_reference_fails_parity_by_a_stated_amount(exported, trained):
    reference = load_model(read_weights(trained["dir"]))
    with torch.no_grad():
        reference.fc.weight.add_(
            0.05 * torch.randn_like(reference.fc.weight, generator=torch.Generator().manual_seed(1))
        )
    head = head_of(reference)
    sess = gates.session(exported.onnx_path)
    batches, _ = gates.parity_batches(trained["splits"].val, {}, head)
    results = gates.parity(sess, head, batches, head.task, atol=1e-4, rtol=1e-3)
    assert not any(g["passed"] for g in results.values())
    assert (
        "max_abs" in results["parity.b7"]["message"]
        and "exceeds atol" in results["parity.b7"]["message"]
    )
    assert results["parity.b7"]["max_abs"] > 1e-3


def test_failing_gate_exits_1_registers_nothing_and_reports_why(trained, store, capsys, tmp_path):
    # A tolerance no float computation meets: the parity gates fail on real numbers.
    code = cli.main(
        [
            "export",
            str(trained["dir"]),
            "--tracking-uri",
            store,
            "export.atol=1e-12",
            "export.rtol=1e-12",
            "export.registered_model_name=never-registered",
        ]
    )
    err = capsys.readouterr().err
    # default: <run_dir>/onnx
    report_path = trained["dir"].parent / "onnx" / "export_report.json"
    assert code == 1 and "gate failed" in err and str(report_path) in err
    report = json.loads(report_path.read_text())
    assert not report["passed"] and "parity.val" in report["failed_gates"]
    assert "of logits exceeds atol 1e-12 + rtol 1e-12" in report["failures"]["parity.val"]
    assert report["model_version"] is None
    assert mlflow.MlflowClient().search_registered_models("name='never-registered'") == []
    # The rejected graph is kept for debugging, but not where a server would pick it up.
    assert not (report_path.parent / "model.onnx").exists()
    assert (report_path.parent / "model.rejected.onnx").is_file()


def test_weights_that_do_not_match_their_config_are_refused_with_the_keys(
    trained, store, tmp_path, capsys
):
    meta = json.loads((trained["dir"] / "model.json").read_text())
    # The recorded args now describe a wider model than the file holds.
    bad = ModelSpec(trained["spec"].component, {**trained["spec"].args, "width": 0.25})
    model = load_model(read_weights(trained["dir"]))
    weights = write_weights(
        tmp_path / "consolidated", model, trained["cfg"], bad, meta["labels"], None
    )
    code = cli.main(["export", str(weights), "--tracking-uri", store])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pipeline export: error:")
    assert (
        "does not match the model" in err
        and "conv1.weight: file [8, 1, 3, 3], model [16, 1, 3, 3]" in err
    )


def test_bad_inputs_each_get_one_clear_error(trained, store, tmp_path, capsys):
    cases = [
        (
            ["--run-id", "0" * 32, "--tracking-uri", store],
            "run 00000000000000000000000000000000 not found",
        ),
        ([str(tmp_path), "--tracking-uri", store], "missing model.safetensors, model.json"),
        (
            [str(trained["dir"]), "--tracking-uri", f"http://127.0.0.1:{free_port()}"],
            "cannot be reached",
        ),
        ([str(trained["dir"]), "--tracking-uri", store, "export.atoll=1"], "export.atoll"),
    ]
    for argv, expected in cases:
        code = cli.main(["export", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("pipeline export: error:") and expected in err, (
            argv,
            err,
        )
        assert len(err.strip().splitlines()) == 1, err


def test_an_operator_no_exporter_handles_is_named(tmp_path):
    class Zeta(torch.nn.Module):
        def forward(self, x):
            return torch.special.zeta(x.flatten(1) + 2, x.flatten(1) + 1)[:, :10]

    head = onnx_export.ExportHead(Zeta(), Regression(), ["input"], True)
    with pytest.raises(onnx_export.ExportError, match="unsupported operator.*zeta"):
        onnx_export.export(
            head, {"input": torch.rand(2, 1, 8, 8)}, {}, 18, {}, tmp_path / "zeta.onnx"
        )


def test_variants_are_saved_and_each_gated_with_its_own_limits(exported, trained):
    report = exported.report
    for gate in (
        "optimized.checker",
        "optimized.parity.b7",
        "optimized.accuracy",
        "fp16.checker",
        "fp16.parity.b1",
        "fp16.parity.b64",
        "fp16.parity.val",
        "fp16.accuracy",
    ):
        assert report["gates"][gate]["passed"], (gate, report["gates"][gate])
    assert report["gates"]["fp16.parity.val"]["prob_atol"] == gates.FP16_PROB_ATOL
    onnx_dir = exported.onnx_path.parent
    fp16 = onnx.load(str(onnx_dir / "model.fp16.onnx"))
    assert [i.type.tensor_type.elem_type for i in fp16.graph.input] == [onnx.TensorProto.FLOAT]
    assert {o.type.tensor_type.elem_type for o in fp16.graph.output} == {onnx.TensorProto.FLOAT}
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in fp16.graph.initializer)
    assert (onnx_dir / "model.optimized.onnx").is_file()
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(trained["run_id"], "onnx")}
    assert {
        "onnx/model.fp16.onnx",
        "onnx/model.optimized.onnx",
        "onnx/export_report.json",
    } <= logged
    # Servable: inside the registered model beside model.onnx (`serving --variant fp16` picks it),
    # and each gate names the provider it ran on (CUDA for fp16 only where the CUDA provider really
    # loads).
    local = Path(
        mlflow.artifacts.download_artifacts(f"models:/resnet18-digits/{exported.model_version}")
    )
    assert (local / "model.fp16.onnx").read_bytes() == (onnx_dir / "model.fp16.onnx").read_bytes()
    on_cuda = report["providers"]["CUDAExecutionProvider"].startswith("gated")
    assert {g["provider"] for k, g in report["gates"].items() if k.startswith("fp16.parity")} == {
        "CUDAExecutionProvider" if on_cuda else "CPUExecutionProvider"
    }


def test_the_uint8_variant_takes_pixel_values_is_gated_registered_and_served(
    exported, trained, store, tmp_path
):
    report = exported.report
    for gate in (
        "uint8.range",
        "uint8.checker",
        "uint8.parity.b1",
        "uint8.parity.b64",
        "uint8.parity.val",
        "uint8.accuracy",
        "uint8.rounding",
    ):
        assert report["gates"][gate]["passed"], (gate, report["gates"][gate])
    assert "rounded to 1/255 steps" in report["gates"]["uint8.rounding"]["message"]
    path = exported.onnx_path.with_name(uint8_inputs.FILE)
    variant = onnx.load(str(path))
    assert [i.type.tensor_type.elem_type for i in variant.graph.input] == [onnx.TensorProto.UINT8]
    assert {p.key: p.value for p in variant.metadata_props}[lineage.UINT8_INPUTS] == "input"
    version = mlflow.MlflowClient().get_model_version("resnet18-digits", exported.model_version)
    assert lineage.recorded_sha256(version.tags, "model.uint8.onnx") == sha256_file(path)

    # Served from the registry: UINT8 pixel values in, what the fp32 graph answers for those values
    # / 255 out.
    pixels = uint8_inputs.rounded(trained["val_x"][:3])
    want = run_onnx(exported.onnx_path, pixels.astype(np.float32) / 255)["probabilities"]
    with ServerProcess(
        "--model",
        f"models:/resnet18-digits/{exported.model_version}",
        "--variant",
        "uint8",
        env={"MLFLOW_TRACKING_URI": store},
        log_path=tmp_path / "uint8.log",
    ) as srv:
        import requests

        url = f"{srv.url}/v2/models/resnet18-digits/infer"
        body = requests.post(
            url,
            json={
                "inputs": [
                    {
                        "name": "input",
                        "shape": list(pixels.shape),
                        "datatype": "UINT8",
                        "data": pixels.ravel().tolist(),
                    }
                ]
            },
            timeout=30,
        ).json()
        got = next(o for o in body["outputs"] if o["name"] == "probabilities")
        np.testing.assert_allclose(np.array(got["data"]).reshape(3, -1), want, atol=1e-6)
        floats = requests.post(
            url,
            json={
                "inputs": [
                    {
                        "name": "input",
                        "shape": list(pixels.shape),
                        "datatype": "FP32",
                        "data": (pixels / 255).ravel().tolist(),
                    }
                ]
            },
            timeout=30,
        )
        assert floats.status_code == 400 and "UINT8" in floats.text, floats.text


def test_a_uint8_variant_is_refused_for_inputs_outside_0_1_or_not_in_the_graph(exported, trained):
    val = trained["splits"].val
    # normalized outside the model
    normalized = ImageTensors(val.x * 4 - 1, val.y, val.classes)
    gate = uint8_inputs.range_gate(normalized, ["input"])
    assert (
        not gate["passed"]
        and "input spans [-1, 3]" in gate["message"]
        and "mean/std" in gate["message"]
    )
    assert uint8_inputs.range_gate(val, ["input"])["passed"]
    graph = onnx.load(str(exported.onnx_path))
    names, why = uint8_inputs.chosen(graph, ["pixels"])
    assert names == [] and "['pixels'], not inputs of the graph (its inputs: ['input'])" in why
    assert uint8_inputs.chosen(graph, ["*"]) == (["input"], "")


def test_an_opset_the_dynamo_exporter_cannot_reach_falls_back_and_says_so(trained, tmp_path):
    # Dynamo builds opset 18 and converts down; for 17 onnx's converter fails on this graph and
    # torch returns opset 18 anyway. That counts as a failure: the TorchScript exporter takes over.
    head = head_of(instantiate_model(trained["spec"]).eval())
    exported = onnx_export.export(
        head, {"input": torch.from_numpy(trained["val_x"][:2])}, {}, 17, {}, tmp_path / "model.onnx"
    )
    assert (
        exported.exporter == "torchscript"
        and "opset 18, not the requested 17" in exported.fallback_reason
    )
    # what it wrote
    assert onnx.load(str(tmp_path / "model.onnx")).opset_import == exported.model.opset_import
    assert {o.domain: o.version for o in exported.model.opset_import}[""] == 17
    # batch still dynamic
    assert exported.model.graph.input[0].type.tensor_type.shape.dim[0].dim_param


# --- champion vs challenger --------------------------------------------------------------------


def perturbed_weights(trained, directory: Path, scale: float) -> Path:
    """The trained model with noise on its classifier: still exports and passes parity, but less
    accurate."""
    model = load_model(read_weights(trained["dir"]))
    with torch.no_grad():
        noise = torch.randn_like(model.fc.weight, generator=torch.Generator().manual_seed(7))
        model.fc.weight.add_(scale * noise * model.fc.weight.abs().mean())
    meta = json.loads((trained["dir"] / "model.json").read_text())
    return write_weights(
        directory, model, trained["cfg"], trained["spec"], meta["labels"], trained["run_id"]
    )


def test_a_worse_retrain_leaves_the_champion_and_a_better_one_takes_it(
    trained, store, tmp_path, capsys
):
    name = "promotion-digits"
    client = mlflow.MlflowClient()
    worse = perturbed_weights(trained, tmp_path / "worse" / "consolidated", scale=3.0)

    def export(weights: Path, *overrides: str) -> dict:
        code = cli.main(
            [
                "export",
                str(weights),
                "--tracking-uri",
                store,
                f"export.registered_model_name={name}",
                *overrides,
            ]
        )
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads((weights.parent / "onnx" / "export_report.json").read_text()) | {
            "stdout": out.out
        }

    def champion() -> str:
        return str(client.get_model_version_by_alias(name, "champion").version)

    # no champion yet: the first model takes the alias, and the report says so
    first = export(worse)
    assert first["promotion"]["promote"] and first["promotion"]["reason"].startswith(
        f"first model: {name}"
    )
    assert champion() == first["model_version"] == "1"

    better = export(trained["dir"])
    decision = better["promotion"]
    assert decision["promote"] and decision["champion"]["version"] == "1" and champion() == "2"
    assert (
        decision["candidate"]["accuracy"] > decision["champion"]["accuracy"]
        and decision["gain"] > 0
    )
    # Both measured the same way, in their own process: latency and peak memory of each.
    for who in ("candidate", "champion"):
        assert (
            decision[who]["latency_ms_p50"] > 0
            and decision[who]["peak_rss_mb"] > decision[who]["model_rss_mb"] > 0
        )
    # The candidate's accuracy through onnxruntime is the one its gate measured.
    assert decision["candidate"]["accuracy"] * 100 == pytest.approx(
        better["gates"]["accuracy"]["onnx_accuracy_pct"]
    )

    # a worse retrain: registered, gated, but not promoted
    again = export(worse)
    decision = again["promotion"]
    assert not decision["promote"] and again["alias"] == "challenger" and champion() == "2"
    assert (
        str(client.get_model_version_by_alias(name, "challenger").version)
        == again["model_version"]
        == "3"
    )
    assert (
        "candidate" in decision["reason"]
        and "worse" in decision["reason"]
        and "if_not_worse" in decision["reason"]
    )
    assert "not promoted" in again["stdout"] and "@challenger" in again["stdout"]
    version = client.get_model_version(name, "3")
    assert (
        version.tags[lineage.PROMOTION] == "not promoted" and "@challenger" in version.description
    )
    run = client.get_run(trained["run_id"])
    figures = mlflow.load_table("onnx/gates.json", run_ids=[trained["run_id"]])
    compared = figures[(figures.gate == "compare") & (figures.figure == "champion.accuracy")]
    # this export's: replaced
    assert list(compared.value) == [pytest.approx(decision["champion"]["accuracy"])]
    assert run.data.metrics["compare.gain"] < 0 and run.data.tags[lineage.VERDICT].endswith(
        "not promoted"
    )

    forced = export(worse, "export.promote=always")
    assert forced["promotion"]["promote"] and champion() == forced["model_version"] == "4"

    # A champion that no longer loads: said so, and the candidate (which passed every gate) replaces
    # it.
    source = Path(client.get_model_version(name, "4").source)
    broken = next(
        p
        for p in Path(mlflow.artifacts.download_artifacts(f"models:/{name}/4")).rglob("model.onnx")
    )
    stored = [
        p
        for p in (Path(store.removeprefix("sqlite:///")).parent / "artifacts").rglob("model.onnx")
        if p.read_bytes() == broken.read_bytes()
    ]
    assert stored, source
    for p in stored:
        p.write_bytes(b"not an onnx file")
    rescued = export(trained["dir"])
    assert (
        rescued["promotion"]["promote"]
        and "@champion v4 can't be served: its graph can't be read"
        in rescued["promotion"]["reason"]
    ), rescued["promotion"]["reason"]
    assert champion() == rescued["model_version"] == "5"


def contract_graph(
    path: Path,
    task: str = "regression",
    input_name: str = "x",
    dims=("batch", 3),
    dtype=onnx.TensorProto.FLOAT,
    labels=None,
) -> Path:
    """A one-node graph with the contract named: its input, output, task and labels."""
    from onnx import helper

    g = helper.make_graph(
        [helper.make_node("Identity", [input_name], ["output"])],
        "g",
        [helper.make_tensor_value_info(input_name, dtype, list(dims))],
        [helper.make_tensor_value_info("output", dtype, list(dims))],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    props = {lineage.TASK: task} | ({lineage.LABELS: json.dumps(labels)} if labels else {})
    helper.set_model_props(m, props)
    onnx.save(m, str(path))
    return path


def test_the_input_output_contract_and_each_way_it_changed(tmp_path):
    from pipeline.artifact.promotion import comparable, contract_changes, contract_of

    def changes(**kw) -> list[str]:
        return contract_changes(
            contract_of(contract_graph(tmp_path / "a.onnx")),
            contract_of(contract_graph(tmp_path / "b.onnx", **kw)),
        )

    assert changes() == []
    # a dynamic axis is one whatever its name
    assert changes(dims=("n", 3)) == []
    assert changes(dims=("batch", 4)) == [
        "input 'x': [-1,3] -> [-1,4]",
        "output 'output': [-1,3] -> [-1,4]",
    ]
    assert changes(dtype=onnx.TensorProto.INT64)[0] == "input 'x': float32 -> int64"
    assert changes(input_name="tokens")[:2] == ["input 'x' removed", "input 'tokens' added"]
    assert changes(task="classification") == ["task: regression -> classification"]
    relabelled = changes(labels=["cat", "dog", "eel"])
    assert relabelled == ["class labels: (none) -> 3 [cat, dog, eel]"] and comparable(relabelled)
    assert not comparable(changes(dims=("batch", 4)))


def test_onnxruntimes_error_is_kept_whole(tmp_path):
    """The newcomer's reason was onnxruntime's last line alone, "[' Please fix either the
    inputs/outputs or the model.']": the line that says what was wrong came before it. A model
    measured on inputs it can't take raises with the whole text, on one line."""
    from pipeline.artifact import promotion

    path = contract_graph(tmp_path / "fixed.onnx", dims=(2, 3))
    np.savez(tmp_path / "inputs.npz", **{"0/x": np.zeros((2, 4), np.float32)})
    with pytest.raises(promotion.MeasureError) as caught:
        promotion.measure(path, tmp_path / "inputs.npz", [], Regression())
    said = str(caught.value)
    assert "Got invalid dimensions for input: x for the following indices" in said, said
    assert "index: 1 Got: 4 Expected: 3" in said and said.endswith(
        "Please fix either the inputs/outputs or the model."
    )
    assert "\n" not in said


def other_contract_weights(tmp_path: Path, store: str) -> Path:
    """An untrained MLP on 3x4x4 random images (data.name=synthetic): the README's model name,
    another input contract, as a newcomer's image-folder retrain gives (3x32x32 against 1x8x8)."""
    cfg = load_config(
        overrides=[
            "data.name=synthetic",
            "data.args={channels: 3, size: 4, samples: 80}",
            "model.name=mlp",
            "model.args={hidden: [8]}",
            f"tracking.tracking_uri={store}",
            f"tracking.experiment={EXPERIMENT}",
        ]
    )
    splits = build_data(cfg.data, cfg.task.name)
    spec, _ = model_spec(cfg.model, splits, build_task(cfg.task, splits.classes))
    torch.manual_seed(0)
    weights = write_weights(
        tmp_path / "other" / "consolidated",
        instantiate_model(spec).eval(),
        cfg,
        spec,
        splits.classes,
        None,
    )
    meta = json.loads((weights / "model.json").read_text())
    meta["inputs"] = [{"name": "input", "dtype": "float32", "shape": [3, 4, 4]}]
    (weights / "model.json").write_text(json.dumps(meta))
    return weights


def test_a_retrain_with_another_input_contract_leaves_the_champion_and_says_why(
    trained, store, tmp_path, caplog
):
    """The newcomer's friction 1: the README's config, retrained on the image-folder recipe's
    3x32x32 images, took @champion from the 1x8x8 v1 ("the current @champion (v1) can't be
    evaluated: measuring model.onnx failed: [' Please fix either the inputs/outputs or the
    model.']"), and every client of v1 got 400s. v1 serves: it runs its own input example. Now the
    candidate is registered as @challenger, the log and its description name the change and the way
    out; with export.allow_contract_change=true it takes the alias, and v1's page and its run's
    verdict say which version holds it now."""
    name = "contract-digits"
    client = mlflow.MlflowClient()
    model = load_model(read_weights(trained["dir"]))
    first = write_weights(
        tmp_path / "first" / "consolidated",
        model,
        trained["cfg"],
        trained["spec"],
        trained["splits"].classes,
        None,
    )
    naming = [f"export.registered_model_name={name}", "export.allow_below_baseline=true"]
    v1 = main(first, tracking_uri=store, overrides=naming)
    assert v1.model_version == "1" and v1.report["alias"] == "champion"
    other = other_contract_weights(tmp_path, store)

    caplog.set_level("INFO")
    v2 = main(other, tracking_uri=store, overrides=naming)
    decision = v2.report["promotion"]
    assert v2.passed and v2.model_version == "2" and v2.report["alias"] == "challenger"
    assert not decision["promote"] and "error" not in decision["champion"], decision
    says = (
        "the input/output contract differs from @champion v1's: input 'input': [-1,1,8,8] -> "
        "[-1,3,4,4]; clients of @champion would break; register it under another name "
        "(export.registered_model_name) or pass `export.allow_contract_change=true`"
    )
    assert decision["reason"] == says
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    assert f"not promoted: {says}" in caplog.text
    assert "input 'input': [-1,1,8,8] -> [-1,3,4,4]" in caplog.text.split("not promoted: ")[0]
    description = client.get_model_version(name, "2").description
    assert "Why it holds \\@challenger: the input/output contract differs" in description

    v3 = main(other, tracking_uri=store, overrides=[*naming, "export.allow_contract_change=true"])
    assert v3.model_version == "3" and v3.report["alias"] == "champion", v3.report["promotion"]
    assert "which export.allow_contract_change=true allows" in v3.report["promotion"]["reason"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == "3"
    held = client.get_model_version(name, "1")
    assert "Why it held \\@champion: first model" in held.description, held.description
    last = held.description.rsplit("\n\n", 1)[1]
    assert last.startswith("\\@champion is on v3 since ") and last.endswith(
        "This version no longer holds it."
    ), last
    verdict = client.get_run(held.run_id).data.tags[lineage.VERDICT]
    assert verdict.startswith(f"{name} v1: @champion moved to v3 ("), verdict


@pytest.mark.parametrize(
    "mine, theirs, mode, promote, tolerance, moves",
    [
        # equal: not worse
        (0.90, 0.90, "max", "if_not_worse", 0.0, True),
        (0.89, 0.90, "max", "if_not_worse", 0.0, False),
        # within the tolerance
        (0.89, 0.90, "max", "if_not_worse", 0.02, True),
        # equal is not better
        (0.90, 0.90, "max", "if_better", 0.0, False),
        # better, but not by more than the tolerance
        (0.91, 0.90, "max", "if_better", 0.02, False),
        (0.93, 0.90, "max", "if_better", 0.02, True),
        # a loss or RMSE: lower is better
        (1.5, 2.0, "min", "if_better", 0.0, True),
        (2.5, 2.0, "min", "if_not_worse", 0.0, False),
        # a metric that failed never wins
        (float("nan"), 2.0, "min", "if_not_worse", 1e9, False),
        # ...and a champion's that failed always loses
        (
            2.0,
            float("nan"),
            "min",
            "if_better",
            0.0,
            True,
        ),
        (0.1, 0.9, "max", "always", 0.0, True),
    ],
)
def test_the_promotion_rule(mine, theirs, mode, promote, tolerance, moves):
    from pipeline.artifact.promotion import verdict

    got, gain, reason = verdict(mine, theirs, mode, promote, tolerance)
    assert got is moves and promote in reason and "{}" in reason


def test_a_model_no_better_than_the_trivial_predictor_is_not_registered(trained, store, tmp_path):
    """The newcomer's mobilenet: BatchNorm statistics that had not settled, 11.7% on 10 classes,
    became @champion because it was the first. The same weights with their running statistics back
    at their start: the baseline gate names the trivial predictor, both figures and the BatchNorm
    cause, and nothing is registered; told, export registers it and records it below the
    baseline."""
    model = load_model(read_weights(trained["dir"]))
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            # what a few steps of a slow running average leave
            module.reset_running_stats()
    unsettled = write_weights(
        tmp_path / "consolidated",
        model,
        trained["cfg"],
        trained["spec"],
        trained["splits"].classes,
        None,
    )
    refused = main(
        unsettled, tracking_uri=store, overrides=["export.registered_model_name=unsettled"]
    )
    gate = refused.report["gates"]["baseline"]
    assert not refused.passed and refused.failed == ["baseline"] and refused.model_version is None
    assert (
        gate["below_baseline"]
        and gate["value"] < gate["baseline"] + 0.05 < gate["batch_statistics"]
    ), gate
    assert "not clearly better than the baseline (always class" in gate["message"], gate["message"]
    assert (
        f"{gate['baseline']:.2%}" in gate["message"] and f"{gate['value']:.2%}" in gate["message"]
    )
    assert "BatchNorm running statistics have not settled" in gate["message"]
    assert "export.allow_below_baseline=true" in gate["message"]
    assert not mlflow.MlflowClient().search_registered_models("name='unsettled'")

    allowed = main(
        unsettled,
        tracking_uri=store,
        output_dir=tmp_path / "allowed",
        overrides=["export.registered_model_name=unsettled", "export.allow_below_baseline=true"],
    )
    assert allowed.passed and allowed.model_version == "1"
    assert allowed.report["gates"]["baseline"]["below_baseline"]
    assert "registered anyway" in allowed.report["gates"]["baseline"]["message"]


def test_the_baseline_gate_passes_a_model_that_learned(exported):
    gate = exported.report["gates"]["baseline"]
    assert gate["passed"] and not gate["below_baseline"] and gate["value"] > gate["needed"], gate
    assert "beats the baseline (always class" in gate["message"]
