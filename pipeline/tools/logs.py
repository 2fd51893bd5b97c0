"""Logging for every stage: one line per event, rank-prefixed in training, libraries quiet.

The set-up itself is serving/console.py's, shared with the server (which imports nothing from
here)."""

from __future__ import annotations

import logging

from serving.console import clip
from serving.console import configure as _configure

__all__ = ["clip", "configure", "first_line"]


def first_line(exc: BaseException) -> str:
    """An exception as one line for a message: its text's first line, whole (a refusal's fix is at
    its end), else its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def configure(rank: int | None = None, level: int = logging.INFO) -> None:
    """`[rank1] 12:00:01 INFO pipeline.train: ...` under torchrun, `12:00:01 INFO ...` otherwise."""
    _configure(rank, level)
