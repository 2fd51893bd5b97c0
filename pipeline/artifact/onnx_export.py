"""PyTorch module -> ONNX graph: the exporter part of `pipeline export`, nothing about gates or
MLflow.

The graph takes the model's named inputs (`input` for a lone tensor, the dict keys otherwise) with
the dtypes and sample shapes of the validation data, a dynamic batch axis, and the dynamic axes
`export.dynamic_axes` names; it returns every output of the model by name (a lone tensor as the task
names it: `logits`, `prediction`, `output`; dict keys and ModelOutput fields as they are; tuples as
`output_0`, `output_1`, ...) and the outputs the task adds (`probabilities`, the softmax inside the
graph). Preprocessing that lives in the model (the built-ins' normalization buffers) is in the graph
too.

A graph whose weights pass protobuf's 2 GB limit (or any, with `export.external_data=always`) is
written as `<file>.onnx` plus its weights in `<file>.onnx.data` beside it (ONNX external data): the
exporter streams the weights there straight from the module's tensors, so no protobuf ever holds
them (pytorch #132205, onnxruntime #7974). The two files travel together: `move` renames both,
`data_file` names the second.
"""

from __future__ import annotations

import json
import logging
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import nn

from pipeline.components.data import forward

# raised here, defined with the others
from pipeline.errors import ExportError  # noqa: F401
from pipeline.tools.logs import clip
from serving import lineage

log = logging.getLogger(__name__)

# Exporting with a batch of 1 lets torch.export specialize the batch dimension to the constant 1
# (the "0/1 specialization"): the graph would then only accept batch 1. Any size > 1 avoids it.
EXPORT_BATCH = 2


class ExportHead(nn.Module):
    """The model as the graph runs it: one positional argument per named input, in `input_names`
    order (a lone tensor, or the dict the model takes as keyword arguments), returning the graph's
    outputs in `output_names` order (the task's `exported`: the model's, then the task's own). The
    task must have seen the model's outputs (its probe) first."""

    def __init__(self, model: nn.Module, task, input_names: list[str], single_input: bool):
        super().__init__()
        self.model = model
        self.task = task
        self.input_names = list(input_names)
        self.single_input = single_input

    @property
    def output_names(self) -> list[str]:
        return self.task.output_names

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = inputs[0] if self.single_input else dict(zip(self.input_names, inputs))
        exported = self.task.exported(forward(self.model, batch))
        return tuple(exported[name] for name in self.output_names)


# One protobuf holds at most 2 GB (and onnx refuses to serialize past it): weights past this go to a
# data file.
EXTERNAL_DATA_ABOVE = 1_800_000_000


@dataclass
class Exported:
    # the graph as saved; without its weights when they are in a data file
    model: onnx.ModelProto
    # "dynamo" (torch.export + onnxscript) or "torchscript" (legacy fallback)
    exporter: str
    # why dynamo was not used; "" when it was
    fallback_reason: str
    seconds: float


