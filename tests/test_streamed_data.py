"""Sharded, streamed training data (pipeline/shards/, data.name=sharded) through the real stages:
`pipeline data shard` writes the digits as Parquet shards, torchrun trains from them with 2 ranks x
2 loader workers, a kill -9 mid-epoch resumes to byte-identical weights, a resume at another world
size trains every sample of the epoch exactly once (counted from the ids each rank trained on:
TRAINSERVE_SAMPLE_LOG), and `pipeline run` trains, exports, registers, serves and verifies a model
from shards on an S3 store (moto_server)."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch
from conftest import REPO, TINY, model_from_checkpoint, run_cli
from object_store import moto_s3

from pipeline import checkpoint
from pipeline.shards import format as shard_format
from pipeline.shards.stream import epoch_order

# 1,438 training samples: 5 shards of 6 row groups
ROWS = [
    "--rows-per-shard",
    "300",
    "--rows-per-group",
    "50",
]
# 44 steps of the global batch of 32 (drop_last)
EPOCH_STEPS = 1438 // 32
STREAM = [
    "data.name=sharded",
    "data.num_workers=2",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every_n_steps=10",
    "checkpoint.keep_last=5",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "digits"
    proc = run_cli(
        ["data", "shard", "--config", str(TINY), "--out", str(out), *ROWS], cwd=out.parent
    )
    assert "train 1438 samples in 5 shards (29 row groups)" in proc.stdout, proc.stdout
    assert f"data.name=sharded 'data.args={{root: {out}}}'" in proc.stdout
    return out


def train(
    workdir, shards, name, nproc, steps, *extra, env=None, resume=None, restarts=0, check=True
):
    args = [
        "train",
        "--config",
        str(TINY),
        "--nproc-per-node",
        str(nproc),
        f"--max-restarts={restarts}",
        *(["--resume", resume] if resume else []),
        *STREAM,
        f"data.args.root={shards}",
        f"train.max_steps={steps}",
        f"train.run_name={name}",
        *extra,
    ]
    return run_cli(args, cwd=workdir, env=env, check=check)


def trained_ids(log) -> dict[tuple[int, int], list[int]]:
    """{(epoch, micro-batch k): the sample ids of every rank, rank order} from a sample log, the
    last record of each (epoch, k, rank) winning: a restart replays the steps after its
    checkpoint."""
    last: dict[tuple[int, int, int], dict] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        last[(record["epoch"], record["k"], record["rank"])] = record
    out: dict[tuple[int, int], list[int]] = {}
    for epoch, k, rank in sorted(last):
        out.setdefault((epoch, k), []).extend(last[(epoch, k, rank)]["ids"])
    return out


def final_weights(workdir, name):
    return model_from_checkpoint(
        checkpoint.latest(workdir / "outputs" / name / "checkpoints")
    ).state_dict()


@pytest.fixture(scope="module")
def straight(shards, tmp_path_factory):
    """30 steps of 2 ranks x 2 loader workers from the shards, uninterrupted, and the ids each rank
    trained on: the reference of the kill below, and the first leg of the elastic resume."""
    workdir = tmp_path_factory.mktemp("stream")
    log = workdir / "straight.jsonl"
    train(workdir, shards, "straight", 2, 30, env={"TRAINSERVE_SAMPLE_LOG": str(log)})
    return workdir, log


@pytest.mark.slow
def test_kill_9_mid_epoch_resumes_a_stream_of_2_ranks_x_2_workers_to_byte_identical_weights(
    shards, straight
):
    workdir, straight_log = straight
    killed_log = workdir / "killed.jsonl"
    proc = train(
        workdir,
        shards,
        "killed",
        2,
        30,
        restarts=1,
        env={"TRAINSERVE_FAULT": "step:17:1", "TRAINSERVE_SAMPLE_LOG": str(killed_log)},
    )
    assert "SIGKILL to rank 1 at step 17" in proc.stderr and "torchrun restart 1" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000010" in proc.stderr
    assert "the stream resumes at epoch 0, sample 320 of 1438" in proc.stderr

    a, b = final_weights(workdir, "straight"), final_weights(workdir, "killed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The same samples in the same micro-batches, the replayed ones (steps 11-17) included.
    straight_ids, killed_ids = trained_ids(straight_log), trained_ids(killed_log)
    assert straight_ids == killed_ids and len(straight_ids) == 30
    assert collections.Counter(map(len, straight_ids.values())) == {32: 30}


@pytest.mark.slow
def test_a_resume_at_another_world_size_trains_every_sample_of_the_epoch_exactly_once(
    shards, straight, tmp_path
):
    """2 ranks (the straight run's step-10 checkpoint) -> 1 rank, killed at step 25 (checkpoint 20)
    -> 2 ranks to the epoch's end: the ids trained on, counted, are the epoch's first 44 x 32
    positions, each once."""
    workdir, straight_log = straight
    logs = [straight_log, tmp_path / "leg1.jsonl", tmp_path / "leg2.jsonl"]
    second = train(
        workdir,
        shards,
        "elastic",
        1,
        60,
        resume=str(workdir / "outputs/straight/checkpoints/step_00000010"),
        check=False,
        env={"TRAINSERVE_FAULT": "step:25:0", "TRAINSERVE_SAMPLE_LOG": str(logs[1])},
    )
    assert "the stream resumes at epoch 0, sample 320 of 1438" in second.stderr, second.stderr[
        -3000:
    ]
    assert second.returncode != 0 and "SIGKILL to rank 0 at step 25" in second.stderr
    third = train(
        workdir,
        shards,
        "elastic",
        2,
        EPOCH_STEPS,
        resume="latest",
        env={"TRAINSERVE_SAMPLE_LOG": str(logs[2])},
    )
    assert "the stream resumes at epoch 0, sample 640 of 1438" in third.stderr

    legs = [trained_ids(log) for log in logs]
    # Each leg's steps up to the checkpoint the next one resumed from: 0-9 at 2 ranks, 10-19 at 1,
    # 20-43 at 2.
    epoch = {
        **{k: v for k, v in legs[0].items() if k[1] < 10},
        **{k: v for k, v in legs[1].items() if k[1] < 20},
        **legs[2],
    }
    assert sorted(k for _, k in epoch) == list(range(EPOCH_STEPS))
    # one rank took the whole micro-batch
    assert {len(r) for (_, k), r in legs[1].items()} == {32}
    ids = [i for k in sorted(epoch) for i in epoch[k]]
    assert len(ids) == len(set(ids)) == EPOCH_STEPS * 32, "a sample lost or repeated"
    # ... and exactly the epoch's first 1,408 positions of the seeded order, in it.
    order = epoch_order(shard_format.read_manifest(shards / "train"), 0, 0)
    expected = [int(s) for s, _ in _ids_in_order(order, EPOCH_STEPS * 32)]
    assert ids == expected


def _ids_in_order(order, count):
    from pipeline.shards.stream import _GroupCache

    cache = _GroupCache(order.manifest)
    try:
        return order.read(cache, 0, count)
    finally:
        cache.close()


@pytest.mark.slow
def test_pipeline_run_trains_from_shards_on_s3_exports_registers_serves_and_verifies(tmp_path):
    with moto_s3(log_dir=tmp_path) as store:
        env = store.env
        root = f"{store.url}/data/digits"
        wrote = run_cli(
            ["data", "shard", "--config", str(TINY), "--out", root, *ROWS], cwd=tmp_path, env=env
        )
        digest = json.loads(
            store.client()
            .get_object(Bucket=store.bucket, Key="data/digits/train/manifest.json")["Body"]
            .read()
        )["digest"]
        assert f"manifest sha256 {digest[:16]}" in wrote.stdout
        proc = run_cli(
            [
                "run",
                "--config",
                str(TINY),
                "--nproc-per-node",
                "2",
                "--serve-check",
                "serve.port=0",
                "data.name=sharded",
                f"data.args.root={root}",
                "data.num_workers=2",
                "train.max_steps=60",
                "train.eval_every=20",
                "train.run_name=from-s3",
            ],
            cwd=tmp_path,
            env=env,
            timeout=900,
        )
        # Served: the sample request's answer, a real validation sample through the started server.
        assert (
            "from the validation split -> predicted" in proc.stdout and ", correct" in proc.stdout
        ), proc.stdout
        # The run's MLflow inputs are the manifests: their digests, and where they are.
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
        client = mlflow.MlflowClient()
        version = client.get_model_version_by_alias("resnet18-sharded", "champion")
        run = client.get_run(version.run_id)
        inputs = {
            next(t.value for t in i.tags if t.key == "mlflow.data.context"): i
            for i in run.inputs.dataset_inputs
        }
        assert inputs["training"].dataset.digest == digest[:32]
        assert (
            json.loads(inputs["training"].dataset.source)["tags"]["manifest"]
            == f"{root}/train/manifest.json"
        )
        assert json.loads(inputs["training"].dataset.profile)["targets"]["classes"]["0"] > 0

        verified = run_cli(
            ["verify", "models:/resnet18-sharded@champion"], cwd=tmp_path, env=env, check=False
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert (
            "train manifest s3://trainserve/data/digits/train/manifest.json has the digest trained on, and its 5 "
            "shards are there at the sizes it names" in verified.stdout
        ), verified.stdout

        # A manifest rewritten under the run (another split at the same place): verify names it.
        run_cli(
            ["data", "shard", "--config", str(TINY), "--out", root, "--rows-per-shard", "400"],
            cwd=tmp_path,
            env=env,
        )
        changed = run_cli(
            ["verify", "models:/resnet18-sharded@champion"], cwd=tmp_path, env=env, check=False
        )
        assert changed.returncode != 0
        assert (
            "train manifest s3://trainserve/data/digits/train/manifest.json now has digest"
            in changed.stdout
        )


def test_the_epoch_order_is_a_function_of_seed_and_epoch_alone_and_covers_every_sample(shards):
    manifest = shard_format.read_manifest(shards / "train")
    a, b, other = (
        epoch_order(manifest, 0, 1),
        epoch_order(manifest, 0, 1),
        epoch_order(manifest, 0, 2),
    )
    assert a.blocks == b.blocks and a.blocks != other.blocks
    ids = [i for i, _ in _ids_in_order(a, manifest.rows)]
    assert sorted(ids) == list(range(manifest.rows))
    assert ids != sorted(ids)
    assert os.path.basename(manifest.location) == "train"


@pytest.mark.slow
def test_a_folder_of_image_files_becomes_shards_and_trains(tmp_path):
    """Photos as they usually come, one sub-folder a class: read by pipeline.datasets:image_folder,
    written as shards, trained from as a stream."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:300], digits.target[:300])):
        (tmp_path / "photos" / f"digit-{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 16).astype(np.uint8)).resize((20, 20)).save(
            tmp_path / "photos" / f"digit-{label}" / f"{i}.png"
        )
    (tmp_path / "photos" / "digit-3" / "notes.txt").write_text("not an image: skipped")
    folder = [
        "data.component=pipeline.datasets:image_folder",
        f"data.args={{root: {tmp_path / 'photos'}, image_size: 12, mode: L}}",
    ]
    wrote = run_cli(
        ["data", "shard", "--config", str(TINY), "--out", str(tmp_path / "shards"), *folder],
        cwd=tmp_path,
    )
    assert "train 240 samples in 1 shards" in wrote.stdout and "val   60 samples" in wrote.stdout
    manifest = shard_format.read_manifest(tmp_path / "shards" / "train")
    assert manifest.classes == [f"digit-{d}" for d in range(10)]
    assert manifest.columns[0].shape == (1, 12, 12) and manifest.model_args["image_size"] == 12
    assert sum(manifest.targets["classes"].values()) == 240

    proc = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "data.name=sharded",
            f"data.args={{root: {tmp_path / 'shards'}}}",
            "train.max_steps=8",
            "train.run_name=photos",
        ],
        cwd=tmp_path,
    )
    assert "step 8: val accuracy" in proc.stderr

    broken = run_cli(
        [
            "data",
            "shard",
            "--config",
            str(TINY),
            "--out",
            str(tmp_path / "none"),
            "data.component=pipeline.datasets:image_folder",
            f"data.args={{root: {tmp_path / 'nowhere'}}}",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert (
        broken.returncode == 2
        and "is not a directory; give a folder with one sub-folder per class" in broken.stderr
    )


def test_loader_workers_live_across_epochs_and_read_each_epochs_own_order(
    shards, tmp_path, monkeypatch
):
    """The workers are forked once (persistent); each epoch's order and start reach them through
    shared memory: epoch 1 after a whole epoch 0, and a resume into the middle of epoch 1, yield
    what the order says."""
    from pipeline.datasets import sharded
    from pipeline.shards.stream import StreamLoader, _GroupCache

    log = tmp_path / "ids.jsonl"
    monkeypatch.setenv("TRAINSERVE_SAMPLE_LOG", str(log))
    stream = sharded(root=str(shards))["train"]
    loader = StreamLoader(stream, 32, 0, 1, 7, 2, False)
    manifest = shard_format.read_manifest(shards / "train")

    def expected(epoch, first, count):
        cache = _GroupCache(manifest)
        try:
            return [i for i, _ in epoch_order(manifest, 7, epoch).read(cache, first, first + count)]
        finally:
            cache.close()

    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == EPOCH_STEPS and all(len(b[1]) == 32 for b in batches)
    resumed = StreamLoader(stream, 32, 0, 1, 7, 2, False)
    resumed.load_state_dict({**loader.state_dict(), "epoch": 1, "position": 20 * 32})
    resumed.set_epoch(1)
    assert len(list(resumed)) == EPOCH_STEPS - 20

    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_epoch = collections.defaultdict(list)
    for r in records[: 2 * EPOCH_STEPS]:
        by_epoch[r["epoch"]].extend(r["ids"])
    assert by_epoch[0] == expected(0, 0, EPOCH_STEPS * 32) and by_epoch[1] == expected(
        1, 0, EPOCH_STEPS * 32
    )
    assert [i for r in records[2 * EPOCH_STEPS :] for i in r["ids"]] == expected(
        1, 20 * 32, (EPOCH_STEPS - 20) * 32
    )


# --- a stream of the data component's own (examples/digit_stream: Stateful, deals itself by rank) --------------

OWN = [
    "data.component=examples.digit_stream.data:digit_stream",
    "data.num_workers=2",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every_n_steps=10",
    "checkpoint.keep_last=5",
]
ON_PATH = {"PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_a_stateful_stream_of_its_own_resumes_exactly_after_kill_9_and_only_at_its_world_size(
    tmp_path,
):
    def own(name, *extra, nproc=2, env=None, check=True, restarts=0):
        return run_cli(
            [
                "train",
                "--config",
                str(TINY),
                "--nproc-per-node",
                str(nproc),
                f"--max-restarts={restarts}",
                *OWN,
                "train.max_steps=30",
                f"train.run_name={name}",
                *extra,
            ],
            cwd=tmp_path,
            env={**ON_PATH, **(env or {})},
            check=check,
        )

    own("straight")
    proc = own("killed", env={"TRAINSERVE_FAULT": "step:17:0"}, restarts=1)
    assert "SIGKILL to rank 0 at step 17" in proc.stderr and "torchrun restart 1" in proc.stderr
    assert "the stream of your own resumes at epoch 0 where rank 1 stopped" in proc.stderr
    a, b = final_weights(tmp_path, "straight"), final_weights(tmp_path, "killed")
    for key in a:
        assert torch.equal(a[key], b[key]), key

    ckpt = tmp_path / "outputs" / "killed" / "checkpoints" / "step_00000010"
    other = own("on_one", "--resume", str(ckpt), nproc=1, check=False)
    assert other.returncode != 0
    assert (
        "the checkpoint holds the positions of a stream of your own on 2 ranks x 2 loader workers; this run has "
        "1 x 2"
    ) in other.stderr and "--nproc-per-node 2 data.num_workers=2" in other.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["data.args.stateful=false"],
            "is an IterableDataset without state_dict()/load_state_dict(): a resume could only "
            "read its batches again and skip them",
        ),
        (
            ["data.args.sized=false", "train.max_steps=0"],
            "a stream of the data component's own without len(): its "
            "epochs have no known length, so set train.max_steps",
        ),
    ],
)
def test_a_stream_that_cannot_resume_or_has_no_length_is_refused_before_training(
    tmp_path, args, says
):
    proc = run_cli(
        ["train", "--config", str(TINY), "--nproc-per-node", "2", *OWN, *args],
        cwd=tmp_path,
        env=ON_PATH,
        check=False,
    )
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    # the launcher's one line, before any rank starts
    assert "[rank" not in proc.stderr


def test_the_data_check_reads_a_stream_of_its_own_without_moving_it(monkeypatch):
    """check_splits reads a stream's first items to check them: a queue or cursor must not lose them
    to the check (its state is put back), nor the first epoch start 8 samples in."""
    import sys

    from pipeline.components.build import build_data
    from pipeline.config import load_config

    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    cfg = load_config(str(TINY), ["data.component=examples.digit_stream.data:digit_stream"])
    splits = build_data(cfg.data, cfg.task.name)
    assert splits.train.position == 0
    assert torch.equal(
        next(iter(splits.train))[0],
        splits.train.x[
            torch.randperm(len(splits.train.y), generator=torch.Generator().manual_seed(0))[0]
        ],
    )
