"""`pipeline consolidate`: real DCP checkpoints in, model.safetensors + model.json out.

Checkpoints are made the way training makes them: `pipeline.checkpoint.save` in one process, or
under a real 2-process torchrun (gloo) with DDP or FSDP2 for the sharded cases and the memory test.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_lineage
from safetensors.torch import load_file

from pipeline import checkpoint, consolidate
from pipeline.artifact.safetensors_writer import StreamingWriter, TensorSpec
from pipeline.cli import main as pipeline_cli
from pipeline.components.build import ModelSpec, instantiate_model, state_manifest
from pipeline.config import Config
from pipeline.distributed import DistInfo
from serving import lineage

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
TINY = ModelSpec(
    "pipeline.models:resnet18",
    {"num_classes": 10, "in_channels": 1, "width": 0.125, "mean": [0.5], "std": [0.25]},
)
ONE_PROCESS = DistInfo(0, 1, 0, 1, torch.device("cpu"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(
    run_dir: Path,
    step: int = 3,
    spec: ModelSpec = TINY,
    poison: str | None = None,
    run_id: str | None = None,
) -> tuple[Path, torch.nn.Module]:
    """A model after one AdamW step (so optimizer state exists), saved as training saves it."""
    torch.manual_seed(step)
    model = instantiate_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.rand(8, 1, 8, 8)
    torch.nn.functional.cross_entropy(
        model(x), torch.randint(0, spec.args["num_classes"], (8,))
    ).backward()
    optimizer.step()
    if poison:
        with torch.no_grad():
            model.state_dict()[poison].view(-1)[0] = float("nan")
    meta = {
        "config": Config().model_dump(mode="json"),
        "model": spec.to_json(),
        "model_state": state_manifest(model),
        "labels": [str(i) for i in range(spec.args["num_classes"])],
        "strategy": "ddp",
        "mlflow_run_id": run_id,
        "train_state": {"epoch": 0},
    }
    path = checkpoint.save(
        run_dir / "checkpoints", step, model, optimizer, meta, ONE_PROCESS, keep_last=5
    )
    return path, model


def rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replaces a file of a checkpoint and updates its COMPLETE marker, as if it had been saved
    so."""
    (ckpt / name).write_bytes(data)
    marker = json.loads((ckpt / checkpoint.MARKER).read_text())
    marker["files"][name] = len(data)
    marker["sha256"][name] = hashlib.sha256(data).hexdigest()
    (ckpt / checkpoint.MARKER).write_text(json.dumps(marker))


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def run_consolidate(args: list[str], capsys) -> tuple[int, str, str]:
    code = pipeline_cli(["consolidate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(".*tmp-*")) if directory.exists() else []


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return save_checkpoint(tmp_path_factory.mktemp("one") / "run")


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the one-process checkpoint, free to damage."""
    shutil.copytree(saved[0].parent.parent, tmp_path / "run")
    return tmp_path / "run" / "checkpoints" / saved[0].name


# --- the result -----------------------------------------------------------------------------


def test_one_process_checkpoint_gives_the_models_state_dict_and_describes_it(ckpt, saved):
    live = saved[1].state_dict()
    weights = consolidate.main(ckpt, log_to_mlflow=False)

    assert weights == ckpt.parent.parent.resolve() / "consolidated" / "model.safetensors"
    got = load_file(str(weights))
    # exactly the model's keys, buffers included, no optimizer
    assert sorted(got) == sorted(live)
    for name, tensor in live.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["bn1.num_batches_tracked"].dtype == torch.int64

    meta = json.loads((weights.parent / "model.json").read_text())
    assert meta["format"] == "trainserve-weights/2"
    assert meta["sha256"] == sha256(weights)
    assert meta["dtype"] == "fp32" and meta["model"] == TINY.to_json() and meta["labels"][0] == "0"
    assert meta["config"] == Config().model_dump(mode="json")
    assert meta["tensors"]["fc.weight"] == {"shape": [10, 64], "dtype": "float32"}
    assert set(meta["tensors"]) == set(live)
    assert meta["source"] == {
        "checkpoint": str(ckpt.resolve()),
        "step": 3,
        "world_size": 1,
        "strategy": "ddp",
        "mlflow_run_id": None,
        "val_metrics": None,
        "best": False,
    }
    assert temporaries(weights.parent) == []


def test_bf16_casts_floating_tensors_and_keeps_integer_buffers(ckpt, saved, tmp_path):
    weights = consolidate.main(ckpt, output=tmp_path / "bf16", dtype="bf16", log_to_mlflow=False)
    got, live = load_file(str(weights)), saved[1].state_dict()
    assert torch.equal(got["fc.weight"], live["fc.weight"].bfloat16())
    assert got["normalize.std"].dtype == torch.bfloat16
    assert torch.equal(got["bn1.num_batches_tracked"], live["bn1.num_batches_tracked"])
    assert json.loads((tmp_path / "bf16" / "model.json").read_text())["dtype"] == "bf16"


def test_a_run_directory_gives_its_best_checkpoint_and_latest_its_newest_complete(tmp_path, capsys):
    run = tmp_path / "run"
    save_checkpoint(run, step=3)
    save_checkpoint(run, step=5)
    shutil.copytree(run / "checkpoints" / "step_00000005", run / "checkpoints" / "step_00000007")
    # a save that never finished
    (run / "checkpoints" / "step_00000007" / checkpoint.MARKER).unlink()

    # no best.json: the newest complete
    code, out, _ = run_consolidate([str(run), "--no-log"], capsys)
    assert code == 0 and out.strip() == str(run.resolve() / "consolidated" / "model.safetensors")
    assert json.loads((run / "consolidated" / "model.json").read_text())["source"]["step"] == 5

    (run / "checkpoints" / "best.json").write_text(
        json.dumps(
            {
                "checkpoint": "step_00000003",
                "step": 3,
                "metric": "val/accuracy",
                "value": 0.9,
                "mode": "max",
            }
        )
    )
    code, _, err = run_consolidate([str(run), "--no-log"], capsys)
    assert (
        code == 0
        and json.loads((run / "consolidated" / "model.json").read_text())["source"]["step"] == 3
    )
    code, _, err = run_consolidate([str(run), "--latest", "--no-log"], capsys)
    assert (
        code == 0
        and json.loads((run / "consolidated" / "model.json").read_text())["source"]["step"] == 5
    )

    (run / "checkpoints" / "best.json").write_text("{not json")
    code, _, err = run_consolidate([str(run), "--no-log"], capsys)
    assert code == 2 and "best.json" in err and "--latest" in err


# --- bad input ------------------------------------------------------------------------------


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _other_model(ckpt: Path) -> None:
    """The trainserve.json of a wider model with 5 classes beside these shards."""
    meta = json.loads((ckpt / checkpoint.META).read_text())
    other = ModelSpec(TINY.component, {**TINY.args, "num_classes": 5, "width": 0.25})
    meta["model"], meta["model_state"] = other.to_json(), state_manifest(instantiate_model(other))
    rewrite(ckpt, checkpoint.META, json.dumps(meta).encode())


def _no_manifest(ckpt: Path) -> None:
    """What a trainserve before components saved: no model_state manifest."""
    meta = json.loads((ckpt / checkpoint.META).read_text())
    del meta["model_state"]
    rewrite(ckpt, checkpoint.META, json.dumps(meta).encode())


DAMAGE = {
    "no COMPLETE marker (partial save)": (
        lambda c: (c / checkpoint.MARKER).unlink(),
        "has no COMPLETE marker",
    ),
    "shard file missing": (
        lambda c: (c / "__0_0.distcp").unlink(),
        "file '__0_0.distcp' is missing",
    ),
    "shard file truncated": (
        lambda c: _truncate(c / "__0_0.distcp", 1000),
        "truncated or overwritten",
    ),
    "a bit flipped in a shard": (
        lambda c: _flip_a_bit(c / "__0_0.distcp"),
        "file '__0_0.distcp' differs from what was saved (its sha256 does not match",
    ),
    "shard truncated, marker rewritten to match": (
        lambda c: rewrite(c, "__0_0.distcp", (c / "__0_0.distcp").read_bytes()[:1000]),
        "__0_0.distcp failed: shard file corrupt or truncated?",
    ),
    ".metadata truncated, marker rewritten to match": (
        lambda c: rewrite(c, ".metadata", (c / ".metadata").read_bytes()[:500]),
        ".metadata can't be read",
    ),
    "metadata from another model": (
        _other_model,
        "shape differs: fc.weight checkpoint [10, 64] vs model [5, 128]",
    ),
    "saved before components (no manifest)": (_no_manifest, "records no model_state manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_stops_with_a_clear_error_and_writes_nothing(ckpt, damage, capsys):
    spoil, expected = DAMAGE[damage]
    spoil(ckpt)
    code, out, err = run_consolidate([str(ckpt), "--no-log"], capsys)
    assert code == 2, out
    assert err.startswith("pipeline consolidate: error: ") and expected in err, err
    assert not (ckpt.parent.parent / "consolidated" / "model.safetensors").exists()
    assert temporaries(ckpt.parent.parent / "consolidated") == []


def test_a_missing_path_is_named(tmp_path, capsys):
    code, _, err = run_consolidate([str(tmp_path / "nowhere"), "--no-log"], capsys)
    assert code == 2 and f"'{tmp_path / 'nowhere'}' does not exist" in err


def test_an_output_that_cannot_be_written_is_named(ckpt, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory")
    code, _, err = run_consolidate(
        [str(ckpt), "--output", str(tmp_path / "a_file" / "out"), "--no-log"], capsys
    )
    assert code == 2 and "can't be written" in err and "--output" in err


def test_nan_in_the_weights_stops_and_keeps_the_previous_consolidation(tmp_path):
    good, _ = save_checkpoint(tmp_path / "good")
    # The poisoned tensor sorts last in the file, so the stage fails after writing most of it.
    bad, _ = save_checkpoint(tmp_path / "bad", poison="normalize.std")
    out = tmp_path / "out"
    weights = consolidate.main(good, output=out, log_to_mlflow=False)
    before = (sha256(weights), (out / "model.json").read_text())

    with pytest.raises(
        consolidate.ConsolidateError, match="tensor 'normalize.std' holds 1 NaN and 0 Inf"
    ):
        consolidate.main(bad, output=out, log_to_mlflow=False)
    assert (sha256(weights), (out / "model.json").read_text()) == before
    assert temporaries(out) == []


def test_a_temporary_left_by_a_killed_run_is_removed(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # no such process
    stale = out / ".model.safetensors.tmp-999999999"
    stale.write_bytes(b"half a file")
    consolidate.main(ckpt, output=out, log_to_mlflow=False)
    assert not stale.exists()


def test_a_disk_too_small_is_refused_before_writing(ckpt, tmp_path, capsys):
    """ENOSPC for real: a 256 KiB tmpfs (needs root / CAP_SYS_ADMIN, else skipped). The space check
    before writing refuses it; the mid-write failure is the next test's."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("can't mount a tmpfs here")
    try:
        code, _, err = run_consolidate(
            [str(ckpt), "--output", str(mnt / "out"), "--no-log"], capsys
        )
        assert code == 2 and "not enough disk space" in err
        assert list((mnt / "out").iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_write_failing_midway_leaves_nothing_behind(ckpt, tmp_path):
    """A full disk in the middle of the write, simulated by a file size limit (RLIMIT_FSIZE makes
    write() fail with EFBIG once the file reaches 200 kB; the file needs ~720 kB)."""
    out = tmp_path / "out"

    def limit_file_size():
        # else the kernel kills the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "consolidate",
            str(ckpt),
            "--output",
            str(out),
            "--no-log",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_file_size,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "pipeline consolidate: error: disk full while writing" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == []


def test_the_writer_refuses_tensors_out_of_order_or_missing(tmp_path):
    specs = [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (3,), torch.float32)]
    writer = StreamingWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(ValueError, match="out of order: 'a' comes next"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="the header says torch.float32 \\[2\\]"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written, first: \\['b'\\]"):
        writer.close()


# --- MLflow ---------------------------------------------------------------------------------


def test_logs_to_the_run_and_consolidates_from_a_run_id(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment(
        "consolidate", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    with mlflow.start_run(experiment_id=experiment) as run:
        run_id = run.info.run_id
    ckpt, model = save_checkpoint(tmp_path / "trained", run_id=run_id)
    mlflow.MlflowClient().log_artifacts(run_id, str(ckpt), f"checkpoints/{ckpt.name}")
    # another machine: only the run id is left
    shutil.rmtree(tmp_path / "trained")

    weights = consolidate.main(run_id=run_id, tracking_uri=uri)

    assert weights == Path("outputs") / run_id / "consolidated" / "model.safetensors"
    got = load_file(str(weights))
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    client = mlflow.MlflowClient(uri)
    logged = sorted(a.path for a in client.list_artifacts(run_id, "consolidated"))
    assert logged == ["consolidated/model.json", "consolidated/model.safetensors"]
    tags = client.get_run(run_id).data.tags
    assert run_lineage(run_id, client)["consolidated"]["sha256"] == sha256(weights)
    assert lineage.read_stages(tags[lineage.STAGES])["consolidate"] == "done"


def test_an_unknown_run_id_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_consolidate(
        ["--run-id", "0" * 32, "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}"], capsys
    )
    assert code == 2 and f"run {'0' * 32} not found" in err


# --- real 2-process checkpoints -------------------------------------------------------------


def torchrun(script: str, *args: str, timeout: float = 300) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / script),
        *args,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_process(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param)
    torchrun(
        "consolidate_make_checkpoint.py",
        "--strategy",
        request.param,
        "--model",
        json.dumps(TINY.to_json()),
        "--out",
        str(out),
        "--live",
    )
    return request.param, out


@pytest.mark.slow
def test_two_process_checkpoint_gives_the_live_models_weights_and_outputs(two_process):
    strategy, out = two_process
    ckpt = checkpoint.latest(out / "run" / "checkpoints")
    metadata = consolidate.CachedMetadataReader(ckpt).metadata
    files = {info.relative_path for info in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    # truly sharded: a weight stored as slices in both files
    if strategy == "fsdp":
        chunks = metadata.state_dict_metadata["model.fc.weight"].chunks
        assert len(chunks) == 2

    weights = consolidate.main(ckpt, log_to_mlflow=False)

    got, live = load_file(str(weights)), load_file(str(out / "live.safetensors"))
    assert sorted(got) == sorted(live)
    for name in live:
        assert torch.equal(got[name], live[name]), name
    model = instantiate_model(TINY)
    model.load_state_dict(got, strict=True)
    model.eval()
    recorded = load_file(str(out / "live_outputs.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(
            model(recorded["input"]), recorded["output"], rtol=1e-5, atol=1e-6
        )
    source = json.loads((weights.parent / "model.json").read_text())["source"]
    assert (source["world_size"], source["strategy"], source["step"]) == (2, strategy, 2)


# A checkpoint of ~450 MB: MLP weights (~150 MB, largest tensor 4096x4096 fp32 = 64 MiB) + AdamW.
BIG = ModelSpec(
    "pipeline.models:mlp",
    {
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 32,
        "hidden": [4096, 4096, 4096],
        "mean": [0.5],
        "std": [0.25],
    },
)


def peak_rss(mode: str, ckpt: Path, out: Path) -> int:
    """Peak resident memory over the process baseline, in bytes, measured in a fresh process
    (VmHWM)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "consolidate_peak_rss.py"), mode, str(ckpt), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["peak"] - result["baseline"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_memory_stays_under_the_bound_where_dcp_to_torch_save_does_not(tmp_path, strategy):
    """Bound: half the largest tensor (64 MiB): the one pass streams each tensor through one 4 MiB
    buffer, so what it holds does not grow with the tensors (reading a tensor whole would take 1x;
    dcp_to_torch_save holds the whole checkpoint). Under FSDP every tensor is split between the two
    shard files and reassembled."""
    torchrun(
        "consolidate_make_checkpoint.py",
        "--strategy",
        strategy,
        "--steps",
        "1",
        "--model",
        json.dumps(BIG.to_json()),
        "--out",
        str(tmp_path),
    )
    ckpt = checkpoint.latest(tmp_path / "run" / "checkpoints")
    metadata = consolidate.CachedMetadataReader(ckpt).metadata
    sizes = [
        md.size.numel() * md.properties.dtype.itemsize
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    ]
    largest = max(sizes)
    assert largest == 4096 * 4096 * 4 and sum(sizes) > 2 * largest
    bound = 0.5 * largest

    ours = peak_rss("ours", ckpt, tmp_path / "ours")
    theirs = peak_rss("dcp_to_torch_save", ckpt, tmp_path / "theirs")

    assert ours < bound, (
        f"ours peaked {ours / 2**20:.0f} MiB over baseline, bound {bound / 2**20:.0f} MiB"
    )
    assert theirs > bound, (
        f"dcp_to_torch_save peaked {theirs / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
    )
    weights = load_file(str(tmp_path / "ours" / "model.safetensors"))
    with torch.device("meta"):
        assert set(weights) == set(instantiate_model(BIG).state_dict())
