"""The lineage contract: every `trainserve.*` key written into an ONNX file's metadata, onto an
MLflow run, onto a registered version or onto a logged dataset, and the `Lineage` value that export
writes and the loader, verify, trace and promote read. Torch- and pipeline-free, so that the server
reads the same contract the pipeline writes.

Where each fact lives, and for whom:
- the ONNX file's metadata: what the file itself says of where it came from; the server reads it
  from the bytes it serves (receipts, /v2/models parameters) and `pipeline verify` checks it against
  the registry;
- a registered version's tags: the handful a person reads in the MLflow UI (model, data, task,
  checkpoint, run, verdict) and one `trainserve.sha256` record of every file and digest the server
  and `verify` check; no path of the machine that trained;
- a run's tags: at most 12 a person reads (RUN_TAGS); everything else is the run's `lineage.json`
  artifact.

The run id has one rule: it is the MLflow run that trained the weights (model.json's
`source.mlflow_run_id`), "" for weights made outside a tracked run; the ONNX metadata and the
version's tag say the same. (MLflow's own `run_id` of a version is the run its model was logged to,
the same run whenever there is one.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping

PREFIX = "trainserve."

# --- in the ONNX file's metadata and, the same fact under the same key, on the registered version --------------
# the MLflow run that trained the weights (the rule above)
RUN_ID = "trainserve.run_id"
# the checkpoint's directory name (step_00000088), never a path
CHECKPOINT = "trainserve.checkpoint"
# its training step
STEP = "trainserve.step"
# the model component
MODEL = "trainserve.model"
# the data component
DATA = "trainserve.data"
TASK = "trainserve.task"
# of the run's resolved config
CONFIG_SHA256 = "trainserve.config_sha256"
# of the consolidated model.safetensors
WEIGHTS_SHA256 = "trainserve.weights_sha256"
# of its model.json (ONNX metadata only)
WEIGHTS_META_SHA256 = "trainserve.weights_meta_sha256"


def file_sha256(path: Path, block: int = 1 << 20) -> str:
    """A file's sha256 as the version's `trainserve.sha256` record holds it (export, consolidate and
    the checkpoint write it; the server and `pipeline verify` check it), read a block at a time."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            sha.update(chunk)
    return sha.hexdigest()


def data_sha256(split: str) -> str:
    """The content digest of a split ("train", "val") the weights were trained and validated on."""
    return f"trainserve.{split}_sha256"


# --- the ONNX file's metadata only: what the server needs to serve it -----------------------------
MODEL_NAME = "trainserve.model_name"
# JSON list: the class names
LABELS = "trainserve.labels"
# the output whose argmax over axis 1 is the answer (shadow agreement)
DECISION = "trainserve.decision"
# the output that carries the prediction (live metrics)
PREDICTION = "trainserve.prediction"
OPSET = "trainserve.opset"
# JSON {input: {axis: longest length}} (serving/lengths.py)
MAX_LENGTHS = "trainserve.max_lengths"
# the inputs a uint8 variant takes as pixel values (serving/drift.py)
UINT8_INPUTS = "trainserve.uint8_inputs"
# the logged MLflow model's metadata: the validation parity gate's sentence
REPORT = "trainserve.report"
# How an image file becomes the model's input, as training made it: JSON {input: serving/images.py
# Preprocessing} (one input). Written from the data component at export, also on the registered
# version; a server takes encoded images (PNG, JPEG) for that input (serving/image_inputs.py),
# applying exactly this.
PREPROCESSING = "trainserve.preprocessing"
# The output whose row holds a score per class name (a classifier's probabilities): what an image
# request's answer ranks, the class names with their scores, best first.
SCORES = "trainserve.scores"
# The model's rows are independent along the first axis: the batch sizes export checked it at
# ("1,7,64"), or how else it is known. The server batches requests together only for a file that
# records it (or on its operator's say-so: --batching, config.pbtxt).
ROWS_INDEPENDENT = "trainserve.rows_independent"

# --- on a registered version only -----------------------------------------------------------------
# JSON {file name or digest name: sha256}: what the server and `verify` check (below)
SHA256 = "trainserve.sha256"
# JSON {provider: variant}: what `serve --variant auto` picks
FASTEST_VARIANTS = "trainserve.fastest_variants"
# pending | promoted | not promoted (promotion.py's turn-taking reads it)
PROMOTION = "trainserve.promotion"
# JSON: the shadow figures `pipeline promote` judged the version on
SHADOW = "trainserve.shadow"
# promote | reject | ... (" (forced)"), the one figure read at a glance
SHADOW_VERDICT = "trainserve.shadow_verdict"

