"""What an image request costs the server before its model runs: decoding the file and applying the
training transform (serving/images.py `tensor`: Pillow's decode, convert, resize, /255, layout), per
image, for the files clients send, against the same with Pillow's JPEG `draft` (libjpeg scales the
DCT down by 1/2, 1/4 or 1/8 while it decodes, when the target is that much smaller).

Files (made here with Pillow from a smooth random image, so JPEG compresses them as it does photos):

  grey PNG 8x8 -> L 8x8                the digits of the README, as files
  grey PNG 32x32 -> L 32x32            docs/data.md's image folder
  RGB JPEG 224x224 -> RGB 224x224      a photo already at a model's size (no resize)
  RGB JPEG 1024x768 -> RGB 224x224     a phone photo, resized down
  RGB JPEG 4032x3024 -> RGB 224x224    a 12-megapixel camera photo

Each line: the median of REPEATS runs of a loop over the file (after one warm-up), in microseconds
per image, and the encoded size; `draft` lines also give how far the draft tensor is from the exact
one (max abs, on [0, 1]): the server applies the exact transform (the one training applied), so
draft is measured, not used. Run in an environment with pillow-simd instead of Pillow, it measures
that: its resize is several times faster, and its pixels differ from Pillow's by up to 1/255, so a
server on it would not compute training's tensors unless training read its files with it too.

    .venv/bin/python benchmarks/image_decode.py
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.images import Preprocessing, apply, tensor  # noqa: E402

REPEATS = 5


def smooth(width: int, height: int, channels: int) -> np.ndarray:
    """A smooth random image (low frequencies, some noise): compresses as photos do."""
    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, (max(2, height // 32), max(2, width // 32), channels), np.uint8)
    image = Image.fromarray(coarse[:, :, 0] if channels == 1 else coarse).resize(
        (width, height), Image.BICUBIC
    )
    pixels = np.asarray(image, np.int16) + rng.integers(-8, 9, np.asarray(image).shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, format_: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format_, **({"quality": 90} if format_ == "JPEG" else {}))
    return buffer.getvalue()


def per_image_us(fn, data: bytes, loops: int) -> float:
    fn(data)
    runs = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(loops):
            fn(data)
        runs.append((time.perf_counter() - started) / loops * 1e6)
    return statistics.median(runs)


def drafted(preprocessing: Preprocessing, data: bytes) -> np.ndarray:
    """`tensor` with Pillow's draft asked first: libjpeg decodes at the smallest 1/2^k scale still
    >= the size."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft(preprocessing.mode, preprocessing.size)
        return apply(preprocessing, image)


def main() -> None:
    cases = [
        ("grey PNG 8x8 -> L 8x8", smooth(8, 8, 1), "PNG", Preprocessing("L", (8, 8))),
        ("grey PNG 32x32 -> L 32x32", smooth(32, 32, 1), "PNG", Preprocessing("L", (32, 32))),
        (
            "RGB JPEG 224x224 -> 224x224",
            smooth(224, 224, 3),
            "JPEG",
            Preprocessing("RGB", (224, 224)),
        ),
        (
            "RGB JPEG 1024x768 -> 224x224",
            smooth(1024, 768, 3),
            "JPEG",
            Preprocessing("RGB", (224, 224)),
        ),
        (
            "RGB JPEG 4032x3024 -> 224x224",
            smooth(4032, 3024, 3),
            "JPEG",
            Preprocessing("RGB", (224, 224)),
        ),
    ]
    import PIL

    print(f"Pillow {PIL.__version__}; median of {REPEATS} runs, microseconds per image")
    print(
        f"{'file -> tensor':34s} {'bytes':>9s} {'exact us':>10s} {'draft us':>10s} "
        f"{'draft max abs':>14s}"
    )
    for name, pixels, format_, preprocessing in cases:
        data = encoded(pixels, format_)
        loops = max(1, int(2e5 // pixels.size) or 1)
        exact = per_image_us(lambda d, p=preprocessing: tensor(p, d), data, loops)
        line = f"{name:34s} {len(data):9d} {exact:10.0f}"
        if format_ == "JPEG":
            fast = per_image_us(lambda d, p=preprocessing: drafted(p, d), data, loops)
            off = float(np.max(np.abs(drafted(preprocessing, data) - tensor(preprocessing, data))))
            line += f" {fast:10.0f} {off:14.3f}"
        print(line)


if __name__ == "__main__":
    main()
