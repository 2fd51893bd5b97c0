"""The train stage: `pipeline train --config configs/X.yaml [--nproc-per-node N] [key=value ...]`.

Runs on every rank under torchrun (or alone as a world of one). `main(cfg)` reads top to bottom;
the pieces it uses live in their own modules (components/: build, data, tasks, checkpoint, tracking;
distributed/: process group, parallelize, replicas).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import logging
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline import checkpoint, distributed, tracking
from pipeline.checkpoint import object_store
from pipeline.checkpoint import run_dir as run_dir_owner
from pipeline.checkpoint import store as checkpoint_store
from pipeline.checkpoint.saver import Saver, snapshot
from pipeline.checkpoint.uploads import BackgroundUploads
from pipeline.components import amp
from pipeline.components.build import (
    build_data,
    component_references,
    instantiate_model,
    model_spec,
    preflight,
    probe,
    state_manifest,
)
from pipeline.components.code_capture import capture
from pipeline.components.data import (
    EVAL_BATCH,
    DataError,
    Splits,
    eval_loader,
    eval_shard,
    first_batch,
    forward,
    make_train_loader,
    restore_loader,
    set_epoch,
    split_digest,
    to_device,
)
from pipeline.components.monitor import Monitor, build_monitor, sync_best_file, write_best
from pipeline.components.optim import build_optimizer, build_scheduler
from pipeline.components.own_stream import OwnStreamLoader, check_length, has_length
from pipeline.components.reference import model_short_name, short_name
from pipeline.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    TrainConfig,
    check_runtime,
    flatten,
    load_config,
    to_yaml,
)
from pipeline.distributed import DistInfo, gradients, launch, mesh, pipeline_parallel, replicas
from pipeline.distributed.parallelize import uses_channels_last, wrap_model
from pipeline.errors import worker_message
from pipeline.plan import BatchPlan, Degrees, Plan
from pipeline.tasks import build_task
from pipeline.tools import stopping
from pipeline.tools.every import Every
from pipeline.tools.faults import inject_fault
from pipeline.tools.files import StateFileError, read_json, write_atomically, write_json
from serving import lineage

log = logging.getLogger("pipeline.train")


class TrainingDiverged(RuntimeError):
    """The loss went NaN or infinite: nothing more can be learned from this run."""


@dataclass
class TrainResult:
    run_dir: Path
    run_id: str | None
    checkpoint: Path
    losses: list[float] = field(default_factory=list)
    # At the final step
    val_metrics: dict[str, float] = field(default_factory=dict)
    # The monitor's state: best step and value, early stop reason
    best: dict = field(default_factory=dict)


def main(cfg: Config, resume: str | None = None) -> TrainResult:
    plan = check_runtime(
        cfg,
        int(os.environ.get("WORLD_SIZE", 1)),
        torch.cuda.is_available(),
        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )
    previous_sigterm = stopping.exit_on_sigterm()
    info = distributed.setup(cfg.train.device, cfg.train.threads_per_rank)
    distributed.configure_logging(info.rank)
    model, optimizer, scheduler, run_dir = None, None, None, None
    try:
        precision = amp.resolve_precision(cfg.train.precision, info.device)
        run_dir = object_store.location(cfg.train.output_dir) / distributed.broadcast_object(
            default_run_name(cfg), info
        )
        # An object store: every host's credentials and endpoint
        check_reachable_everywhere(run_dir, info)
        # Before anything is written there
        claim_run_dir(run_dir, info)
        # A local directory: every rank writes its shard there, all must see it
        check_shared(run_dir, info)
        ckpt_root = run_dir / "checkpoints"
        # No .tmp- directories on an object store: marker-less ones instead
        if info.is_main and object_store.is_url(ckpt_root):
            checkpoint.clear_incomplete(ckpt_root)
        resume = choose_resume(resume, ckpt_root, distributed.job_restarts(info))
        log.info(
            "world size %d, device %s, precision %s, strategy %s, %d threads, run dir %s",
            info.world_size,
            info.device,
            precision,
            cfg.train.strategy,
            torch.get_num_threads(),
            run_dir,
        )

        # The data, the task and the model, each checked on real samples before training starts.
        # The same seed on every rank: identical initial replicas
        seed_everything(cfg.train.seed)
        splits = build_data(cfg.data, cfg.task.name)
        task = build_task(cfg.task, splits.classes)
        spec, from_data = model_spec(cfg.model, splits, task)
        plain_model = instantiate_model(spec)
        probe(plain_model, splits, task, spec.component)
        # After the probe: it names a custom metric
        monitor = build_monitor(cfg.checkpoint, cfg.train, task)
        manifest = state_manifest(plain_model)
        channels_last = uses_channels_last(cfg.train, info, plain_model)
        if info.device.type == "cuda":
            log.info(
                "channels_last %s (train.channels_last=%s)",
                "on" if channels_last else "off",
                cfg.train.channels_last,
            )

        # The model on the mesh: this rank's pipeline stage, or the whole model wrapped.
        run_mesh = mesh.build(plan.degrees, cfg.train.strategy, info)
        pipe = None
        if plan.degrees.pp > 1:
            pipe = build_pipeline(
                plain_model,
                cfg.train,
                batch=plan.batch,
                splits=splits,
                task=task,
                run_mesh=run_mesh,
                info=info,
                precision=precision,
                channels_last=channels_last,
            )
        model = (
            pipe.module
            if pipe
            else wrap_model(plain_model, cfg.train, precision, info, run_mesh.device)
        )
        # A pipeline stage's rank keeps its own stage only
        plain_model = None
        optimizer = build_optimizer(model.parameters(), cfg.optim)
        # The data is dealt over the data-parallel ranks
        loader = make_train_loader(
            splits.train,
            plan.batch,
            run_mesh.layout.dp_rank,
            cfg.train.seed,
            cfg.data.num_workers,
            pin_memory=info.device.type == "cuda",
            info=info,
        )
        steps_per_epoch = epoch_steps(loader, plan, cfg.train.max_steps)
        total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
        scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
        scaler = amp.grad_scaler(precision, info.device)

        step, epoch, run_id, resumed_rng = 0, 0, read_run_id(run_dir), None
        resume_path = checkpoint_store.resolve_resume(resume, ckpt_root, info) if resume else None
        if resume_path:
            # Before any shape check
            check_same_model(checkpoint.read_meta(resume_path), spec, resume_path)
            meta = checkpoint.load(
                resume_path, model, optimizer, info, held_elsewhere(manifest, model)
            )
            # The generators as the checkpoint left them: the loop's first step starts from them,
            # whatever the setup below draws (a data set's own randomness, read for its digest).
            resumed_rng = checkpoint.rng_state()
            step, epoch = restore_train_state(
                meta, scheduler, scaler, loader, plan.batch.data_parallel
            )
            monitor.restore(meta["train_state"].get("monitor"))
            # Later steps in this run's directory belong to a timeline this resume leaves
            if info.is_main:
                checkpoint.set_aside_after(ckpt_root, step)
                sync_best_file(ckpt_root, monitor)
            distributed.barrier(info)
            run_id = meta.get("mlflow_run_id") or run_id
            log.info("resumed from %s at step %d (epoch %d)", resume_path, step, epoch)
        elif ckpt_root.exists() and checkpoint.latest(ckpt_root):
            raise ConfigError(
                f"{run_dir} already holds checkpoints; resume it with --resume latest, "
                "or start a new run with another train.run_name"
            )

        uploads, code = None, None
        # Which data trained it: a content digest of each split (every rank hashes its share),
        # logged by rank 0 as the run's MLflow datasets.
        digests = {
            split: split_digest(
                getattr(splits, split),
                cfg.data.num_workers,
                info,
                {"component": cfg.data.component, "args": cfg.data.args},
            )
            for split in ("train", "val")
        }
        if info.is_main:
            code = capture(component_references(cfg.model, cfg.data, cfg.task))
            run_id = start_tracking(
                cfg,
                run_dir,
                run_id,
                info,
                setup_words(info, cfg.train.strategy, plan.degrees, precision),
                spec,
                from_data,
                code,
                replaying=resume == "auto",
            )
            tracking.log_datasets(
                cfg.data.component, cfg.data.args, digests, [s.to_json() for s in splits.inputs]
            )
            if cfg.checkpoint.log_to_mlflow == "all" and not object_store.is_url(run_dir):
                uploads = BackgroundUploads(run_id, run_dir / "checkpoints-uploading")
        # What every checkpoint says about itself: enough to rebuild and check the model elsewhere.
        meta = {
            "config": cfg.model_dump(mode="json"),
            "model": spec.to_json(),
            "data": {"component": cfg.data.component, "args": cfg.data.args, "digests": digests},
            "task": task.facts(),
            "labels": task.facts().get("labels"),
            "inputs": [s.to_json() for s in splits.inputs],
            "single_input": splits.single_input,
            "model_state": manifest,
            "code": code.describe() if code else None,
            "strategy": cfg.train.strategy,
            "precision": precision,
            "mlflow_run_id": run_id,
        }

        learner = Learner(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            device=info.device,
            precision=precision,
            loss_fn=task.loss,
            clip_grad_norm=cfg.train.clip_grad_norm,
            channels_last=channels_last,
            pipe=pipe,
        )
        run = Training(
            learner=learner,
            scheduler=scheduler,
            loader=loader,
            splits=splits,
            task=task,
            monitor=monitor,
            info=info,
            batch=plan.batch,
            mesh=run_mesh,
            ckpt_root=ckpt_root,
            meta=meta,
            uploads=uploads,
            total_steps=total_steps,
            eval_every=cfg.train.eval_every or max(1, steps_per_epoch or total_steps),
            num_workers=cfg.data.num_workers,
            step=step,
            epoch=epoch,
            rng=resumed_rng,
        )
        loop = train_loop(run, cfg.train, cfg.checkpoint)
        final = final_checkpoint(ckpt_root, loop.step) if info.is_main else None
        final = object_store.location(distributed.broadcast_object(str(final), info))
        # The final step's evaluation; a resume of a finished (or early-stopped) run trains no step.
        metrics, state = loop.evaluated or evaluate(run, loop.step)
        # Leave the process group before rank 0's final uploads, which can outlast the group's
        # timeout that the other ranks would otherwise spend waiting in teardown's barrier.
        # DDP first: see the finally below
        model = optimizer = scheduler = None  # noqa: F841
        distributed.teardown(clean=True)
        if info.is_main:
            finish_tracking(cfg, run, final, state, run_id, loop.step)
        return TrainResult(run_dir, run_id, final, loop.losses, metrics, monitor.state())
    except BaseException:
        end_run_after_failure(run_dir)
        raise
    finally:
        clean = sys.exc_info()[0] is None
        if not clean:
            end_run_after_failure(run_dir)
        if info.is_main and run_dir is not None:
            # An object store's lease; nothing for a local flock
            run_dir_owner.release(run_dir)
        # Drop DDP (its reducer holds the process group) before destroying the group: if the
        # reducer held the last reference, gloo's destructor would join its worker threads with
        # the GIL held while a worker waits for the GIL to free a tensor, and the rank would hang.
        model = optimizer = scheduler = None  # noqa: F841
        distributed.teardown(clean)
        signal.signal(signal.SIGTERM, previous_sigterm)


def epoch_steps(loader, plan: Plan, max_steps: int) -> int | None:
    """Optimizer steps an epoch; None for a stream of the data component's own that has no len()
    (then train.max_steps says how long to train)."""
    if isinstance(loader, OwnStreamLoader):
        degrees = plan.degrees
        if degrees.tp > 1 or degrees.pp > 1:
            raise ConfigError(
                "a stream of the data component's own deals itself by rank, and the ranks of a "
                f"tensor-parallel group or a pipeline (train.parallel.tp={degrees.tp}, "
                f"pp={degrees.pp}) must read the same batches: write it as shards "
                "(`pipeline data shard`), which are dealt over the data-parallel ranks"
            )
        # The launcher checked it too; not a run under your own torchrun
        check_length(loader.dataset, max_steps)
        if not has_length(loader.dataset):
            return None
    return len(loader) // plan.batch.accumulation


def build_pipeline(
    plain_model,
    t: TrainConfig,
    *,
    batch: BatchPlan,
    splits: Splits,
    task,
    run_mesh: mesh.Mesh,
    info: DistInfo,
    precision: str,
    channels_last: bool,
) -> pipeline_parallel.Pipeline:
    """This rank's pipeline stage (wrapped as wrap_model wraps a whole model) and its schedules,
    traced on a micro-batch of the training data. Each micro-batch's loss is divided by the pieces
    of a step, so the gradients are their mean, as one batch's would be."""
    # train.precision=auto on a GPU without bf16 (check_runtime refused fp16 when asked for)
    if precision == "fp16":
        raise ConfigError(
            "train.parallel.pp with fp16 (what train.precision=auto takes on this GPU, which has no "
            "bf16): GradScaler's step skipping would have to agree across the stages; set "
            "train.precision=fp32"
        )
    example, target = first_batch(splits.train, batch.micro_rows)
    if not torch.is_tensor(target):
        raise ConfigError(
            f"train.parallel.pp: the task's target is a {type(target).__name__}, and the pipeline's "
            "schedule cuts only a tensor target into micro-batches; train this task without "
            "train.parallel.pp"
        )
    return pipeline_parallel.build(
        plain_model.to(info.device),
        to_device(example, info.device, channels_last),
        run_mesh.layout,
        run_mesh.device["pp"].get_group(),
        info.device,
        batch.microbatches,
        t.parallel.pp_split,
        t.parallel.pp_schedule,
        loss_fn=lambda output, target: task.loss(output, target) / batch.pieces,
        wrap=lambda stage: wrap_model(stage, t, precision, info, run_mesh.device),
    )


