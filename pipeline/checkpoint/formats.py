"""The checkpoint formats, one module each, and the registry that names them: a format is a module
with `FORMAT` (the name its checkpoints record in trainserve.json), `start_save`/`finish_save` (a
collective save, in two halves so that it may write in the background) and `load` (a collective load
into a model and optimizer). Saving uses the newest format; reading uses the one the checkpoint
names. Adding a format is one module and one line below; the storage layout around it (layout.py)
and everything above it (saver, store, consolidate) stay.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

import pipeline.checkpoint.dcp as dcp
from pipeline.checkpoint.layout import read_meta
from pipeline.distributed import DistInfo
from pipeline.errors import CheckpointError


class CheckpointFormat(Protocol):
    FORMAT: str

    def start_save(
        self,
        root: Path,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict,
        info: DistInfo,
        background: Any = None,
    ) -> Any: ...

    def finish_save(
        self,
        pending: Any,
        info: DistInfo,
        keep_last: int,
        protect: tuple[int | None, ...] = (),
        group: Any = None,
    ) -> Path: ...

    def load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        info: DistInfo,
        held_elsewhere: frozenset[str] = frozenset(),
    ) -> dict: ...


# name -> module; the first is the one saved. trainserve-dcp/1 (before components) is read by the
# same code.
FORMATS: dict[str, ModuleType] = {dcp.FORMAT: dcp, "trainserve-dcp/1": dcp}
WRITTEN = next(iter(FORMATS.values()))


def of(path: Path) -> CheckpointFormat:
    """The format the complete checkpoint at `path` was written in (its trainserve.json says)."""
    name = read_meta(path).get("format", "")
    if name not in FORMATS:
        raise CheckpointError(
            f"checkpoint '{path}' is in format {name or '(none recorded)'}, which this trainserve "
            f"does not read (it reads {', '.join(FORMATS)}); load it with the trainserve that "
            "wrote it, or train again"
        )
    return FORMATS[name]


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    info: DistInfo,
    keep_last: int,
    protect: tuple[int | None, ...] = (),
) -> Path:
    """Collective: every rank calls it. Returns the published directory. Keeps the newest
    `keep_last` checkpoints and those of the steps in `protect` (the best one)."""
    return WRITTEN.finish_save(
        WRITTEN.start_save(root, step, model, optimizer, meta, info), info, keep_last, protect
    )


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    info: DistInfo,
    held_elsewhere: frozenset[str] = frozenset(),
) -> dict:
    """Collective. Loads the model (and optimizer, and this rank's RNG where present) in place;
    returns the meta. `held_elsewhere`: the model's keys that other ranks' pipeline stages hold (the
    checkpoint has them too)."""
    return of(path).load(path, model, optimizer, info, held_elsewhere)
