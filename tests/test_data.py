"""Data: the built-in data sets (digits offline, Fashion-MNIST IDX files the test writes), the
loaders that shard them, and clear errors."""

import gzip
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from pipeline.components.data import DataError, make_train_loader, rescale_loader_state
from pipeline.datasets import digits, fashion_mnist
from pipeline.plan import BatchPlan


def write_idx(path, array: np.ndarray, gz: bool):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def write_fashion(tmp_path, gz: bool, n_train=20, n_val=10):
    rng = np.random.default_rng(0)
    write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, (n_train, 28, 28)), gz)
    write_idx(tmp_path / "train-labels-idx1-ubyte", rng.integers(0, 10, (n_train,)), gz)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_val, 28, 28)), gz)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", rng.integers(0, 10, (n_val,)), gz)


def test_digits_split_is_fixed_and_scaled():
    a, b = digits(0.2, 0), digits(0.2, 0)
    assert torch.equal(a["val"].y, b["val"].y) and len(a["val"]) == 359 and len(a["train"]) == 1438
    x = a["train"].x
    assert x.shape[1:] == (1, 8, 8) and 0 <= x.min() and x.max() <= 1
    assert a["train"].classes == [str(d) for d in range(10)]
    # What the training set suggests for the built-in models: input shape and its own statistics.
    hints = a["train"].model_args
    assert hints["in_channels"] == 1 and hints["image_size"] == 8
    assert hints["mean"] == pytest.approx([x.mean().item()]) and hints["std"] == pytest.approx(
        [x.std().item()]
    )


def test_digits_are_scikit_learns_without_importing_it(tmp_path):
    """The built-in digits are read from the file scikit-learn ships: the same images and targets as
    its loader, and scikit-learn stays unimported (its import was most of the data's start-up
    time)."""
    code = (
        "import sys; from pipeline.datasets.digits import load_digits; images, target = load_digits(); "
        "assert 'sklearn' not in sys.modules, 'sklearn was imported'; "
        "import numpy as np; np.save(sys.argv[1], images); np.save(sys.argv[2], target)"
    )
    paths = [str(tmp_path / "images.npy"), str(tmp_path / "target.npy")]
    subprocess.run(
        [sys.executable, "-c", code, *paths], check=True, cwd=Path(__file__).resolve().parents[1]
    )
    images, target = np.load(paths[0]), np.load(paths[1])
    from sklearn.datasets import load_digits

    data = load_digits()
    assert images.shape == data.images.shape == (1797, 8, 8) and images.dtype == data.images.dtype
    assert np.array_equal(images, data.images) and np.array_equal(target, data.target)


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_reads_idx_files(tmp_path, gz):
    write_fashion(tmp_path, gz)
    s = fashion_mnist(str(tmp_path))
    assert s["train"].x.shape == (20, 1, 28, 28) and s["val"].x.shape == (10, 1, 28, 28)
    assert s["train"].x.max() <= 1 and s["train"].classes[9] == "Ankle boot"


def test_fashion_mnist_missing_files_are_listed(tmp_path):
    with pytest.raises(DataError) as err:
        fashion_mnist(str(tmp_path))
    msg = str(err.value)
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert name in msg
    assert "fashion-mnist" in msg


def test_fashion_mnist_truncated_file_is_named(tmp_path):
    write_fashion(tmp_path, gz=False)
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*truncated"):
        fashion_mnist(str(tmp_path))


def test_global_batches_do_not_depend_on_world_size():
    """Rank batches of a 2-process run, put together, are the 1-process run's batches."""
    s = digits(0.2, 0)["train"]
    whole, halves = BatchPlan(rows=32), BatchPlan(rows=16, data_parallel=2)
    one = next(iter(make_train_loader(s, whole, 0, seed=3, num_workers=0, pin_memory=False)))[1]
    two = [
        next(iter(make_train_loader(s, halves, r, seed=3, num_workers=0, pin_memory=False)))[1]
        for r in (0, 1)
    ]
    assert sorted(one.tolist()) == sorted(torch.cat(two).tolist())


def test_loader_resumes_mid_epoch_without_repeating_or_skipping():
    s = digits(0.2, 0)["train"]
    full = make_train_loader(s, BatchPlan(rows=16), 0, seed=1, num_workers=0, pin_memory=False)
    full.sampler.set_epoch(2)
    expected = [y for _, y in full]
    part = make_train_loader(s, BatchPlan(rows=16), 0, seed=1, num_workers=0, pin_memory=False)
    part.sampler.set_epoch(2)
    it = iter(part)
    seen = [next(it)[1] for _ in range(5)]
    state = part.state_dict()
    resumed = make_train_loader(s, BatchPlan(rows=16), 0, seed=1, num_workers=0, pin_memory=False)
    resumed.sampler.set_epoch(2)
    resumed.load_state_dict(state)
    rest = [y for _, y in resumed]
    assert len(seen) + len(rest) == len(expected)
    for a, b in zip(seen + rest, expected):
        assert torch.equal(a, b)


