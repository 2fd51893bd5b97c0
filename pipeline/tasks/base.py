"""What every task shares: the outputs a model returns, named; targets of any structure; the sums
and gathers that make validation metrics exact across ranks; a loss or metric component made
callable.

A model may return a tensor, a tuple or list of tensors, a dict of tensors, or a `ModelOutput`-like
object (a mapping or a dataclass of tensors, as Hugging Face transformers returns). `OutputLayout`
names each tensor once, the same way in training, in the ONNX graph and in the server: dict keys and
field names as they are (a transformers output's `None` fields are absent), a tuple's as `output_0`,
`output_1`, ..., and a lone tensor by the name its task gives it (`logits`, `prediction`, `output`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipeline.components.data import leaves
from pipeline.components.reference import (
    ArtifactSource,
    ComponentError,
    call,
    plain_signature,
    resolve,
)
from pipeline.errors import TaskError

TENSOR, SEQUENCE, MAPPING = "tensor", "sequence", "mapping"


@dataclass(frozen=True)
class OutputLayout:
    """How a model's return value is structured, and the name of each of its tensors."""

    # TENSOR, SEQUENCE or MAPPING
    kind: str
    names: tuple[str, ...]

    def flatten(self, output: Any) -> dict[str, torch.Tensor]:
        """{name: tensor} of one return value of the model (in this layout)."""
        if self.kind == TENSOR:
            return {self.names[0]: output}
        if self.kind == SEQUENCE:
            return dict(zip(self.names, output))
        fields = _mapping_of(output)
        return {name: fields[name] for name in self.names}

    def rebuild(self, named: Mapping[str, Any]) -> Any:
        """The model's structure again from {name: value}: a tensor, a tuple, or for a mapping or
        dataclass output `Fields`, which reads as both `outputs["logits"]` and `outputs.logits`, as
        a transformers ModelOutput does: a loss written either way works in training and in
        evaluation alike."""
        if self.kind == TENSOR:
            return named[self.names[0]]
        if self.kind == SEQUENCE:
            return tuple(named[n] for n in self.names)
        return Fields({n: named[n] for n in self.names})

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "names": list(self.names)}

    @classmethod
    def from_json(cls, value: dict | None) -> "OutputLayout | None":
        return cls(value["kind"], tuple(value["names"])) if value else None


