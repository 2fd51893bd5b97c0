"""Every error a user can meet, in one place: each names what is wrong and what would be right.

A stage's CLI answers these with one line on stderr and exit 2 (a failed gate or check: exit 1);
anything else is a fault of ours, with its traceback. The modules that raise them re-export them
under their old names.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user has to fix; the message says what and how."""


class ComponentError(ConfigError):
    """A component that can't be imported, called or used; the message names the key and the fix."""


class DataError(ValueError):
    """Data the user pointed at is missing or malformed; the message says which and why."""


class CheckpointError(RuntimeError):
    """A checkpoint that can't be used; the message names the file or keys at fault."""


class ExportError(RuntimeError):
    """The model could not be turned into ONNX; the message names the operator(s) when known."""


class TrackingError(RuntimeError):
    """The tracking store or a run in it can't be used; the message says which and why."""


class WeightsError(ValueError):
    """The consolidated weights can't be used; the message says what is wrong and what was
    expected."""


class ConsolidateError(RuntimeError):
    """Consolidation can't go on; the message says what is wrong and how to fix it."""


class VerifyError(RuntimeError):
    """The model URI or the store can't be used at all (not a broken link: bad input)."""


class TraceError(RuntimeError):
    """The request can't be found, or the log can't be read."""


class ServeCheckError(RuntimeError):
    """The freshly started server did not come up, or did not answer the sample request."""


class TaskError(ComponentError):
    """The model's outputs don't fit the task and its data; the message says what would."""


def worker_message(exc: BaseException) -> str:
    """The message of an error raised in a DataLoader worker process, without the wrapper torch
    re-raises it in ("Caught DataError in DataLoader worker process 0. Original Traceback ...": the
    worker's message is the traceback's last line); any other error's message as it is."""
    text = str(exc)
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return text
    name = f"{type(exc).__module__}.{type(exc).__name__}: "
    lines = [line for line in text.splitlines() if line.startswith(name)]
    return lines[-1][len(name) :] if lines else text