# --- on a run (RUN_TAGS: the whole set, at most 12) -----------------------------------------------
# "2 x cpu, ddp, bf16-mixed": world size, device, strategy, precision
SETUP = "trainserve.setup"
# the commit the code was at (12 digits; the whole one in lineage.json)
GIT = "trainserve.git"
# where the run's checkpoints are: a local directory or an s3:// URL (resume reads it)
RUN_DIR = "trainserve.run_dir"
# the best checkpoint's directory name, by the monitored metric
BEST = "trainserve.best"
# the newest checkpoint's directory name (what a resume continues from)
LATEST = "trainserve.latest"
# "done: train, consolidate · running: export"
STAGES = "trainserve.stages"
# what export made of it: "resnet18-digits v1 @champion", "not promoted: ..."
VERDICT = "trainserve.verdict"
# JSON, while a stage runs: its process, and the status to put back; else "gone: ..."
PROCESS = "trainserve.process"
# CHECKPOINT (the exported checkpoint), TASK, MODEL and DATA are on the run too, as on the version.
RUN_TAGS = (
    TASK,
    MODEL,
    DATA,
    SETUP,
    GIT,
    RUN_DIR,
    BEST,
    LATEST,
    CHECKPOINT,
    STAGES,
    VERDICT,
    PROCESS,
)

# --- on a logged dataset (a run's input) ----------------------------------------------------------
# the split's whole digest (MLflow's own digest is 8 characters)
DATASET_SHA256 = "trainserve.sha256"
DATASET_SAMPLES = "trainserve.samples"
# JSON: the inputs' names, dtypes and shapes
DATASET_INPUTS = "trainserve.inputs"

# the run's artifact with the whole lineage
RUN_FILE = "lineage.json"


def onnx_file(variant: str) -> str:
    """The file name of a variant in a registered version ("fp32" is model.onnx)."""
    return "model.onnx" if variant == "fp32" else f"model.{variant}.onnx"


# --- what versions and files recorded before this contract (read, never written) ------------------
LEGACY_FILE_TAGS = {
    "model.onnx": "trainserve.onnx_sha256",
    "drift_reference.json": "trainserve.drift_sha256",
    "weights": "trainserve.weights_sha256",
    "config": "trainserve.config_sha256",
    "train": "trainserve.data.train_sha256",
    "val": "trainserve.data.val_sha256",
}
LEGACY_METADATA = {
    STEP: "trainserve.checkpoint_step",
    MODEL: "trainserve.model_component",
    DATA: "trainserve.data_component",
    "trainserve.train_sha256": "trainserve.data.train_sha256",
    "trainserve.val_sha256": "trainserve.data.val_sha256",
}
LEGACY_RUN = {"checkpoint": "trainserve.checkpoint", "best": "trainserve.best_checkpoint"}
# + the stage: running | done | failed
LEGACY_STAGE = "trainserve.stage."


def sha256_record(tags: Mapping[str, str]) -> dict[str, str] | None:
    """A version's record of {file or digest name: sha256}: its SHA256 tag, else what the tags
    recorded before it; None where it records nothing (registered by hand). ValueError: a SHA256 tag
    that is not a JSON object."""
    if SHA256 in tags:
        recorded = json.loads(tags[SHA256] or "null")
        if not isinstance(recorded, dict):
            raise ValueError(f"the {SHA256} tag is not a JSON object")
        return {str(k): str(v) for k, v in recorded.items()}
    legacy = {
        k: v for k, v in tags.items() if k.startswith("trainserve.") and k.endswith("_sha256") and v
    }
    if not legacy:
        return None
    names = {tag: name for name, tag in LEGACY_FILE_TAGS.items()}
    found = {}
    for tag, digest in legacy.items():
        if tag in names:
            found[names[tag]] = digest
        elif tag.startswith("trainserve.onnx_"):
            # trainserve.onnx_<variant>_sha256, trainserve.onnx[_<variant>]_data_sha256 (a graph's
            # external data)
            variant = tag.removeprefix("trainserve.onnx_").removesuffix("_sha256")
            data = variant == "data" or variant.endswith("_data")
            variant = variant.removesuffix("data").removesuffix("_")
            found[
                (f"model.{variant}.onnx" if variant else "model.onnx") + (".data" if data else "")
            ] = digest
    return found


def recorded_sha256(tags: Mapping[str, str], name: str) -> str:
    """The sha256 a version records for a file (model.onnx, model.fp16.onnx, model.onnx.data,
    drift_reference.json) or a digest ("weights", "config", "train", "val"); "" when it records none
    (or its record can't be read)."""
    try:
        return (sha256_record(tags) or {}).get(name, "")
    except ValueError:
        return ""


