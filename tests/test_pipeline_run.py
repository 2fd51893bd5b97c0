"""`pipeline run` as the README tells users to run it (against a remote tracking server:
tests/test_multi_node.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, cli_env, mlflow_client, run_cli

from serving import lineage

pytestmark = pytest.mark.slow


def readme_command(prefix: str) -> str:
    """The README's quick-start line that starts with `prefix`."""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(prefix):
            return line
    raise AssertionError(f"README has no line starting with {prefix!r}")


def wait_for_line(path: Path, proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first line of the file `path` that starts with `prefix`, once `proc` has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in path.read_text().splitlines() if line.startswith(prefix)]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(
                f"exited {proc.returncode} before {prefix!r}:\n{path.read_text()[-6000:]}"
            )
        time.sleep(0.5)
    raise AssertionError(f"no {prefix!r} after {timeout} s:\n{path.read_text()[-6000:]}")


# Our log lines (`[rank0] 12:00:01 INFO pipeline.train: ...`, `12:00:01 WARNING serving.app: ...`)
# and the sample request's three lines: anything else on the console is a library talking, or a
# Python warning.
OUR_LINE = re.compile(
    r"^(\[rank\d+\] )?\d\d:\d\d:\d\d (INFO|WARNING|ERROR) (pipeline|serving)(\.[\w.]+)?: \S"
)
SAMPLE_LINES = ("sample request: ", "  the server's answer ", "  POST http://")
# 31 at 7ede3a0+: one summary line for the saves, not one per save
MAX_QUICK_START_LINES = 33


def assert_console_is_clean(text: str) -> None:
    """The quick start's console, sent to a file: one line per event."""
    assert "\r" not in text, "a progress bar's carriage returns in a file:\n" + text
    lines = text.splitlines()
    foreign = [
        line for line in lines if not (OUR_LINE.match(line) or line.startswith(SAMPLE_LINES))
    ]
    assert not foreign, (
        "third-party chatter or Python warnings:\n" + "\n".join(foreign) + "\n--- all:\n" + text
    )
    assert not [line for line in lines if "Warning:" in line or "warnings.warn" in line], text
    assert len(lines) <= MAX_QUICK_START_LINES, f"{len(lines)} lines:\n{text}"


def assert_the_mlflow_ui_shows_the_record(workdir: Path, run, version, model_id: str) -> None:
    """`pipeline ui` in headless Chromium: the run, the registered version and the logged model
    pages, as a person reads them after the quick start (screenshots kept: tests/browser.py)."""
    import browser

    step, checkpoint = version.tags[lineage.STEP], version.tags[lineage.CHECKPOINT]
    experiment = run.info.experiment_id
    with browser.mlflow_ui(workdir) as ui:
        text, dom = browser.page(
            f"{ui}/#/experiments/{experiment}/runs/{run.info.run_id}", "mlflow-run"
        )
        # its datasets
        assert re.search(r"Datasets digits-train \(\w+\) training", text), text[:6000]
        tags = dict(
            re.findall(r"(trainserve\.\w+) : (.+?)(?= trainserve\.| Registered models)", text)
        )
        assert (
            tags[lineage.CHECKPOINT] == checkpoint
            and tags[lineage.VERDICT] == "resnet18-digits v1 @champion"
        ), tags
        assert re.search(r"Registered models\s+resnet18-digits\s+v1", text), text[:3000]
        # "@champion" in the description is not a user's link
        assert "github.com/champion" not in dom
        text, dom = browser.page(
            f"{ui}/#/models/resnet18-digits/versions/{version.version}", "mlflow-version"
        )
        # the alias
        assert "Version 1" in text and "champion" in text, text[:3000]
        # its description
        assert f"checkpoint {checkpoint} (step {step})" in text and re.search(
            r"Gates\s*:\s*\d+ of \d+ passed", text
        ), text[:3000]
        assert (
            "passed parity.val" in text
            and "first model: resnet18-digits has no @champion yet" in text
        ), text[:3000]
        # no link to a stranger; no local path
        assert "github.com/champion" not in dom and "/tmp/" not in text
        # an escape shown as itself
        assert "\\@" not in text, text[:3000]
        text, _ = browser.page(
            f"{ui}/#/experiments/{experiment}/models/{model_id}", "mlflow-logged-model"
        )
        # both splits, not "None"
        assert re.search(r"Datasets used digits-train \(#\w+\) \+1", text), text
        # its metrics name their split
        assert re.search(r"val/accuracy digits-val \(#\w+\)", text), text
        # the step's metrics, not the gates'
        assert "val/accuracy" in text and "export.passed" not in text, text[:3000]


def test_readme_commands_are_what_ci_runs():
    assert readme_command("scripts/test") == "scripts/test"
    assert "scripts/test" in (REPO / ".ci/run").read_text()
    setup_line = readme_command("scripts/setup && ")
    assert setup_line.startswith("scripts/setup && .venv/bin/pipeline run ")


