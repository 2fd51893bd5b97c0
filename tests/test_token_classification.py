"""Token classification (`task.name: token_classification`) as a user runs it:
configs/digit_tokens_bert.yaml (a tag for every pixel token of the digits, padding tagged -100; a
transformers BertForTokenClassification as it is) trained on 2 ranks under torchrun by
`pipeline run --serve-check`, exported, gated, registered; the registered model served by a real
server process and asked over V2 HTTP and gRPC; its per-token metrics checked against
scikit-learn's. Before that the pure pieces: the metrics by hand, the refusals, the per-token
decisions of the gates and the shadow, and the Task protocol against what the stages use."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, mlflow_client, run_cli
from serving_fixtures import ServerProcess, free_port

from pipeline.artifact import gates
from pipeline.components.data import DataError
from pipeline.config import ConfigError, load_config
from pipeline.errors import TaskError
from pipeline.tasks import TASKS, Task, build_task, task_class
from pipeline.tasks.token_classification import TokenClassification

WHERE = "model.component 'm' on 2 validation samples"
TAGS = ["blank", "a", "b", "c"]


def token_task(*overrides: str) -> TokenClassification:
    return build_task(load_config(None, ["task.name=token_classification", *overrides]).task, TAGS)


def batch(seed: int, rows: int = 5, length: int = 9, ignore: int = -100):
    """Logits N x L x C and tags N x L, about a third of them `ignore` (and every tag of one row);
    the last tag is predicted but never true (macro F1 counts it, with F1 0, as scikit-learn
    does)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, len(TAGS), generator=g)
    target = torch.randint(0, len(TAGS) - 1, (rows, length), generator=g)
    target[torch.rand(rows, length, generator=g) < 0.3] = ignore
    target[0] = ignore
    return logits, target


@pytest.mark.parametrize("ignore", [-100, -1])
def test_the_metrics_are_scikit_learns_over_the_tokens_kept_and_add_up_across_ranks(ignore):
    from sklearn.metrics import accuracy_score, f1_score

    task = token_task(*([] if ignore == -100 else [f"task.ignore_index={ignore}"]))
    parts = [batch(seed, ignore=ignore) for seed in range(3)]
    whole, shards = (
        task.new_state(torch.device("cpu")),
        [task.new_state(torch.device("cpu")) for _ in range(2)],
    )
    for i, (logits, target) in enumerate(parts):
        task.update(whole, {"logits": logits}, target)
        # two ranks' sums, then added up
        task.update(shards[i % 2], {"logits": logits}, target)
    summed = {k: shards[0][k] + shards[1][k] for k in whole}
    logits, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    kept = target != ignore
    truth, predicted = target[kept].numpy(), logits.argmax(2)[kept].numpy()
    expected = {
        "macro_f1": f1_score(truth, predicted, average="macro"),
        "token_accuracy": accuracy_score(truth, predicted),
        "loss": F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore).item(),
    }
    for state in (whole, summed):
        got = task.metrics(state)
        assert list(got) == ["macro_f1", "token_accuracy", "loss"] and task.primary == "macro_f1"
        # the loss: float32 per batch, summed in float64
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-6 if name == "loss" else 1e-12), name
    # A batch whose tags are all left out adds nothing and trains on nothing (0, not NaN).
    assert task.loss(logits[:1], target[:1]).item() == 0.0
    assert task.facts()["ignore_index"] == ignore


def test_probabilities_have_the_classes_on_axis_1_and_the_gates_decide_per_token():
    task = token_task()
    logits, target = batch(0)
    # a transformers output: a mapping with `logits`
    task.check_output({"logits": logits}, target, WHERE)
    exported = task.exported({"logits": logits})
    assert list(exported) == ["logits", "probabilities"] == task.output_names
    assert exported["logits"].shape == (5, 9, 4) and exported["probabilities"].shape == (5, 4, 9)
    torch.testing.assert_close(exported["probabilities"].sum(1), torch.ones(5, 9))
    assert task.decision == "probabilities" and task.derived == ("probabilities",)

    ref = {k: v.numpy() for k, v in exported.items()}
    moved = {k: v.copy() for k, v in ref.items()}
    # one token flips
    moved["probabilities"][2, :, 4] = np.eye(4)[(ref["probabilities"][2, :, 4].argmax() + 1) % 4]
    result = gates.compare(moved, ref, 1e-4, 1e-4, derived=task.derived, decision=task.decision)
    # 1 of 5 x 9 tokens
    assert result["argmax_agreement"] == pytest.approx(1 - 1 / 45) and not result["passed"]


