"""The PyTorch reference of a weights bundle, rebuilt once the same way for every stage that judges
an ONNX file against it (export, `pipeline verify`, the serve check), and the gate runner they
share.

`rebuild` imports the components model.json names (only when trusted: model.json may come from a
shared store), reads the validation split, builds the task from what training recorded of it, and
runs the probe: one forward of real samples that teaches the task the model's outputs. `run_gates`
is export's gates, in the order and with the limits export runs them, on one onnxruntime session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from pipeline.artifact import gates
from pipeline.artifact.onnx_export import ExportHead
from pipeline.artifact.weights import META_FILE, Weights, load_model, remapped
from pipeline.components.build import build_data, probe
from pipeline.components.code_capture import missing_code_hint
from pipeline.components.data import Splits
from pipeline.components.reference import ArtifactSource, check_all_trusted, recorded_components
from pipeline.errors import DataError
from pipeline.tasks import build_task

CPU = "CPUExecutionProvider"


@dataclass
class Reference:
    weights: Weights
    splits: Splits
    task: Any
    # the model as the graph runs it: named inputs in, the graph's outputs out
    head: ExportHead
    source: ArtifactSource
    hint: str

    def fresh_head(self) -> ExportHead:
        """Another copy of the model, for an exporter that may change what it is given: its tensors
        mapped from the file again, so that none is shared with the reference."""
        return ExportHead(
            load_model(remapped(self.weights), self.source, self.hint),
            self.task,
            self.splits.input_names,
            self.splits.single_input,
        )


def rebuild(
    weights: Weights, trusted: Sequence[str] = (), data_cfg=None, task_cfg=None
) -> Reference:
    """The reference model, task and validation split of `weights` (the data and task sections of
    its own config unless given: `pipeline run` passes the config it was run with)."""
    data_cfg, task_cfg = data_cfg or weights.config.data, task_cfg or weights.config.task
    source = ArtifactSource(str(weights.directory / META_FILE), tuple(trusted))
    # every component model.json names, refused all at once rather than one per try
    named = weights.config
    check_all_trusted(
        recorded_components(named.model, named.data, named.task.loss, named.task.metric), source
    )
    hint = missing_code_hint(weights.meta.get("code"), weights.source.get("mlflow_run_id"))
    model = load_model(weights, source, hint)
    splits = build_data(data_cfg, task_cfg.name, source, hint)
    check_inputs(weights, splits)
    task = build_task(task_cfg, splits.classes, source, weights.meta.get("task"))
    probe(model, splits, task, weights.meta["model"]["component"])
    return Reference(
        weights,
        splits,
        task,
        ExportHead(model, task, splits.input_names, splits.single_input),
        source,
        hint,
    )


def check_inputs(weights: Weights, splits: Splits) -> None:
    """The data the export is gated on has the inputs the model was trained on."""
    trained = [(i["name"], i["dtype"]) for i in weights.meta.get("inputs") or []]
    now = [(s.name, str(s.dtype).removeprefix("torch.")) for s in splits.inputs]
    if trained and trained != now:
        raise DataError(
            f"the validation data now gives inputs {now}, but the model was trained on {trained} "
            f"(see {weights.directory / META_FILE}); export with the data it was trained on"
        )


def run_gates(
    sess,
    ref: Reference,
    batches,
    cfg,
    provider: str = CPU,
    variant: str = "fp32",
    kept: dict | None = None,
) -> dict[str, dict]:
    """Parity on the prepared batches, then parity and the task's metric over the whole split, each
    gate recording the provider it ran on; a single failed `provider` gate if `sess` does not run on
    `provider`. `variant` (fp32, fp16, int8): whose limits, as the task gives them (`gate_limits`):
    fp16 scales atol/rtol and adds the task's own (probabilities, agreement); int8's are the task's
    entirely (atol, rtol included)."""
    check = gates.provider_gate(sess, provider)
    if not check["passed"]:
        return {"provider": check}
    limits = dict(ref.task.gate_limits(cfg, variant))
    atol, rtol = cfg.atol, cfg.rtol
    if variant == "fp16":
        atol, rtol = atol * gates.FP16_LOGIT_SCALE[0], rtol * gates.FP16_LOGIT_SCALE[1]
    atol, rtol = limits.pop("atol", atol), limits.pop("rtol", rtol)
    tolerance = limits.pop("tolerance")
    # int8 flips a decision that sits near a tie: its agreement is a rate, held over the whole split
    # (parity.val); on the batches of 1, 7 or 64 samples one flip would fail it, so those check the
    # graph runs, finite.
    on_batches = (
        dict(limits, min_agreement=0.0)
        if variant == "int8" and "min_agreement" in limits
        else limits
    )
    results = gates.parity(sess, ref.head, batches, ref.task, atol, rtol, **on_batches)
    results.update(
        gates.validation(
            sess,
            ref.head,
            ref.splits.val,
            ref.task,
            atol,
            rtol,
            tolerance,
            cfg.metric_atol,
            kept,
            **limits,
        )
    )
    return {name: {**gate, "provider": check["provider"]} for name, gate in results.items()}


def gate_file(onnx_path: Path, ref: Reference, cfg) -> dict[str, dict]:
    """Every gate export runs on the CPU provider, on a saved ONNX file: the checker, the dynamic
    axes, an image model's preprocessing, parity and the metric. What `pipeline verify` re-runs on a
    registered version."""
    batches, axes_failed = gates.parity_batches(ref.splits.val, cfg.dynamic_axes, ref.head)
    results = {"checker": gates.check_model(onnx_path), **axes_failed}
    results |= gates.preprocessing(onnx_path, ref.splits.val)
    return results | run_gates(gates.session(onnx_path), ref, batches, cfg)