def held_elsewhere(manifest: dict, model) -> frozenset[str]:
    """The model's state keys that other ranks' pipeline stages hold (none without a pipeline)."""
    return frozenset(manifest) - set(getattr(model, "module", model).state_dict())


def claim_run_dir(run_dir: Path, info: DistInfo) -> None:
    """Rank 0 owns the run directory (see run_dir.py); every rank stops together if another run
    does."""
    error = None
    if info.is_main:
        try:
            run_dir_owner.claim(run_dir)
        except run_dir_owner.RunDirBusy as exc:
            error = str(exc)
    error = distributed.broadcast_object(error, info)
    if error:
        raise run_dir_owner.RunDirBusy(error)


def check_reachable_everywhere(run_dir: Path, info: DistInfo) -> None:
    """A run directory on an object store: each rank (each host) reaches it with its own credentials
    and endpoint; every rank stops together, with the first rank's reason, if one can't."""
    if not object_store.is_url(run_dir):
        return
    try:
        object_store.check_reachable(run_dir)
        error = None
    except ConfigError as exc:
        error = f"rank {info.rank} on {socket.gethostname()}: {exc}"
    errors = [e for e in distributed.all_gather_object(error, info) if e]
    if errors:
        raise ConfigError(errors[0])


def check_shared(run_dir: Path, info: DistInfo) -> None:
    """Every rank writes its own checkpoint shard into the run directory, and the marker, the resume
    and the upload to MLflow need all of them in one place: a local train.output_dir must be one
    directory that every rank sees (one host, or a filesystem all hosts mount). Rank 0 writes a
    nonce there; a rank that can't see it is on a host with another disk, and the run stops before
    training instead of publishing checkpoints that hold only rank 0's shard (which consolidation
    then can't read)."""
    if object_store.is_url(run_dir) or not info.distributed:
        return
    probe = None
    if info.is_main:
        probe = run_dir / f".shared-{secrets.token_hex(8)}"
        probe.write_text(socket.gethostname())
    probe = Path(distributed.broadcast_object(str(probe) if probe else None, info))
    seen = distributed.all_gather_object((probe.is_file(), socket.gethostname()), info)
    distributed.barrier(info)
    if info.is_main:
        probe.unlink(missing_ok=True)
    blind = [f"rank {rank} on {host}" for rank, (saw, host) in enumerate(seen) if not saw]
    if blind:
        raise ConfigError(
            f"train.output_dir={run_dir.parent} is not shared by every rank: {', '.join(blind)} can't "
            f"see what rank 0 on {seen[0][1]} wrote in {run_dir}. Each rank writes its own checkpoint "
            "shard there, so hosts that share no disk need an object store: "
            "train.output_dir=s3://<bucket>/<prefix> (pip install -e '.[remote]'; AWS_ENDPOINT_URL, "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), or a filesystem every host mounts at that path"
        )