def test_the_shadow_compares_and_scores_a_class_per_token():
    """The server knows only `trainserve.decision`: its argmax over axis 1 is the answer, a class
    per token."""
    from serving.shadow import Rule, Shadow

    task = token_task()
    logits, target = batch(1, rows=1)
    # a lone tensor: `logits`
    champion = {k: v.numpy() for k, v in task.exported(logits).items()}
    challenger = {k: v.numpy() for k, v in task.exported(logits.flip(2)).items()}
    shadow = Shadow(Rule(min_pairs=1, min_labels=1, max_source_share=1))
    shadow.pairing("1", "2", task.decision, task.prediction)
    shadow.pair("r1", champion, challenger, 1.0, 1.0, ("1", "2"), b"x", "client")
    report = shadow.report()
    decided = champion["logits"].argmax(2)
    # over 9 tokens
    assert report["agreement"] == float((decided == challenger["logits"].argmax(2)).mean())
    truth = decided.copy()
    truth[0, :3] = (truth[0, :3] + 1) % 4
    assert shadow.feedback({"r1": truth}) == {"joined": 1, "unknown": 0}
    assert shadow.report()["live"]["champion"]["accuracy"] == pytest.approx(6 / 9)
    shadow.pair("r2", champion, challenger, 1.0, 1.0, ("1", "2"), b"y", "client")
    with pytest.raises(
        ValueError, match="holds -100, not a class of this model: a class index is a whole number"
    ):
        # the padding's -100 is no live label
        shadow.feedback({"r2": np.where(truth < 2, -100, truth)})


@pytest.mark.parametrize(
    "target, expected",
    [
        (
            torch.tensor(2),
            "the target is a int64 tensor of shape []; token_classification needs a 1-d int64 tensor per "
            "sample, a class index per token (torch.as_tensor(tags, dtype=torch.long)), the positions to "
            "leave out marked -100; for one class per sample set task.name=classification",
        ),
        (
            torch.zeros(3, 3, dtype=torch.long),
            "the target is a int64 tensor of shape [3, 3]; token_classification needs",
        ),
        (torch.zeros(3), "the target is a float32 tensor of shape [3]; token_classification needs"),
        (
            torch.tensor([0, 4, -100]),
            "the tags hold class index 4, outside 0..3 (the training set has 4 classes)",
        ),
    ],
)
def test_each_target_that_is_not_a_tag_per_token_is_refused_with_the_fix(target, expected):
    with pytest.raises(DataError) as err:
        TokenClassification.check_target(target, TAGS, "item 0")
    assert expected in str(err.value), err.value
    # negatives: the probe checks
    TokenClassification.check_target(torch.tensor([0, 3, -100, -7]), TAGS, "item 0")


@pytest.mark.parametrize(
    "logits, target, expected",
    [
        (
            torch.zeros(2, 4),
            torch.zeros(2, 9, dtype=torch.long),
            "logits must be (batch, length, classes) for targets of shape [2, 9]; it is a float32 tensor of shape [2, 4]; "
            "that is a class per sequence: for it set task.name=classification",
        ),
        (
            torch.zeros(2, 4, 9),
            torch.zeros(2, 9, dtype=torch.long),
            "it is a float32 tensor of shape [2, 4, 9]; put the classes last, as a transformers ...ForTokenClassification",
        ),
        (
            torch.zeros(2, 9, 5),
            torch.zeros(2, 9, dtype=torch.long),
            "the model returns 5 logits per token but the data has 4 classes (the training set's `classes`); set "
            "model.args.num_classes=4",
        ),
        (
            torch.zeros(2, 3, 4),
            torch.tensor([[0, -1, 2], [1, 1, 1]]),
            "a target holds -1, neither a class index of a model with 4 outputs nor task.ignore_index (-100); if it marks "
            "the positions to leave out, set task.ignore_index=-1",
        ),
    ],
)
def test_the_probe_refuses_logits_and_tags_that_do_not_fit(logits, target, expected):
    with pytest.raises(TaskError) as err:
        token_task().check_output(logits, target, WHERE)
    assert expected in str(err.value), err.value


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["task.name=token_classification", "task.ignore_index=0"],
            "task.ignore_index=0 is a class index; it must be negative, so that no class is ever left out",
        ),
        (
            ["task.ignore_index=-100"],
            "task.ignore_index only applies to task.name=token_classification",
        ),
        (["task.name=segmentation", "task.ignore_index=-1"], "task.ignore_index only applies to"),
        (
            ["task.name=token_classification", "task.metric_mode=max"],
            "task.metric_mode only apply to task.name=custom",
        ),
    ],
)
def test_settings_of_the_task_are_checked_when_the_config_is_loaded(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_config(None, overrides)


def stage_uses_of_task() -> set[str]:
    """Every `task.<member>` (also `self.task.`, `ref.task.`) in the stages' code, f-strings
    included; not `cfg.task.<key>`, a config's."""
    used = set()
    # every room but the tasks
    for path in [p for p in REPO.glob("pipeline/**/*.py") if "tasks" not in p.parts]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "task") or (
                    isinstance(owner, ast.Attribute)
                    and owner.attr == "task"
                    and isinstance(owner.value, ast.Name)
                    and owner.value.id in ("self", "ref")
                ):
                    used.add(node.attr)
    return used