def recorded_files(tags: Mapping[str, str]) -> dict[str, str]:
    """{ONNX file name: sha256} of the model files a version records (a variant's among them; data
    files not)."""
    try:
        return {k: v for k, v in (sha256_record(tags) or {}).items() if k.endswith(".onnx")}
    except ValueError:
        return {}


# --- stages, on the run's STAGES tag --------------------------------------------------------------
STAGE_ORDER = ("train", "consolidate", "export", "pipeline")


def read_stages(value: str | None) -> dict[str, str]:
    """{stage: state} from a STAGES tag ("done: train, consolidate · running: export")."""
    found = {}
    for part in (value or "").split(" · "):
        state, _, stages = part.partition(": ")
        found |= {
            stage.strip(): state.strip()
            for stage in stages.split(",")
            if stage.strip() and state.strip()
        }
    return found


def write_stages(stages: Mapping[str, str]) -> str:
    """The STAGES tag: the stages grouped by state, each in pipeline order (short enough for the
    UI's tag chips)."""
    order = {stage: i for i, stage in enumerate(STAGE_ORDER)}
    ordered = sorted(stages.items(), key=lambda kv: order.get(kv[0], 99))
    states = list(dict.fromkeys(state for _, state in ordered))
    return " · ".join(
        f"{state}: {', '.join(k for k, v in ordered if v == state)}" for state in states
    )


@dataclass(frozen=True)
class Lineage:
    """Where a model came from: the same value in the ONNX file's metadata and on its registered
    version."""

    run_id: str = ""
    # the checkpoint directory's name
    checkpoint: str = ""
    step: str = ""
    model: str = ""
    data: str = ""
    task: str = ""
    config_sha256: str = ""
    weights_sha256: str = ""
    weights_meta_sha256: str = ""
    # {"train"|"val": sha256}
    data_sha256: dict[str, str] = field(default_factory=dict)

    _KEYS = {
        "run_id": RUN_ID,
        "checkpoint": CHECKPOINT,
        "step": STEP,
        "model": MODEL,
        "data": DATA,
        "task": TASK,
        "config_sha256": CONFIG_SHA256,
        "weights_sha256": WEIGHTS_SHA256,
        "weights_meta_sha256": WEIGHTS_META_SHA256,
    }

    def metadata(self) -> dict[str, str]:
        """As the ONNX file's metadata_props."""
        return {key: getattr(self, name) for name, key in self._KEYS.items()} | {
            data_sha256(split): digest for split, digest in self.data_sha256.items()
        }

    def version_tags(self) -> dict[str, str]:
        """As a registered version's readable tags (the digests go into its SHA256 record:
        `digests`)."""
        return {
            key: getattr(self, name)
            for name, key in self._KEYS.items()
            if key in (RUN_ID, CHECKPOINT, STEP, MODEL, DATA, TASK)
        }

    def digests(self) -> dict[str, str]:
        """The digests a version's SHA256 record holds besides its files'."""
        return {"weights": self.weights_sha256, "config": self.config_sha256, **self.data_sha256}

    def served(self) -> dict[str, str]:
        """What a server says of the model it loaded (/v2/models parameters, receipts), under the
        names its clients know; the non-empty facts only (none for a hand-made ONNX file)."""
        found = {
            "run_id": self.run_id,
            "checkpoint_step": self.step,
            "checkpoint": self.checkpoint,
            "config_sha256": self.config_sha256,
            "weights_sha256": self.weights_sha256,
            "model_component": self.model,
            "data_component": self.data,
        }
        return {k: v for k, v in found.items() if v}

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, found: Mapping[str, str]) -> "Lineage":
        """From an ONNX file's metadata_props (or a version's tags and SHA256 record); missing facts
        stay ""."""
        values = {
            name: str(found.get(key) or found.get(LEGACY_METADATA.get(key, "")) or "").strip()
            for name, key in cls._KEYS.items()
        }
        # a version: its digests are in its SHA256 record
        if SHA256 in found:
            values |= {
                "config_sha256": recorded_sha256(found, "config"),
                "weights_sha256": recorded_sha256(found, "weights"),
            }
        digests = {
            split: str(
                found.get(data_sha256(split))
                or found.get(LEGACY_METADATA[data_sha256(split)])
                or recorded_sha256(found, split)
            )
            for split in ("train", "val")
        }
        return cls(**values, data_sha256={k: v for k, v in digests.items() if v})


# the contract is whole
assert {f.name for f in fields(Lineage)} == set(Lineage._KEYS) | {"data_sha256"}  # noqa: S101
# what the MLflow UI shows a person at a glance
assert len(RUN_TAGS) <= 12  # noqa: S101
