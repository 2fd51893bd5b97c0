"""Sharded DCP checkpoints: exact resume after a kill -9 mid-save, crashes mid-save, and clear
refusals of checkpoints that can't be used. FSDP2's shards and a resume on another world size launch
in tests/launches.py (rows fsdp, fsdp_on_one, ddp_on_one); a kill -9 between saves under every mesh,
one MLflow run across the restart with each step logged once, in tests/test_exact_resume.py."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CPU1,
    TINY,
    checkpoint_meta,
    mlflow_client,
    mlp_spec,
    model_from_checkpoint,
    run_cli,
)

from pipeline import checkpoint
from pipeline.checkpoint import CheckpointError
from pipeline.checkpoint import store as checkpoint_store
from pipeline.components.build import instantiate_model
from serving import lineage

STEPS = [
    "train.max_steps=16",
    "checkpoint.every_n_steps=6",
    "checkpoint.keep_last=3",
    "train.log_every=1",
    "train.eval_every=0",
]
MLP = ["model.name=mlp", "model.args={hidden: [64]}"]


def weights(ckpt):
    return model_from_checkpoint(ckpt).state_dict()


def final(workdir, name):
    return checkpoint.latest(workdir / "outputs" / name / "checkpoints")


def losses(workdir, run_name):
    client = mlflow_client(workdir)
    run = client.search_runs(
        [client.get_experiment_by_name("tiny").experiment_id],
        filter_string=f"attributes.run_name = '{run_name}'",
    )[0]
    by_step: dict[int, set[float]] = {}
    for m in client.get_metric_history(run.info.run_id, "train/loss"):
        by_step.setdefault(m.step, set()).add(m.value)
    return run, by_step


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (
            f"{k} differs: max |diff| {(a[k].double() - b[k].double()).abs().max()}"
        )


def torchrun(workdir, args, env=None, max_restarts=0):
    return run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "--nproc-per-node",
            "2",
            f"--max-restarts={max_restarts}",
            *args,
        ],
        cwd=workdir,
        env=env,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 2-process DDP run straight through: 16 steps, checkpoints at 6, 12, 16."""
    workdir = tmp_path_factory.mktemp("ckpt")
    torchrun(workdir, [*STEPS, "train.run_name=straight"])
    return workdir