def test_the_task_protocol_names_every_member_the_stages_use_and_every_task_has_them():
    members = {n for n in dir(Task) if not n.startswith("_")} | set(Task.__annotations__)
    used = stage_uses_of_task()
    # the scan finds them
    assert {
        "update",
        "metric_gate",
        "decision",
        "describe",
        "probe_rows",
    } <= used
    assert used <= members, f"used by the stages but not in tasks.Task: {sorted(used - members)}"
    custom = [
        "task.loss.component=torch.nn:L1Loss",
        "task.metric.component=torch.nn.functional:l1_loss",
        "task.metric_mode=min",
    ]
    for name in TASKS:
        cfg = load_config(None, [f"task.name={name}", *(custom if name == "custom" else [])])
        task = build_task(cfg.task, None if name == "regression" else TAGS)
        missing = sorted(m for m in members if not hasattr(task, m))
        assert not missing and task_class(name).from_config, (name, missing)


# --- the example, through every stage -------------------------------------------------------------

NAME = "digit-tokens-bert"
RUN = [
    "train.run_name=tok",
    "train.max_steps=200",
    "train.eval_every=100",
    "train.log_every=50",
    "checkpoint.every_n_steps=100",
    "tracking.system_metrics=false",
    "serve.port=0",
]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """`pipeline run --nproc-per-node 2 --serve-check` on the example, in a directory of its own."""
    workdir = tmp_path_factory.mktemp("tokens")
    proc = run_cli(
        [
            "run",
            "--config",
            str(REPO / "configs/digit_tokens_bert.yaml"),
            "--nproc-per-node",
            "2",
            "--serve-check",
            *RUN,
        ],
        cwd=workdir,
        timeout=600,
    )
    return workdir, proc


def served_tags(outputs: dict[str, np.ndarray]) -> np.ndarray:
    return outputs["probabilities"].argmax(1)