def export(
    head: ExportHead,
    example: dict[str, torch.Tensor],
    dynamic_axes: dict[str, list[int]],
    opset: int,
    metadata: dict[str, str],
    path: Path,
    external_data: str = "auto",
) -> Exported:
    """Exports `head` (eval mode, fp32) to `path` with the dynamo exporter, the legacy one only if
    that fails.

    `example`: one batch of real inputs by name; only dtypes and the sizes of fixed axes matter.
    `dynamic_axes`: input name -> axes besides the batch that vary (checked against the inputs).
    `metadata` goes into the graph's metadata_props (the server reads the model name and labels).
    `external_data`: "always", or "auto" = when the weights pass EXTERNAL_DATA_ABOVE (see the module
    docstring).
    """
    from pipeline.components.build import check_dynamic_axes

    names, output_names = head.input_names, tuple(head.output_names)
    check_dynamic_axes(dynamic_axes, {name: t.dim() for name, t in example.items()})
    args = tuple(example_batch(example, dynamic_axes)[n] for n in names)
    head = head.eval()
    external = external_data == "always" or weights_size(head) > EXTERNAL_DATA_ABOVE
    remove_stale(path)
    start = time.perf_counter()
    try:
        proto = _check_opset(
            _export_dynamo(head, args, names, output_names, dynamic_axes, opset, path, external),
            opset,
            "dynamo",
        )
        exporter, reason = "dynamo", ""
    except Exception as dynamo_exc:  # noqa: BLE001
        # any exporter failure is a reason to try the other one
        reason = _summary(dynamo_exc)
        log.warning("dynamo exporter failed (%s); falling back to the TorchScript exporter", reason)
        # the dynamo attempt may have written its data file before failing a check
        remove_stale(path)
        try:
            proto = _check_opset(
                _export_torchscript(head, args, names, output_names, dynamic_axes, opset),
                opset,
                "TorchScript",
            )
            exporter = "torchscript"
        except Exception as legacy_exc:  # noqa: BLE001
            ops = sorted(set(unsupported_ops(dynamo_exc)) | set(unsupported_ops(legacy_exc)))
            named = (
                f"unsupported operator(s): {', '.join(ops)}"
                if ops
                else "no operator could be named"
            )
            raise ExportError(
                f"the model cannot be exported to ONNX opset {opset}: {named}. "
                f"dynamo exporter: {reason}; TorchScript exporter: {_summary(legacy_exc)}. "
                "Replace the operator with supported ones, or register a translation for it "
                "(torch.onnx.export custom_translation_table)"
            ) from None
    seconds = time.perf_counter() - start
    _name_dynamic_dims(proto, names, dynamic_axes)
    for key, value in metadata.items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    save(proto, path, external)
    return Exported(proto, exporter, reason, seconds)


def remove_stale(path: Path) -> None:
    """The graph and data file an earlier attempt left at `path`: onnx appends to a data file that
    is there, so the next save's file would carry the dead bytes too (loading fine, twice the size,
    hashed and uploaded)."""
    for stale in (path, data_path(path)):
        stale.unlink(missing_ok=True)