class Fields(dict):
    """A dict whose keys also read as attributes (`outputs.logits`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"the model's outputs have no field {name!r}; they are {list(self)}"
            ) from None


def layout_of(output: Any, single_name: str, where: str) -> OutputLayout:
    """The layout of what the model returned; TaskError naming the part that is not a tensor."""
    if torch.is_tensor(output):
        return OutputLayout(TENSOR, (single_name,))
    if isinstance(output, (tuple, list)) and output:
        bad = [i for i, t in enumerate(output) if not torch.is_tensor(t)]
        if bad:
            raise TaskError(
                f"{where}: the model returned a {type(output).__name__} whose item {bad[0]} is "
                f"{shape_of(output[bad[0]])}; return tensors only (tuple items are exported as output_0, "
                "output_1, ...)"
            )
        return OutputLayout(SEQUENCE, tuple(f"output_{i}" for i in range(len(output))))
    fields = _mapping_of(output)
    if fields:
        bad = {k: v for k, v in fields.items() if not torch.is_tensor(v)}
        if bad:
            name, value = next(iter(bad.items()))
            raise TaskError(
                f"{where}: the model's output '{name}' is {shape_of(value)}; every output must be a "
                "tensor (a transformers model: leave output_hidden_states and output_attentions off)"
            )
        for name in fields:
            if not (isinstance(name, str) and name.isidentifier()):
                raise TaskError(
                    f"{where}: output name {name!r} must be a Python identifier: it names the ONNX "
                    "output and the served one"
                )
        return OutputLayout(MAPPING, tuple(fields))
    raise TaskError(
        f"{where}: the model returned {shape_of(output)}; return a tensor, a tuple of tensors, a dict "
        "of tensors or a ModelOutput (a mapping or dataclass of tensors)"
    )


def _mapping_of(output: Any) -> dict[str, Any]:
    """The fields of a dict, a ModelOutput (an OrderedDict of its non-None fields) or a
    dataclass."""
    if isinstance(output, Mapping):
        return {k: v for k, v in output.items() if v is not None}
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return {
            f.name: getattr(output, f.name)
            for f in dataclasses.fields(output)
            if getattr(output, f.name) is not None
        }
    return {}


def pick_output(
    layout: OutputLayout, wanted: str, preferred: tuple[str, ...], task: str, where: str
) -> str:
    """The output that carries the task's prediction: `task.output` when set, else the only one,
    else the first of `preferred` the model returns (`logits` of a transformers classifier)."""
    if wanted:
        if wanted not in layout.names:
            raise TaskError(
                f"{where}: task.output={wanted}, but the model returns {list(layout.names)}; set "
                f"task.output to one of them"
            )
        return wanted
    if len(layout.names) == 1:
        return layout.names[0]
    found = [n for n in preferred if n in layout.names]
    if found:
        return found[0]
    raise TaskError(
        f"{where}: the model returns {len(layout.names)} outputs {list(layout.names)}; say which one "
        f"carries the {task} prediction with task.output=<name> (e.g. task.output={layout.names[0]})"
    )


def check_rows(named: dict[str, torch.Tensor], rows: int, where: str) -> None:
    """Every output has one row per sample first: the server batches and splits answers by rows."""
    for name, t in named.items():
        if t.dim() == 0 or t.shape[0] != rows:
            raise TaskError(
                f"{where}: output '{name}' is {shape_of(t)} for {rows} samples; every output needs the "
                "batch axis first (one row per sample)"
            )


def shape_of(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def component_callable(section, arity: int, source: ArtifactSource | None) -> Callable:
    """A loss or metric component: a class is instantiated with args; a function gets args on every
    call."""
    key = section.KEY
    obj = resolve(key, section.component, source=source)
    if inspect.isclass(obj):
        instance = call(key, section.component, obj, section.args)
        if not callable(instance):
            raise ComponentError(
                f"{key}.component '{section.component}' built a {type(instance).__name__}, "
                "which is not callable as (outputs, target)"
            )
        return instance
    try:
        inspect.signature(obj).bind(*([None] * arity), **section.args)
    except TypeError as exc:
        raise ComponentError(
            f"{key}: {section.component}{plain_signature(inspect.signature(obj))} can't be called as "
            f"(outputs, target, **args) with args {section.args}: {exc}"
        ) from None
    except ValueError:
        # no signature to check
        pass
    return functools.partial(obj, **section.args)


# --- targets of any structure ------------------------------------------------------------------


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """`fn` on every tensor of a tensor, tuple/list or dict of them (a target as the data returns
    it)."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def concat(parts: list[Any]) -> Any:
    """Batches of one structure (tensor, tuple, dict) joined along the rows."""
    first = parts[0]
    if torch.is_tensor(first):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    raise TaskError(
        f"a target of type {type(first).__name__} can't be joined across batches; give tensors"
    )


def rows_of(value: Any) -> int:
    return len(leaves(value)[0])


# --- exact metrics across ranks ----------------------------------------------------------------


def reduce_sums(state: dict[str, Any], info) -> None:
    """Every tensor of `state` summed over the ranks (in place)."""
    if info.distributed:
        for value in state.values():
            if torch.is_tensor(value):
                dist.all_reduce(value)


def gather_in_order(parts: list[Any], info) -> Any:
    """This rank's rows (samples r, r+W, ... of the split) from every rank, back in the split's
    order; `parts` are batches of a tensor or of a tuple/dict of tensors."""
    mine = concat(parts) if parts else None
    if not info.distributed:
        return mine
    shards = [None] * info.world_size
    dist.all_gather_object(shards, mine)
    present = [s for s in shards if s is not None]
    return _interleave(shards, present[0], info.world_size)


