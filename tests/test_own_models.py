"""A user's own model, data and task through every stage, the way docs/own-model.md tells a user to
run them: the example projects in examples/ (trainserve never imports them itself), found on
PYTHONPATH by the CLI and by every torchrun worker, under real torchrun, a real MLflow store and a
real server."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
from conftest import REPO, mlflow_client, run_cli
from serving_fixtures import ServerProcess, free_port

from pipeline import checkpoint
from pipeline.components.build import build_data
from pipeline.components.data import first_batch
from pipeline.config import load_config
from serving import lineage

pytestmark = pytest.mark.slow

TINY = [
    "train.max_steps=12",
    "train.eval_every=6",
    "train.log_every=2",
    "checkpoint.every_n_steps=6",
    "tracking.system_metrics=false",
    "serve.port=0",
    "export.allow_below_baseline=true",
]
# config -> (experiment, registered name, the task's validation metric)
EXAMPLES = {
    "diabetes_mlp": ("trainserve-diabetes", "diabetes-mlp", "val/rmse"),
    "diabetes_mixed_inputs": ("trainserve-diabetes", "diabetes-mixed", "val/mae"),
    "digit_sequences_transformer": (
        "trainserve-digit-sequences",
        "digit-sequences",
        "val/accuracy",
    ),
    # The model contract: two heads and a dict target; a transformers model as it is; a timm-shaped
    # factory given num_classes through **kwargs; per-pixel segmentation.
    "wine_two_heads": ("trainserve-wine", "wine-two-heads", "val/alcohol_rmse"),
    "digit_sequences_bert": ("trainserve-digit-sequences", "digit-sequences-bert", "val/accuracy"),
    "digits_image_zoo": ("trainserve-digits", "digits-image-zoo", "val/accuracy"),
    "digits_segmentation": ("trainserve-digit-masks", "digit-masks", "val/mean_iou"),
}
# Two ranks prove the gathers (a custom metric sees every rank's outputs and targets, dicts
# included); the examples that only add a model or task shape train in the command's own process to
# keep the suite short.
RUN_ARGS = {
    "wine_two_heads": ["--nproc-per-node", "2", "checkpoint.monitor=val/alcohol_rmse"],
    "digits_image_zoo": [],
    "digits_segmentation": [],
}
# The sequence examples' finished runs are the launch table's (tests/launches.py): the transformer's
# through every stage under pipeline parallelism, BERT's under tensor parallelism, each on 2 ranks.
FROM_THE_TABLE = {"digit_sequences_transformer": "pp", "digit_sequences_bert": "tp"}
DYNAMIC_LENGTH = {"digit_sequences_transformer", "digit_sequences_bert"}
# the user's package on PYTHONPATH, run from elsewhere
ON_PATH = {"PYTHONPATH": str(REPO)}


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    workdir: Path
    proc: subprocess.CompletedProcess
    run_dir: Path


@pytest.fixture(scope="module", params=list(EXAMPLES))
def example(request, tmp_path_factory, launched) -> Example:
    """`pipeline run --serve-check` on an example, in a directory of its own, run from elsewhere
    with the example's package on PYTHONPATH."""
    name = request.param
    if name in FROM_THE_TABLE:
        row = FROM_THE_TABLE[name]
        ran = launched(row)
        return Example(name, ran.workdir, ran.proc, ran.workdir / "outputs" / row)
    workdir = tmp_path_factory.mktemp(name)
    proc = run_cli(
        [
            "run",
            "--config",
            str(REPO / f"configs/{name}.yaml"),
            "--serve-check",
            "train.run_name=mine",
            *RUN_ARGS.get(name, ["--nproc-per-node", "2"]),
            *TINY,
        ],
        cwd=workdir,
        env=ON_PATH,
        timeout=600,
        check=False,
    )
    # 12 steps may leave a model no better than the trivial predictor: registered (TINY allows it),
    # and --serve-check then exits 1 saying so, after the server's answer was checked as usual
    assert proc.returncode == 0 or (
        proc.returncode == 1 and "failed its baseline gate" in proc.stderr
    ), f"exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return Example(name, workdir, proc, workdir / "outputs/mine")