def test_global_batches_are_the_same_samples_in_any_world_size_across_an_epoch():
    """Stronger than labels: the images of 2 ranks' k-th batches, put together, are the 1-process
    k-th batch, batch after batch, into the next epoch's shuffle."""
    s = digits(0.2, 0)["train"]

    def batches(world, epoch):
        plan = BatchPlan(rows=32 // world, data_parallel=world)
        loaders = [
            make_train_loader(s, plan, r, seed=5, num_workers=0, pin_memory=False)
            for r in range(world)
        ]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        return [torch.cat([x for x, _ in parts]) for parts in zip(*loaders)]

    for epoch in (0, 1):
        one, two = batches(1, epoch), batches(2, epoch)
        assert len(one) == len(two) == 1438 // 32
        for a, b in zip(one, two):
            # order within a batch is free
            key = lambda t: sorted(map(tuple, t.flatten(1).tolist()))  # noqa: E731
            assert key(a) == key(b)
    # and each epoch reshuffles
    assert not torch.equal(batches(1, 0)[0], batches(1, 1)[0])


def test_a_training_set_smaller_than_one_global_batch_is_refused():
    s = digits(0.2, 0)["train"]
    with pytest.raises(DataError, match="fewer than one global batch \\(2048\\)"):
        make_train_loader(
            s,
            BatchPlan(rows=512, data_parallel=2, accumulation=2),
            0,
            seed=0,
            num_workers=0,
            pin_memory=False,
        )


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_position_moves_to_another_world_size_with_or_without_workers(workers):
    """2 ranks stop after 3 batches; 1 rank resumed from rank 0's state (rescaled) continues with
    exactly the samples the 2 ranks had not seen. With workers, torchdata nests the position in a
    snapshot."""
    s = digits(0.2, 0)["train"]
    loaders = [
        make_train_loader(
            s, BatchPlan(rows=8, data_parallel=2), r, seed=4, num_workers=workers, pin_memory=False
        )
        for r in (0, 1)
    ]
    seen = []
    for loader in loaders:
        it = iter(loader)
        seen += [x for _ in range(3) for x in next(it)[0]]
    state = loaders[0].state_dict()

    one = make_train_loader(s, BatchPlan(rows=16), 0, seed=4, num_workers=workers, pin_memory=False)
    one.load_state_dict(rescale_loader_state(state, saved_world=2, world=1))
    rest = [x for batch, _ in one for x in batch]
    reference = [
        x
        for batch, _ in make_train_loader(
            s, BatchPlan(rows=16), 0, seed=4, num_workers=0, pin_memory=False
        )
        for x in batch
    ]
    key = lambda xs: sorted(tuple(x.flatten().tolist()) for x in xs)  # noqa: E731
    assert len(seen) == 48 and len(seen) + len(rest) == len(reference)
    assert key(seen + rest) == key(reference)


# --- what collation will refuse, refused before any process starts --------------------------------

SEQUENCES = '''
import torch
from torch.utils.data import Dataset


class Sequences(Dataset):
    """Token sequences of 5 to 12 tokens (as text is before padding), a class per sequence or per token."""

    def __init__(self, n, per_token=False, length=0):
        g = torch.Generator().manual_seed(n)
        self.items = []
        for i in range(n):
            tokens = torch.randint(1, 20, (length or 5 + i % 8,), generator=g)
            self.items.append(({"tokens": tokens}, tokens % 3 if per_token else torch.tensor(i % 3)))
        self.classes = ["a", "b", "c"]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad(items):
    """Each batch padded to its longest sequence with token 0."""
    longest = max(len(inputs["tokens"]) for inputs, _ in items)
    tokens = torch.zeros(len(items), longest, dtype=torch.long)
    for row, (inputs, _) in enumerate(items):
        tokens[row, :len(inputs["tokens"])] = inputs["tokens"]
    return {"tokens": tokens}, torch.stack([label for _, label in items])


def data(per_token=False, length=0, collate=""):
    splits = {"train": Sequences(64, per_token, length), "val": Sequences(16, per_token, length)}
    for split in splits.values():
        if collate == "pad":
            split.collate_fn = pad
        elif collate == "broken":
            split.collate_fn = lambda items: 1 / 0
        elif collate == "text":
            split.collate_fn = "pad"
    return splits


class Bag(torch.nn.Module):
    """The mean of the token embeddings (padding included: good enough to be trained)."""

    def __init__(self, num_classes):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, num_classes)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))
'''


@pytest.fixture
def sequences(tmp_path, monkeypatch):
    """A user's project with sequences of different lengths, importable here and by the CLI
    (PYTHONPATH)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "seqdata.py").write_text(SEQUENCES)
    (project / "seq.yaml").write_text(
        "data: {component: seqdata:data}\nmodel: {component: seqdata:Bag}\n"
        "train: {global_batch_size: 8, max_steps: 2, eval_every: 0}\n"
    )
    monkeypatch.syspath_prepend(str(project))
    yield project
    sys.modules.pop("seqdata", None)


def refused_by_the_cli(project, command: str, *overrides: str) -> str:
    """`pipeline <command> --nproc-per-node 2` on the project: exit 2, one line on stderr, no
    process started; returns the line."""
    proc = run_cli(
        [command, "--config", str(project / "seq.yaml"), "--nproc-per-node", "2", *overrides],
        cwd=project,
        env={"PYTHONPATH": str(project)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pipeline {command}: error: "), proc.stderr
    # nothing started: no run directory
    assert not (project / "outputs").exists()
    return lines[0]


@pytest.mark.parametrize("command", ["run", "train"])
def test_items_of_different_lengths_stop_before_any_process_starts(sequences, command):
    """torchrun would start both ranks and each would fail in its first step (130 lines of
    tracebacks)."""
    message = refused_by_the_cli(sequences, command)
    assert (
        "data.component 'seqdata:data' split 'train': items 0 and 9 differ: input 'tokens' has shape [5] in "
        "item 0, [6] in item 9, so they do not stack into one batch"
    ) in message, message
    assert "pad them to one length" in message and "give the data set a `collate_fn`" in message, (
        message
    )


def test_per_token_labels_under_classification_point_to_token_classification(sequences):
    message = refused_by_the_cli(
        sequences, "run", "data.args.per_token=true", "data.args.length=12"
    )
    assert (
        "split 'train' item 0: the target is a int64 tensor of shape [12]; classification needs an int64 class "
        "index"
    ) in message, message
    assert (
        "set task.name=token_classification" in message and "torch.tensor(label" not in message
    ), message


def test_a_label_of_the_wrong_kind_still_gets_the_plain_hint(sequences):
    from pipeline.tasks.classification import Classification

    with pytest.raises(DataError, match=r"use torch.tensor\(label, dtype=torch.long\)"):
        Classification.check_target("cat", None, "item 0")
    with pytest.raises(DataError, match="for a class per pixel .* set task.name=segmentation"):
        Classification.check_target(torch.zeros(4, 4, dtype=torch.long), None, "item 0")


def test_a_collate_fn_of_the_data_set_is_checked_and_used_by_every_loader(sequences):
    from pipeline.components.build import build_data, preflight
    from pipeline.components.data import eval_loader, eval_shard, first_batch
    from pipeline.config import load_config

    cfg = load_config(sequences / "seq.yaml", ["data.args.collate=pad"])
    # ragged, and padded by the data set
    built = preflight(cfg.data, cfg.task, cfg.model, cfg.train, cfg.export)
    inputs, target = first_batch(built.splits.val, 3)
    # lengths 5, 6, 7
    assert inputs["tokens"].shape == (3, 7) and target.tolist() == [0, 1, 2]
    # through a Subset: items 0 and 8
    ((inputs, _),) = list(eval_loader(eval_shard(built.splits.val, 0, 8), 4))
    assert inputs["tokens"].shape == (2, 5)
    loader = make_train_loader(
        built.splits.train, BatchPlan(rows=4, data_parallel=2), 0, 0, 0, False
    )
    assert all(inputs["tokens"].shape[0] == 4 for inputs, _ in loader)

    for collate, expected in (
        (
            "broken",
            "split 'train': its collate_fn raised ZeroDivisionError on items [0, 9, 18, "
            "27, 36, 45, 54, 63]: division by zero",
        ),
        ("text", "split 'train': its `collate_fn` is a str, not callable"),
    ):
        cfg = load_config(sequences / "seq.yaml", [f"data.args.collate={collate}"])
        with pytest.raises(DataError, match=re.escape(expected)):
            build_data(cfg.data, cfg.task.name)
