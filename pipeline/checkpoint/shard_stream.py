"""One pass over a DCP checkpoint's files: every byte read and hashed once, the model's tensors
copied into a safetensors file on the way.

The I/O floor of a consolidation that verifies its input is reading and hashing every shard byte
once and writing the output once. DCP's own reader (dcp.load) re-reads what verification already
read, materializes each stored chunk and then copies it into the destination tensor. Here each shard
file is read front to back, hashed as it is read; the byte ranges DCP's metadata names for model
tensors are read into one buffer, and the tensor found inside (a `torch.save` blob: a zip whose
stored, uncompressed `data/<key>` entry holds the raw bytes) is streamed to its place in the output
with `pwrite`, CHUNK bytes at a time through one reused buffer: each block is hashed, checked
(NaN/Inf) and written from that buffer, so peak memory is a few MiB whatever the tensor's size. Only
a chunk that must be converted (a dtype cast, strides that are not the plain row-major ones) is read
whole into one buffer first (peak: about that stored chunk). The blob's zip directory and pickle (a
few hundred bytes) are read with `pread` beside the front-to-back pass: the only bytes read twice.

Handled layouts: chunks that are slices along dim 0 (DDP's whole tensors, FSDP2's row shards),
stored with no storage transforms. `plan` returns None for anything else and the caller takes the
dcp.load path.

The blob's pickle is read by an unpickler that admits only what a saved tensor's pickle names (its
rebuild function, a storage class, an OrderedDict of hooks): a checkpoint is untrusted input.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.artifact.safetensors_writer import TensorSpec, header_bytes
from pipeline.errors import CheckpointError

# bytes read (and hashed) at a time between the tensors' ranges: small beside a tensor
BLOCK = 1 << 20
# Bytes of a tensor read, hashed, checked and written at a time: big enough that a syscall and a NaN
# check per block cost nothing beside the bytes, small beside a model's big tensors (peak memory is
# this, not a tensor).
CHUNK = 4 << 20


@dataclass(frozen=True)
class Piece:
    """One stored chunk of a model tensor: where it is in its shard file and where its bytes go."""

    # the tensor's key in the output
    name: str
    # the shard file, relative to the checkpoint
    file: str
    # of the chunk's blob in that file
    offset: int
    length: int
    # the chunk's shape
    sizes: tuple[int, ...]
    stored: torch.dtype
    out_dtype: torch.dtype
    # byte offset in the output file
    out_position: int


def plan(
    metadata, specs: list[TensorSpec], file_metadata: dict[str, str]
) -> tuple[bytes, list[Piece]] | None:
    """(the output's header, every chunk to copy), or None when a chunk is not a dim-0 slice of a
    plain stored tensor. `specs` in file order, as the header lays them out."""
    header = header_bytes(specs, file_metadata)
    # None: a non-tensor entry (an optimizer hyperparameter)
    by_chunk = {
        (idx.fqn, tuple(idx.offset)): info
        for idx, info in metadata.storage_data.items()
        if idx.offset is not None
    }
    pieces, position = [], len(header)
    for spec in specs:
        md = metadata.state_dict_metadata[f"model.{spec.name}"]
        size = tuple(md.size)
        row_bytes = math.prod(size[1:]) * spec.dtype.itemsize
        rows = 0
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            info = by_chunk.get((f"model.{spec.name}", offsets))
            if (
                info is None
                or getattr(info, "transform_descriptors", None)
                or any(offsets[1:])
                or sizes[1:] != size[1:]
            ):
                return None
            pieces.append(
                Piece(
                    spec.name,
                    info.relative_path,
                    info.offset,
                    info.length,
                    sizes,
                    md.properties.dtype,
                    spec.dtype,
                    position + (offsets[0] if offsets else 0) * row_bytes,
                )
            )
            rows += sizes[0] if sizes else 1
        # the chunks must cover the tensor exactly once
        if rows != (size[0] if size else 1):
            return None
        position += spec.nbytes
    return header, pieces


def copy_hashed(
    ckpt: Path, header: bytes, pieces: list[Piece], out_fd: int, nonfinite, refuse, release=None
) -> dict[str, str]:
    """Reads every file of `ckpt` once, front to back, hashing it; writes `header` and each piece's
    tensor (in the output dtype) at its place in `out_fd`. `nonfinite(tensor) -> (NaN count, Inf
    count)` is asked of every block written, and `refuse(name, nan, inf, dtype)` (which raises) is
    called for a piece that holds any; `release()` after a piece read whole (returns its freed
    buffer to the OS). Returns {file: sha256}."""
    os.pwrite(out_fd, header, 0)
    by_file: dict[str, list[Piece]] = {}
    for p in pieces:
        by_file.setdefault(p.file, []).append(p)
    # the one buffer every streamed tensor passes through
    block = memoryview(bytearray(CHUNK))
    digests = {}
    for path in sorted(f for f in Path(ckpt).iterdir() if f.is_file()):
        sha = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            at = 0
            for piece in sorted(by_file.pop(path.name, []), key=lambda p: p.offset):
                if not _hash_span(f, sha, piece.offset - at):
                    raise _truncated(ckpt, path.name, f"it ends before tensor '{piece.name}'")
                where = f"checkpoint '{ckpt}': tensor '{piece.name}' in {piece.file}"
                stored = _stored_tensor(
                    _Window(f.fileno(), piece.offset, piece.length), piece.stored, where
                )
                if stored.sizes != piece.sizes:
                    raise CheckpointError(
                        f"{where} holds {list(stored.sizes)}, the metadata says {list(piece.sizes)}"
                    )
                if stored.streamable and piece.out_dtype == piece.stored:
                    _stream_piece(f, sha, piece, stored, block, out_fd, nonfinite, refuse, ckpt)
                else:
                    _copy_whole(f, sha, piece, out_fd, nonfinite, refuse, ckpt)
                    if release is not None:
                        release()
                at = piece.offset + piece.length
            _hash_span(f, sha, None)
        digests[path.name] = sha.hexdigest()
    if by_file:
        raise CheckpointError(
            f"checkpoint '{ckpt}': the metadata names shard files that are not there: "
            f"{sorted(by_file)}"
        )
    return digests


def _stream_piece(
    f,
    sha,
    piece: Piece,
    stored: "_Stored",
    block: memoryview,
    out_fd: int,
    nonfinite,
    refuse,
    ckpt: Path,
) -> None:
    """`f` at the piece's blob: hashes its bytes up to the tensor's, then the tensor's, CHUNK at a
    time through `block` (hashed, counted, written), then the blob's rest."""
    if not _hash_span(f, sha, stored.start):
        raise _truncated(ckpt, piece.file, f"it ends inside tensor '{piece.name}'")
    itemsize = piece.stored.itemsize
    step = len(block) - len(block) % itemsize
    nan = inf = done = 0
    while done < stored.nbytes:
        want = min(step, stored.nbytes - done)
        view = block[:want]
        got = 0
        # a regular file reads short only at its end
        while got < want:
            n = f.readinto(view[got:])
            if not n:
                raise _truncated(ckpt, piece.file, f"it ends inside tensor '{piece.name}'")
            got += n
        sha.update(view)
        counts = nonfinite(torch.frombuffer(view, dtype=piece.stored))
        nan, inf = nan + counts[0], inf + counts[1]
        _pwrite_all(out_fd, view, piece.out_position + done)
        done += want
    if nan or inf:
        refuse(piece.name, nan, inf, piece.out_dtype)
    if not _hash_span(f, sha, piece.length - stored.start - stored.nbytes):
        raise _truncated(ckpt, piece.file, f"it ends inside tensor '{piece.name}'")


def _copy_whole(f, sha, piece: Piece, out_fd: int, nonfinite, refuse, ckpt: Path) -> None:
    """The blob read into one buffer, its tensor converted (cast, made contiguous) and written."""
    buf = bytearray(piece.length)
    if f.readinto(buf) != piece.length:
        raise _truncated(ckpt, piece.file, f"it ends inside tensor '{piece.name}'")
    sha.update(buf)
    tensor = tensor_in_blob(
        buf, piece.stored, f"checkpoint '{ckpt}': tensor '{piece.name}' in {piece.file}"
    )
    # no copy when it already is both
    tensor = tensor.to(piece.out_dtype).contiguous()
    # after the cast: fp16 overflows to Inf past 65504
    nan, inf = nonfinite(tensor)
    if nan or inf:
        refuse(piece.name, nan, inf, piece.out_dtype)
    _pwrite_all(
        out_fd,
        memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"",
        piece.out_position,
    )


def _pwrite_all(fd: int, data, position: int) -> None:
    written = 0
    # pwrite may write less than asked
    while written < len(data):
        written += os.pwrite(fd, data[written:], position + written)


def _hash_span(f, sha, length: int | None) -> bool:
    """Hashes the next `length` bytes of `f` (None: to its end) in BLOCK-sized reads into one
    buffer; False when the file ends first."""
    view = memoryview(bytearray(min(BLOCK, length) if length is not None else BLOCK))
    left = length
    while left is None or left > 0:
        n = f.readinto(view if left is None or left >= len(view) else view[:left])
        if not n:
            return left is None
        sha.update(view[:n])
        if left is not None:
            left -= n
    return True


def _truncated(ckpt: Path, name: str, how: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{ckpt}': reading {name} failed: shard file corrupt or truncated? ({how}, "
        "short of what its metadata says)"
    )


class _Admitted(pickle.Unpickler):
    """What `torch.save` of one tensor pickles, and nothing else: `_rebuild_tensor_v2(storage,
    offset, size, stride, requires_grad, hooks[, metadata])`, the storage as a persistent id, an
    OrderedDict of hooks."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (
                "tensor",
                storage,
                offset,
                tuple(size),
                tuple(stride),
            )
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        if (module, name) == ("torch", "Size"):
            return tuple
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a saved tensor never holds")

    def persistent_load(self, pid):
        return pid


@dataclass(frozen=True)
class _Stored:
    """Where a `torch.save` blob keeps its tensor's bytes, and how the tensor lies in them."""

    # of the storage's bytes, from the blob's start
    start: int
    # the storage's bytes
    nbytes: int
    # the tensor's, in elements, and its sizes and strides
    offset: int
    sizes: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    @property
    def streamable(self) -> bool:
        """The storage holds exactly the tensor's elements, in row-major order: its bytes are the
        output's."""
        row_major, numel = [], 1
        for size in reversed(self.sizes):
            row_major.insert(0, numel)
            numel *= size
        return (
            self.offset == 0
            and self.nbytes == numel * self.itemsize
            and (
                numel <= 1
                or all(
                    st == rm for size, st, rm in zip(self.sizes, self.stride, row_major) if size > 1
                )
            )
        )


def _stored_tensor(blob: io.RawIOBase, dtype: torch.dtype, where: str) -> _Stored:
    """Reads a `torch.save` blob's zip directory and pickle through `blob` (a seekable reader of the
    blob alone): where its tensor's bytes are and how the tensor lies in them. Checks what it can
    without the bytes."""
    try:
        archive = zipfile.ZipFile(blob)
        pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
        kind, storage, offset, size, stride = _Admitted(io.BytesIO(archive.read(pkl))).load()
        member = archive.getinfo(f"{pkl[: -len('data.pkl')]}data/{storage[2]}")
    except (
        zipfile.BadZipFile,
        StopIteration,
        KeyError,
        ValueError,
        TypeError,
        IndexError,
        pickle.UnpicklingError,
    ) as exc:
        raise CheckpointError(
            f"{where}: not a saved tensor ({type(exc).__name__}: {exc})"
        ) from None
    if member.compress_type != zipfile.ZIP_STORED or member.file_size % dtype.itemsize:
        raise CheckpointError(f"{where}: its bytes are compressed or not whole {dtype} items")
    # the local header: 30 bytes, then the name and an extra field
    h = member.header_offset
    blob.seek(h)
    local = blob.read(30)
    if len(local) != 30:
        raise CheckpointError(f"{where}: not a saved tensor (its zip entry is cut short)")
    start = h + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    blob.seek(0, 2)
    if start + member.file_size > blob.tell():
        raise CheckpointError(f"{where}: its stored bytes reach past the blob")
    count = member.file_size // dtype.itemsize
    needed = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else 0
    if needed > count:
        raise CheckpointError(f"{where}: its size and strides reach past its stored bytes")
    return _Stored(start, member.file_size, offset, tuple(size), tuple(stride), dtype.itemsize)


def tensor_in_blob(buf: bytearray, dtype: torch.dtype, where: str) -> torch.Tensor:
    """The tensor a `torch.save` blob holds, as a view of `buf` (no copy)."""
    stored = _stored_tensor(_Reader(memoryview(buf)), dtype, where)
    storage_view = memoryview(buf)[stored.start : stored.start + stored.nbytes]
    flat = (
        torch.frombuffer(storage_view, dtype=dtype)
        if stored.nbytes
        else torch.empty(0, dtype=dtype)
    )
    return flat.as_strided(stored.sizes, stored.stride, stored.offset)


class _Seekable(io.RawIOBase):
    """A read-only, seekable stream of `length` bytes: zipfile reads a stored tensor's directory
    through it. Subclasses say where the bytes come from (`_read_at`)."""

    def __init__(self, length: int):
        self.length, self.pos = length, 0

    def _read_at(self, pos: int, n: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.length if n is None or n < 0 else min(self.length, self.pos + n)
        data = self._read_at(self.pos, end - self.pos) if end > self.pos else b""
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _Window(_Seekable):
    """`length` bytes of a file from `base`, by pread: the file's own position (the front-to-back
    hashing pass) never moves."""

    def __init__(self, fd: int, base: int, length: int):
        super().__init__(length)
        self.fd, self.base = fd, base

    def _read_at(self, pos: int, n: int) -> bytes:
        return os.pread(self.fd, n, self.base + pos)


class _Reader(_Seekable):
    """A memoryview as a file, copying only what is read."""

    def __init__(self, view: memoryview):
        super().__init__(len(view))
        self.view = view

    def _read_at(self, pos: int, n: int) -> bytes:
        return bytes(self.view[pos : pos + n])
