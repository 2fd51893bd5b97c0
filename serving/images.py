"""An image model's input preprocessing, as data, and the one function that applies it to a decoded
image.

A `Preprocessing` says how an image file became the tensor a model was trained on: the Pillow mode
it was converted to (`L`: 1 channel, `RGB`: 3, alpha dropped), the size it was resized to and how,
the number its pixel values were divided by, the per-channel mean and std subtracted and divided by
after that (none when the model normalizes inside its graph, as the built-in models do), and the
layout of the result (`CHW`: channels first, or `HWC`). `apply` turns a decoded image into exactly
that float32 array, one sample without a batch axis. The training data
(`pipeline.datasets:image_folder`) reads its files through this same function, so a server that
decodes an image and applies its model's description computes the tensor training computed, bit for
bit. numpy and Pillow only: the server never imports torch.

An exported model carries its description in its ONNX metadata (`lineage.PREPROCESSING`: `recorded`
reads it, `record` writes it); `tensor` is what a server computes from a file's bytes: `decode` (the
formats in FORMATS only, at most MAX_PIXELS pixels, read from the header before a pixel is decoded),
then `apply`.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, fields

import numpy as np
from PIL import Image, UnidentifiedImageError

from serving.lineage import PREPROCESSING

MODES = {"L": 1, "RGB": 3}
RESAMPLING = {
    "nearest": Image.NEAREST,
    "bilinear": Image.BILINEAR,
    "bicubic": Image.BICUBIC,
    "lanczos": Image.LANCZOS,
}
LAYOUTS = ("CHW", "HWC")
# What a server decodes: the formats a folder of photos for image_folder holds, but TIFF (a large
# attack surface for files from anyone).
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
# The file names of those formats (what a folder of them holds).
SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp")
# Pixels of one image a server decodes at most (a 7000 x 7000 photo): a small file can declare any
# size, and its decoded pixels would take that memory.
MAX_PIXELS = 50_000_000


@dataclass(frozen=True)
class Preprocessing:
    mode: str
    # (width, height), as Pillow's resize takes it.
    size: tuple[int, int]
    resample: str = "bilinear"
    divide_by: float = 255.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    layout: str = "CHW"

    def __post_init__(self):
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode {self.mode!r}: give one of {', '.join(MODES)}")
        if len(self.size) != 2 or any(not isinstance(s, int) or s < 1 for s in self.size):
            problems.append(f"size {self.size!r}: give [width, height], whole numbers above 0")
        if self.resample not in RESAMPLING:
            problems.append(f"resample {self.resample!r}: give one of {', '.join(RESAMPLING)}")
        if not self.divide_by > 0:
            problems.append(f"divide_by {self.divide_by!r}: give a number above 0")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None and len(value) != MODES.get(self.mode, len(value)):
                problems.append(f"{name} has {len(value)} values for mode {self.mode}'s channels")
        if (self.mean is None) != (self.std is None):
            problems.append("mean and std go together: give both or neither")
        if self.std is not None and any(not s > 0 for s in self.std):
            problems.append(f"std {list(self.std)!r}: every value above 0")
        if self.layout not in LAYOUTS:
            problems.append(f"layout {self.layout!r}: give one of {', '.join(LAYOUTS)}")
        if problems:
            raise ValueError("image preprocessing: " + "; ".join(problems))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape `apply` returns."""
        channels, (width, height) = MODES[self.mode], self.size
        return (channels, height, width) if self.layout == "CHW" else (height, width, channels)

    def to_json(self) -> dict:
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
            if v is not None
        }

    @classmethod
    def from_json(cls, data: dict) -> Preprocessing:
        """The description `to_json` wrote; ValueError naming what does not fit."""
        if not isinstance(data, dict):
            raise ValueError(f"image preprocessing: a mapping, not {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted({"mode", "size"} - set(data))
        if unknown or missing:
            raise ValueError(
                "image preprocessing: "
                + "; ".join(
                    [
                        *([f"unknown keys {unknown} (it has {sorted(known)})"] if unknown else []),
                        *([f"missing {missing}"] if missing else []),
                    ]
                )
            )
        return cls(
            **{
                k: tuple(v) if k in ("size", "mean", "std") and isinstance(v, list) else v
                for k, v in data.items()
            }
        )


def apply(preprocessing: Preprocessing, image: Image.Image) -> np.ndarray:
    """The float32 array, of `preprocessing.shape`, that `image` (decoded, any Pillow mode)
    becomes."""
    p = preprocessing
    pixels = image.convert(p.mode).resize(p.size, RESAMPLING[p.resample])
    x = np.asarray(pixels, dtype=np.float32) / np.float32(p.divide_by)
    if x.ndim == 2:
        x = x[:, :, None]
    if p.mean is not None:
        x = (x - np.asarray(p.mean, np.float32)) / np.asarray(p.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1) if p.layout == "CHW" else x)


def decode(data: bytes) -> Image.Image:
    """An encoded image file's bytes, opened: its header read, its pixels decoded when `apply` reads
    them. ValueError naming what is wrong: not a file of FORMATS, or more than MAX_PIXELS pixels."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ValueError(
            f"not an image file Pillow can read as {', '.join(FORMATS)} (another format, or a damaged or "
            f"truncated file: {len(data)} bytes, beginning {bytes(data[:8])!r})"
        ) from None
    width, height = image.size
    if width * height > MAX_PIXELS:
        image.close()
        raise ValueError(
            f"a {width} x {height} {image.format}: more than the {MAX_PIXELS} pixels an image may have; "
            "resize it first"
        )
    return image


def tensor(preprocessing: Preprocessing, data: bytes) -> np.ndarray:
    """The float32 array training computed from an image file with these bytes: `decode`, then
    `applied`. ValueError naming what is wrong with the file (truncated, damaged, not an image)."""
    return applied(preprocessing, decode(data))


def applied(preprocessing: Preprocessing, image: Image.Image) -> np.ndarray:
    """`apply` on an image `decode` opened, which it then closes; ValueError naming a file whose
    pixels can't be decoded (truncated, damaged)."""
    try:
        with image:
            return apply(preprocessing, image)
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise ValueError(
            f"a {image.format} file that can't be decoded ({type(exc).__name__}: {exc})"
        ) from None


def record(input_name: str, preprocessing: Preprocessing) -> str:
    """The PREPROCESSING metadata value: which input the description makes, and the description."""
    return json.dumps({input_name: preprocessing.to_json()}, sort_keys=True)


def recorded(metadata: dict[str, str]) -> tuple[str, Preprocessing] | None:
    """(input name, description) an ONNX file's metadata records, None when it records none.
    ValueError naming what is wrong with a value that is not one `record` writes."""
    raw = metadata.get(PREPROCESSING)
    if not raw:
        return None
    try:
        found = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{PREPROCESSING} is not JSON ({exc})") from None
    if not isinstance(found, dict) or len(found) != 1:
        raise ValueError(f"{PREPROCESSING} must be {{input name: description}} of one input")
    ((name, description),) = found.items()
    return str(name), Preprocessing.from_json(description)
