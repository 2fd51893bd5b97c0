"""A run directory on an object store (train.output_dir=s3://...), against a real moto_server:
checkpoints published by their marker (no rename there), one owner across hosts through a
conditional-write lease, clear refusals of a bad URL or missing credentials; and a local output_dir
that not every rank sees refused. The torchrun runs on a store (kill -9, resume, consolidate) are in
test_checkpoints.py, beside the local ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import CPU1, REPO, TINY, checkpoint_meta, mlp_spec
from object_store import FaultProxy, free_port, moto_s3
from safetensors.torch import load_file

from pipeline import checkpoint, consolidate
from pipeline.checkpoint import CheckpointError, object_store, run_dir
from pipeline.checkpoint.object_store import StoreUrl
from pipeline.components.build import instantiate_model
from pipeline.config import ConfigError, load_config


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One moto_server for this module's tests (each works under its own prefix)."""
    with moto_s3(log_dir=tmp_path_factory.mktemp("moto")) as s3:
        yield s3


@pytest.fixture
def on_store(store, monkeypatch):
    """This process's AWS_* variables pointed at the store, as a user's shell would be."""
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    return store


def saved(root: StoreUrl, steps, keep_last: int = 3):
    spec = mlp_spec()
    model = instantiate_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        checkpoint.save(
            root, step, model, optimizer, checkpoint_meta(model, spec), CPU1, keep_last=keep_last
        )
    return model, spec


def test_a_checkpoint_on_the_store_counts_only_once_its_marker_matches_what_is_there(
    on_store, tmp_path, monkeypatch
):
    root = StoreUrl(f"{on_store.url}/run/checkpoints")
    model, spec = saved(root, [1, 2])
    prefix = "run/checkpoints/step_00000002/"
    assert {k.removeprefix(prefix) for k in on_store.keys(prefix)} == {
        ".metadata",
        "__0_0.distcp",
        checkpoint.META,
        checkpoint.MARKER,
    }
    marker = json.loads(
        on_store.client().get_object(Bucket=on_store.bucket, Key=prefix + "COMPLETE")["Body"].read()
    )
    assert (
        set(marker["files"])
        == set(marker["sha256"])
        == {".metadata", "__0_0.distcp", checkpoint.META}
    )

    # Loaded back through DCP's FsspecReader: the same tensors.
    again = instantiate_model(spec)
    checkpoint.load(checkpoint.latest(root), again, None, CPU1)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name

    # Consolidated from its s3:// path: fetched into outputs/downloaded/, verified, then the local
    # path.
    monkeypatch.chdir(tmp_path)
    weights = consolidate.main(
        f"{root}/step_00000002", output=tmp_path / "consolidated", log_to_mlflow=False
    )
    assert (
        tmp_path / "outputs" / "downloaded" / "run" / "step_00000002" / "__0_0.distcp"
    ).is_file()
    for name, tensor in load_file(weights).items():
        assert torch.equal(tensor, model.state_dict()[name]), name

    # A shard overwritten with other bytes (another size): not a checkpoint any more, `latest` falls
    # back.
    on_store.client().put_object(
        Bucket=on_store.bucket, Key=prefix + "__0_0.distcp", Body=b"truncated"
    )
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000001"]
    with pytest.raises(CheckpointError, match="__0_0.distcp' has 9 bytes, the marker says"):
        checkpoint.verify_complete(root / "step_00000002")
    # A save cut short before its marker: garbage, passed over, and cleared by the next owner (or
    # the next save of that step).
    on_store.client().delete_object(Bucket=on_store.bucket, Key=prefix + "COMPLETE")
    with pytest.raises(CheckpointError, match="has no COMPLETE marker: the save did not finish"):
        checkpoint.read_meta(root / "step_00000002")
    assert checkpoint.clear_incomplete(root) == ["step_00000002"] and on_store.keys(prefix) == []
    saved(root, [2])
    assert [p.name for p in checkpoint.list_complete(root)] == ["step_00000001", "step_00000002"]


def test_a_checkpoint_pruned_while_it_is_fetched_is_named_and_leaves_no_half_copy(
    on_store, tmp_path, monkeypatch
):
    from pipeline.checkpoint import store as checkpoint_store

    root = StoreUrl(f"{on_store.url}/pruned/checkpoints")
    saved(root, [1])
    listed = object_store.files

    # the training's pruning removes a shard between the listing and its download
    def listed_then_pruned(
        url,
    ):
        names = listed(url)
        object_store.filesystem().rm_file((StoreUrl(url) / "__0_0.distcp").key)
        return names

    monkeypatch.setattr(object_store, "files", listed_then_pruned)
    with pytest.raises(
        CheckpointError, match="was removed while it was being fetched: .* fetch again"
    ):
        checkpoint_store.fetch_checkpoint(root / "step_00000001", tmp_path)
    # neither the step's name nor a staging directory
    assert list((tmp_path / "pruned").iterdir()) == []