@pytest.mark.slow
def test_kill_9_mid_save_resumes_exactly_from_an_object_store_and_consolidates_from_there(
    straight, tmp_path, monkeypatch
):
    """The runs above with train.output_dir on an S3-compatible store (a real moto_server), saves
    asynchronous, rank 0 killed after every shard of step 12 is on the store but before its marker:
    the restarted job (the same job: it takes the run's lease over) drops that marker-less step,
    resumes from step 6 bit-exact, and `consolidate --run-id` finds the checkpoints through the
    run's record of where they live."""
    from object_store import moto_s3
    from safetensors.torch import load_file

    from pipeline.checkpoint.object_store import StoreUrl
    from pipeline.checkpoint.store import fetch_checkpoint

    workdir = straight
    with moto_s3(log_dir=tmp_path) as store:
        for name, value in store.env.items():
            monkeypatch.setenv(name, value)
        proc = torchrun(
            workdir,
            [
                *STEPS,
                "train.run_name=killed_s3",
                f"train.output_dir={store.url}/runs",
                "checkpoint.async_save=true",
            ],
            env={**store.env, "TRAINSERVE_FAULT": "save:12:0"},
            max_restarts=1,
        )
        root = StoreUrl(f"{store.url}/runs/killed_s3/checkpoints")
        assert "SIGKILL to rank 0 at save 12" in proc.stderr and "torchrun restart 1" in proc.stderr
        assert (
            "taking over s3://trainserve/runs/killed_s3" in proc.stderr
            and "a restart of the same job" in proc.stderr
        )
        assert f"removed incomplete checkpoints step_00000012 from {root}" in proc.stderr, (
            proc.stderr[-3000:]
        )
        assert f"resumed from {root}/step_00000006" in proc.stderr, proc.stderr[-3000:]
        assert [p.name for p in checkpoint.list_complete(root)] == [
            "step_00000006",
            "step_00000012",
            "step_00000016",
        ]
        assert {
            k.rsplit("/", 1)[1] for k in store.keys("runs/killed_s3/checkpoints/step_00000016/")
        } == {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainserve.json", "COMPLETE"}
        # the lease released
        assert not [k for k in store.keys("runs/killed_s3/") if k.endswith("/.owner")]
        assert not (workdir / "outputs" / "killed_s3").exists() and not (workdir / "s3:").exists()

        fetched = fetch_checkpoint(root / "step_00000016", tmp_path / "fetched")
        assert_bitwise_equal(weights(final(workdir, "straight")), weights(fetched))
        run_b, loss_b = losses(workdir, "killed_s3")
        assert run_b.info.status == "FINISHED" and sorted(loss_b) == list(range(1, 17))
        assert run_b.data.tags[lineage.LATEST] == "step_00000016"

        consolidated = run_cli(
            ["consolidate", "--run-id", run_b.info.run_id], cwd=workdir, env=store.env
        )
        tensors = load_file(workdir / consolidated.stdout.strip().splitlines()[-1])
        assert_bitwise_equal(
            weights(final(workdir, "straight")), {k: tensors[k] for k in weights(fetched)}
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "save, fault",
    [
        # every shard written, before the marker and the rename
        ("sync", "save:12:0"),
        # the background writes done on every rank, before the publish
        ("async", "save:12:0"),
        # one rank's background write in flight
        ("async", "save_started:12:1"),
    ],
)
def test_crash_in_the_middle_of_a_checkpoint_write_keeps_the_previous_one(straight, save, fault):
    workdir, name = straight, f"crash_{save}_{fault.split(':')[0]}"
    proc = torchrun(
        workdir,
        [*STEPS, f"train.run_name={name}", f"checkpoint.async_save={save == 'async'}"],
        env={"TRAINSERVE_FAULT": fault},
        max_restarts=1,
    )
    where, step, rank = fault.split(":")
    assert f"SIGKILL to rank {rank} at {where} {step}" in proc.stderr, proc.stderr[-3000:]
    # not the half-written 12
    assert "resumed from" in proc.stderr and "step_00000006" in proc.stderr
    # The asynchronous saves hold exactly what the synchronous ones do, and resume from them is
    # bit-exact.
    assert_bitwise_equal(weights(final(workdir, "straight")), weights(final(workdir, name)))
    assert sorted(
        p.name for p in checkpoint.list_complete(workdir / "outputs" / name / "checkpoints")
    ) == ["step_00000006", "step_00000012", "step_00000016"]


# --- refusals, in one process -----------------------------------------------------------------

SPEC = mlp_spec()


def save_one(root, step, spec=SPEC):
    model = instantiate_model(spec)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.rand(2, 1, 8, 8)).sum().backward()
    opt.step()
    return checkpoint.save(root, step, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=5)


def test_latest_skips_incomplete_and_load_refuses_broken_checkpoints(tmp_path):
    good = save_one(tmp_path, 1)
    newer = save_one(tmp_path, 2)
    # as if the save never finished
    (newer / checkpoint.MARKER).unlink()
    assert checkpoint.latest(tmp_path) == good
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        checkpoint.verify_complete(newer)
    shard = next(good.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"file '{shard.name}' has .* bytes, the marker says"):
        checkpoint.load(good, instantiate_model(SPEC), None, CPU1)
    assert checkpoint.latest(tmp_path) is None


@pytest.mark.parametrize("marker", ["{}", "[]", '{"files": ["a"]}', '{"files": {"a": "12"}}'])
def test_a_marker_of_another_shape_is_a_broken_checkpoint_not_a_crash(tmp_path, marker):
    good = save_one(tmp_path, 1)
    newer = save_one(tmp_path, 2)
    # valid JSON, not a listing: written by someone else
    (newer / checkpoint.MARKER).write_text(marker)
    with pytest.raises(CheckpointError, match="marker is not a listing of files and sizes"):
        checkpoint.verify_complete(newer)
    assert checkpoint.latest(tmp_path) == good


