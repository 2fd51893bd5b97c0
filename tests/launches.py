"""The configurations that must launch, in one table: a row is one `pipeline train` (or
`pipeline run`) under torchrun, as small as proves that its configuration launches and does what it
claims (tests/test_launches.py holds the claims). One runner, the session fixture `launched`,
launches each row once; a row that compares with another, or resumes another's checkpoint, has that
one launched first. Rows of one family share a config and a working directory (one MLflow store)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, mlflow_client, model_from_checkpoint, run_cli

from pipeline import checkpoint

TRANSFORMER = str(REPO / "configs/digit_sequences_transformer.yaml")
BERT = str(REPO / "configs/digit_sequences_bert.yaml")
MIXED = str(REPO / "configs/diabetes_mixed_inputs.yaml")


@dataclasses.dataclass(frozen=True)
class Family:
    """Rows that share a config, its overrides and one working directory (one MLflow store), so that
    a row's run is found by its name beside the run it is compared with."""

    config: str
    overrides: tuple[str, ...]
    experiment: str


FAMILIES = {
    # The same global batches three ways (1 process, 2 x 2 micro-batches, 1 x 2): an MLP, whose
    # update has no BatchNorm statistics that would legitimately differ per rank.
    "mlp": Family(
        str(TINY),
        (
            "model.name=mlp",
            "model.args={hidden: [64]}",
            "train.max_steps=8",
            "train.eval_every=0",
            "checkpoint.every_n_steps=0",
        ),
        "tiny",
    ),
    # 20 steps, every one logged; a checkpoint every 6 (a kill at step 9 resumes from step 6);
    # gradients clipped (the norm spans every shard and stage).
    "transformer": Family(
        TRANSFORMER,
        (
            "train.max_steps=20",
            "checkpoint.every_n_steps=6",
            "checkpoint.keep_last=3",
            "train.log_every=1",
            "train.eval_every=10",
            "train.clip_grad_norm=1.0",
            "tracking.system_metrics=false",
        ),
        "trainserve-digit-sequences",
    ),
    # FSDP2 on the transformer example, units by its train.fsdp_wrap. SGD, not the config's AdamW:
    # Adam divides by the gradients' running size, so the last-bit differences of another summation
    # order grow into ~1e-5 within a few steps and blur what the resume on one process checks.
    "fsdp": Family(
        TRANSFORMER,
        (
            "train.strategy=fsdp",
            "train.max_steps=12",
            "checkpoint.every_n_steps=6",
            "train.eval_every=0",
            "train.log_every=4",
            "optim.name=sgd",
            "optim.lr=0.05",
            "tracking.system_metrics=false",
        ),
        "trainserve-digit-sequences",
    ),
    # Dropout off: DDP's ranks and a tensor-parallel group draw their masks on other shapes, and the
    # losses are compared step by step.
    "bert": Family(
        BERT,
        (
            "train.max_steps=16",
            "checkpoint.every_n_steps=6",
            "train.log_every=1",
            "train.eval_every=0",
            "model.args.hidden_dropout_prob=0",
            "model.args.attention_probs_dropout_prob=0",
            "tracking.system_metrics=false",
        ),
        "trainserve-digit-sequences",
    ),
    "precision": Family(
        str(TINY),
        ("train.max_steps=0", "train.epochs=2", "train.eval_every=0", "checkpoint.every_n_steps=0"),
        "tiny",
    ),
    # Two named inputs (float32 and int64), AdamW, bf16 autocast, 2 micro-batches per step, replica
    # checks.
    "mixed": Family(
        MIXED,
        (
            "train.max_steps=16",
            "checkpoint.every_n_steps=6",
            "checkpoint.keep_last=3",
            "train.eval_every=0",
            "train.log_every=4",
            "train.precision=bf16",
            "train.grad_accum_steps=2",
            "train.consistency_every=4",
            "tracking.system_metrics=false",
        ),
        "trainserve-diabetes",
    ),
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One row: `pipeline <command>` under torchrun on `nproc` processes (0: in the command's own
    process, no torchrun), its family's overrides then its own, run name = the row's name. `resume`
    is "<row>/<checkpoint>"; `needs` the rows it is compared with (both launched first); `fault` a
    TRAINSERVE_FAULT, with one torchrun restart. What each row claims: tests/test_launches.py."""

    family: str
    nproc: int
    overrides: tuple[str, ...] = ()
    command: str = "train"
    resume: str = ""
    fault: str = ""
    needs: tuple[str, ...] = ()


@dataclasses.dataclass
class Launched:
    """What the runner knows of a launched row: its family's working directory and its console."""

    workdir: Path
    proc: object

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """Row `name`'s final model, loaded the way training resumes it."""
        return model_from_checkpoint(
            checkpoint.latest(self.workdir / "outputs" / name / "checkpoints")
        ).state_dict()

    def losses(self, name: str, experiment: str) -> dict[int, float]:
        return {
            m.step: m.value
            for m in mlflow_client(self.workdir).get_metric_history(
                self.run(name, experiment).info.run_id, "train/loss"
            )
        }

    def run(self, name: str, experiment: str):
        client = mlflow_client(self.workdir)
        return client.search_runs(
            [client.get_experiment_by_name(experiment).experiment_id],
            filter_string=f"attributes.run_name = '{name}'",
        )[0]


HSDP = ("train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2")
RUN_EVERY_STAGE = ("serve.port=0", "export.allow_below_baseline=true")
KILL_9 = "step:9:{rank}"

LAUNCHES: dict[str, Launch] = {
    # Data parallelism and accumulation: one process is the reference.
    "one": Launch("mlp", 0),
    "ddp_accum": Launch(
        "mlp",
        2,
        ("train.grad_accum_steps=2", "checkpoint.every_n_steps=4"),
        needs=("one",),
    ),
    "accum": Launch(
        "mlp",
        0,
        ("train.grad_accum_steps=2",),
        needs=("one",),
    ),
    "one_again": Launch("mlp", 0, needs=("one",)),
    "ddp_on_one": Launch(
        "mlp",
        0,
        ("train.grad_accum_steps=2",),
        resume="ddp_accum/step_00000004",
    ),
    # FSDP2.
    "fsdp": Launch("fsdp", 2),
    "fsdp_on_one": Launch("fsdp", 1, resume="fsdp/step_00000006"),
    # The device mesh on the transformer example: DDP is the reference.
    "ddp": Launch("transformer", 2),
    "hsdp": Launch("transformer", 4, HSDP, needs=("ddp",)),
    "hsdp_killed": Launch(
        "transformer",
        4,
        HSDP,
        fault=KILL_9.format(rank=3),
        needs=("hsdp",),
    ),
    "pp": Launch(
        "transformer",
        2,
        ("train.parallel.pp=2", *RUN_EVERY_STAGE),
        command="run",
        needs=("ddp",),
    ),
    # Resumes pp's own step-12 checkpoint, so it continues pp's MLflow run (steps 13-20 logged
    # again, the setup tag DDP's): pp's claim, before it in the table, is checked on the run as pp
    # left it.
    "pp_then_ddp": Launch(
        "transformer",
        2,
        resume="pp/step_00000012",
        needs=("ddp",),
    ),
    "pp_dp": Launch(
        "transformer",
        4,
        ("train.parallel.pp=2", "train.consistency_every=5"),
        needs=("ddp",),
    ),
    # Tensor parallelism on the BERT example: DDP is the reference.
    "bert": Launch("bert", 2),
    "tp": Launch(
        "bert",
        2,
        ("train.parallel.tp=2", *RUN_EVERY_STAGE),
        command="run",
        needs=("bert",),
    ),
    # Precision: bf16 autocast against fp32, two epochs on one process.
    "fp32": Launch("precision", 0, ("train.precision=fp32",)),
    "bf16": Launch(
        "precision",
        0,
        ("train.precision=bf16",),
        needs=("fp32",),
    ),
    # A model of the user's with dict inputs, under bf16 and accumulation.
    "mixed": Launch("mixed", 2),
    "mixed_killed": Launch(
        "mixed",
        2,
        fault=KILL_9.format(rank=1),
        needs=("mixed",),
    ),
}


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """The runner: `launched(name)` launches row `name` (what it resumes and needs first) once for
    the session, in its family's working directory, and returns it as `Launched`. Tests elsewhere
    that read a finished run of one of these configurations read the row's (test_own_models: pp and
    tp)."""
    done: dict[str, Launched] = {}
    workdirs: dict[str, Path] = {}

    def launch(name: str) -> Launched:
        if name in done:
            return done[name]
        row = LAUNCHES[name]
        family = FAMILIES[row.family]
        for other in (*row.needs, *([row.resume.split("/")[0]] if row.resume else [])):
            launch(other)
        if row.family not in workdirs:
            workdirs[row.family] = tmp_path_factory.mktemp(row.family)
        workdir = workdirs[row.family]
        args = [row.command, "--config", family.config]
        if row.nproc:
            args += ["--nproc-per-node", str(row.nproc)]
        if row.fault:
            args.append("--max-restarts=1")
        if row.resume:
            source, step = row.resume.split("/")
            args += ["--resume", str(workdir / "outputs" / source / "checkpoints" / step)]
        if row.command == "run":
            args.append("--serve-check")
        args += [*family.overrides, *row.overrides, f"train.run_name={name}"]
        env = {"PYTHONPATH": str(REPO)}
        if row.fault:
            env["TRAINSERVE_FAULT"] = row.fault
        proc = run_cli(args, cwd=workdir, env=env, timeout=600, check=row.command != "run")
        if row.command == "run":
            # A few steps leave the model near chance: registered (the override allows it), and
            # --serve-check exits 1 saying so, after the server's answer was checked as usual.
            assert proc.returncode == 0 or (
                proc.returncode == 1 and "failed its baseline gate" in proc.stderr
            ), proc.stderr[-4000:]
        done[name] = Launched(workdir, proc)
        return done[name]

    return launch