def test_a_bad_url_or_a_store_that_cant_be_used_is_refused_with_what_to_do(store, monkeypatch):
    with pytest.raises(
        ConfigError, match="'gs://' is not a supported object store; use s3://<bucket>/<prefix>"
    ):
        load_config(str(TINY), ["train.output_dir=gs://bucket/runs"])
    with pytest.raises(ConfigError, match="'Bad_Bucket' is not a valid bucket name"):
        load_config(str(TINY), ["train.output_dir=s3://Bad_Bucket/runs"])
    assert (
        load_config(str(TINY), [f"train.output_dir={store.url}/runs/"]).train.output_dir
        == f"{store.url}/runs"
    )
    with monkeypatch.context() as without_s3fs:
        # what `import s3fs` meets where it is not installed
        without_s3fs.setitem(sys.modules, "s3fs", None)
        with pytest.raises(
            ConfigError, match=r"needs s3fs, which is not installed: pip install -e '.\[remote\]'"
        ):
            load_config(str(TINY), [f"train.output_dir={store.url}/runs"])

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    with pytest.raises(
        ConfigError, match="no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    ):
        object_store.check_reachable(f"{store.url}/runs")
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ConfigError, match="bucket 'no-such-bucket' does not exist on http://127.0.0.1"
    ):
        object_store.check_reachable("s3://no-such-bucket/runs")
    # and the right one passes
    object_store.check_reachable(f"{store.url}/runs")


OWNER = textwrap.dedent("""
    import sys, time
    from pipeline.checkpoint import run_dir
    run_dir.claim(sys.argv[1])
    print("claimed", flush=True)
    time.sleep(120)
""")


def test_a_store_that_ignores_conditional_writes_is_refused(on_store, monkeypatch):
    """The lease needs If-None-Match honoured: a server that overwrites anyway would let two jobs
    own a run."""
    url = f"{on_store.url}/careless"
    # moto honours it
    object_store.check_reachable(url)
    write = object_store.write_bytes
    monkeypatch.setattr(
        object_store, "write_bytes", lambda target, data, **conditions: write(target, data)
    )
    with pytest.raises(
        ConfigError, match="does not enforce conditional writes .* two jobs could both own a run"
    ):
        object_store.check_reachable(url)
    # the probe object removed
    assert not [k for k in on_store.keys("careless/") if "probe" in k]


def test_one_job_owns_a_run_directory_on_the_store_and_its_own_restart_takes_over(
    on_store, monkeypatch
):
    """Another process (standing for rank 0 of a job on another host) holds the lease; a different
    job is refused with its name, the same job (an elastic restart: same TORCHELASTIC_RUN_ID) takes
    over."""
    url = StoreUrl(f"{on_store.url}/runs/shared")
    env = {**os.environ, **on_store.env, "TORCHELASTIC_RUN_ID": "job-a", "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, url], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout.readline().strip() == "claimed"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        with pytest.raises(
            run_dir.RunDirBusy,
            match=rf"{url} is in use by job job-a: pid {owner.pid} on .* alive \d+ s ago",
        ):
            run_dir.claim(url)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
        previous = run_dir.claim(url)
        assert previous["pid"] == owner.pid and previous["job"] == "job-a"
        record = json.loads(object_store.read_bytes(url / run_dir.OWNER_FILE))
        assert record["pid"] == os.getpid() and record["job"] == "job-a"
    finally:
        owner.kill()
        owner.wait()
        run_dir.release(url)
    # released: the next job claims at once
    assert not (url / run_dir.OWNER_FILE).exists()