def weights_size(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers: what the graph's initializers will hold."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def save(proto: onnx.ModelProto, path: Path, external: bool = False) -> None:
    """`proto` to `path`; its weights into `<path>.data` when `external` (or past
    EXTERNAL_DATA_ABOVE). A graph whose weights are in a data file already (loaded without them) is
    written as it is, still naming that file."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    if any(uses_external_data(t) for t in _get_all_tensors(proto)):
        # names its data file already (onnx refuses to convert it again)
        onnx.save_model(proto, str(path))
        return
    external = external or proto.ByteSize() > EXTERNAL_DATA_ABOVE
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=data_path(path).name if external else None,
    )


def with_weights(graph: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """`graph` (as saved at `path`) with its weights in memory: itself, or read again with its data
    file (for the converters that make a variant of it)."""
    return onnx.load(str(path)) if data_file(path) else graph


def data_path(path: Path) -> Path:
    """Where the export puts the weights of the graph at `path`: `<file>.onnx.data` beside it (the
    server's loader, serving.loader.data_file_of, looks there)."""
    return path.with_name(path.name + ".data")


def data_file(path: Path) -> Path | None:
    """The external data file the ONNX graph at `path` names (beside it), or None when its weights
    are inline. Reads the graph only, never the weights."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    graph = onnx.load(str(path), load_external_data=False)
    locations = {
        ExternalDataInfo(t).location for t in _get_all_tensors(graph) if uses_external_data(t)
    }
    if len(locations) > 1:
        raise ExportError(
            f"{path} keeps its weights in several files ({sorted(locations)}); one is expected"
        )
    return path.parent / locations.pop() if locations else None


def move(src: Path, dst: Path) -> onnx.ModelProto | None:
    """Renames an ONNX file and its data file together (`dst` and `<dst>.data`), the graph rewritten
    to name the new data file. Returns the graph as now saved (without its weights) when it has a
    data file, else None."""
    data = data_file(src)
    if data is None:
        src.replace(dst)
        return None
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    graph = onnx.load(str(src), load_external_data=False)
    for tensor in _get_all_tensors(graph):
        if uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = data_path(dst).name
    data.replace(data_path(dst))
    onnx.save_model(graph, str(dst))
    if src != dst:
        src.unlink()
    return graph


def example_batch(
    example: dict[str, torch.Tensor], dynamic_axes: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """Rows of `example` as the export's example: EXPORT_BATCH rows or more, a count no dynamic axis
    has as its length (torch.export assumes dynamic sizes that are equal in the example are
    equal)."""
    lengths = {example[n].shape[a] for n, axes in dynamic_axes.items() for a in axes}
    rows = EXPORT_BATCH
    while rows in lengths:
        rows += 1
    return {n: t[torch.arange(rows) % len(t)].contiguous() for n, t in example.items()}


def metadata_for(
    model_name: str, task_name: str, labels: list[str] | None, extra: dict[str, str] | None = None
) -> dict[str, str]:
    meta = {lineage.MODEL_NAME: model_name, lineage.TASK: task_name, **(extra or {})}
    if labels is not None:
        meta[lineage.LABELS] = json.dumps(list(labels))
    return meta


class OpsetMismatch(ExportError):
    pass


def _check_opset(proto: onnx.ModelProto, opset: int, which: str) -> onnx.ModelProto:
    """The dynamo exporter builds opset 18 and converts down; when the converter fails it logs an
    error and returns the opset-18 graph anyway. An opset chosen on purpose must be the one we
    get."""
    got = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise OpsetMismatch(
            f"the {which} exporter produced opset {got}, not the requested {opset} "
            "(onnx's version converter could not convert the graph)"
        )
    return proto


def _export_dynamo(
    head: nn.Module,
    args: tuple,
    names: list[str],
    output_names: tuple[str, ...],
    dynamic_axes: dict[str, list[int]],
    opset: int,
    path: Path,
    external: bool,
) -> onnx.ModelProto:
    # Dim.DYNAMIC: torch.export works out which dynamic sizes are equal (tokens and their mask).
    dynamic = torch.export.Dim.DYNAMIC
    shapes = tuple({0: dynamic, **{a: dynamic for a in dynamic_axes.get(n, [])}} for n in names)
    # torch's own exporter trips a deprecation inside torch: not ours to fix
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*LeafSpec.*is deprecated", category=FutureWarning
        )
        program = torch.onnx.export(
            head,
            args,
            dynamo=True,
            verbose=False,
            opset_version=opset,
            input_names=names,
            output_names=list(output_names),
            # one entry: forward's *inputs
            dynamic_shapes=(shapes,),
            optimize=True,
        )
    if not external:
        return program.model_proto
    # Streamed from the module's own tensors to <path>.data, one at a time; the graph read back
    # without them.
    program.save(str(path), external_data=True)
    # onnxscript's rewrite rules keep the last graph they matched (module-level matchers: not freed
    # with the program), and the graph holds the module's tensors: let go of them, or the exporter's
    # copy of the weights stays in memory beside onnxruntime's.
    for value in program.model.graph.initializers.values():
        value.const_value = None
    del program
    return onnx.load(str(path), load_external_data=False)


def _export_torchscript(
    head: nn.Module,
    args: tuple,
    names: list[str],
    output_names: tuple[str, ...],
    dynamic_axes: dict[str, list[int]],
    opset: int,
) -> onnx.ModelProto:
    import io

    axes = {n: {0: "batch", **{a: f"{n}_{a}" for a in dynamic_axes.get(n, [])}} for n in names}
    axes.update({o: {0: "batch"} for o in output_names})
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # we know it's the legacy path: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            head,
            args,
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=names,
            output_names=list(output_names),
            dynamic_axes=axes,
        )
    return onnx.load_from_string(buffer.getvalue())


def _name_dynamic_dims(
    proto: onnx.ModelProto, names: list[str], dynamic_axes: dict[str, list[int]]
) -> None:
    """Readable names for the exporter's symbols (s0, s17): `batch`, and `<input>_<axis>` for the
    dynamic axes, everywhere the same symbol appears."""
    rename: dict[str, str] = {}
    for value in proto.graph.input:
        if value.name not in names:
            continue
        dims = value.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if dim.dim_param and dim.dim_param not in rename:
                rename[dim.dim_param] = "batch" if axis == 0 else f"{value.name}_{axis}"
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in rename:
                dim.dim_param = rename[dim.dim_param]


_OP_PATTERNS = (
    # dynamo: no translation
    re.compile(r"No ONNX function found for <OpOverload\(op='([\w.:]+)'"),
    # dynamo: node that failed
    re.compile(r"target=torch\.ops\.([\w.]+)"),
    # TorchScript exporter
    re.compile(r"Exporting the operator '([\w:.]+)'"),
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
    # the exporter colours its messages
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    ops = unsupported_ops(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # The dynamo exporter puts the root cause under "## Exception summary".
    if "## Exception summary" in lines:
        lines = lines[lines.index("## Exception summary") + 1 :]
    head = lines[0] if lines else ""
    suffix = f" [operators: {', '.join(ops)}]" if ops else ""
    return f"{type(exc).__name__}: {clip(head, 300)}{suffix}"


# ---------------------------------------------------------------------------------------------
# A registered graph against a fresh export of the same weights (`pipeline verify`)
#
# What the dynamo exporter does to the weights here, so that they can't be compared with
# model.safetensors one to one: an initializer is named `model.<state_dict key>` (ExportHead holds
# the model as `model`), a Linear's weight keeps its [out, in] layout (Gemm transB=1); onnxscript's
# optimizer folds each BatchNorm into the Conv before it (the Conv's weight name then holds W *
# gamma / sqrt(var + eps), and a bias appears) and folds shapes and axes into constants (`val_<n>`).
# So the proof is a fresh export of the weights, which is deterministic (the same bytes from one
# process to the next), compared node for node.


def dynamic_axes_of(model: onnx.ModelProto, input_names: list[str]) -> dict[str, list[int]]:
    """The dynamic axes besides the batch that a graph's inputs declare (a symbolic dimension), as
    `export.dynamic_axes` names them: what a fresh export of the same model must be given to match
    it."""
    axes: dict[str, list[int]] = {}
    for value in model.graph.input:
        if value.name in input_names:
            dims = value.type.tensor_type.shape.dim
            found = [a for a, d in enumerate(dims) if a > 0 and not d.HasField("dim_value")]
            if found:
                axes[value.name] = found
    return axes


def opset_of(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def graph_difference(registered: Path, fresh: Path, shown: int = 6) -> list[str]:
    """How the computation of the ONNX file `registered` differs from that of `fresh` (nothing: []):
    the opsets, the graph's inputs and outputs (names, dtypes, shapes), every node in order (its
    operator, its attributes and which values it connects) and every initializer by name, its dtype,
    shape and bytes. The names of the values between nodes count only by where they are made and
    used, so a renamed intermediate is no difference; metadata, doc strings and node names are not
    compared. Weights in an external data file are hashed from that file, a tensor at a time."""
    a, b = _canonical(registered), _canonical(fresh)
    found: list[str] = []
    if a.opsets != b.opsets:
        found.append(f"opsets {a.opsets}, a fresh export's {b.opsets}")
    for what in ("inputs", "outputs"):
        if getattr(a, what) != getattr(b, what):
            found.append(f"{what} {getattr(a, what)}, a fresh export's {getattr(b, what)}")
    if a.nodes != b.nodes:
        i = next(
            (i for i, (x, y) in enumerate(zip(a.nodes, b.nodes)) if x != y),
            min(len(a.nodes), len(b.nodes)),
        )
        first = (
            f"node {i} is {a.described[i]}" if i < len(a.nodes) else f"node {i} is missing"
        ) + (
            f" where a fresh export has {b.described[i]}"
            if i < len(b.nodes)
            else ", past the fresh export's last"
        )
        found.append(f"{len(a.nodes)} nodes, a fresh export's {len(b.nodes)}: {first}")
        ops = _counted([n[1] for n in a.nodes], [n[1] for n in b.nodes])
        if ops:
            found.append(f"operators beyond a fresh export's: {ops}")
    extra = [k for k in a.tensors if k not in b.tensors]
    missing = [k for k in b.tensors if k not in a.tensors]
    changed = [k for k in a.tensors if k in b.tensors and a.tensors[k] != b.tensors[k]]
    for count, names, says in (
        (len(extra), extra, "a fresh export of the weights has not"),
        (len(missing), missing, "missing that a fresh export has"),
        (len(changed), changed, "whose dtype, shape or values differ from a fresh export's"),
    ):
        if count:
            listed = ", ".join(names[:shown]) + (", ..." if count > shown else "")
            found.append(f"{count} initializer(s) {says}: {listed}")
    return found


def _counted(mine: list[str], theirs: list[str]) -> str:
    """The operators `mine` has more of than `theirs`, with how many more."""
    from collections import Counter

    more = Counter(mine) - Counter(theirs)
    return ", ".join(f"{op} +{n}" for op, n in sorted(more.items()))


@dataclass
class _Canonical:
    opsets: list[tuple[str, int]]
    inputs: list[tuple]
    outputs: list[tuple]
    nodes: list[tuple]
    # each node with the graph's own names, to say where they differ
    described: list[str]
    # initializer name -> (dtype, dims, sha256 of the bytes)
    tensors: dict[str, tuple]


def _canonical(path: Path) -> _Canonical:
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    # Inputs, outputs and initializers keep their names (the exporter's are the state_dict's,
    # deterministic).
    boundary = {v.name for v in [*graph.input, *graph.output, *graph.initializer]}
    canonical: dict[str, str] = {}

    def name(value: str) -> str:
        if value == "" or value in boundary:
            return value
        if value not in canonical:
            canonical[value] = f"%{len(canonical)}"
        return canonical[value]

    nodes, described = [], []
    for node in graph.node:
        attributes = tuple(sorted((x.name, x.SerializeToString()) for x in node.attribute))
        nodes.append(
            (
                node.domain or "",
                node.op_type,
                tuple(name(v) for v in node.input),
                tuple(name(v) for v in node.output),
                attributes,
            )
        )
        described.append(f"{node.op_type}({', '.join(node.input)}) -> {', '.join(node.output)}")
    tensors = {
        t.name: (t.data_type, tuple(t.dims), _tensor_sha256(t, path)) for t in graph.initializer
    }

    def values(vs) -> list[tuple]:
        return [
            (
                v.name,
                v.type.tensor_type.elem_type,
                tuple(
                    d.dim_value if d.HasField("dim_value") else "?"
                    for d in v.type.tensor_type.shape.dim
                ),
            )
            for v in vs
        ]

    return _Canonical(
        sorted((o.domain or "", o.version) for o in model.opset_import),
        values(graph.input),
        values(graph.output),
        nodes,
        described,
        tensors,
    )


def _tensor_sha256(tensor: onnx.TensorProto, path: Path) -> str:
    """The sha256 of a tensor's bytes: inline, or read from the external data file beside `path`
    (only a plain file name there is followed: a location is the graph's word, not ours)."""
    import hashlib

    from onnx import numpy_helper
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    digest = hashlib.sha256()
    if not uses_external_data(tensor):
        digest.update(
            tensor.raw_data
            if tensor.HasField("raw_data")
            else numpy_helper.to_array(tensor).tobytes()
        )
        return digest.hexdigest()
    info = ExternalDataInfo(tensor)
    if Path(info.location).name != info.location or info.location in ("", ".", ".."):
        return f"(external data at {info.location!r}, outside the graph's directory)"
    data = path.parent / info.location
    offset = int(info.offset or 0)
    length = int(info.length) if info.length is not None else max(0, data.stat().st_size - offset)
    with open(data, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(length, 1 << 20))
            if not chunk:
                return "(external data shorter than the graph says)"
            digest.update(chunk)
            length -= len(chunk)
    return digest.hexdigest()
