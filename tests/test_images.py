"""serving/images.py: an image model's preprocessing as data, and the function that applies it, the
one `pipeline.datasets:image_folder` reads its files through. Real files of every kind a folder of
photos holds (grey and colour PNG, JPEG, a palette GIF, an RGBA PNG, sizes that need resizing up and
down), written with Pillow; the training transform as it was written before it became data is the
reference."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from serving.images import Preprocessing, apply


def photos(root):
    """Two classes of images in the modes and formats a folder of photos holds."""
    rng = np.random.default_rng(0)
    made = []
    for i, (mode, suffix, size) in enumerate(
        [
            ("L", "png", (28, 28)),
            ("RGB", "jpg", (40, 30)),
            ("RGBA", "png", (9, 13)),
            ("P", "gif", (32, 32)),
            ("L", "jpg", (64, 48)),
            ("RGB", "png", (16, 16)),
        ]
    ):
        channels = {"L": 1, "P": 1, "RGB": 3, "RGBA": 4}[mode]
        pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
        image = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels)
        image = image.convert(mode) if mode == "P" else image
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i}.{suffix}")
        made.append(folder / f"{i}.{suffix}")
    return made


def as_training_wrote_it(path, mode: str, image_size: int) -> np.ndarray:
    """image_folder's transform as it was written in pipeline/datasets/image_folder.py before it
    became data."""
    with Image.open(path) as image:
        pixels = image.convert(mode).resize((image_size, image_size), Image.BILINEAR)
    x = np.asarray(pixels, dtype=np.float32) / 255.0
    return x[None] if x.ndim == 2 else x.transpose(2, 0, 1)


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_image_folder_reads_every_file_through_its_description_as_training_did(tmp_path, mode):
    from pipeline.datasets.image_folder import image_folder

    photos(tmp_path / "photos")
    splits = image_folder(str(tmp_path / "photos"), image_size=20, mode=mode, val_fraction=0.34)
    for split in splits.values():
        assert split.preprocessing == Preprocessing(mode=mode, size=(20, 20))
        for i, (path, _) in enumerate(split.files):
            sample = split[i][0].numpy()
            with Image.open(path) as image:
                served = apply(Preprocessing.from_json(split.preprocessing.to_json()), image)
            assert sample.dtype == served.dtype == np.float32
            assert sample.shape == served.shape == split.preprocessing.shape
            # Bit for bit: what a server computes from the file is the tensor the model trained on.
            assert np.array_equal(sample, served) and np.array_equal(
                served, as_training_wrote_it(path, mode, 20)
            ), path


def test_normalization_and_layout_are_applied_as_described(tmp_path):
    path = photos(tmp_path)[1]
    plain = Preprocessing(mode="RGB", size=(8, 6))
    normalized = Preprocessing(
        mode="RGB", size=(8, 6), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5), layout="HWC"
    )
    with Image.open(path) as image:
        x, y = apply(plain, image), apply(normalized, image)
    assert x.shape == plain.shape == (3, 6, 8) and y.shape == normalized.shape == (6, 8, 3)
    expected = (x.transpose(1, 2, 0) - np.float32([0.5, 0.4, 0.3])) / np.float32([0.2, 0.25, 0.5])
    assert np.array_equal(y, expected)
    assert json.loads(json.dumps(normalized.to_json())) == {
        "mode": "RGB",
        "size": [8, 6],
        "resample": "bilinear",
        "divide_by": 255.0,
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.25, 0.5],
        "layout": "HWC",
    }
    assert Preprocessing.from_json(normalized.to_json()) == normalized


@pytest.mark.parametrize(
    "description, message",
    [
        ({"mode": "CMYK", "size": [8, 8]}, "mode 'CMYK': give one of L, RGB"),
        ({"mode": "L", "size": [8]}, "size (8,): give [width, height], whole numbers above 0"),
        (
            {"mode": "L", "size": [8, 8], "mean": [0.5, 0.5], "std": [1, 1]},
            "mean has 2 values for mode L's channels",
        ),
        ({"mode": "L", "size": [8, 8], "mean": [0.5]}, "mean and std go together"),
        ({"mode": "L", "size": [8, 8], "layout": "NCHW"}, "layout 'NCHW': give one of CHW, HWC"),
        ({"mode": "L", "size": [8, 8], "scale": 255}, "unknown keys ['scale']"),
        ({"size": [8, 8]}, "missing ['mode']"),
    ],
)
def test_a_description_that_does_not_fit_is_refused_naming_what(description, message):
    with pytest.raises(ValueError, match="image preprocessing: ") as refused:
        Preprocessing.from_json(description)
    assert message in str(refused.value), refused.value


def test_it_needs_neither_torch_nor_the_pipeline():
    """The server imports it, and serving/ never imports torch or pipeline/."""
    code = (
        "import sys, serving.images; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pipeline')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