def check_same_model(meta: dict, spec, path: Path) -> None:
    """A resume continues the model it saved: another component is refused (same shapes or not)."""
    saved = (meta.get("model") or {}).get("component")
    if saved and saved != spec.component:
        raise checkpoint.CheckpointError(
            f"checkpoint '{path}' was trained with model.component '{saved}', this "
            f"config names '{spec.component}'; resume with the config it was trained "
            f"with ({Path(path) / checkpoint.META})"
        )
    if saved and meta["model"].get("args") != spec.args:
        log.warning(
            "resuming %s with other model args than it was saved with: %s (saved) vs %s",
            path,
            meta["model"].get("args"),
            spec.args,
        )


def final_checkpoint(ckpt_root: Path, last_step: int) -> Path | None:
    """The loop's save at its last step, not merely the newest: a resume from an older checkpoint
    with fewer steps would otherwise report a step the weights never reached."""
    exact = ckpt_root / checkpoint.step_dir_name(last_step)
    return exact if exact.is_dir() else checkpoint.latest(ckpt_root)


def end_run_after_failure(run_dir: Path | None) -> None:
    """Close this process's MLflow run (if it has one) as KILLED (Ctrl-C) or FAILED (any other
    exception being handled), even if SIGTERM arrives meanwhile.

    When a peer rank dies, this rank's collective fails at once (gloo; NCCL blocks until its
    timeout, where only torchrun's SIGKILL ends the rank and the launcher closes the run) and
    torchrun's SIGTERM follows within milliseconds. SIGTERM is ignored from here on (torchrun still
    escalates to SIGKILL after 30 s). `main` calls this twice, from `except` and from `finally`,
    because the one SIGTERM can still land before the first call ignores it; the second call then
    runs with SIGTERM ignored. Ending an ended run is a no-op.
    """
    stopping.ignore_sigterm()
    status = "KILLED" if sys.exc_info()[0] is KeyboardInterrupt else "FAILED"
    try:
        ended = tracking.end_run(status, failed_stage="train")
    except Exception as exc:
        # the failure being handled is the news; don't replace it with this one
        log.error("could not mark the MLflow run %s: %s", status, exc)
        return
    if ended and run_dir is not None and not object_store.is_url(run_dir):
        # the launcher then need not open the store to close it (importing MLflow alone takes
        # seconds)
        try:
            write_run_record(run_dir, ended, status)
        except OSError as exc:
            log.error(
                "marked the MLflow run %s %s, but could not say so in %s: %s",
                ended,
                status,
                run_dir,
                exc,
            )


