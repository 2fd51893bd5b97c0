"""A safetensors file written tensor by tensor: the header first, then each tensor's bytes.

The safetensors format is an 8-byte little-endian header length, a JSON header naming every
tensor's dtype, shape and byte range, then the raw bytes. Everything in the header follows from
names, shapes and dtypes alone, so it can be written before any tensor exists and the tensors
streamed after it: memory holds one tensor at a time, never the whole file.

Invariant: `close()` succeeds only when every tensor of the header was written, in header order,
with its declared shape and dtype; the returned sha256 is that of the bytes on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# torch dtype -> safetensors dtype name.
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def file_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The order safetensors itself uses: widest dtype first, then by name. Every tensor then starts
    at a multiple of its item size, so readers that map the file get aligned tensors."""
    return sorted(specs, key=lambda s: (-s.dtype.itemsize, s.name))


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for `specs` laid out in the given order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        if s.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor '{s.name}': dtype {s.dtype} has no safetensors name")
        header[s.name] = {
            "dtype": DTYPE_NAMES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # pad so the data starts 8-byte aligned
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def total_size(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    return len(header_bytes(specs, metadata)) + sum(s.nbytes for s in specs)


class StreamingWriter:
    """Writes `specs` (already in file order) to `path`; call `write` once per tensor in that
    order."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        self._sha = hashlib.sha256()
        self._file = open(self.path, "wb")
        try:
            self._write(header_bytes(self._specs, metadata))
        except BaseException:
            self._file.close()
            raise

    def _write(self, data) -> None:
        self._file.write(data)
        self._sha.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(
                f"tensor '{name}' is not in the header: every tensor was written already"
            )
        spec = self._specs[self._next]
        if name != spec.name:
            raise ValueError(f"tensor '{name}' written out of order: '{spec.name}' comes next")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"tensor '{name}' is {tensor.dtype} {list(tensor.shape)}, "
                f"the header says {spec.dtype} {list(spec.shape)}"
            )
        if spec.nbytes:
            # A uint8 view shares the tensor's memory: no copy on the way to the file (for a
            # contiguous tensor). Assumes a little-endian host, as safetensors does.
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._write(memoryview(data))
        self._next += 1

    def close(self) -> str:
        """Flushes to disk (fsync) and returns the sha256 of the file; refuses an incomplete
        file."""
        try:
            if self._next != len(self._specs):
                missing = [s.name for s in self._specs[self._next :]]
                raise ValueError(f"{len(missing)} tensor(s) never written, first: {missing[:5]}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._file.close()