def _interleave(shards: list[Any], like: Any, world: int) -> Any:
    if torch.is_tensor(like):
        total = sum(len(s) for s in shards if s is not None)
        out = torch.empty((total, *like.shape[1:]), dtype=like.dtype)
        for rank, shard in enumerate(shards):
            if shard is not None and len(shard):
                out[rank::world] = shard
        return out
    if isinstance(like, Mapping):
        return {
            k: _interleave([s[k] if s is not None else None for s in shards], like[k], world)
            for k in like
        }
    return type(like)(
        _interleave([s[i] if s is not None else None for s in shards], like[i], world)
        for i in range(len(like))
    )


# --- the outputs of one model, as a task sees them ---------------------------------------------


class ModelOutputs:
    """What a task learns from the probe's forward and keeps: the layout of the model's outputs, and
    the one that carries its prediction. Mixed into every task; `single_name` names a lone tensor,
    `preferred` is tried when several are returned and `task.output` is unset, `derived` are outputs
    the task computes in the graph from the prediction (`derive`)."""

    single_name = "output"
    preferred: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    # the prediction's argmax over axis 1 is the answer (classes)
    decides = False
    needs_prediction = True
    # task.output
    wanted = ""
    # learned by the probe, or recorded with the weights
    _layout: OutputLayout | None = None
    _prediction: str | None = None

    @property
    def layout(self) -> OutputLayout:
        """Until a probe or the recorded facts say otherwise: a lone tensor (the built-in models'
        layout)."""
        return self._layout or OutputLayout(TENSOR, (self.single_name,))

    @property
    def prediction(self) -> str | None:
        return self._prediction or (self.layout.names[0] if self.needs_prediction else None)

    def learn_outputs(self, output: Any, target: Any, where: str) -> dict[str, torch.Tensor]:
        layout = layout_of(output, self.single_name, where)
        named = layout.flatten(output)
        check_rows(named, rows_of(target), where)
        clash = sorted(set(self.derived) & set(layout.names))
        if clash:
            raise TaskError(
                f"{where}: the model returns an output named {clash[0]}, which the {self.name} task adds "
                "to the exported graph itself; rename it"
            )
        self._layout = layout
        if self.needs_prediction:
            self._prediction = pick_output(layout, self.wanted, self.preferred, self.name, where)
        return named

    def named(self, output: Any) -> dict[str, torch.Tensor]:
        """{name: tensor} of one return value of the model."""
        return self.layout.flatten(output)

    def predicted(self, output: Any) -> torch.Tensor:
        return self.named(output)[self.prediction]

    @property
    def output_names(self) -> list[str]:
        return [*self.layout.names, *self.derived]

    @property
    def decision(self) -> str | None:
        return self.prediction if self.decides else None

    def exported(self, output: Any) -> dict[str, torch.Tensor]:
        """The graph's outputs by name: the model's own, then the task's."""
        named = self.named(output)
        return {**named, **self.derive(named)}

    def derive(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}

    def output_facts(self) -> dict[str, Any]:
        return {"layout": self.layout.to_json(), "prediction": self.prediction}

    def restore_outputs(self, recorded: dict, wanted: str) -> None:
        self.wanted = wanted
        self._layout = OutputLayout.from_json(recorded.get("layout"))
        self._prediction = recorded.get("prediction")


def suggest_num_classes(classes: list[str] | None) -> dict[str, Any]:
    """`num_classes` for a model that takes it, from the training set's `classes`."""
    return {"num_classes": len(classes)} if classes else {}


def refuse_others_settings(task_cfg, own: tuple[str, ...] = ()) -> None:
    """Settings of other tasks, refused by name: given to this one they would do nothing. `own`: the
    ones it takes itself."""
    given = [
        k
        for k in ("metric", "metric_mode")
        if k not in own and getattr(task_cfg, k, None) is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join('task.' + k for k in given)} only apply to task.name=custom; "
            f"{task_cfg.name} has its own metrics (set task.name=custom to use yours)"
        )
    if "ignore_index" not in own and getattr(task_cfg, "ignore_index", None) is not None:
        raise ValueError(
            f"task.ignore_index only applies to task.name=token_classification (a class per token, "
            f"positions marked to leave out); {task_cfg.name} has no positions to leave out"
        )


def describe_value(value: Any) -> str:
    if torch.is_tensor(value):
        return shape_of(value)
    return f"a {type(value).__name__} ({value!r:.40})"
