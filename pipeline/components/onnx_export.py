"""PyTorch module -> ONNX graph: the exporter part of `pipeline export`, nothing about gates or MLflow.

The graph has one input `input` (B, C, H, W) float32 in [0, 1] and two outputs, `logits` and
`probabilities` (softmax inside the graph, so clients need no post-processing), with a dynamic
batch axis. Normalization is already inside the model (buffers), so the graph carries its own
preprocessing.
"""

from __future__ import annotations

import json
import logging
import re
import time
import warnings
from dataclasses import dataclass

import onnx
import torch
from torch import nn

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAMES = ("logits", "probabilities")
# Exporting with a batch of 1 lets torch.export specialize the batch dimension to the constant 1
# (the "0/1 specialization"): the graph would then only accept batch 1. Any size > 1 avoids it.
EXPORT_BATCH = 2
META_MODEL_NAME = "trainserve.model_name"
META_LABELS = "trainserve.labels"


class ExportError(RuntimeError):
    """The model could not be turned into ONNX; the message names the operator(s) when known."""


class WithProbabilities(nn.Module):
    """The classifier plus a softmax, so the graph returns both logits and probabilities."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(x)
        return logits, torch.softmax(logits, dim=1)


@dataclass
class Exported:
    model: onnx.ModelProto
    exporter: str            # "dynamo" (torch.export + onnxscript) or "torchscript" (legacy fallback)
    fallback_reason: str     # why dynamo was not used; "" when it was
    seconds: float


def export(model: nn.Module, sample: torch.Tensor, opset: int, metadata: dict[str, str]) -> Exported:
    """Exports `model` (eval mode, fp32) with the dynamo exporter, the legacy one only if that fails.

    `sample` is one example input batch; only its shape beyond the batch axis and dtype matter.
    `metadata` goes into the graph's metadata_props (the server reads the model name and labels).
    """
    wrapped = WithProbabilities(model).eval()
    example = sample[:1].expand(EXPORT_BATCH, *sample.shape[1:]).contiguous().float()
    start = time.perf_counter()
    try:
        proto = _check_opset(_export_dynamo(wrapped, example, opset), opset, "dynamo")
        exporter, reason = "dynamo", ""
    except Exception as dynamo_exc:  # noqa: BLE001 - any exporter failure is a reason to try the other one
        reason = _summary(dynamo_exc)
        log.warning("dynamo exporter failed (%s); falling back to the TorchScript exporter", reason)
        try:
            proto = _check_opset(_export_torchscript(wrapped, example, opset), opset, "TorchScript")
            exporter = "torchscript"
        except Exception as legacy_exc:  # noqa: BLE001
            ops = sorted(set(unsupported_ops(dynamo_exc)) | set(unsupported_ops(legacy_exc)))
            named = f"unsupported operator(s): {', '.join(ops)}" if ops else "no operator could be named"
            raise ExportError(
                f"the model cannot be exported to ONNX opset {opset}: {named}. "
                f"dynamo exporter: {reason}; TorchScript exporter: {_summary(legacy_exc)}. "
                "Replace the operator with supported ones, or register a translation for it "
                "(torch.onnx.export custom_translation_table)") from None
    seconds = time.perf_counter() - start
    for key, value in metadata.items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    return Exported(proto, exporter, reason, seconds)


def metadata_for(model_name: str, labels: list[str], extra: dict[str, str] | None = None) -> dict[str, str]:
    return {META_MODEL_NAME: model_name, META_LABELS: json.dumps(list(labels)), **(extra or {})}


class OpsetMismatch(ExportError):
    pass


def _check_opset(proto: onnx.ModelProto, opset: int, which: str) -> onnx.ModelProto:
    """The dynamo exporter builds opset 18 and converts down; when the converter fails it logs an
    error and returns the opset-18 graph anyway. An opset chosen on purpose must be the one we get."""
    got = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise OpsetMismatch(f"the {which} exporter produced opset {got}, not the requested {opset} "
                            "(onnx's version converter could not convert the graph)")
    return proto


def _export_dynamo(wrapped: nn.Module, example: torch.Tensor, opset: int) -> onnx.ModelProto:
    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(
        wrapped, (example,), dynamo=True, verbose=False, opset_version=opset,
        input_names=[INPUT_NAME], output_names=list(OUTPUT_NAMES),
        dynamic_shapes=({0: batch},), optimize=True)
    return program.model_proto


def _export_torchscript(wrapped: nn.Module, example: torch.Tensor, opset: int) -> onnx.ModelProto:
    import io

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # we know it's the legacy path: that is the point
        torch.onnx.export(
            wrapped, (example,), buffer, dynamo=False, opset_version=opset,
            input_names=[INPUT_NAME], output_names=list(OUTPUT_NAMES),
            dynamic_axes={name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)})
    return onnx.load_from_string(buffer.getvalue())


_OP_PATTERNS = (
    re.compile(r"No ONNX function found for <OpOverload\(op='([\w.:]+)'"),   # dynamo: no translation
    re.compile(r"target=torch\.ops\.([\w.]+)"),                             # dynamo: node that failed
    re.compile(r"Exporting the operator '([\w:.]+)'"),                      # TorchScript exporter
    re.compile(r"Unsupported FX nodes: \{([^}]*)\}"),
)


def unsupported_ops(exc: BaseException) -> list[str]:
    """The operator names an exporter error mentions, searched through its whole cause chain."""
    found: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for pattern in _OP_PATTERNS:
            for match in pattern.findall(str(exc)):
                for name in re.findall(r"[\w.:]+", match):
                    name = re.sub(r"\.default$", "", name)
                    if name not in found:
                        found.append(name)
        exc = exc.__cause__
    return found


def _summary(exc: BaseException) -> str:
    """One line: the exception type and the most specific line of its message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # the exporter colours its messages
    ops = unsupported_ops(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # The dynamo exporter puts the root cause under "## Exception summary".
    if "## Exception summary" in lines:
        lines = lines[lines.index("## Exception summary") + 1:]
    head = lines[0] if lines else ""
    suffix = f" [operators: {', '.join(ops)}]" if ops else ""
    return f"{type(exc).__name__}: {head[:300]}{suffix}"