@dataclass(kw_only=True)
class Learner:
    """The model as this rank trains it, and what one optimizer step needs besides the batch
    (train_step): its optimizer and loss scaler, how the inputs reach the device, the loss."""

    model: Any
    optimizer: Any
    scaler: Any
    device: torch.device
    precision: str
    loss_fn: Callable
    # 0: the norm is not clipped (it is still measured when asked for)
    clip_grad_norm: float = 0.0
    # NHWC inputs (parallelize.uses_channels_last decided it for this model)
    channels_last: bool = False
    # This rank's pipeline stage and its schedules (train.parallel.pp); None: the whole model
    pipe: pipeline_parallel.Pipeline | None = None


@dataclass(kw_only=True)
class Training:
    """What the training loop works on, built once by `main`: the learner, the data, the task and
    its monitor, where this rank sits, where checkpoints go, and where the loop starts (a resume's
    step and epoch)."""

    learner: Learner
    scheduler: Any
    loader: Any
    splits: Splits
    task: Any
    monitor: Monitor
    info: DistInfo
    batch: BatchPlan
    mesh: mesh.Mesh
    ckpt_root: Path
    # What every checkpoint says about itself (train_state is added per save)
    meta: dict
    uploads: BackgroundUploads | None
    total_steps: int
    eval_every: int
    # The evaluation loader's worker processes (data.num_workers)
    num_workers: int = 0
    # Where the loop starts: a resume's step and epoch (0 for a new run)
    step: int = 0
    epoch: int = 0
    # A resume's random generators as its checkpoint saved them (checkpoint.rng_state), set
    # immediately before its first step
    rng: dict | None = None


@dataclass
class LoopResult:
    losses: list[float]
    # The last step trained: total_steps, or where early stopping stopped
    step: int
    # (metrics, state) of the last step's evaluation; None if no step ran
    evaluated: tuple | None


def train_loop(run: Training, t: TrainConfig, ckpt_cfg: CheckpointConfig) -> LoopResult:
    """Trains to `run.total_steps` or until the monitor stops early. After each step, what is due
    by its own rule runs: the log (train.log_every), the evaluation (`run.eval_every`), the replica
    check (train.consistency_every) and the save (checkpoint.every_n_steps, and each new best); each
    of them at the last step too."""
    info, monitor, model = run.info, run.monitor, run.learner.model
    saver = Saver(
        run.ckpt_root, info, ckpt_cfg.keep_last, ckpt_cfg.async_save, every=ckpt_cfg.every_n_steps
    )
    metrics_log = MetricsLog(info, run.total_steps, run.step, every=t.log_every)
    evaluation = Every(run.eval_every)
    # Only where another rank holds a copy of this rank's tensors
    replica_check = Every(t.consistency_every) if run.mesh.replica_group is not None else None
    step, epoch, evaluated = run.step, run.epoch, None
    if run.rng is not None:
        checkpoint.set_rng_state(run.rng)
    while step < run.total_steps and not monitor.stopped:
        # A new shuffle each epoch, the same on every rank
        set_epoch(run.loader, epoch)
        steps_before_epoch = step
        for micro_batches in chunked(run.loader, run.batch.accumulation):
            log_now = metrics_log.due(step + 1, last=step + 1 == run.total_steps)
            started = time.perf_counter()
            loss, norm = train_step(run.learner, micro_batches, want_norm=log_now)
            # The warm-up a user waits through, said once
            if t.compile and step == run.step:
                log.info(
                    "train.compile: the first step took %.1f s, compiling the model; the steps "
                    "after it run the compiled code",
                    time.perf_counter() - started,
                )
            run.scheduler.step()
            step += 1
            metrics_log.add(loss)
            last = step == run.total_steps
            eval_now = evaluation.due(step, last)
            check_now = replica_check is not None and replica_check.due(step, last)
            # Also before anything reads the weights (an evaluation, the replica check, a save),
            # not only at log steps: diverged weights must not be judged, compared, or saved for a
            # resume.
            if log_now or eval_now or check_now or saver.due(step, last):
                mean_loss = metrics_log.mean(step, run.mesh.layout)
            if log_now:
                metrics_log.write(run, step, epoch, mean_loss, norm)
            evaluated, best = None, False
            if eval_now:
                evaluated = evaluate(run, step)
                best = judge(monitor, evaluated[0], step, info)
            if check_now:
                replicas.sync_buffers(model, run.mesh.stage_group)
                # The final weights are what every later stage uses
                replicas.check(model, step, run.mesh.replica_group)
            inject_fault("step", step, info)
            if saver.due(step, last or bool(monitor.stopped)) or best:
                save(run, saver, step, epoch, evaluated, best)
            else:
                # An asynchronous save is published once every rank has written it
                saver.poll()
            if last or monitor.stopped:
                break
        # The epoch ran out (or a resume landed exactly on its end)
        else:
            if step == steps_before_epoch and not resumed_at_epoch_end(run, epoch):
                raise DataError(
                    f"epoch {epoch} gave no optimizer step: the training stream ended before "
                    f"{run.batch.accumulation} micro-batch(es) of {run.batch.global_batch_size} "
                    "samples a step; a stream of your own must start again at set_epoch(epoch), "
                    "and hold a global batch"
                )
            epoch += 1
    saver.close()
    metrics_log.close()
    if monitor.stopped:
        log.warning("%s", monitor.stopped)
    return LoopResult(metrics_log.losses, step, evaluated)


