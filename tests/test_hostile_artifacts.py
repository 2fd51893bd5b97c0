"""Artifacts are untrusted input. The review's attack: anyone who can write to the MLflow store
plants a checkpoint whose `.metadata` (or a non-tensor entry) is a pickle that runs a command when
unpickled, with a COMPLETE marker whose sizes and checksums match (the attacker writes those too).
Resume, consolidate and a download by run id must refuse it without running anything."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import CPU1, checkpoint_meta, mlflow_client, mlp_spec

from pipeline import checkpoint, consolidate
from pipeline.checkpoint import CheckpointError, dcp_read
from pipeline.checkpoint import store as checkpoint_store
from pipeline.cli import main as pipeline_cli
from pipeline.components.build import instantiate_model


class Payload:
    """Unpickling this runs `touch <marker>`: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def saved(root: Path, step: int = 1, **optimizer_extra):
    spec = mlp_spec()
    model = instantiate_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0].update(optimizer_extra)
    return checkpoint.save(
        root, step, model, optimizer, checkpoint_meta(model, spec), CPU1, keep_last=5
    ), spec


def as_the_attacker_rewrites(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file and write a COMPLETE marker whose sizes and sha256 match: the checks pass."""
    (ckpt / name).write_bytes(data)
    marker = json.loads((ckpt / checkpoint.MARKER).read_text())
    marker["files"][name] = len(data)
    marker["sha256"][name] = hashlib.sha256(data).hexdigest()
    (ckpt / checkpoint.MARKER).write_text(json.dumps(marker))


@pytest.fixture
def planted(tmp_path):
    ckpt, spec = saved(tmp_path / "run" / "checkpoints")
    ran = tmp_path / "RAN"
    as_the_attacker_rewrites(ckpt, ".metadata", pickle.dumps(Payload(ran)))
    # the marker vouches for the planted file: checksums prove nothing
    checkpoint.verify_checksums(ckpt)
    return ckpt, spec, ran


REFUSED = r"\.metadata refused, nothing in it was run: it names posix.system"


def test_resume_refuses_a_hostile_metadata_without_running_it(planted):
    ckpt, spec, ran = planted
    model = instantiate_model(spec)
    with pytest.raises(CheckpointError, match=REFUSED):
        checkpoint.load(ckpt, model, torch.optim.SGD(model.parameters(), lr=0.1), CPU1)
    assert not ran.exists()


def test_consolidate_refuses_a_hostile_metadata_without_running_it(planted, capsys):
    ckpt, _, ran = planted
    with pytest.raises(CheckpointError, match=REFUSED):
        consolidate.main(ckpt, log_to_mlflow=False)
    assert pipeline_cli(["consolidate", str(ckpt), "--no-log"]) == 2
    assert "nothing in it was run" in capsys.readouterr().err
    assert (
        not ran.exists()
        and not (ckpt.parent.parent / "consolidated" / "model.safetensors").exists()
    )


def test_a_hostile_checkpoint_in_the_store_is_refused_by_run_id(planted, tmp_path, monkeypatch):
    """Planted in a run's artifacts: `consolidate --run-id` and `train --resume <run id>` download
    it (its checksums verify) and refuse it."""
    ckpt, spec, ran = planted
    monkeypatch.chdir(tmp_path)
    client = mlflow_client(tmp_path)
    experiment = client.create_experiment("shared", artifact_location=(tmp_path / "store").as_uri())
    run_id = client.create_run(experiment).info.run_id
    client.log_artifacts(run_id, str(ckpt), f"checkpoints/{ckpt.name}")
    with pytest.raises(CheckpointError, match=REFUSED):
        consolidate.main(run_id=run_id, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = checkpoint_store.resolve_resume(run_id, tmp_path / "new" / "checkpoints", CPU1)
    model = instantiate_model(spec)
    with pytest.raises(CheckpointError, match=REFUSED):
        checkpoint.load(found, model, torch.optim.SGD(model.parameters(), lr=0.1), CPU1)
    assert not ran.exists()


def test_a_hostile_optimizer_entry_is_refused_on_resume(tmp_path):
    """Non-tensor entries (optimizer hyperparameters) are unpickled by DCP with
    weights_only=False."""
    ran = tmp_path / "RAN"
    ckpt, spec = saved(tmp_path / "run" / "checkpoints", evil=Payload(ran))
    model = instantiate_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # the key must be asked for, as a resume with that optimizer would
    optimizer.param_groups[0]["evil"] = 0
    with pytest.raises(
        CheckpointError,
        match=r"entry optim.param_groups.[\w.]+.evil refused, nothing in it was run",
    ):
        checkpoint.load(ckpt, model, optimizer, CPU1)
    assert not ran.exists()
    # and a plain checkpoint still loads, hyperparameters included
    good, _ = saved(tmp_path / "good" / "checkpoints", momentum_note=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    optimizer.param_groups[0]["momentum_note"] = 0.0
    checkpoint.load(good, model, optimizer, CPU1)
    assert (
        optimizer.param_groups[0]["lr"] == 0.1 and optimizer.param_groups[0]["momentum_note"] == 0.5
    )


@pytest.mark.parametrize("escape", ["../", "absolute", "symlink"])
def test_a_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path, escape, capsys):
    """The review's M2: every model tensor's relative_path set to another run's shard (`../...`),
    marker rewritten: the restricted unpickler admits it (DCP types only) and consolidate produced
    the other run's weights byte for byte. Here consolidate and resume refuse it, naming the tensor
    and the path."""
    ckpt, spec = saved(tmp_path / "run" / "checkpoints")
    other, _ = saved(tmp_path / "other" / "checkpoints")
    shard = next(other.glob("*.distcp"))
    if escape == "symlink":
        (ckpt / "link.distcp").symlink_to(shard)
    target = {
        "../": os.path.relpath(shard, ckpt),
        "absolute": str(shard),
        "symlink": "link.distcp",
    }[escape]
    metadata = dcp_read.read_metadata_safely(ckpt)
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            info.relative_path = target
    metadata.storage_meta = None
    as_the_attacker_rewrites(ckpt, ".metadata", pickle.dumps(metadata))
    with pytest.raises(
        CheckpointError, match=r"\.metadata reads 'model\..+' from .+ outside the checkpoint"
    ):
        consolidate.main(ckpt, log_to_mlflow=False)
    assert pipeline_cli(["consolidate", str(ckpt), "--no-log"]) == 2
    assert "outside the checkpoint directory" in capsys.readouterr().err
    model = instantiate_model(spec)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        checkpoint.load(ckpt, model, torch.optim.SGD(model.parameters(), lr=0.1), CPU1)
    assert not (ckpt.parent.parent / "consolidated" / "model.safetensors").exists()