def test_an_example_goes_through_every_stage_with_one_command(example):
    name, workdir, proc, run_dir = example.name, example.workdir, example.proc, example.run_dir
    experiment, registered, metric = EXAMPLES[name]
    assert "sample request: a real" in proc.stdout, proc.stdout[-2000:]
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]

    client = mlflow_client(workdir)
    version = client.get_model_version_by_alias(registered, "champion")
    run = client.get_run(version.run_id)
    cfg = load_config(REPO / f"configs/{name}.yaml")
    assert (
        run.info.status == "FINISHED"
        and lineage.read_stages(run.data.tags[lineage.STAGES])["export"] == "done"
    )
    assert version.tags[lineage.MODEL] == cfg.model.component
    assert version.tags[lineage.DATA] == cfg.data.component
    assert metric in run.data.metrics and run.data.metrics["export.passed"] == 1.0
    # The user's component modules are logged with the run, as MLflow's code_paths would.
    module = next(
        c for c in (cfg.model.component, cfg.data.component) if c.startswith("examples.")
    ).split(":")[0]
    package = module.split(".")[1]
    code = {a.path for a in client.list_artifacts(run.info.run_id, f"code/examples/{package}")}
    assert (
        f"code/{module.replace('.', '/')}.py" in code
        or f"code/{module.replace('.', '/')}/__init__.py" in code
    ), code
    # The model's arguments as built: what the data suggested is in the params and the checkpoint.
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    recorded = checkpoint.read_meta(ckpt)["model"]
    for key, value in recorded["args"].items():
        assert run.data.params[f"model.args.{key}"] == str(value)[:6000]
    # The registered MLflow model's signature names every input, -1 on the batch and dynamic axes.
    import mlflow

    signature = mlflow.models.get_model_info(f"models:/{registered}@champion").signature
    inputs = {s.name: s for s in signature.inputs.inputs}
    assert list(inputs) == [s["name"] for s in checkpoint.read_meta(ckpt)["inputs"]]
    assert all(s.shape[0] == -1 for s in inputs.values())
    if name == "digit_sequences_transformer":
        assert inputs["tokens"].shape == (-1, -1) and str(inputs["mask"].type) == "bool"
    # the transformers model's forward takes these names as they are
    if name == "digit_sequences_bert":
        assert list(inputs) == ["input_ids", "attention_mask"] and inputs["input_ids"].shape == (
            -1,
            -1,
        )
    report = json.loads((run_dir / "onnx/export_report.json").read_text())
    assert report["passed"] and report["task"]["name"] == cfg.task.name
    assert [i["name"] for i in report["inputs"]] == [
        s["name"] for s in checkpoint.read_meta(ckpt)["inputs"]
    ]
    if name == "diabetes_mlp":
        assert "predicted_vs_actual.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
        assert report["gates"]["rmse"]["passed"] and report["outputs"] == ["prediction"]
    # two more lengths of the dynamic token axis were gated
    if name == "digit_sequences_transformer":
        assert sum(1 for g in report["gates"] if g.startswith("parity.tokens_1.len")) == 2
    outputs = {o.name for o in signature.outputs.inputs}
    # both heads exported by the dict's keys, each one gated
    if name == "wine_two_heads":
        assert report["outputs"] == ["cultivar_logits", "alcohol"] == sorted(outputs, reverse=True)
        assert set(report["gates"]["parity.val"]["outputs"]) == {"cultivar_logits", "alcohol"}
        figures = client.load_table(
            run.info.experiment_id, "onnx/gates.json", run_ids=[run.info.run_id]
        )
        assert "alcohol.max_abs" in set(figures[figures.gate == "parity.b7"].figure), figures
        assert "val/cultivar_accuracy" in run.data.metrics
        best = json.loads((run_dir / "checkpoints/best.json").read_text())
        # checkpoint.monitor picks the 2nd
        assert best["metric"] == "val/alcohol_rmse" and best["mode"] == "min"
    # no wrapper, no num_classes in model.args
    if name in (
        "digit_sequences_bert",
        "digits_image_zoo",
    ):
        assert (
            run.data.params["model.args.num_classes"] == "10"
            and "num_classes" not in cfg.model.args
        )
        assert (
            report["outputs"] == ["logits", "probabilities"]
            and report["task"]["prediction"] == "logits"
        )
    # its SequenceClassifierOutput, read by the field that carries logits
    if name == "digit_sequences_bert":
        assert report["task"]["layout"] == {"kind": "mapping", "names": ["logits"]}
        assert sum(1 for g in report["gates"] if g.startswith("parity.input_ids_1.len")) == 2
    if name == "digits_segmentation":
        assert report["gates"]["mean_iou"]["passed"] and "val/pixel_accuracy" in run.data.metrics
        assert (
            report["outputs"] == ["logits", "probabilities"]
            and report["gates"]["parity.val"]["argmax_agreement"] == 1
        )


