"""Exact resume with randomness in every step: one rank killed with SIGKILL, torchrun restarts the
job, and the resumed run ends with the weights of a run that was never interrupted, to the byte,
under every mesh (DDP with loader workers, FSDP2, tensor and pipeline parallelism), killed
mid-epoch, and under DDP killed again, after the restart, right after an epoch-boundary checkpoint.

The randomness: the model's dropout, and a data set that draws per item from torch's, numpy's and
Python's generators, read in the training process or in loader workers. One table: a row is a mesh
and where it is killed. Each mesh's uninterrupted run is shared by its rows. That the randomness is
really drawn (dropout in training mode, the data set's noise), the generators, a checkpoint from
before they were all saved, and the loaders' own seeds are checked in process at the end, in
seconds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import (
    CPU1,
    REPO,
    checkpoint_meta,
    mlflow_client,
    mlp_spec,
    model_from_checkpoint,
    run_cli,
)
from torch.utils.data import Dataset

from pipeline import checkpoint
from pipeline.components.build import build_data, instantiate_model, model_spec, probe
from pipeline.components.data import first_batch, forward
from pipeline.config import load_config
from pipeline.tasks import build_task

TRANSFORMER = str(REPO / "configs/digit_sequences_transformer.yaml")
BERT = str(REPO / "configs/digit_sequences_bert.yaml")
# 1,438 training samples in global batches of 400: 3 steps an epoch. A checkpoint every 2 steps:
# step 2 is mid-epoch, step 6 ends the second epoch.
STEPS = [
    "train.max_steps=7",
    "train.global_batch_size=400",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=5",
    "train.eval_every=7",
    "train.log_every=1",
    "tracking.system_metrics=false",
    # This file's data component (the runs have tests/ on their PYTHONPATH).
    "data.component=test_exact_resume:noisy_digit_sequences",
]
SMALL_TRANSFORMER = "model.args={dim: 16, heads: 2, layers: 2, dropout: 0.1}"
# The BERT example as shipped keeps Hugging Face's dropout of 0.1 (hidden states and attention).
SMALL_BERT = [
    "model.args.hidden_size=16",
    "model.args.num_hidden_layers=1",
    "model.args.num_attention_heads=2",
    "model.args.intermediate_size=32",
]
NO_DROPOUT = ["model.args.dropout=0"]
NO_BERT_DROPOUT = [
    "model.args.hidden_dropout_prob=0",
    "model.args.attention_probs_dropout_prob=0",
]
# mesh: (config, overrides)
MESHES = {
    # The data set's draws made in 2 loader workers per rank, which a resume starts afresh
    # mid-epoch.
    "ddp-2-workers": (TRANSFORMER, [SMALL_TRANSFORMER, "data.num_workers=2"]),
    "fsdp2": (TRANSFORMER, [SMALL_TRANSFORMER, "train.strategy=fsdp"]),
    "tp": (BERT, [*SMALL_BERT, "train.parallel.tp=2"]),
    "pp": (TRANSFORMER, [SMALL_TRANSFORMER, "train.parallel.pp=2"]),
}
# where: (the step after which rank 1 is killed, the checkpoint the restart resumes from, its epoch)
KILLS = {"mid-epoch": (3, 2, 0), "epoch-end": (7, 6, 1)}
# A row is a mesh and its kills, one per attempt. Every mesh mid-epoch; under DDP the restarted run
# is killed again at the epoch boundary (the loader's next epoch, reshuffled), which its second
# restart resumes.
ROWS = {
    **{mesh: ("mid-epoch",) for mesh in MESHES},
    "ddp-2-workers": ("mid-epoch", "epoch-end"),
}


class NoisySequences(Dataset):
    """The digit sequences with a random corruption per item, drawn from all three of a process's
    generators: which tokens (torch), whether (Python's random) and by which token (numpy) they are
    replaced."""

    def __init__(self, inner: Dataset, noise: float):
        self.inner, self.noise = inner, noise
        self.classes, self.model_args = inner.classes, inner.model_args

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        inputs, label = self.inner[i]
        if not self.noise:
            return inputs, label
        key = "tokens" if "tokens" in inputs else "input_ids"
        tokens = inputs[key].clone()
        where = (torch.rand(tokens.shape) < self.noise) & (tokens != 0)
        if random.random() < 0.5:
            tokens[where] = int(np.random.randint(1, 18))
        return {**inputs, key: tokens}, label


def noisy_digit_sequences(noise: float = 0.2, names: str = "plain") -> dict[str, Dataset]:
    """A data component: the example's digit sequences, the training split corrupted at random per
    item."""
    from examples.digit_sequences.data import digit_sequences

    splits = digit_sequences(names=names)
    return {"train": NoisySequences(splits["train"], noise), "val": splits["val"]}


def train(workdir, mesh: str, name: str, env=None, max_restarts=0):
    config, overrides = MESHES[mesh]
    return run_cli(
        [
            "train",
            "--config",
            config,
            "--nproc-per-node",
            "2",
            f"--max-restarts={max_restarts}",
            *STEPS,
            *overrides,
            f"train.run_name={name}",
        ],
        cwd=workdir,
        env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", **(env or {})},
        timeout=600,
    )


def weights(workdir, name: str) -> dict[str, torch.Tensor]:
    """The final checkpoint's model, as consolidation reads it (every shard, resharded into one
    model)."""
    return model_from_checkpoint(
        checkpoint.latest(workdir / "outputs" / name / "checkpoints")
    ).state_dict()


def losses(workdir, name: str):
    """Run `name`'s MLflow run and its train/loss history, (step, value) in step order."""
    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("trainserve-digit-sequences").experiment_id
    run = client.search_runs([experiment], filter_string=f"attributes.run_name = '{name}'")[0]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    return run, sorted((m.step, m.value) for m in history)


def differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each mesh's run straight through, trained once in one working directory (one MLflow store)
    for all rows."""
    workdir = tmp_path_factory.mktemp("exact-resume")
    done: set[str] = set()

    def reference(mesh: str):
        if mesh not in done:
            train(workdir, mesh, f"{mesh}-straight")
            done.add(mesh)
        return workdir

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ROWS)
def test_a_kill_9_resumes_to_the_weights_of_an_uninterrupted_run(uninterrupted, mesh):
    workdir = uninterrupted(mesh)
    wheres = ROWS[mesh]
    name = f"{mesh}-killed-{'-then-'.join(wheres)}"
    proc = train(
        workdir,
        mesh,
        name,
        env={"TRAINSERVE_FAULT": ",".join(f"step:{KILLS[where][0]}:1" for where in wheres)},
        max_restarts=len(wheres),
    )
    for where in wheres:
        killed_at, resumed_from, epoch = KILLS[where]
        assert f"SIGKILL to rank 1 at step {killed_at}" in proc.stderr
        assert (
            f"{checkpoint.step_dir_name(resumed_from)} at step {resumed_from} (epoch {epoch})"
            in proc.stderr
        )
        assert f"already holds metrics up to step {killed_at}" in proc.stderr
    assert differing(weights(workdir, f"{mesh}-straight"), weights(workdir, name)) == []
    # One MLflow run across the restarts, each step's loss logged once (the replays are not logged
    # again), and the losses the uninterrupted run logged.
    run, logged = losses(workdir, name)
    assert run.info.status == "FINISHED"
    assert [step for step, _ in logged] == list(range(1, 8))
    assert logged == losses(workdir, f"{mesh}-straight")[1]


# --- the generators, in process ------------------------------------------------------------------


def draws() -> tuple:
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random(), random.gauss(0, 1))


def saved(tmp_path, monkeypatch=None, leave_out: str | None = None):
    """A checkpoint of a small model saved now (without the generator `leave_out`, as an older
    version saved it), and the draws that follow the save."""
    from pipeline.checkpoint import dcp

    if leave_out:
        full = dcp.rng_state
        monkeypatch.setattr(
            dcp, "rng_state", lambda: {k: v for k, v in full().items() if k != leave_out}
        )
    spec = mlp_spec()
    model = instantiate_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = checkpoint.save(tmp_path, 1, model, optimizer, checkpoint_meta(model, spec), CPU1, 1)
    return path, spec, draws()


def reseed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_every_generator_of_the_training_process_is_restored_by_a_load(tmp_path):
    """torch's, numpy's (its cached Gaussian too) and Python's `random`, with the second value of
    the pair random.gauss draws (it caches one), which a resume used to drop."""
    random.gauss(0, 1)
    np.random.standard_normal()
    path, spec, after_save = saved(tmp_path)
    reseed_all(1)
    checkpoint.load(path, instantiate_model(spec), None, CPU1)
    assert draws() == after_save


def test_a_checkpoint_saved_without_pythons_cached_gaussian_still_loads(tmp_path, monkeypatch):
    random.seed(5)
    random.gauss(0, 1)
    path, spec, after_save = saved(tmp_path, monkeypatch, leave_out="python_gauss")
    reseed_all(1)
    checkpoint.load(path, instantiate_model(spec), None, CPU1)
    # Every generator as saved, but the pair's second Gaussian, which such a checkpoint does not
    # hold.
    assert draws()[:3] == after_save[:3]


def test_the_loaders_leave_the_training_generators_alone():
    """A DataLoader draws its workers' base seed from torch's default generator when it has none of
    its own, at every iterator it creates; a resume creates its iterators at other points than the
    uninterrupted run did."""
    from pipeline.components.data import eval_loader, first_batch, make_train_loader
    from pipeline.plan import BatchPlan

    splits = noisy_digit_sequences(noise=0)
    before = torch.get_rng_state()
    train_loader = make_train_loader(
        splits["train"], BatchPlan(rows=8, data_parallel=2), 0, 0, 0, False
    )
    next(iter(train_loader))
    next(iter(eval_loader(splits["val"])))
    first_batch(splits["val"], 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_loader_workers_draw_for_a_batch_what_the_batch_alone_decides():
    """A resume starts fresh workers mid-epoch: what they draw for the rest of the epoch is what the
    first run's workers drew; and what 2 workers draw, 1 draws."""
    from pipeline.components.data import make_train_loader, restore_loader, set_epoch
    from pipeline.plan import BatchPlan

    data = noisy_digit_sequences()["train"]

    def loader(workers: int):
        made = make_train_loader(data, BatchPlan(rows=16, data_parallel=2), 1, 0, workers, False)
        set_epoch(made, 1)
        return made

    def tokens(batches, count: int) -> list[torch.Tensor]:
        return [inputs["tokens"] for inputs, _ in (next(batches) for _ in range(count))]

    first = loader(2)
    batches = iter(first)
    drawn = tokens(batches, 2)
    position = first.state_dict()
    drawn += tokens(batches, 3)
    resumed = loader(2)
    restore_loader(resumed, position, 1, 2, 2)
    alone = tokens(iter(loader(1)), 5)
    assert all(map(torch.equal, drawn, [*drawn[:2], *tokens(iter(resumed), 3)]))
    assert all(map(torch.equal, drawn, alone))