def test_a_lease_whose_holder_is_gone_is_taken_over_and_a_race_has_one_winner(
    on_store, monkeypatch
):
    url = StoreUrl(f"{on_store.url}/runs/stale")
    record = url / run_dir.OWNER_FILE
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-new")
    # A live job on another host whose clock is an hour behind: its heartbeat time looks an hour
    # old, but the store wrote its record just now. Judged by the holder's clock it would be taken
    # over; it is busy.
    object_store.write_json(
        record, {"host": "elsewhere", "pid": 1, "job": "job-old", "heartbeat": time.time() - 3600}
    )
    with pytest.raises(
        run_dir.RunDirBusy, match=r"in use by job job-old: pid 1 on elsewhere .*, alive [01] s ago"
    ):
        run_dir.claim(url)
    # Killed outright on another host (its clock an hour ahead): the record is not refreshed for
    # longer than the lease, by the store's clock (Date minus LastModified), whatever heartbeat time
    # it holds.
    lease = run_dir.LEASE_S
    monkeypatch.setattr(run_dir, "LEASE_S", 1.0)
    object_store.write_json(
        record, {"host": "elsewhere", "pid": 1, "job": "job-old", "heartbeat": time.time() + 3600}
    )
    time.sleep(2.2)
    assert run_dir.claim(url)["job"] == "job-old"
    run_dir.release(url)
    monkeypatch.setattr(run_dir, "LEASE_S", lease)
    # Killed outright on this host (kill -9, no release): its pid is gone, so no waiting for the
    # lease.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    object_store.write_json(
        record,
        {
            **run_dir.this_process(),
            "pid": dead.pid,
            "started": "1",
            "job": "job-old",
            "heartbeat": time.time(),
        },
    )
    assert run_dir.claim(url)["pid"] == dead.pid
    run_dir.release(url)
    # The holder's heartbeat refreshes its record, and stops writing once another has taken the
    # record over.
    monkeypatch.setattr(run_dir, "HEARTBEAT_S", 0.2)
    run_dir.claim(url)
    first = json.loads(object_store.read_bytes(record))["heartbeat"]
    time.sleep(1.0)
    assert json.loads(object_store.read_bytes(record))["heartbeat"] > first
    object_store.write_json(
        record, {"host": "elsewhere", "pid": 1, "job": "job-thief", "heartbeat": time.time()}
    )
    time.sleep(1.0)
    assert json.loads(object_store.read_bytes(record))["job"] == "job-thief"
    # ... and this process writes nothing there any more: a save (which would prune the thief's
    # checkpoints) stops.
    with pytest.raises(
        run_dir.RunDirBusy, match=rf"{url} was taken over by job job-thief .* stops writing there"
    ):
        saved(url / "checkpoints", [1])
    assert not object_store.exists(url / "checkpoints")
    run_dir.release(url)
    # not ours to remove any more
    assert json.loads(object_store.read_bytes(record))["job"] == "job-thief"
    record.unlink()
    # The conditional writes themselves: of two creates one wins, and an overwrite needs the ETag
    # read.
    object_store.write_bytes(record, b"{}", mode="create")
    with pytest.raises(FileExistsError):
        object_store.write_bytes(record, b"{}", mode="create")
    tag = object_store.etag(record)
    object_store.write_bytes(record, b'{"first": 1}', IfMatch=tag)
    with pytest.raises(OSError):
        object_store.write_bytes(record, b'{"second": 1}', IfMatch=tag)
    # ... and the delete a release makes: only of the record it last wrote (a takeover's record
    # stays).
    assert not object_store.remove_if_unchanged(record, tag) and object_store.exists(record)
    assert object_store.remove_if_unchanged(
        record, object_store.etag(record)
    ) and not object_store.exists(record)


def test_a_write_the_store_applied_but_answered_500_leaves_the_lease_ours(on_store, monkeypatch):
    """The review's F5: one heartbeat PUT that reached the store but was answered 500 (botocore's
    retry, with the old ETag, then got 412) left the lease with an ETag that was no longer the
    record's: every later heartbeat was refused, the job stopped itself, its release left the record
    behind; the same fault on the first create made the process refuse itself. The record's nonce
    now tells our own write from a take-over."""
    monkeypatch.setattr(run_dir, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(run_dir, "LEASE_S", 1.5)
    with FaultProxy(on_store.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        url = StoreUrl(f"{on_store.url}/runs/flaky-heartbeat")
        record = url / run_dir.OWNER_FILE
        run_dir.claim(url)
        time.sleep(0.5)
        # the next heartbeat is applied, then answered 500
        proxy.arm()
        # longer than LEASE_S - HEARTBEAT_S: a lease that lost its ETag would have stopped the job
        time.sleep(2.0)
        assert proxy.faults == 1
        # still ours
        run_dir.check_still_owned(url)
        assert json.loads(object_store.read_bytes(record))["pid"] == os.getpid()
        run_dir.release(url)
        # released: nothing left behind
        assert not object_store.exists(record)

        url = StoreUrl(f"{on_store.url}/runs/flaky-claim")
        # the first create is applied, then answered 500
        proxy.arm()
        # not "in use by pid <its own>"
        assert run_dir.claim(url) is None
        assert proxy.faults == 2
        run_dir.check_still_owned(url)
        run_dir.release(url)
        assert not object_store.exists(url / run_dir.OWNER_FILE)


@pytest.mark.slow
def test_two_hosts_that_share_no_disk_are_refused_a_local_output_dir(tmp_path):
    """The issue's repro, without namespaces: two torchrun agents (--nnodes 2, c10d on loopback),
    each in its own working directory, so the relative train.output_dir is a different directory for
    each "host". Before, rank 0's checkpoints held only its own shard; now both stop at start,
    saying to use an object store."""
    port = free_port("127.0.0.1")
    procs = []
    for node in (0, 1):
        home = tmp_path / f"host{node}"
        home.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "noshare",
            "-m",
            "pipeline.train",
            "--config",
            str(TINY),
            "train.run_name=noshare",
            "train.max_steps=2",
            "checkpoint.log_to_mlflow=all",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=home,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=240)[0])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    assert all(proc.returncode != 0 for proc in procs), outputs
    text = "\n".join(outputs)
    assert "train.output_dir=outputs is not shared by every rank: rank 1 on" in text, text[-3000:]
    assert "train.output_dir=s3://<bucket>/<prefix>" in text
    # nothing trained
    assert not list((tmp_path / "host0" / "outputs" / "noshare").glob("checkpoints/step_*"))
