"""A checkpoint save that runs out of disk space: one line that says so, the partial directory gone,
the last complete checkpoint intact, and training's CLI exits 2 with that line, not a 65-line
traceback. A real 1 MiB tmpfs (root only), unmounted afterwards."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU1, TINY, checkpoint_meta, mlp_spec, run_cli, small_tmpfs

from pipeline import checkpoint
from pipeline.checkpoint import CheckpointError
from pipeline.components.build import instantiate_model


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as mount:
        yield mount


def test_a_full_disk_during_a_save_is_one_line_naming_disk_space(small_disk):
    """The review: the run FAILED correctly, but with "unexpected pos 704 vs 598" in a 65-line
    traceback and no word of disk space."""
    root = small_disk / "run" / "checkpoints"
    small = instantiate_model(mlp_spec())
    first = checkpoint.save(
        root,
        1,
        small,
        torch.optim.SGD(small.parameters(), lr=0.1),
        checkpoint_meta(small, mlp_spec()),
        CPU1,
        keep_last=3,
    )
    # ~1.1 MiB of weights: more than the disk holds
    spec = mlp_spec(hidden=(4096,))
    model = instantiate_model(spec)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.save(
            root,
            2,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            checkpoint_meta(model, spec),
            CPU1,
            keep_last=3,
        )
    message = str(caught.value)
    assert (
        "the disk is full" in message
        and "train.output_dir" in message
        and "step_00000001, is intact" in message
    )
    assert "\n" not in message and "unexpected pos" not in message, message
    # the partial .tmp-step_00000002 is gone
    assert [p.name for p in root.iterdir()] == [first.name]
    checkpoint.verify_checksums(first)


@pytest.mark.slow
def test_training_onto_a_full_disk_exits_with_that_line(small_disk, tmp_path):
    result = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "model.name=mlp",
            "model.args={hidden: [4096]}",
            f"train.output_dir={small_disk}",
            "train.run_name=full",
            "train.max_steps=2",
            "train.eval_every=0",
            "tracking.system_metrics=false",
        ],
        cwd=tmp_path,
        check=False,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [
        line for line in result.stderr.splitlines() if line.startswith("pipeline train: error:")
    ]
    assert len(errors) == 1 and "the disk is full" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "unexpected pos" not in result.stderr, (
        result.stderr[-3000:]
    )