# --- the randomness the rows resume, in process ---------------------------------------------------


def built(config: str, overrides: list[str]):
    """The model and data a training of `config` builds: the file's data component, the mesh's
    model."""
    cfg = load_config(config, [*STEPS, *overrides])
    splits = build_data(cfg.data, cfg.task.name)
    task = build_task(cfg.task, splits.classes)
    spec, _ = model_spec(cfg.model, splits, task)
    model = instantiate_model(spec)
    # As training does: the probe also teaches the task the model's output layout.
    probe(model, splits, task, spec.component)
    return model, splits, task


@pytest.mark.parametrize(
    "config, overrides, turned_off",
    [(TRANSFORMER, [SMALL_TRANSFORMER], NO_DROPOUT), (BERT, SMALL_BERT, NO_BERT_DROPOUT)],
    ids=["transformer", "bert"],
)
def test_the_models_the_rows_train_draw_dropout_in_training(config, overrides, turned_off):
    """Without this, a row could pass because nothing in its training step draws a random number: in
    training mode the loss of a batch depends on the generator's state, and with the model's dropout
    turned off it does not."""

    def losses_under_two_seeds(extra: list[str]) -> list[torch.Tensor]:
        model, splits, task = built(config, [*overrides, *extra])
        inputs, targets = first_batch(splits.val, 8)
        model.train()
        drawn = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            drawn.append(task.loss(forward(model, inputs), targets))
        return drawn

    assert not torch.equal(*losses_under_two_seeds([]))
    assert torch.equal(*losses_under_two_seeds(turned_off))


def test_the_data_set_the_rows_read_draws_from_every_generator():
    """An item of the training split is another item under other seeds of each of torch's, numpy's
    and Python's generators, and the same item with the noise turned off."""
    noisy, plain = noisy_digit_sequences()["train"], noisy_digit_sequences(noise=0)["train"]

    def tokens(data, seeds) -> list[torch.Tensor]:
        torch.manual_seed(seeds[0])
        np.random.seed(seeds[1])
        random.seed(seeds[2])
        return [data[i][0]["tokens"] for i in range(16)]

    seeds = (1, 1, 1)
    for other in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        assert not all(map(torch.equal, tokens(noisy, seeds), tokens(noisy, other))), other
        assert all(map(torch.equal, tokens(plain, seeds), tokens(plain, other))), other