@pytest.mark.slow
def test_the_example_trains_exports_registers_and_serves_a_tag_per_token(example, tmp_path):
    import json

    import onnxruntime as ort
    import requests
    import tritonclient.grpc as triton_grpc
    from sklearn.metrics import accuracy_score, f1_score

    from pipeline.datasets import digit_tokens

    workdir, proc = example
    assert (
        "sample request: a real sequence of" in proc.stdout
        and "tagged tokens from the validation split" in proc.stdout
    ), proc.stdout[-2000:]
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]

    # Gated per token, registered, the figure drawn; the 2 ranks' validation metric is the
    # one-process figure.
    report = json.loads((workdir / "outputs/tok/onnx/export_report.json").read_text())
    assert report["passed"] and report["task"]["name"] == "token_classification"
    assert report["task"]["ignore_index"] == -100 and report["outputs"] == [
        "logits",
        "probabilities",
    ]
    gate = report["gates"]["macro_f1"]
    assert gate["passed"] and report["gates"]["parity.val"]["argmax_agreement"] == 1
    # other lengths gated
    assert sum(1 for g in report["gates"] if g.startswith("parity.input_ids_1.len")) == 2
    trained = report["weights"]["source"]
    assert trained["world_size"] == 2
    assert trained["val_metrics"]["macro_f1"] == pytest.approx(
        gate["torch_macro_f1_pct"] / 100, abs=1e-12
    )
    # blank, the most frequent tag, is ~60%
    assert trained["val_metrics"]["token_accuracy"] > 0.75
    client = mlflow_client(workdir)
    version = client.get_model_version_by_alias(NAME, "champion")
    run = client.get_run(version.run_id)
    assert {"val/macro_f1", "val/token_accuracy", "val/loss"} <= set(run.data.metrics)
    assert "onnx/confusion_matrix.png" in {
        a.path for a in client.list_artifacts(run.info.run_id, "onnx")
    }

    # The registered model, served from the registry by a real server process.
    val = digit_tokens()["val"]
    ids, mask, tags = val.input_ids.numpy(), val.attention_mask.numpy(), val.tags.numpy()
    direct = ort.InferenceSession(
        str(workdir / "outputs/tok/onnx/model.onnx"), providers=["CPUExecutionProvider"]
    )
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        f"models:/{NAME}@champion",
        "--grpc-port",
        str(grpc_port),
        cwd=workdir,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"},
        log_path=tmp_path / "server.log",
    ) as server:
        url = f"{server.url}/v2/models/{NAME}/infer"

        def over_http(rows: slice, length: int = 64) -> dict[str, np.ndarray]:
            body = {
                "inputs": [
                    {
                        "name": n,
                        "shape": [len(a[rows]), length],
                        "datatype": "INT64",
                        "data": a[rows, :length].ravel().tolist(),
                    }
                    for n, a in (("input_ids", ids), ("attention_mask", mask))
                ]
            }
            answer = requests.post(url, json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return {
                o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
                for o in answer.json()["outputs"]
            }

        first = over_http(slice(0, 3))
        assert first["logits"].shape == (3, 64, 11) and first["probabilities"].shape == (3, 11, 64)
        want = dict(
            zip(
                ["logits", "probabilities"],
                direct.run(
                    ["logits", "probabilities"], {"input_ids": ids[:3], "attention_mask": mask[:3]}
                ),
            )
        )
        for key, value in want.items():
            np.testing.assert_allclose(first[key], value, rtol=1e-5, atol=1e-5)
        # the length axis is dynamic
        assert over_http(slice(3, 5), length=40)["logits"].shape == (
            2,
            40,
            11,
        )

        over_grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        feeds = []
        for n, a in (("input_ids", ids[:3]), ("attention_mask", mask[:3])):
            feeds.append(triton_grpc.InferInput(n, list(a.shape), "INT64"))
            feeds[-1].set_data_from_numpy(np.ascontiguousarray(a))
        result = over_grpc.infer(NAME, feeds)
        over_grpc.close()
        assert result.as_numpy("logits").shape == (3, 64, 11)
        for key, value in want.items():
            np.testing.assert_allclose(result.as_numpy(key), value, rtol=1e-5, atol=1e-5)

        # The whole validation split through the server: its per-token metrics are scikit-learn's on
        # the tokens kept, and the ones export measured through onnxruntime.
        answers = [over_http(slice(i, i + 64)) for i in range(0, len(tags), 64)]
        predicted = np.concatenate([served_tags(a) for a in answers])
        kept = tags != -100
        f1 = f1_score(tags[kept], predicted[kept], average="macro")
        assert f1 == pytest.approx(gate["onnx_macro_f1_pct"] / 100, abs=1e-9)
        assert accuracy_score(tags[kept], predicted[kept]) == pytest.approx(
            trained["val_metrics"]["token_accuracy"], abs=1e-9
        )
        # Drift observed on every input and output; the validation split is drawn as the training
        # split was.
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        drift = {
            line.split("{")[0] + " " + line.split('put="')[1].split('"')[0]: float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith(("trainserve_input_drift{", "trainserve_output_drift{"))
        }
        assert set(drift) == {
            "trainserve_input_drift input_ids",
            "trainserve_input_drift attention_mask",
            "trainserve_output_drift logits",
            "trainserve_output_drift probabilities",
        }, drift
        assert max(drift.values()) < 0.2, drift
    assert "failed" not in Path(tmp_path / "server.log").read_text()