def save(
    run: Training, saver: Saver, step: int, epoch: int, evaluated: tuple | None, best: bool
) -> None:
    """Collective: the state of `step` saved; best.json and the MLflow upload once it is
    published."""
    # One copy of the BatchNorm statistics saved, whichever rank DCP picks
    replicas.sync_buffers(run.learner.model, run.mesh.stage_group)
    run.meta["train_state"] = train_state(run, step, epoch)
    run.meta["val_metrics"] = evaluated[0] if evaluated else None
    saver.save(
        step,
        run.learner.model,
        run.learner.optimizer,
        run.meta,
        (run.monitor.best_step,),
        functools.partial(published, run, best=best, monitor=snapshot(run.monitor)),
    )


def published(run: Training, path: Path, best: bool, monitor: Monitor) -> None:
    """What follows a save's publish: best.json at a new best, the upload to MLflow."""
    if best and run.info.is_main:
        write_best(run.ckpt_root, monitor, path)
    if run.uploads:
        run.uploads.submit(path)


class MetricsLog:
    """The training metrics of the steps since the last log, and the progress bar. The loss is
    summed on the device between logs: a .item() per step would be a host sync per step on CUDA."""

    def __init__(self, info: DistInfo, total_steps: int, start: int, every: int):
        self.every, self.info = Every(every), info
        self.losses: list[float] = []
        self._new_window()
        self.progress = make_progress(info, total_steps, start)

    def due(self, step: int, last: bool) -> bool:
        """A log at each train.log_every-th step and at the last."""
        return self.every.due(step, last)

    def add(self, loss: torch.Tensor) -> None:
        self.window_loss += loss
        self.window_steps += 1
        self.progress.update(1)

    def mean(self, step: int, layout: mesh.Layout) -> float:
        """Collective: the window's mean loss over the ranks (see mean_loss_over_ranks)."""
        return mean_loss_over_ranks(self.window_loss, self.window_steps, step, self.info, layout)

    def write(self, run: Training, step: int, epoch: int, mean_loss: float, norm: float) -> None:
        """The window's metrics logged at `step` (MLflow and the progress bar on the main rank);
        a new window starts."""
        elapsed = time.perf_counter() - self.window_start
        scaler = run.learner.scaler
        metrics = {
            "train/loss": mean_loss,
            "train/lr": run.scheduler.get_last_lr()[0],
            "train/grad_norm": norm,
            "train/samples_per_s": self.window_steps * run.batch.global_batch_size / elapsed,
            "train/epoch": epoch,
        }
        if scaler.is_enabled():
            metrics["train/loss_scale"] = scaler.get_scale()
        self.losses.append(mean_loss)
        if self.info.is_main:
            tracking.log_metrics(metrics, step)
            self.progress.set_postfix(
                loss=f"{mean_loss:.4f}", samples_s=f"{metrics['train/samples_per_s']:.0f}"
            )
        self._new_window()

    def close(self) -> None:
        self.progress.close()

    def _new_window(self) -> None:
        self.window_loss = new_window(self.info)
        self.window_steps, self.window_start = 0, time.perf_counter()


def resumed_at_epoch_end(run: Training, epoch: int) -> bool:
    """A resume whose checkpoint was saved at its epoch's last step: that epoch rightly gives no
    step here."""
    return epoch == run.epoch and run.step > 0


def judge(monitor: Monitor, metrics: dict[str, float], step: int, info: DistInfo) -> bool:
    """One evaluation for the monitor; True at a new best. Rank 0's verdict is every rank's, so all
    ranks save and stop together whatever a custom metric computes on each."""
    best = monitor.update(metrics, step)
    state, best = distributed.broadcast_object((monitor.state(), best), info)
    monitor.restore(state)
    if best and info.is_main:
        tracking.log_metrics(
            {f"best/val_{monitor.metric}": monitor.best_value, "best/step": step}, step
        )
    return best


def new_window(info: DistInfo) -> torch.Tensor:
    """The sum of the training losses since the last log, kept on the device (float64, as Python's
    sum of floats was: the logged means are the same to the bit)."""
    return torch.zeros((), dtype=torch.float64, device=info.device)


def mean_loss_over_ranks(
    window_loss: torch.Tensor,
    window_steps: int,
    step: int,
    info: DistInfo,
    layout: mesh.Layout | None = None,
) -> float:
    """The mean training loss over the window's steps and every rank that computes one (a pipeline's
    earlier stages add 0): collective, and the loop's one read of the loss. Every rank raises
    TrainingDiverged here, at the same step, when any rank's loss was NaN or infinite: a rank
    raising alone would leave its peers blocked in their next collective, which under NCCL waits out
    the 10-minute timeout, beyond the reach of a SIGTERM handler, until torchrun's SIGKILL ends them
    with their MLflow run still RUNNING."""
    values = torch.zeros(1 + info.world_size, dtype=torch.float64, device=info.device)
    values[0] = window_loss
    # which ranks, for the message
    values[1 + info.rank] = (~torch.isfinite(window_loss)).double()
    total, *flags = distributed.sum_over_ranks(values, info).tolist()
    holders = info.world_size // (layout.pp if layout else 1)
    mean = total / (window_steps * holders)
    bad = [rank for rank, flag in enumerate(flags) if flag]
    if bad:
        raise TrainingDiverged(
            f"the training loss is {mean} (not finite on rank {', '.join(map(str, bad))}, between "
            f"steps {step - window_steps + 1} and {step}); lower optim.lr, set "
            "train.clip_grad_norm, or use train.precision=fp32"
        )
    return mean


def chunked(loader, size: int):
    """Groups of `size` micro-batches; a trailing incomplete group is dropped (drop_last
    semantics)."""
    batches = iter(loader)
    while True:
        group = list(itertools.islice(batches, size))
        if len(group) < size:
            return
        yield group