def validation_requests(name: str, rows: int) -> list[dict[str, np.ndarray]]:
    """Real validation samples of the example, one request each, as numpy inputs by name."""
    cfg = load_config(REPO / f"configs/{name}.yaml")
    # examples/ is importable here: pytest runs from the repository
    splits = build_data(cfg.data, cfg.task.name)
    inputs, _ = first_batch(splits.val, rows)
    named = inputs if isinstance(inputs, dict) else {"input": inputs}
    return [{k: v[i : i + 1].numpy() for k, v in named.items()} for i in range(rows)]


V2 = {"float32": "FP32", "int64": "INT64", "bool": "BOOL"}


def test_the_served_answers_equal_onnxruntime_run_directly(example, tmp_path):
    """Every output by name over KServe V2 JSON, binary (tritonclient.http) and gRPC
    (tritonclient.grpc), and /invocations with named inputs; for the sequence models, concurrent
    requests of different lengths, which the batcher must never merge."""
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton

    name = example.name
    onnx_path = example.run_dir / "onnx/model.onnx"
    direct = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in direct.get_outputs()]
    samples = validation_requests(name, 6)
    # other lengths than training's 64, up to the model's 128
    if name in DYNAMIC_LENGTH:
        samples += [
            {k: np.ascontiguousarray(np.resize(v, (1, length))) for k, v in s.items()}
            for s in samples[:3]
            for length in (17, 90)
        ]

    def expected(feeds):
        return dict(zip(outputs, direct.run(outputs, feeds)))

    grpc_port = free_port()
    with ServerProcess(
        "--model", str(onnx_path), "--grpc-port", str(grpc_port), log_path=tmp_path / "server.log"
    ) as server:
        model = requests.get(f"{server.url}/v2/models/{EXAMPLES[name][1]}", timeout=5).json()
        assert [i["name"] for i in model["inputs"]] == list(samples[0])
        # the metadata lists every output
        assert [o["name"] for o in model["outputs"]] == outputs

        def v2_json(feeds):
            body = {
                "inputs": [
                    {
                        "name": k,
                        "shape": list(v.shape),
                        "datatype": V2[str(v.dtype)],
                        "data": v.reshape(-1).tolist(),
                    }
                    for k, v in feeds.items()
                ]
            }
            answer = requests.post(
                f"{server.url}/v2/models/{EXAMPLES[name][1]}/infer", json=body, timeout=30
            )
            assert answer.status_code == 200, answer.text
            return {
                o["name"]: np.asarray(o["data"]).reshape(o["shape"])
                for o in answer.json()["outputs"]
            }

        # concurrent: the batcher merges what fits
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(v2_json, samples))
        for feeds, answer in zip(samples, answers):
            for key, value in expected(feeds).items():
                np.testing.assert_allclose(answer[key], value, rtol=1e-5, atol=1e-5)

        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        for feeds in samples[:3]:
            infer_inputs = []
            for key, value in feeds.items():
                item = triton.InferInput(key, list(value.shape), V2[str(value.dtype)])
                item.set_data_from_numpy(value, binary_data=True)
                infer_inputs.append(item)
            result = client.infer(
                EXAMPLES[name][1],
                infer_inputs,
                outputs=[triton.InferRequestedOutput(o, binary_data=True) for o in outputs],
            )
            for key, value in expected(feeds).items():
                np.testing.assert_allclose(result.as_numpy(key), value, rtol=1e-5, atol=1e-5)

        over_grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for feeds in samples[:3]:
            infer_inputs = []
            for key, value in feeds.items():
                item = triton_grpc.InferInput(key, list(value.shape), V2[str(value.dtype)])
                item.set_data_from_numpy(value)
                infer_inputs.append(item)
            result = over_grpc.infer(EXAMPLES[name][1], infer_inputs)
            for key, value in expected(feeds).items():
                np.testing.assert_allclose(result.as_numpy(key), value, rtol=1e-5, atol=1e-5)
        over_grpc.close()

        batch = {k: np.concatenate([s[k] for s in samples[:4]]) for k in samples[0]}
        answer = requests.post(
            f"{server.url}/invocations",
            timeout=30,
            json={"inputs": {k: v.tolist() for k, v in batch.items()}},
        )
        assert answer.status_code == 200, answer.text
        for key, value in expected(batch).items():
            np.testing.assert_allclose(
                np.asarray(answer.json()["predictions"][key]), value, rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("example", ["diabetes_mlp"], indirect=True)
def test_a_users_export_is_refused_when_its_components_are_not_trusted_here(example, tmp_path):
    """`pipeline export` of a user's weights on its own: model.json names the user's components,
    which are imported only when trusted (pipeline run trusted its own config's)."""
    workdir = example.workdir
    weights = example.run_dir / "consolidated"
    proc = run_cli(
        ["export", str(weights), "--output", str(tmp_path / "onnx"), "--no-register"],
        cwd=workdir,
        env=ON_PATH,
        check=False,
    )
    # Every untrusted component in one refusal, one line, with one --trust that covers them all.
    both = "examples.diabetes.models:TabularMLP,examples.diabetes.data:features"
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (
        "model.component 'examples.diabetes.models:TabularMLP', data.component 'examples.diabetes.data:features', "
        "which are not trusted here"
        in proc.stderr
        and proc.stderr.rstrip().endswith(
            f"--trust '{both}' (or TRAINSERVE_TRUSTED_COMPONENTS='{both}')"
        )
    )
    assert not (tmp_path / "onnx" / "model.onnx").exists()
    # Trusted with that --trust, copied as it is, but not installed here (no PYTHONPATH, run from
    # elsewhere): the next error is not about trust; it says what the run logged.
    run_id = json.loads((weights / "model.json").read_text())["source"]["mlflow_run_id"]
    lacking = run_cli(
        [
            "export",
            str(weights),
            "--output",
            str(tmp_path / "onnx"),
            "--no-register",
            "--trust",
            both,
            "--tracking-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert lacking.returncode == 2 and "No module named 'examples'" in lacking.stderr
    assert (
        f"the training run logged that code: `mlflow artifacts download -r {run_id} -a code -d .`"
        in lacking.stderr
    )
    assert "examples/diabetes/models.py" in lacking.stderr
    # trusted and importable, it exports: pipeline run did
    assert not (tmp_path / "onnx" / "model.onnx").exists()


@pytest.mark.parametrize("example", ["digit_sequences_transformer"], indirect=True)
def test_a_token_model_is_served_up_to_the_length_it_was_exported_for(example):
    """Export recorded the model's position limit (max_len 128; the data is 64 long); the server
    shows it and answers a longer sequence with a 400 naming it, not with onnxruntime's "invalid
    expand shape"."""
    import onnx

    exported = example.run_dir / "onnx/model.onnx"
    meta = {p.key: p.value for p in onnx.load(str(exported)).metadata_props}
    assert json.loads(meta[lineage.MAX_LENGTHS]) == {"mask": {"1": 128}, "tokens": {"1": 128}}
    with ServerProcess("--model", str(exported), "--model-name", "seq") as server:
        assert requests.get(f"{server.url}/v2/models/seq", timeout=10).json()["parameters"][
            "max_lengths"
        ] == {"mask": {"1": 128}, "tokens": {"1": 128}}
        for length, status in ((128, 200), (129, 400)):
            body = {
                "inputs": [
                    {
                        "name": "tokens",
                        "datatype": "INT64",
                        "shape": [1, length],
                        "data": [1] * length,
                    },
                    {
                        "name": "mask",
                        "datatype": "BOOL",
                        "shape": [1, length],
                        "data": [True] * length,
                    },
                ]
            }
            answer = requests.post(f"{server.url}/v2/models/seq/infer", json=body, timeout=30)
            assert answer.status_code == status, answer.text
        assert "model 'seq' was exported for at most 128" in answer.json()["error"]