def test_readme_quick_start_in_a_tiny_variant(tmp_path):
    """The README's main job, verbatim but shorter, ending with a correct prediction of a real
    digit."""
    import browser

    # (skips here, not half-way, where it can't be installed)
    browser.chromium()
    command = shlex.split(readme_command("scripts/setup && ").split("&&", 1)[1])
    assert command[0] == ".venv/bin/pipeline"
    # the README's relative config path
    (tmp_path / "configs").symlink_to(REPO / "configs")
    argv = [
        sys.executable,
        "-m",
        "pipeline",
        *command[1:],
        "train.epochs=2",
        "serve.port=0",
        "train.run_name=quick",
    ]
    # The console to a file, as a user's `> log.txt` or CI sees it: held to console_is_clean at the
    # end.
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        proc = subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    lines: list[str] = []
    try:
        url = (
            wait_for_line(console, proc, "  POST http://", timeout=420).split()[1].split("/v2/")[0]
        )
        lines = console.read_text().splitlines(keepends=True)
        sample = next(line for line in lines if line.startswith("sample request:"))
        assert sample.rstrip().endswith("correct") and "WRONG" not in sample, sample
        # The README's next step: re-prove the chain behind what the live server serves.
        verified = run_cli(
            ["verify", "models:/resnet18-digits@champion", "--server", url], cwd=tmp_path
        )
        assert [line.split()[:2] for line in verified.stdout.splitlines()[:-1]] == [
            ["ok", link]
            for link in (
                "registry",
                "onnx",
                "lineage",
                "weights",
                "checkpoint",
                "graph",
                "gates",
                "data",
                "server",
            )
        ]
        assert verified.stdout.splitlines()[-1] == "verified: models:/resnet18-digits@champion"
        # the user's Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, console.read_text()[-4000:]
    assert_console_is_clean(console.read_text())

    client = mlflow_client(tmp_path)
    version = client.get_model_version_by_alias("resnet18-digits", "champion")
    run = client.get_run(version.run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags[lineage.STAGES] == "done: train, consolidate, export, pipeline"
    assert "registered **resnet18-digits** version 1" in tags["mlflow.note.content"]
    promotion = next(
        line for line in tags["mlflow.note.content"].splitlines() if line.startswith("- promotion:")
    )
    # Markdown-escaped: the UI made "@champion" a user's link
    assert "no \\@champion yet" in promotion, promotion
    # The data behind the run: both splits as MLflow datasets, whose digests the registered version
    # names.
    datasets = {d.dataset.name: {t.key: t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    assert set(datasets) == {"digits-train", "digits-val"}
    assert (
        datasets["digits-train"]["mlflow.data.context"] == "training"
        and datasets["digits-train"][lineage.DATASET_SAMPLES] == "1438"
    )
    for split in ("train", "val"):
        assert (
            lineage.recorded_sha256(version.tags, split)
            == datasets[f"digits-{split}"][lineage.DATASET_SHA256]
        )
    # Two ranks evaluated disjoint halves of the split during training; export evaluated the
    # consolidated weights in one process over all of it. The counts must add up exactly.
    metrics = run.data.metrics
    assert metrics["val/accuracy"] * 100 == pytest.approx(
        metrics["export.accuracy.torch_accuracy_pct"], abs=1e-9
    )
    # the rest: table
    assert len([k for k in metrics if k.startswith(("export.", "compare."))]) <= 10, sorted(metrics)
    # The logged model is the exported checkpoint's: MLflow links it to that step's validation
    # metrics and, through them, to the validation dataset ("Datasets used"); the gates' figures
    # stay the export's, not the model's.
    report = json.loads(
        Path(
            client.download_artifacts(run.info.run_id, "onnx/export_report.json", str(tmp_path))
        ).read_text()
    )
    # the stored copy is the final one
    assert report["model_version"] == "1" and report["alias"] == "champion"
    # the exported model's confusion matrix beside it, its title naming the exported step (the run's
    # own, at its root, is the newest checkpoint's and says so)
    assert Path(report["figure"]).name == "confusion_matrix.png"
    assert "onnx/confusion_matrix.png" in {
        a.path for a in client.list_artifacts(run.info.run_id, "onnx")
    }
    linked = [
        m
        for m in client.get_logged_model(report["model_uri"].removeprefix("models:/")).metrics or []
    ]
    assert [
        m
        for m in linked
        if m.key == "val/accuracy"
        and m.step == int(version.tags[lineage.STEP])
        and m.dataset_name == "digits-val"
    ], linked
    assert not [m for m in linked if m.key.startswith(("export.", "system/"))], linked
    # ...and the datasets say what they hold, for the UI's drawer: a schema and a profile
    val = next(d.dataset for d in run.inputs.dataset_inputs if d.dataset.name == "digits-val")
    profile = json.loads(val.profile)
    assert "input" in val.schema and profile["samples"] == 359 == sum(
        profile["targets"]["classes"].values()
    )
    assert set(profile["targets"]["classes"]) == {str(c) for c in range(10)}, profile
    # ...and the MLflow UI shows all this to a person, in a real browser
    assert_the_mlflow_ui_shows_the_record(
        tmp_path, run, version, report["model_uri"].removeprefix("models:/")
    )

    again = run_cli(
        [
            "run",
            "--config",
            "configs/digits_resnet18.yaml",
            "--nproc-per-node",
            "2",
            "train.epochs=2",
            "train.run_name=quick",
        ],
        cwd=tmp_path,
    )
    for stage in (
        "train: already done",
        "consolidate: ",
        "export: version 1 of resnet18-digits already passed",
    ):
        assert stage in again.stderr, again.stderr[-3000:]

    # One flipped byte in any artifact of the chain breaks `pipeline verify` at that link, and only
    # there.
    from pipeline import verify

    artifacts = tmp_path / "mlartifacts"
    consolidated = next(artifacts.rglob("consolidated/model.safetensors")).parent
    best = json.loads((tmp_path / "outputs/quick/checkpoints/best.json").read_text())["checkpoint"]
    tampered = [
        ("onnx", next(p for p in artifacts.rglob("model.onnx") if "models" in p.parts)),
        ("weights", consolidated / "model.safetensors"),
        ("weights", consolidated / "model.json"),
        ("checkpoint", tmp_path / "outputs/quick/checkpoints" / best / "__1_0.distcp"),
    ]
    for link, path in tampered:
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(tmp_path)
                links = verify.main("models:/resnet18-digits@champion", echo=lambda _: None)
        finally:
            path.write_bytes(original)
        failed = [k.name for k in links if k.status == "FAIL"]
        assert link in failed, (path.name, [k.line() for k in links])


def own_model_block(after: str, lang: str) -> str:
    """The first ```lang block after the text `after` in docs/own-model.md, the README's "Train your
    own model"."""
    text = (REPO / "docs" / "own-model.md").read_text()
    start = text.index(f"```{lang}\n", text.index(after)) + len(lang) + 4
    return text[start : text.index("```", start)]


def test_readme_train_your_own_model_as_a_newcomer_follows_it(tmp_path):
    """docs/own-model.md's complete example: its module and config written as it says, in a
    directory trainserve has never seen, run with its command (shorter), then the first errors it
    lists, verbatim."""
    (tmp_path / "my_project").mkdir()
    module = own_model_block("`my_project/tabular.py` in any directory", "python")
    (tmp_path / "my_project" / "tabular.py").write_text(module)
    (tmp_path / "mine.yaml").write_text(own_model_block("this as `mine.yaml`", "yaml"))
    command = shlex.split(own_model_block("one command trains it", "bash").strip())
    assert command[0].endswith("/.venv/bin/pipeline") and command[1:] == [
        "run",
        "--config",
        "mine.yaml",
        "--nproc-per-node",
        "2",
        "--serve-check",
    ]
    proc = run_cli([*command[1:], "train.epochs=10", "serve.port=0"], cwd=tmp_path)
    assert "sample request: a real validation sample (target" in proc.stdout, proc.stdout
    assert "the server's answer equals the PyTorch model's" in proc.stdout
    client = mlflow_client(tmp_path)
    version = client.get_model_version_by_alias("my-tabular-net", "champion")
    assert version.tags[lineage.MODEL] == "my_project.tabular:TabularNet"
    run = client.get_run(version.run_id)
    assert {"code/my_project/tabular.py"} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "code/my_project")
    }

    errors = own_model_block("## The errors you will meet\n", "").strip().splitlines()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text())
    missing = run_cli(
        ["run", "--config", "mine.yaml", "--nproc-per-node", "2"], cwd=elsewhere, check=False
    )
    assert missing.returncode == 2 and missing.stderr.strip() == errors[0]
    typo = run_cli(
        ["run", "--config", "mine.yaml", "--nproc-per-node", "2", "model.args={hiden: 64}"],
        cwd=tmp_path,
        check=False,
    )
    assert typo.returncode == 2 and typo.stderr.strip() == errors[1]


def test_a_taken_serve_port_stops_pipeline_run_before_it_trains(tmp_path):
    """Found only after training, exporting and registering, it cost a whole run (and moved the
    alias)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(
            ["run", "--config", str(TINY), "--serve-check", f"serve.port={port}"],
            cwd=tmp_path,
            check=False,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"serve.port={port} on 127.0.0.1 is taken" in proc.stderr
        and "serve.port=0 for any free one" in proc.stderr
    )
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


def test_serve_check_fails_a_model_registered_below_its_baseline(tiny_run):
    """--serve-check printed "WRONG" and exited 0 for a chance-level model. The tiny config's 12
    steps leave one (its BatchNorm statistics unsettled), registered only because the config allows
    it: the run says so, and --serve-check exits 1 though the server answers. (The session's
    tiny_run is that command.)"""
    proc = tiny_run.proc
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "is below the baseline: accuracy" in proc.stderr
        and "not clearly better than the baseline" in proc.stderr
    )
    assert (
        "--serve-check: the server answers, but models:/resnet18-digits@champion failed its baseline gate"
        in proc.stderr
    ), proc.stderr[-3000:]
