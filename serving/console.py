"""The console of every trainserve process (each pipeline stage, torchrun's workers, the server):
one line per event in one format, third-party chatter off unless --verbose.

It lives in `serving/` because the server imports nothing from `pipeline/`, while the stages may
import from here (pipeline/tools/logs.py calls `configure`). Quieting is done through each library's
own settings, and the environment variables among them are set here so that the processes a stage
starts (torchrun's workers, the server of `--serve`) inherit them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
import warnings

VERBOSE_ENV = "TRAINSERVE_VERBOSE"

# Loggers that speak per store open, per optimization pass, per op, per request: what matters from
# them is said once in our own words (registered version, system metrics, artifacts downloaded).
QUIET = {
    "alembic": logging.WARNING,
    "mlflow": logging.WARNING,
    "urllib3": logging.WARNING,
    "matplotlib": logging.WARNING,
    "PIL": logging.WARNING,
    "uvicorn": logging.WARNING,
    "onnxscript": logging.ERROR,
    "onnx_ir": logging.ERROR,
    "torch.onnx": logging.ERROR,
    "huey": logging.WARNING,
    "sqlalchemy": logging.WARNING,
    "httpx": logging.WARNING,
}

# onnxruntime's C++ logger: 3 = errors, 4 = fatal only. A failed run (a client's bad shape) is an
# error to onnxruntime and a 400 to us, which we log ourselves; its red `[E:onnxruntime...]` line
# would say it a second time, in another format.
ORT_QUIET, ORT_VERBOSE = 4, 1


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false", "no")


def set_verbose(on: bool) -> None:
    """--verbose: for this process and every process it starts."""
    if on:
        os.environ[VERBOSE_ENV] = "1"


def ort_severity() -> int:
    """For `SessionOptions.log_severity_level`."""
    return ORT_VERBOSE if verbose() else ORT_QUIET


def clip(text: str, limit: int) -> str:
    """`text`, or its first words within `limit` characters and " ...": a message is never cut
    mid-word."""
    if len(text) <= limit:
        return text
    head = text[: limit + 1]
    cut = max(head.rfind(" "), head.rfind(","), head.rfind(";"))
    return (head[:cut] if cut > limit // 2 else text[:limit]).rstrip(" ,;") + " ..."


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def escape_controls(text: str) -> str:
    """`text` with its control characters (newlines, carriage returns, escape sequences; not tabs)
    written as Python escapes: "a\nb" -> "a\\nb"."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class OneLine(logging.Formatter):
    """Each event one line: control characters in the message (a client's model name, an exception's
    text with a value of theirs in it) are escaped, so that no value can start a line of its own and
    pass for an entry of ours; a traceback, appended after the message, stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def configure(rank: int | None = None, level: int | str = logging.INFO) -> None:
    """`[rank1] 12:00:01 INFO pipeline.train: ...` under torchrun, `12:00:01 INFO ...` otherwise."""
    loud = verbose()
    # MLflow configures its own handler and format at import unless told not to; its download bars
    # are carriage returns in a file. Both set before mlflow is imported, here or in a child
    # process.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    handler = logging.StreamHandler()
    prefix = "[rank%(rank)s] " if rank is not None else ""
    if rank is not None:
        handler.addFilter(RankFilter(rank))
    handler.setFormatter(
        OneLine(prefix + "%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name, quiet_level in QUIET.items():
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET if loud else quiet_level)
        # a library's own handler would print in its own format
        logger.handlers[:] = []
        logger.propagate = True
    if loud:
        # one line each, in our format
        logging.captureWarnings(True)
    else:
        # The torch exporter's and onnxscript's warnings ("Evaluation failed: ...") are about their
        # internals; export's gates say whether the model is right. PYTHONWARNINGS for child
        # processes.
        warnings.simplefilter("ignore")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
    _quiet_onnxruntime(loud)


def _quiet_onnxruntime(loud: bool) -> None:
    """Sessions that set no severity of their own take the default logger's."""
    if "onnxruntime" in sys.modules or _importable("onnxruntime"):
        import onnxruntime

        onnxruntime.set_default_logger_severity(ORT_VERBOSE if loud else ORT_QUIET)


def _importable(name: str) -> bool:
    import importlib.util

    with contextlib.suppress(ImportError, ValueError):
        return importlib.util.find_spec(name) is not None
    return False


class Progress:
    """A progress bar on a terminal (tqdm); elsewhere (a file, a pipe, CI) a plain log line every
    `total / lines` steps, because a bar's carriage returns make a log unreadable.
    The interface is the part of tqdm's that training uses: update, set_postfix, close."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "train",
        enabled: bool = True,
        lines: int = 5,
        logger: logging.Logger | None = None,
        stream=None,
    ):
        stream = stream or sys.stderr
        self.total, self.n, self.initial, self.desc, self.enabled = (
            total,
            initial,
            initial,
            desc,
            enabled,
        )
        self.every = max(1, -(-total // lines))
        self.postfix: dict[str, str] = {}
        self.log = logger or logging.getLogger("trainserve.progress")
        self.started = time.monotonic()
        self.bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit="step",
                mininterval=1.0,
                dynamic_ncols=True,
                file=stream,
            )

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (self.n % self.every == 0 or self.n == self.total):
            self._line()

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _line(self) -> None:
        rate = (self.n - self.initial) / max(time.monotonic() - self.started, 1e-9)
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        self.log.info(
            "%s: step %d/%d (%d%%)%s, %.1f steps/s",
            self.desc,
            self.n,
            self.total,
            100 * self.n // max(self.total, 1),
            extra,
            rate,
        )
