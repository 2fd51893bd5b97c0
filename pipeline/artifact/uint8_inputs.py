"""The uint8-input variant: image inputs taken as UINT8 pixel values (0-255) and scaled to [0, 1]
inside the graph.

A 224x224 RGB image is 602 KB as FP32 and 150 KB as UINT8: a quarter of the bytes to send, receive,
check and copy to a GPU, for the images cameras and decoders give as bytes anyway. The variant
(`model.uint8.onnx`, export.uint8_inputs) is the gated fp32 graph with each chosen input `x`
replaced by a UINT8 input of the same name and shape, followed by Cast to float and Div by 255
feeding what `x` fed; outputs are unchanged. A model whose float input is not in [0, 1] (normalized
outside the model) has no such variant: the data's range is a gate.

Its gates (all must pass, as for fp16; a failure fails the export and says which):
    uint8.range        every chosen input of the validation split lies in [0, 1]
    uint8.checker      onnx.checker on the file
    uint8.parity.*     the variant on inputs rounded to 1/255 steps against PyTorch on the same
                       rounded values, with the export's fp32 limits (the rewrite computes what the
                       model computes)
    uint8.<metric>     that, over the whole split, with the export's tolerance
    uint8.rounding     what rounding costs: the task's metric of the fp32 graph on the inputs as
                       given against PyTorch's on the rounded ones, within the export's tolerance

The ONNX metadata names the scaled inputs (serving.drift.PIXEL_INPUTS_KEY, which reads it): the
server's drift monitor scales them back before it compares them with the training data's statistics.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from pipeline.artifact import gates, onnx_export
from pipeline.artifact.rebuild import run_gates
from serving.drift import PIXEL_INPUTS_KEY

FILE = "model.uint8.onnx"
SCALE = 255.0


def chosen(model: onnx.ModelProto, asked: list[str]) -> tuple[list[str], str]:
    """The inputs to take as UINT8 (["*"]: every float input) and '' , or [] and why not."""
    floats = [
        i.name for i in model.graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT
    ]
    names = floats if asked == ["*"] else list(asked)
    every = [i.name for i in model.graph.input]
    unknown = [n for n in names if n not in every]
    if unknown:
        return (
            [],
            f"export.uint8_inputs names {unknown}, not inputs of the graph (its inputs: {every})",
        )
    not_float = [n for n in names if n not in floats]
    if not_float:
        return (
            [],
            f"export.uint8_inputs: {not_float} are not FP32 inputs (only a float image input can be taken as UINT8)",
        )
    if not names:
        return [], f"export.uint8_inputs: the graph has no FP32 input (its inputs: {every})"
    return names, ""


def rounded(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] as the UINT8 pixel values nearest them."""
    return np.clip(np.rint(np.asarray(x, np.float32) * SCALE), 0, 255).astype(np.uint8)


