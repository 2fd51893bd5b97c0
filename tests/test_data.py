"""Data loaders: digits offline, Fashion-MNIST IDX files the test writes, clear errors."""

import gzip
import struct

import numpy as np
import pytest
import torch

from pipeline.components.data import DataError, load_digits_splits, load_fashion_mnist_splits, make_train_loader


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
    a, b = load_digits_splits(0.2, 0), load_digits_splits(0.2, 0)
    assert torch.equal(a.val_y, b.val_y) and len(a.val_y) == 359 and len(a.train_y) == 1438
    assert a.train_x.shape[1:] == (1, 8, 8) and 0 <= a.train_x.min() and a.train_x.max() <= 1
    info = a.info()
    assert info["num_classes"] == 10 and info["channels"] == 1 and info["size"] == 8


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_reads_idx_files(tmp_path, gz):
    write_fashion(tmp_path, gz)
    s = load_fashion_mnist_splits(str(tmp_path))
    assert s.train_x.shape == (20, 1, 28, 28) and s.val_x.shape == (10, 1, 28, 28)
    assert s.train_x.max() <= 1 and s.labels[9] == "Ankle boot"


def test_fashion_mnist_missing_files_are_listed(tmp_path):
    with pytest.raises(DataError) as err:
        load_fashion_mnist_splits(str(tmp_path))
    msg = str(err.value)
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert name in msg
    assert "fashion-mnist" in msg


def test_fashion_mnist_truncated_file_is_named(tmp_path):
    write_fashion(tmp_path, gz=False)
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*truncated"):
        load_fashion_mnist_splits(str(tmp_path))


def test_global_batches_do_not_depend_on_world_size():
    """Rank batches of a 2-process run, put together, are the 1-process run's batches."""
    s = load_digits_splits(0.2, 0)
    one = next(iter(make_train_loader(s, 32, 0, 1, seed=3, num_workers=0, pin_memory=False)))[1]
    two = [next(iter(make_train_loader(s, 16, r, 2, seed=3, num_workers=0, pin_memory=False)))[1] for r in (0, 1)]
    assert sorted(one.tolist()) == sorted(torch.cat(two).tolist())


def test_loader_resumes_mid_epoch_without_repeating_or_skipping():
    s = load_digits_splits(0.2, 0)
    full = make_train_loader(s, 16, 0, 1, seed=1, num_workers=0, pin_memory=False)
    full.sampler.set_epoch(2)
    expected = [y for _, y in full]
    part = make_train_loader(s, 16, 0, 1, seed=1, num_workers=0, pin_memory=False)
    part.sampler.set_epoch(2)
    it = iter(part)
    seen = [next(it)[1] for _ in range(5)]
    state = part.state_dict()
    resumed = make_train_loader(s, 16, 0, 1, seed=1, num_workers=0, pin_memory=False)
    resumed.sampler.set_epoch(2)
    resumed.load_state_dict(state)
    rest = [y for _, y in resumed]
    assert len(seen) + len(rest) == len(expected)
    for a, b in zip(seen + rest, expected):
        assert torch.equal(a, b)


def test_global_batches_are_the_same_samples_in_any_world_size_across_an_epoch():
    """Stronger than labels: the images of 2 ranks' k-th batches, put together, are the 1-process
    k-th batch, batch after batch, into the next epoch's shuffle."""
    s = load_digits_splits(0.2, 0)

    def batches(world, epoch):
        loaders = [make_train_loader(s, 32 // world, r, world, seed=5, num_workers=0, pin_memory=False)
                   for r in range(world)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        return [torch.cat([x for x, _ in parts]) for parts in zip(*loaders)]

    for epoch in (0, 1):
        one, two = batches(1, epoch), batches(2, epoch)
        assert len(one) == len(two) == 1438 // 32
        for a, b in zip(one, two):
            key = lambda t: sorted(map(tuple, t.flatten(1).tolist()))  # noqa: E731  (order within a batch is free)
            assert key(a) == key(b)
    assert not torch.equal(batches(1, 0)[0], batches(1, 1)[0])  # and each epoch reshuffles


def test_a_training_set_smaller_than_one_global_batch_is_refused():
    s = load_digits_splits(0.2, 0)
    with pytest.raises(DataError, match="fewer than one global batch \\(2048\\)"):
        make_train_loader(s, 512, 0, 2, seed=0, num_workers=0, pin_memory=False, grad_accum_steps=2)
