"""The weights bundle: `model.safetensors` + `model.json` (format trainserve-weights/2). What
model.json holds is said here (`describe`, which `pipeline consolidate` writes beside the weights it
streamed); read and checked here for every stage that takes them (export, verify, the serve check),
and the model rebuilt from them.

model.json holds the config, the model's component and args, the task's facts, the data's inputs,
the checkpoint it came from (`source`), and the sha256 of model.safetensors, which is checked on
read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.artifact.safetensors_writer import TensorSpec
from pipeline.components.build import ModelSpec, instantiate_model
from pipeline.components.reference import ArtifactSource
from pipeline.config import Config, config_from_dict
from pipeline.errors import WeightsError
from serving.lineage import file_sha256

WEIGHTS_FORMAT = "trainserve-weights/2"
WEIGHTS_FILE, META_FILE = "model.safetensors", "model.json"


@dataclass
class Weights:
    directory: Path
    meta: dict[str, Any]
    config: Config
    state_dict: dict[str, torch.Tensor]

    @property
    def source(self) -> dict[str, Any]:
        return self.meta.get("source") or {}

    @property
    def step(self) -> int:
        """The training step of the checkpoint the weights came from (0 when they do not say)."""
        step = self.source.get("step")
        return (
            int(step) if isinstance(step, int) or (isinstance(step, str) and step.isdigit()) else 0
        )


def describe(meta: dict, ckpt: Path, specs: list[TensorSpec], sha: str, dtype: str) -> dict:
    """model.json, as `pipeline consolidate` writes it beside the weights: everything export needs
    besides them. `meta`: the checkpoint's own description (trainserve.json); `specs`: the tensors
    written; `sha`: the weights file's sha256; `dtype`: what the tensors were cast to."""
    return {
        "format": WEIGHTS_FORMAT,
        "config": meta.get("config"),
        "model": meta.get("model"),
        "data": meta.get("data"),
        "task": meta.get("task"),
        "labels": meta.get("labels"),
        "inputs": meta.get("inputs"),
        "single_input": meta.get("single_input", True),
        "code": meta.get("code"),
        "tensors": {
            s.name: {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")}
            for s in sorted(specs, key=lambda s: s.name)
        },
        "sha256": sha,
        "dtype": dtype,
        "source": {
            "checkpoint": str(ckpt.resolve()),
            "step": meta.get("step"),
            "world_size": meta.get("world_size"),
            "strategy": meta.get("strategy"),
            "mlflow_run_id": meta.get("mlflow_run_id"),
            # of this step, when it was evaluated
            "val_metrics": meta.get("val_metrics"),
            "best": ((meta.get("train_state") or {}).get("monitor") or {}).get("best_step")
            == meta.get("step"),
        },
    }


def read_weights(directory: Path) -> Weights:
    """Reads and checks model.json + model.safetensors (format, checksum, config); loads tensors
    safely."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta_path, weights_path = directory / META_FILE, directory / WEIGHTS_FILE
    missing = [p.name for p in (weights_path, meta_path) if not p.is_file()]
    if missing:
        raise WeightsError(
            f"{directory}: missing {', '.join(missing)}; expected the output of "
            "`pipeline consolidate` (model.safetensors and model.json)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != WEIGHTS_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise WeightsError(
            f"{meta_path}: format {got!r}, expected {WEIGHTS_FORMAT!r}"
            + ("; consolidate the checkpoint again with this trainserve" if got else "")
        )
    absent = [k for k in ("config", "model", "sha256") if not meta.get(k)]
    model = meta.get("model")
    if not absent and not (
        isinstance(model, dict)
        and isinstance(model.get("component"), str)
        and isinstance(model.get("args"), dict)
    ):
        absent = ["model {component, args}"]
    if absent:
        raise WeightsError(f"{meta_path}: missing field(s) {', '.join(absent)}")
    digest = file_sha256(weights_path)
    if digest != meta["sha256"]:
        raise WeightsError(
            f"{weights_path}: sha256 {digest} does not match model.json ({meta['sha256']}); "
            "the file was changed or truncated after consolidation"
        )
    config = config_from_dict(meta["config"])
    # mapped, not read: a tensor's pages are read (and count against the process) when touched
    try:
        state_dict = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"{weights_path}: cannot be read as safetensors ({exc})") from None
    labels, classes = meta.get("labels"), (meta.get("task") or {}).get("num_classes")
    if labels is not None and classes is not None and len(labels) != classes:
        raise WeightsError(f"{meta_path}: {len(labels)} labels for a model with {classes} classes")
    return Weights(directory, meta, config, state_dict)


def load_model(
    weights: Weights, source: ArtifactSource | None = None, missing_hint: str = ""
) -> torch.nn.Module:
    """The model rebuilt from its recorded component and args, with the weights checked key by key
    and shape by shape."""
    spec = ModelSpec(**weights.meta["model"])
    model = instantiate_model(spec, source, missing_hint)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.state_dict.items()}
    problems = [f"missing {k} {list(s)}" for k, s in expected.items() if k not in got]
    problems += [f"unexpected {k} {list(s)}" for k, s in got.items() if k not in expected]
    problems += [
        f"{k}: file {list(got[k])}, model {list(s)}"
        for k, s in expected.items()
        if k in got and got[k] != s
    ]
    if problems:
        shown = "; ".join(problems[:20]) + (
            f"; ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise WeightsError(
            f"{weights.directory / WEIGHTS_FILE} does not match the model its config describes "
            f"({spec.component} with args {_brief(spec.args)}): {shown}"
        )
    # Weights consolidated as bf16/fp16 load in the model's own dtypes (fp32 for most, float64 if
    # built so): the graph and its gates run at the precision the model was defined in. assign: the
    # module takes the file's tensors themselves (mapped, see read_weights) instead of copying them
    # into its freshly initialized ones, so a model of N GB costs N GB once, in pages read only as
    # they are used (a lookup reads its rows).
    own = model.state_dict()
    model.load_state_dict(
        {k: v.to(own[k].dtype) for k, v in weights.state_dict.items()}, strict=True, assign=True
    )
    return model.eval()


def remapped(weights: Weights) -> Weights:
    """`weights` with tensors of their own, mapped from the file again: a model built from them
    shares no tensor with one built from `weights` (what one does to its weights, the other does not
    see)."""
    from safetensors.torch import load_file

    return replace(weights, state_dict=load_file(str(weights.directory / WEIGHTS_FILE)))


def _brief(args: dict) -> str:
    text = json.dumps(args)
    return text if len(text) <= 120 else text[:117] + "..."