def make(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` whose inputs `names` are UINT8, cast and divided by 255 before what they
    fed."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    nodes = []
    for name in names:
        scaled = f"{name}__from_uint8"
        # what read the float input now reads its scaled copy
        for node in graph.node:
            node.input[:] = [scaled if i == name else i for i in node.input]
        # an input passed straight through stays what it was
        for output in graph.output:
            if output.name == name:
                raise ValueError(
                    f"input {name} is also an output of the graph: it cannot change its type"
                )
        value = next(i for i in graph.input if i.name == name)
        value.type.tensor_type.elem_type = TensorProto.UINT8
        nodes += [
            helper.make_node(
                "Cast", [name], [f"{name}__as_float"], to=TensorProto.FLOAT, name=f"{name}__cast"
            ),
            helper.make_node(
                "Div", [f"{name}__as_float", f"{name}__scale"], [scaled], name=f"{name}__scale"
            ),
        ]
        graph.initializer.append(
            helper.make_tensor(f"{name}__scale", TensorProto.FLOAT, [], [SCALE])
        )
    for node in reversed(nodes):
        graph.node.insert(0, node)
    onnx.helper.set_model_props(
        out, {**{p.key: p.value for p in model.metadata_props}, PIXEL_INPUTS_KEY: ",".join(names)}
    )
    return out


class RoundedFeeds:
    """An onnxruntime session of the variant that takes the float feeds the data gives (what the
    gates feed), rounded to UINT8 on the way in."""

    def __init__(self, sess, names: list[str]):
        self.sess, self.names = sess, set(names)

    def run(self, output_names, feeds):
        return self.sess.run(
            output_names, {k: rounded(v) if k in self.names else v for k, v in feeds.items()}
        )

    # get_outputs, get_providers, ...
    def __getattr__(self, attr):
        return getattr(self.sess, attr)


class RoundedHead(torch.nn.Module):
    """The PyTorch reference on the values the variant sees: each chosen input rounded to 1/255
    steps."""

    def __init__(self, head, names: list[str]):
        super().__init__()
        self.head, self.names = head, set(names)
        self.input_names, self.output_names = head.input_names, head.output_names

    def forward(self, *inputs):
        return self.head(
            *(
                torch.from_numpy(rounded(x.numpy())).float() / SCALE if name in self.names else x
                for name, x in zip(self.input_names, inputs)
            )
        )


def range_gate(val, names: list[str]) -> dict:
    """Whether every chosen input of the validation split lies in [0, 1]."""
    from pipeline.components.data import eval_loader

    low = {n: np.inf for n in names}
    high = {n: -np.inf for n in names}
    for inputs, _ in eval_loader(val, 256):
        for name, x in gates.feeds_of(inputs).items():
            if name in low:
                low[name], high[name] = (
                    min(low[name], float(x.min())),
                    max(high[name], float(x.max())),
                )
    outside = {n: (low[n], high[n]) for n in names if low[n] < 0 or high[n] > 1}
    if outside:
        spans = ", ".join(f"{n} spans [{lo:.3g}, {hi:.3g}]" for n, (lo, hi) in outside.items())
        return {
            "passed": False,
            "message": f"{spans} on the validation split, not [0, 1]: a UINT8 input carries pixel "
            "values 0-255 that the graph scales by 1/255. Normalize inside the model "
            "(pipeline.models take mean/std) or leave export.uint8_inputs off",
        }
    return {
        "passed": True,
        "message": "every value of " + ", ".join(names) + " in [0, 1] on the validation split",
    }


def make_variant(
    exported_model: onnx.ModelProto, onnx_path: Path, out: Path, ref, batches, cfg, asked: list[str]
) -> tuple[Path | None, dict[str, dict]]:
    """The variant beside `onnx_path` (the gated fp32 file) and its gates, `uint8.`-prefixed; (None,
    gates) when it cannot be made."""
    names, why_not = chosen(exported_model, asked)
    if why_not:
        return None, {"uint8.inputs": {"passed": False, "message": why_not}}
    results = {"uint8.range": range_gate(ref.splits.val, names)}
    if not results["uint8.range"]["passed"]:
        return None, results
    path = out / FILE
    onnx_export.save(make(onnx_export.with_weights(exported_model, onnx_path), names), path)
    results["uint8.checker"] = gates.check_model(path)
    rounding_ref = replace(ref, head=RoundedHead(ref.head, names))
    sess = RoundedFeeds(gates.session(path), names)
    results.update(
        {f"uint8.{k}": v for k, v in run_gates(sess, rounding_ref, batches, cfg).items()}
    )
    # What rounding costs the task: the fp32 graph on the inputs as given vs PyTorch on the rounded
    # ones (the parity part is not a gate here: the inputs differ on purpose).
    limits = dict(ref.task.gate_limits(cfg, "fp32"))
    cost = gates.validation(
        gates.session(onnx_path),
        rounding_ref.head,
        ref.splits.val,
        ref.task,
        np.inf,
        np.inf,
        limits["tolerance"],
        cfg.metric_atol,
    )
    results["uint8.rounding"] = {
        **cost[ref.task.primary],
        "message": "inputs as given vs rounded to 1/255 steps: "
        + cost[ref.task.primary]["message"]
        .replace("ONNX", "as given")
        .replace("PyTorch", "rounded"),
    }
    return path, results