def test_missing_metadata_and_missing_directory_are_named(tmp_path):
    ckpt = save_one(tmp_path, 1)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="file '.metadata' is missing"):
        checkpoint.verify_complete(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.verify_complete(tmp_path / "nope")


def test_checkpoint_of_another_model_lists_keys_and_shapes(tmp_path):
    ckpt = save_one(tmp_path, 1)
    other = instantiate_model(mlp_spec(hidden=[32, 8]))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(ckpt, other, None, CPU1)
    msg = str(err.value)
    assert "shape differs: body.0.weight checkpoint [16, 64] vs model [32, 64]" in msg
    assert "missing in checkpoint: body.2.weight [8, 32]" in msg


def test_resume_from_an_mlflow_run_id_downloads_its_newest_checkpoint(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # not an experiment id another test left active in this process
    mlflow.set_experiment("resume")
    ckpt = save_one(tmp_path / "run/checkpoints", 4)
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(ckpt), f"checkpoints/{ckpt.name}")
    found = checkpoint_store.resolve_resume(run.info.run_id, tmp_path / "new/checkpoints", CPU1)
    assert found.name == "step_00000004" and found != ckpt
    checkpoint.load(found, instantiate_model(SPEC), None, CPU1)
    with pytest.raises(
        CheckpointError, match="not 'latest', an existing path, nor an MLflow run id"
    ):
        checkpoint_store.resolve_resume("no-such-thing", tmp_path, CPU1)


@pytest.mark.slow
def test_log_to_mlflow_all_uploads_every_checkpoint_in_the_background_despite_pruning(tmp_path):
    """keep_last=1 deletes each checkpoint as the next one lands, while it may still be
    uploading."""
    import json

    from conftest import only_run, run_lineage

    torchrun(
        tmp_path,
        [
            "train.max_steps=12",
            "checkpoint.every_n_steps=4",
            "checkpoint.keep_last=1",
            "checkpoint.log_to_mlflow=all",
            "train.run_name=all",
        ],
    )
    run_dir = tmp_path / "outputs" / "all"
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())["step"]
    # keep_last=1 keeps the newest, and the best (saved when it was reached, never pruned).
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == sorted(
        {f"step_{best:08d}", "step_00000012"}
    )
    assert not (run_dir / "checkpoints-uploading").exists()
    client, run = only_run(tmp_path, "tiny")
    assert run_lineage(run.info.run_id, client)["training"]["checkpoint_upload_failures"] == []
    uploaded = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert uploaded == [f"checkpoints/step_{s:08d}" for s in sorted({4, best, 8, 12})]
    # each upload is whole: the sizes its marker records
    for step_dir in uploaded:
        local = client.download_artifacts(run.info.run_id, step_dir, str(tmp_path / "dl"))
        checkpoint.verify_complete(local)

    # An upload cut short (no marker) is passed over for the newest complete one.
    partial = tmp_path / "step_00000099"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"half")
    client.log_artifacts(run.info.run_id, str(partial), "checkpoints/step_00000099")
    proc = run_cli(["consolidate", "--run-id", run.info.run_id, "--latest"], cwd=tmp_path)
    assert (
        "checkpoints/step_00000099 was not uploaded completely; using checkpoints/step_00000012"
        in proc.stderr
    )
    weights = tmp_path / proc.stdout.strip().splitlines()[-1]
    assert json.loads((weights.parent / "model.json").read_text())["source"]["step"] == 12
    # the best, by default
    proc = run_cli(["consolidate", "--run-id", run.info.run_id], cwd=tmp_path)
    assert f"downloading checkpoints/step_{best:08d} (the best)" in proc.stderr
    assert json.loads((weights.parent / "model.json").read_text())["source"]["step"] == best


def test_a_background_upload_survives_its_checkpoint_being_pruned_and_reports_failures(tmp_path):
    import shutil

    from pipeline.checkpoint.uploads import BackgroundUploads

    client = mlflow_client(tmp_path)
    run_id = client.create_run(
        client.create_experiment("uploads", str(tmp_path / "artifacts"))
    ).info.run_id
    ckpt = save_one(tmp_path / "run/checkpoints", 4)
    uploads = BackgroundUploads(run_id, tmp_path / "run/checkpoints-uploading")
    uploads.submit(ckpt)
    # pruned by keep_last the moment the next checkpoint lands
    shutil.rmtree(ckpt)
    assert uploads.finish() == {}
    local = client.download_artifacts(run_id, "checkpoints/step_00000004", str(tmp_path / "dl"))
    checkpoint.verify_complete(local)
    assert not (tmp_path / "run/checkpoints-uploading").exists()

    # a run the store lacks
    to_nowhere = BackgroundUploads("0" * 32, tmp_path / "run/checkpoints-uploading")
    to_nowhere.submit(save_one(tmp_path / "run/checkpoints", 8))
    failed = to_nowhere.finish()
    assert list(failed) == ["step_00000008"] and "0" * 32 in failed["step_00000008"]
