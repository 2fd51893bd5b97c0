"""The first hour of a newcomer (shared/reviews/newcomer-d80ae6e.md), each friction replayed as they
met it: the CLI in a subprocess, a server process and an HTTP request, scripts/setup as typed. Each
answer must be one line that names what is wrong and the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, TINY, cli_env, run_cli

from pipeline import checkpoint


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# --- 1. companion packages that match the installed torch; 7. no pip index noise ------------------


def cpu_torch_only() -> None:
    """These replay the CPU set-up, where no torchvision fits without PyTorch's CPU index; elsewhere
    (a CUDA torch) `--with torchvision` would install one for real."""
    import torch

    if (
        not torch.__version__.endswith("+cpu")
        or Path(sys.prefix).resolve() != (REPO / ".venv").resolve()
    ):
        pytest.skip("needs the CPU torch in the .venv scripts/setup made")


def setup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_CPU_INDEX"} | (env or {})
    return subprocess.run(
        [str(REPO / "scripts/setup"), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_setup_with_torchvision_removes_a_broken_one_and_refuses_saying_what_works(tmp_path):
    """The review's order: a bare `pip install torch torchvision` left a torchvision that fails at
    import, then `scripts/setup --with torchvision` refused but kept it. Now it removes it, says so,
    and refuses with the line docs/install.md shows (one path, the same in docs/own-model.md)."""
    from test_setup_constraints import fake_wheel

    cpu_torch_only()
    wheel = fake_wheel(
        tmp_path,
        "torchvision",
        "0.28.0",
        files={"torchvision/__init__.py": BROKEN, "torchvision/ops.py": ""},
    )
    installed = pip("install", "--no-deps", "--no-index", str(wheel))
    assert installed.returncode == 0, installed.stderr
    try:
        proc = setup("--with", "torchvision")
    finally:
        pip("uninstall", "-y", "torchvision")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (
        f"setup: removed torchvision 0.28.0, which fails at import under torch {torch_version()} "
        "(RuntimeError: operator torchvision::nms does not exist)"
    ) in proc.stdout.splitlines(), proc.stdout
    refusal = (
        f"setup: --with torchvision: torch {torch_version()} is a CPU build and its torchvision, torchvision=="
        f"{cpu_torchvision()}, is not in pip's indexes here (their torchvision wheels are CUDA builds: they install, "
        "then fail at import with 'operator torchvision::nms does not exist'); set TORCH_CPU_INDEX to PyTorch's CPU "
        "wheel index (https://download.pytorch.org/whl/cpu) and run scripts/setup --with torchvision again, or use "
        "the CUDA pair in an environment of its own: pip install torch==2.14.1 torchvision==0.29.1 (about 5.5 GB), "
        f"then pip install -e {REPO} in it (docs/install.md#torchvision)"
    )
    assert error_lines(proc.stderr) == [refusal]
    assert pip("show", "torchvision").returncode != 0, "the broken torchvision is still installed"
    install, own_model = (
        (REPO / "docs" / page).read_text() for page in ("install.md", "own-model.md")
    )
    shown = refusal.replace(str(REPO), "/path/to/trainserve")
    assert shown in (line.strip() for line in install.splitlines()), (
        "docs/install.md does not show the refusal scripts/setup prints"
    )
    # One path: docs/own-model.md sends the reader to install.md's, and installs no pair of its own.
    assert "install.md#torchvision" in own_model and "torchvision==" not in own_model
    # The way the docs install any other package refuses it too, instead of installing the
    # registry's CUDA build (pip resolves only: --dry-run).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--disable-pip-version-check",
            "-c",
            str(REPO / ".venv/constraints.txt"),
            "torchvision",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Would install" not in said, said
    assert "(constraint) torchvision" in said and f"=={cpu_torchvision()}" in said, said


def test_setup_shows_pips_errors_without_its_index_warnings(tmp_path):
    """A configured index location that does not exist made pip say so once per package looked up:
    166 lines of a fresh set-up. A torch that is nowhere (resolved only, nothing changes) shows both
    kinds of line."""
    cpu_torch_only()
    proc = setup(
        env={"TORCH_VERSION": "0.0.1", "TORCH_CPU_INDEX": (tmp_path / "no-index").as_uri()}
    )
    assert proc.returncode != 0
    # pip's own error, kept
    assert [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("ERROR:") and "torch==0.0.1" in line
    ], proc.stderr
    assert "is ignored" not in proc.stdout + proc.stderr, proc.stderr


def torch_version() -> str:
    import torch

    return torch.__version__


def cpu_torchvision() -> str:
    minor, patch = (int(p) for p in torch_version().partition("+")[0].split(".")[1:3])
    return f"0.{minor + 15}.{patch}+cpu"


BROKEN = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


# --- 3. a misspelt registered model, alias or version: the names there are ------------------------


def test_a_misspelt_registry_name_alias_or_version_gets_the_names_there(tiny_run):
    # The session's tiny run registered resnet18-digits version 1 as @champion.
    store = tiny_run.uri

    def error(*args: str) -> str:
        proc = run_cli(list(args), cwd=tiny_run.workdir, check=False, timeout=120)
        lines = error_lines(proc.stderr)
        assert proc.returncode != 0 and len(lines) == 1, proc.stderr
        return lines[0]

    assert error("serve", "--model", "models:/resnet18-digit@champion") == (
        f"pipeline serve: error: cannot serve: no registered model 'resnet18-digit' in {store}; did you mean "
        "'resnet18-digits'?"
    )
    assert error("serve", "--model", "models:/resnet18-digits/7") == (
        "pipeline serve: error: cannot serve: resnet18-digits has no version 7; its versions: 1"
    )
    assert error("verify", "models:/resnet18-digits@champoin") == (
        "pipeline verify: error: resnet18-digits has no alias @champoin; its aliases: @champion"
    )
    # promote asks the registry before the server (none listens here)
    assert error("promote", "resnet18-digit", "--server", "http://127.0.0.1:9") == (
        f"pipeline promote: error: no registered model 'resnet18-digit' in {store}; did you mean 'resnet18-digits'?"
    )


# --- 4. a shape the model can't take: the shapes fed and the shapes it takes ----------------------


def mismatched_lengths_model(path: Path) -> Path:
    """`a` and `b`, FP32 [batch, length] each, added: any length fits each input, but not two
    different ones, which onnxruntime finds only at run time (as a sequence model's ids and mask of
    different lengths)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["sum"])],
        "add",
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", n + "_length"])
            for n in ("a", "b")
        ],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch", "length"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_a_shape_the_model_cannot_take_is_named_with_the_shapes_sent_and_taken(tmp_path):
    import numpy as np
    import requests
    import tritonclient.grpc as triton_grpc
    from serving_fixtures import ServerProcess, free_port
    from tritonclient.utils import InferenceServerException

    grpc_port = free_port()
    with ServerProcess(
        "--model",
        str(mismatched_lengths_model(tmp_path / "add.onnx")),
        "--grpc-port",
        str(grpc_port),
        log_path=tmp_path / "server.log",
    ) as server:
        v2 = {
            "inputs": [
                {"name": "a", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
                {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            ]
        }
        mlflow_style = {"inputs": {"a": [[1, 2, 3]], "b": [[1, 2, 3, 4]]}}
        errors = []
        for path, body in (("/v2/models/add/infer", v2), ("/invocations", mlflow_style)):
            answer = requests.post(server.url + path, json=body, timeout=30)
            assert answer.status_code == 400, answer.text
            errors.append(answer.json()["error"])
        inputs = []
        for name, length in (("a", 3), ("b", 4)):
            inputs.append(triton_grpc.InferInput(name, [1, length], "FP32"))
            inputs[-1].set_data_from_numpy(np.ones((1, length), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}").infer("add", inputs)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        errors.append(refused.value.message())
    sent = (
        "the model cannot compute on these input values: a [1, 3] (the model takes [-1,-1] FP32), b [1, 4] (the "
        "model takes [-1,-1] FP32): "
    )
    assert errors[0].startswith(sent) and "3 by 4" in errors[0], errors[0]
    # one message for every front end
    assert errors[1] == errors[0] and sent in errors[2], errors


def test_a_model_that_cannot_take_the_data_says_what_it_was_fed(tmp_path):
    config = tmp_path / "linear.yaml"
    config.write_text(
        "data:\n  name: digits\nmodel:\n  component: torch.nn:Linear\n"
        "  args: {in_features: 32, out_features: 10}\n"
    )
    proc = run_cli(["run", "--config", str(config)], cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "pipeline run: error: model.component 'torch.nn:Linear' on 2 validation samples, fed input [2, 1, 8, 8] "
        "float32: RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x8 and 32x10)"
    ], proc.stderr


# --- 5. a config key's error names the YAML file it is in -----------------------------------------


def test_a_misspelt_key_in_a_config_file_names_the_file_and_line(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(
        textwrap.dedent("""\
        data:
          name: digits
        train:
          max_steps: 2
          epoch: 3
        """)
    )
    proc = run_cli(["train", "--config", str(config)], cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert (
        f"{config}:5: unknown config key 'train.epoch' in section 'train'. Did you mean 'train.epochs'?"
        in lines[0]
    )
    # The same key on the command line is named as the override it came from.
    proc = run_cli(
        ["train", "--config", str(config), "train.epoch=3"], cwd=tmp_path, check=False, timeout=60
    )
    assert "override train.epoch=3: unknown config key 'train.epoch'" in proc.stderr, proc.stderr


# --- 6. checkpoint saves: one summary line, each save only at --verbose ---------------------------


@pytest.mark.slow
def test_checkpoint_saves_are_one_summary_line_unless_verbose(tiny_run, tmp_path):
    # Quiet: the session's tiny run (checkpoints at steps 6 and 12), its console as `pipeline run`
    # left it.
    console = tiny_run.proc.stderr
    assert "checkpoint saved" not in console, console
    summary = [line for line in console.splitlines() if "checkpoints to" in line]
    kept = [p.name for p in checkpoint.list_complete(tiny_run.run_dir / "checkpoints")]
    assert len(summary) == 1 and re.search(
        r"INFO pipeline\.checkpoint\.saver: saved 2 checkpoints to "
        r"outputs/tiny/checkpoints \(\d+\.\d s in all\), kept (\d) \((.*)\)$",
        summary[0],
    ).groups() == (str(len(kept)), ", ".join(kept)), console
    verbose = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "train.run_name=loud",
            "train.max_steps=3",
            "train.eval_every=0",
            "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=2",
            "--verbose",
        ],
        cwd=tmp_path,
        timeout=180,
    ).stderr
    assert (
        sum(
            "checkpoint saved: outputs/loud/checkpoints/step_" in line
            for line in verbose.splitlines()
        )
        == 3
    ), verbose
    # The summary counts every save and names what keep_last left.
    assert (
        "saved 3 checkpoints to outputs/loud/checkpoints" in verbose
        and "kept 2 (step_00000002, step_00000003)" in verbose
    ), verbose


# --- 2. an import error in an optional package is shown as itself ---------------------------------


def broken_torchvision(directory: Path) -> Path:
    """A torchvision as the registry's CUDA build is under a CPU torch: installed (so transformers
    imports it too), and failing at import the way it does there."""
    (directory / "torchvision").mkdir(parents=True)
    (directory / "torchvision" / "__init__.py").write_text(BROKEN)
    dist_info = directory / "torchvision-0.28.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n"
    )
    (dist_info / "top_level.txt").write_text("torchvision\n")
    return directory


def test_a_broken_optional_package_is_named_with_its_fix(tmp_path):
    env = {"PYTHONPATH": f"{broken_torchvision(tmp_path / 'site')}:{REPO}"}
    fix = (
        "torchvision 0.28.0 was built for another torch than the installed {}: scripts/setup --with torchvision "
        "installs one that fits (or says why none can here), or uninstall it: pip uninstall torchvision"
    )
    import torch

    fix = fix.format(torch.__version__)
    # A transformers model: transformers imports torchvision on its way to the class, and said only
    # "Could not import module 'BertForSequenceClassification'. Are this object's requirements
    # defined correctly?"
    proc = run_cli(
        ["run", "--config", str(REPO / "configs/digit_sequences_bert.yaml")],
        cwd=tmp_path,
        env=env,
        check=False,
        timeout=120,
    )
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (
        "pipeline run: error: model.component 'pipeline.models.huggingface:from_config' raised "
        "ModuleNotFoundError: Could not import module 'BertForSequenceClassification', because importing "
        "torchvision failed: RuntimeError: operator torchvision::nms does not exist; " + fix
    ), lines[0]
    # torchvision's own model: the error was already its own; now it names the fix too.
    config = tmp_path / "mobilenet.yaml"
    config.write_text(
        "data:\n  name: digits\nmodel:\n  component: torchvision.models:mobilenet_v3_small\n"
    )
    proc = run_cli(
        ["run", "--config", str(config)], cwd=tmp_path, env=env, check=False, timeout=120
    )
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "pipeline run: error: model.component 'torchvision.models:mobilenet_v3_small': importing 'torchvision.models' "
        "raised RuntimeError: operator torchvision::nms does not exist; " + fix
    ], proc.stderr


# --- their own folder of grey images: shards, the command the shard hint prints, a bad file on any rank ------------

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def grey_photos(root: Path, count: int) -> Path:
    """`count` of scikit-learn's real digits as grey 8x8 PNG files (Pillow mode L), a folder a class
    named as a person would (`zero` ... `nine`)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:count], digits.target[:count])):
        (root / NAMES[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 16).astype(np.uint8)).save(root / NAMES[label] / f"{i:04d}.png")
    return root


def docs_image_folder_shard_command() -> list[str]:
    """docs/data.md's `pipeline data shard` of a folder of image files, as its arguments."""
    import shlex

    from test_readme_commands import pasted_commands

    return next(
        shlex.split(command, comments=True)[1:]
        for page, command, _ in pasted_commands()
        if page == "docs/data.md" and "image_folder" in command
    )


@pytest.mark.slow
def test_grey_photos_shard_and_train_with_the_command_the_hint_prints(tmp_path):
    """docs/data.md's image-folder command on grey PNGs, then the `pipeline run` command it prints,
    pasted into a shell as printed (a tiny run's settings after it): the grey images stay 1-channel,
    and the run trains from the shards and registers under the name given to the shard command."""
    grey_photos(tmp_path / "photos", 300)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    argv = docs_image_folder_shard_command()
    assert "../photos" in " ".join(argv) and "../shards/photos" in argv, argv
    wrote = run_cli(argv, cwd=work, timeout=120)
    assert "train 240 samples" in wrote.stdout, wrote.stdout
    printed = wrote.stdout.strip().splitlines()[-1].strip()
    assert printed.startswith(
        f"{sys.executable} -m pipeline run --config configs/digits_resnet18.yaml "
    )
    assert printed.endswith(" data.name=sharded 'data.args={root: ../shards/photos}'"), printed
    from pipeline.shards import format as shard_format

    assert shard_format.read_manifest(tmp_path / "shards/photos/train").columns[0].shape[0] == 1
    tiny = "model.args.width=0.125 train.max_steps=2 train.eval_every=0 export.allow_below_baseline=true"
    proc = subprocess.run(
        ["bash", "-c", f"{printed} {tiny}"],
        cwd=work,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "model args from the data: in_channels=1," in proc.stderr, proc.stderr[-6000:]
    assert "registered photos-resnet18 version 1 as @champion" in proc.stderr, proc.stderr[-6000:]


@pytest.mark.slow
def test_a_corrupt_image_met_by_one_rank_of_two_is_one_line_and_exit_2(tmp_path):
    """A truncated PNG in a map-style image folder, met by rank 1 as it hashes its part of the
    training split: the line naming the file is all the user sees (no traceback from rank 0, whose
    collective lost its peer, nor torchrun's report of the failed workers), and the exit code is
    2."""
    from pipeline.datasets.image_folder import image_folder, spread

    photos = grey_photos(tmp_path / "photos", 600)
    train = image_folder(str(photos))["train"]
    # Rank r hashes positions r, r + 2, ... of the split; the positions the data set reads when it
    # is built (its statistics) would stop the run in the launcher, before torchrun.
    position = next(p for p in range(1, len(train), 2) if p not in spread(len(train)))
    bad = train.files[position][0]
    bad.write_bytes(bad.read_bytes()[:60])
    proc = run_cli(
        [
            "run",
            "--config",
            str(TINY),
            "--nproc-per-node",
            "2",
            "data.component=pipeline.datasets:image_folder",
            f"data.args={{root: {photos}}}",
        ],
        cwd=tmp_path,
        check=False,
        timeout=300,
    )
    # The ranks' progress before it ("[rank0] 12:00:01 INFO pipeline.train: world size 2, ...") is
    # the run's log.
    said = [
        line for line in error_lines(proc.stderr) if not re.match(r"\[rank\d\] [\d:]+ INFO ", line)
    ]
    assert proc.returncode == 2 and said == [
        f"pipeline train: [rank1] error: {bad} can't be read as an image (OSError: image file is truncated); "
        "remove it or replace it"
    ], proc.stdout[-3000:] + proc.stderr
    assert not re.search(r"Traceback|ChildFailedError|Connection closed", proc.stdout + proc.stderr)


def test_bad_input_is_said_by_the_first_rank_only_and_the_others_know(
    tmp_path, monkeypatch, capsys
):
    from pipeline.distributed import launch

    monkeypatch.setenv(launch.ERROR_FILE, str(tmp_path / "error"))
    assert not launch.another_rank_said_why(wait=0)
    launch.say_error("pipeline train: [rank1] error: photos/4/0270.png can't be read")
    launch.say_error("pipeline train: [rank0] error: photos/5/0001.png can't be read")
    assert launch.another_rank_said_why(wait=0)
    assert capsys.readouterr().err.splitlines() == [
        "pipeline train: [rank1] error: photos/4/0270.png can't be read"
    ]


def test_args_another_component_does_not_take_get_the_override_that_replaces_them(
    tmp_path, monkeypatch
):
    """The digits config's `val_fraction` kept by `data.args.root=DIR` (a dotted override keeps the
    file's other args): the error shows the override that drops it, and that override, pasted,
    works."""
    import shlex

    from pipeline import data_cli
    from pipeline.components.build import build_data
    from pipeline.config import load_config
    from pipeline.errors import ComponentError

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs/digits_resnet18.yaml")
    data_cli.main(config, [], "shards")
    cfg = load_config(config, ["data.name=sharded", "data.args.root=shards"])
    with pytest.raises(ComponentError) as refused:
        build_data(cfg.data, cfg.task.name)
    assert str(refused.value) == (
        "data.args do not fit pipeline.datasets:sharded(root=None, train=None, val=None, check=True): got an "
        "unexpected keyword argument 'val_fraction' (given: root, val_fraction); set data.args to what it "
        "takes: 'data.args={root: shards}' on the command line replaces the whole mapping "
        "(data.args.NAME=VALUE sets one key and keeps the others)"
    )
    pasted = shlex.split(re.search(r"takes: ('[^']+')", str(refused.value))[1])
    cfg = load_config(config, ["data.name=sharded", *pasted])
    assert len(build_data(cfg.data, cfg.task.name).train.manifest.shards) == 1


def test_image_folder_keeps_the_images_own_channels_unless_mode_says(tmp_path):
    import numpy as np
    from PIL import Image

    from pipeline.datasets.image_folder import image_folder

    def folder(name: str, modes: list[str]) -> str:
        for i, mode in enumerate(modes):
            (tmp_path / name / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            pixels = np.full((6, 6, len(mode)) if len(mode) > 1 else (6, 6), 200, np.uint8)
            Image.fromarray(pixels, mode).save(tmp_path / name / f"c{i % 2}" / f"{i}.png")
        return str(tmp_path / name)

    def channels(root: str, **args) -> int:
        splits = image_folder(root, image_size=4, **args)
        assert splits["train"].model_args["in_channels"] == splits["train"][0][0].shape[0]
        return splits["val"][0][0].shape[0]

    grey = folder("grey", ["L"] * 4)
    assert channels(grey) == 1 and channels(grey, mode="RGB") == 3
    assert channels(folder("colour", ["RGB"] * 4)) == 3
    assert channels(folder("alpha", ["RGBA"] * 4)) == 3
    mixed = folder("mixed", ["L", "L", "RGB", "L"])
    assert channels(mixed) == 3 and channels(mixed, mode="L") == 1