def train_step(learner: Learner, micro_batches, want_norm: bool) -> tuple[torch.Tensor, float]:
    """One optimizer step over the micro-batches of (inputs, target); returns this rank's loss, a
    0-d float64 tensor on the device (0 on a pipeline's earlier stages), and the global grad norm
    (NaN unless asked for: reading it, like reading the loss, waits for the GPU; the loop reads
    both only when it logs, and checks there that the loss is finite, see `mean_loss_over_ranks`).
    With a pipeline, each micro-batch goes through its schedule (its own micro-batches, forward and
    backward, its loss function scaled for both), and the gradient norm is whole over its stages."""
    model, optimizer, scaler = learner.model, learner.optimizer, learner.scaler
    device, precision, pipe = learner.device, learner.precision, learner.pipe
    accum = len(micro_batches)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, (inputs, target) in enumerate(micro_batches):
        inputs = to_device(inputs, device, learner.channels_last)
        # A tensor, or a dict/tuple of them (custom tasks)
        target = to_device(target, device)
        if pipe:
            # The stage's forwards run inside the schedule's step
            with amp.autocast(precision, device):
                loss = pipe.step(inputs, target)
            total += loss if loss is not None else 0.0
            continue
        # Without no_sync DDP would all-reduce every micro-batch; FSDP2 has its own switch.
        with (
            sync_context(model, last_micro_batch=i == accum - 1),
            amp.autocast(precision, device),
        ):
            loss = learner.loss_fn(forward(model, inputs), target) / accum
        scaler.scale(loss).backward()
        total += loss.detach()
    norm = float("nan")
    clip = learner.clip_grad_norm
    if clip or want_norm:
        # Clip and report true gradients, not scaled ones
        scaler.unscale_(optimizer)
        stages = pipe.group if pipe else None
        # Split projections, or a pipeline's stages
        if gradients.needs_own_norm(model.parameters(), stages):
            total_norm = gradients.grad_norm(model.parameters(), stages)
            if clip:
                gradients.clip_grads(model.parameters(), clip, total_norm)
        elif clip:
            total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        # Only reported: skip clip_grad_norm_'s multiply of every gradient by 1
        else:
            total_norm = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]
            )
        if want_norm:
            whole = total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm
            norm = whole.item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def sync_context(model, last_micro_batch: bool):
    if isinstance(model, DDP):
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()
    # FSDP2
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(run: Training, step: int | None = None) -> tuple[dict[str, float], dict]:
    """The task's metrics over the whole validation split, each data-parallel rank on its own
    disjoint shard (the ranks of a tensor-parallel group compute one shard together, and one of
    them counts it; a pipeline's stages pass each batch on, and its last stage counts it); returns
    them and the reduced state (for the plot). Logged as val/<metric> at `step`."""
    learner, layout, info, task = run.learner, run.mesh.layout, run.info, run.task
    model, pipe, device = learner.model, learner.pipe, learner.device
    # Every rank evaluates with the same BatchNorm statistics
    replicas.sync_buffers(model, run.mesh.stage_group)
    model.eval()
    val = run.splits.val
    shard = eval_shard(val, layout.dp_rank, layout.dp_size)
    # Every rank runs the same number of forwards (FSDP all-gathers inside each one). A pipeline's
    # batches are the size its graphs were traced at.
    batch_size = pipe.rows if pipe else EVAL_BATCH
    per_rank = -(-len(val) // layout.dp_size)
    n_batches = max(1, -(-per_rank // batch_size))
    batches = iter(
        eval_loader(shard, batch_size, run.num_workers, pin_memory=device.type == "cuda")
    )
    state = task.new_state(device)
    for _ in range(n_batches):
        batch = next(batches, None)
        # This rank's shard ran out: a forward all the same, its output unused
        filler = batch is None
        inputs, target = first_batch(val, 1) if filler else batch
        with amp.autocast(learner.precision, device):
            inputs = to_device(inputs, device, learner.channels_last)
            output = pipe.forward(inputs) if pipe else forward(model, inputs)
        if not filler and layout.reads_for_its_group:
            task.update(state, task.named(output), to_device(target, device))
    task.reduce(state, info)
    metrics = task.metrics(state)
    if info.is_main and step is not None:
        tracking.log_metrics({f"val/{k}": v for k, v in metrics.items()}, step)
        log.info("step %d: %s", step, ", ".join(f"val {k} {v:.4f}" for k, v in metrics.items()))
    model.train()
    return metrics, state


def default_run_name(cfg: Config) -> str:
    """Stable across torchrun restarts (TORCHELASTIC_RUN_ID), so restarted workers find their
    checkpoints."""
    if cfg.train.run_name:
        return cfg.train.run_name
    stem = (
        f"{model_short_name(cfg.model.component, cfg.model.args)}-{short_name(cfg.data.component)}"
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"{stem}-{run_id[:8]}"
    # A random suffix: two runs started in the same second (a sweep) once shared one directory.
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def choose_resume(requested: str | None, ckpt_root: Path, restarts: int) -> str | None:
    """After torchrun restarts the workers (`restarts`: the job's count, every node's, see
    distributed.job_restarts), continue from the run's newest complete checkpoint, even when the
    first attempt was itself resumed from elsewhere (that one is older)."""
    if restarts > 0 and (requested is None or checkpoint.latest(ckpt_root) is not None):
        log.info(
            "torchrun restart %d: resuming from the newest complete checkpoint, if any", restarts
        )
        return "auto"
    return requested


def read_run_id(run_dir: Path) -> str | None:
    """The MLflow run of this run directory, kept so a restart before the first checkpoint continues
    it."""
    record = read_run_record(run_dir)
    return record["run_id"] if record else None


def read_run_record(run_dir: Path) -> dict | None:
    """mlflow_run.json: {"run_id": the run directory's MLflow run} while a process has it open, and
    "ended": its status once the process that had it ended it after a failure (write_run_record)."""
    f = run_dir / "mlflow_run.json"
    if not f.exists():
        return None
    record = read_json(
        f,
        f'it should hold {{"run_id": <the MLflow run of {run_dir}>}}; restore it, or delete it to '
        "start a new MLflow run for this directory",
    )
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise StateFileError(f'{f} holds {str(record)[:80]}, not {{"run_id": ...}}')
    return record


def write_run_record(run_dir: Path, run_id: str, ended: str | None = None) -> None:
    write_json(
        run_dir / "mlflow_run.json", {"run_id": run_id} | ({"ended": ended} if ended else {})
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_state(run: Training, step: int, epoch: int) -> dict:
    """What a resume needs besides the tensors DCP stores. Rank 0's loader state stands for all
    ranks: they are at the same place of the same epoch's shuffle (a stream of the component's own
    gathers every rank's: a collective, which every rank calls here). `data_parallel`: the ranks
    the data was dealt over (the world, less its tensor-parallel and pipeline ranks, which read
    their group's batch)."""
    scaler = run.learner.scaler
    return {
        "step": step,
        "epoch": epoch,
        "world_size": run.info.world_size,
        "data_parallel": run.batch.data_parallel,
        "scheduler": run.scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
        "dataloader": run.loader.state_dict(),
        "monitor": run.monitor.state(),
    }


def restore_train_state(
    meta: dict, scheduler, scaler, loader, data_parallel: int
) -> tuple[int, int]:
    """A checkpoint's step and epoch; its scheduler, scaler and loader state restored, the loader's
    rescaled from the ranks the checkpoint dealt its data over to this run's `data_parallel`."""
    state = meta["train_state"]
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    restore_loader(
        loader, state["dataloader"], state["epoch"], saved_data_parallel(meta), data_parallel
    )
    return state["step"], state["epoch"]


def saved_data_parallel(meta: dict) -> int:
    """The ranks a checkpoint's data was dealt over. Checkpoints from before pipeline parallelism
    recorded only the world size: their tensor-parallel groups (train.parallel.tp in their config)
    read one batch each."""
    state = meta["train_state"]
    if "data_parallel" in state:
        return state["data_parallel"]
    parallel = ((meta.get("config") or {}).get("train") or {}).get("parallel") or {}
    return state["world_size"] // (parallel.get("tp", 1) * parallel.get("pp", 1))


def make_progress(info: DistInfo, total: int, initial: int):
    from serving.console import Progress

    return Progress(total, initial, desc="train", enabled=info.is_main, logger=log)


def start_tracking(
    cfg: Config,
    run_dir: Path,
    run_id: str | None,
    info: DistInfo,
    setup: str,
    spec,
    from_data: dict,
    code,
    replaying: bool,
) -> str:
    """`setup`: the run's setup tag (setup_words). `replaying`: a torchrun restart re-runs the steps
    since the checkpoint with the same config; the run already holds their metrics. (A deliberate
    --resume logs its steps again.)"""
    tracking.setup(cfg.tracking)
    tags = {
        lineage.TASK: cfg.task.name,
        lineage.MODEL: cfg.model.component,
        lineage.DATA: cfg.data.component,
        lineage.SETUP: setup,
        lineage.GIT: tracking.git_commit()[:12],
        lineage.RUN_DIR: str(run_dir.resolve()),
        **tracking.process_tag(),
    }
    resumed = run_id is not None
    if resumed:
        # Before the run turns RUNNING again: an "ended" left by the failed attempt would tell the
        # launcher this attempt closed it too, should it be killed before it can say otherwise.
        write_run_record(run_dir, run_id)
    run_id = tracking.start_run(
        run_dir.name,
        run_id,
        tags,
        cfg.tracking.system_metrics,
        skip_logged_steps=replaying,
        gpu=info.device.type == "cuda",
    )
    if resumed:
        # test hook: killed as the run turns RUNNING again
        inject_fault("run_reopened", 0, info)
    tracking.mark_stage("train", "running")
    if not resumed:
        # The config as given, and the model's arguments as built (those the data suggested
        # included).
        tracking.log_params(
            {**flatten(cfg), **{f"model.args.{k}": v for k, v in spec.args.items()}}
        )
        tracking.log_text(to_yaml(cfg), "config/resolved.yaml")
        tracking.log_text(json.dumps(spec.to_json(), indent=2), "config/model.json")
        tracking.log_code(code.files, code.describe()["packages"])
    if from_data:
        log.info(
            "model args from the data: %s",
            ", ".join(f"{k}={_short(v)}" for k, v in from_data.items()),
        )
    for why in code.skipped:
        log.warning("component code not logged: %s", why)
    run_dir.mkdir(parents=True, exist_ok=True)
    # (a resumed run's was written above)
    if not resumed:
        write_run_record(run_dir, run_id)
    write_atomically(run_dir / "config.yaml", to_yaml(cfg))
    return run_id


def setup_words(info: DistInfo, strategy: str, degrees: Degrees, precision: str) -> str:
    """The run's setup tag, "2 x cpu, ddp, pp 2, fp32": the mesh's degrees named only where
    train.parallel asks for more than data parallelism over every rank."""
    mesh_words = ""
    if degrees.needs_mesh:
        named = degrees.named().items()
        mesh_words = " x ".join(f"{name} {degree}" for name, degree in named if degree > 1) + ", "
    return f"{info.world_size} x {info.device.type}, {strategy}, {mesh_words}{precision}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def finish_tracking(
    cfg: Config, run: Training, final: Path, state: dict, run_id: str, step: int
) -> None:
    """Rank 0, once the process group is gone: the validation plot, the final (and best)
    checkpoint to MLflow, the run's lineage; the run ends FINISHED."""
    task, uploads, monitor = run.task, run.uploads, run.monitor
    on_store = object_store.is_url(final)
    # A figure is a local file first. The last evaluation's, the newest checkpoint's: export draws
    # the exported checkpoint's beside its model.
    with tempfile.TemporaryDirectory(prefix="trainserve-plot-") as scratch:
        figure = task.plot(
            state,
            (Path(scratch) if on_store else final.parent.parent) / "validation.png",
            subject=f"validation at step {step} (the newest checkpoint)",
        )
        if figure:
            tracking.log_artifact(figure)
    best = (
        final.parent / checkpoint.step_dir_name(monitor.best_step)
        if monitor.best_step is not None
        else None
    )
    if on_store and cfg.checkpoint.log_to_mlflow != "none":
        # Already where every host can read them; the run's tags (lineage.RUN_DIR, lineage.LATEST)
        # say where, and `consolidate --run-id` fetches from there.
        log.info(
            "checkpoints stay on the object store (%s), recorded on the run, not uploaded again "
            "(checkpoint.log_to_mlflow=%s applies to a local train.output_dir)",
            final.parent,
            cfg.checkpoint.log_to_mlflow,
        )
    elif cfg.checkpoint.log_to_mlflow == "last":
        checkpoint_store.log_checkpoint(final, run_id)
        if best is not None and best != final and best.is_dir():
            checkpoint_store.log_checkpoint(best, run_id)
    failed = {}
    if uploads:
        # Saved by an attempt that died before uploading it
        if final.name not in uploads.submitted:
            uploads.submit(final)
        failed = uploads.finish()
        if failed:
            log.warning(
                "checkpoints not uploaded to MLflow run %s: %s", run_id, ", ".join(sorted(failed))
            )
        # A later stage on another machine would silently take an older one
        if final.name in failed:
            raise tracking.TrackingError(
                f"the final checkpoint could not be uploaded to MLflow run {run_id} "
                f"({failed[final.name]}); "
                f"it is intact at {final}: consolidate it by path, or fix the store and upload it with "
                f"`mlflow artifacts log-artifacts -l {final} -r {run_id} -a checkpoints/{final.name}`"
            )
    tracking.set_tags(
        {lineage.LATEST: final.name} | ({lineage.BEST: best.name} if best is not None else {})
    )
    tracking.record_lineage(
        "training",
        {
            "run_dir": str(final.parent.parent if not on_store else final.parent),
            "latest": str(final),
            "best": best.name if best is not None else None,
            "best_step": monitor.best_step,
            "monitor": f"val/{monitor.metric} ({monitor.mode})",
            "best_value": monitor.best_value,
            "early_stopping": monitor.stopped or None,
            "checkpoint_upload_failures": sorted(failed),
            "git": tracking.git_commit(),
        },
    )
    tracking.mark_stage("train", "done")
    tracking.end_run("FINISHED")


# --- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", help="YAML config (configs/*.yaml); defaults apply to what it omits"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        help="start torchrun with this many processes on this machine (omit under torchrun)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc-per-node: let torchrun restart failed workers; they resume "
        "from the newest complete checkpoint",
    )
    parser.add_argument(
        "--resume",
        help="latest | auto | a checkpoint or run directory | an MLflow run id; auto: "
        "this run's newest complete checkpoint if it has one, else start (what a restarted job "
        "wants: deploy/train-pytorchjob.yaml)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. optim.lr=0.05"
    )


def torchrun_arguments(
    nproc_per_node: int,
    max_restarts: int,
    config: str | None,
    resume: str | None,
    overrides: list[str],
) -> list[str]:
    """torchrun's arguments for this stage on this machine."""
    arguments = (["--config", config] if config else []) + (["--resume", resume] if resume else [])
    return launch.torchrun_arguments(
        "pipeline.train", nproc_per_node, max_restarts, [*arguments, *overrides]
    )


def launch_torchrun(args, cfg: Config) -> int:
    """Re-runs this stage under torchrun, with the run name fixed once for all ranks and restarts.
    This launcher owns the run directory throughout, torchrun's restarts included."""
    run_name = cfg.train.run_name or default_run_name(cfg)
    run_dir = object_store.location(cfg.train.output_dir) / run_name
    # on an object store rank 0 holds the lease, restarts included
    if not object_store.is_url(run_dir):
        run_dir_owner.claim(run_dir)
    argv = torchrun_arguments(
        args.nproc_per_node,
        args.max_restarts,
        args.config,
        args.resume,
        [*args.overrides, f"train.run_name={run_name}"],
    )
    return run_torchrun(argv, cfg, run_dir)


def run_torchrun(argv: list[str], cfg: Config, run_dir: Path) -> int:
    """torchrun's exit code. When it failed, also closes an MLflow run that rank 0 left RUNNING:
    a SIGKILL (the OOM killer, torchrun's escalation after 30 s) gives rank 0 no chance to."""
    code = launch.run_torchrun(argv)
    record = read_run_record(run_dir) if code else None
    # (ended: rank 0 closed it itself)
    if record and not record.get("ended"):
        run_id = record["run_id"]
        try:
            tracking.use_store(cfg.tracking.tracking_uri)
            if tracking.fail_if_running(run_id, "train"):
                print(
                    f"pipeline train: torchrun exited {code} and left the run RUNNING; "
                    f"marked MLflow run {run_id} FAILED",
                    file=sys.stderr,
                )
        except Exception as exc:
            # the workers' failure is the news; don't bury it under this one
            print(f"pipeline train: could not close MLflow run {run_id}: {exc}", file=sys.stderr)
    return code


def cli(args) -> int:
    rank = os.environ.get("RANK", "0")
    prefix = (
        f"pipeline train: [rank{rank}] error:"
        if rank != "0" or launch.under_torchrun()
        else "pipeline train: error:"
    )
    try:
        cfg = load_config(args.config, args.overrides)
        if args.nproc_per_node and not launch.under_torchrun():
            # Fail before spawning: one clear line instead of one per rank and torchrun's report.
            check_runtime(cfg, args.nproc_per_node, torch.cuda.is_available(), args.nproc_per_node)
            tracking.check_reachable(tracking.resolve_tracking_uri(cfg.tracking.tracking_uri))
            if object_store.is_url(cfg.train.output_dir):
                object_store.check_reachable(cfg.train.output_dir)
            # the data, task and model components, checked on real samples
            preflight(cfg.data, cfg.task, cfg.model, cfg.train, cfg.export)
            return launch_torchrun(args, cfg)
        main(cfg, resume=args.resume)
        return 0
    except (
        ConfigError,
        DataError,
        checkpoint.CheckpointError,
        tracking.TrackingError,
        run_dir_owner.RunDirBusy,
        StateFileError,
    ) as exc:
        launch.say_error(f"{prefix} {worker_message(exc)}")
        return 2
    except (replicas.ReplicaDivergence, TrainingDiverged) as exc:
        print(f"{prefix} {exc}", file=sys.stderr)
        return 3
    except Exception:
        # Another rank met bad input and said so (launch.say_error): this rank's failure, a
        # collective whose peer left ("Connection closed by peer"), is its echo, not news.
        if launch.another_rank_said_why():
            return 2
        raise


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pipeline train", allow_abbrev=False)
    add_arguments(parser)
    sys.exit(cli(parser.parse_intermixed_args()))
