"""Logging for every stage: one line per event, rank-prefixed in training, libraries quiet."""

from __future__ import annotations

import logging

# Libraries that log a line per store open, per optimization pass, or per op they can't find.
QUIET = {"alembic": logging.WARNING, "mlflow.store": logging.WARNING, "urllib3": logging.WARNING,
         "onnxscript": logging.WARNING, "onnx_ir": logging.WARNING,
         "torch.onnx._internal.exporter._registration": logging.ERROR}


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line for a message: its text's first line (at most `limit` chars), else its type."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def configure(rank: int | None = None, level: int = logging.INFO) -> None:
    """`[rank1] 12:00:01 INFO pipeline.train: ...` under torchrun, `12:00:01 INFO ...` otherwise."""
    handler = logging.StreamHandler()
    prefix = "[rank%(rank)s] " if rank is not None else ""
    if rank is not None:
        handler.addFilter(RankFilter(rank))
    handler.setFormatter(logging.Formatter(prefix + "%(asctime)s %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name, quiet_level in QUIET.items():
        logging.getLogger(name).setLevel(quiet_level)
