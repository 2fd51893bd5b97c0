"""Where the model comes from, what it is called, and loading it into an Engine.

Sources:
    path/to/model.onnx, or a directory holding one (e.g. a downloaded MLflow model)
    models:/<name>@<alias>     a registered model by alias (the only source `--reload-interval` polls)
    models:/<name>/<version>   a registered model version
    models:/<model id>         an MLflow logged model
    runs:/<run id>/<path>      an artifact of a run

mlflow is imported only for the registry and run sources: a server of a local file doesn't need it.
The tracking and registry servers come from MLflow's own environment (MLFLOW_TRACKING_URI, ...).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from serving.engine import Engine

log = logging.getLogger("serving.loader")

_ALIAS = re.compile(r"^models:/([^/@]+)@([^/@]+)$")
_VERSION = re.compile(r"^models:/([^/@]+)/(\d+)$")
_LOGGED = re.compile(r"^models:/([^/@]+)$")
_RUN = re.compile(r"^runs:/([^/]+)/(.+)$")

# Where the model came from, as the exporter writes it into the ONNX file's metadata_props: lineage key ->
# metadata key. Read from the loaded file itself, so that every answer names the file that computed it.
LINEAGE_KEYS = {
    "run_id": "trainserve.run_id",  # the MLflow training run
    "checkpoint_step": "trainserve.checkpoint_step",
    "checkpoint": "trainserve.checkpoint",  # the checkpoint directory the weights were consolidated from
    "config_sha256": "trainserve.config_sha256",
    "weights_sha256": "trainserve.weights_sha256",  # of the consolidated model.safetensors
    "model_component": "trainserve.model_component",
    "data_component": "trainserve.data_component",
}


class SourceError(Exception):
    """The model source cannot be parsed, found or fetched."""


@dataclass(frozen=True)
class ModelInfo:
    """What clients are told about the loaded model."""
    name: str
    version: str
    source: str  # the path or URI it was loaded from
    labels: tuple[str, ...] | None = None
    # LINEAGE_KEYS found in the file's metadata with a non-empty value (none for a hand-made ONNX file).
    lineage: dict[str, str] = field(default_factory=dict)


@dataclass
class LoadedModel:
    engine: Engine
    info: ModelInfo
    workdir: str | None = None  # a download directory to delete when the model is dropped

    def discard(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def check_source(uri: str) -> str:
    """The kind of `uri` ("file", "alias", "version", "logged", "run"), or SourceError explaining the forms."""
    for kind, pattern in (("alias", _ALIAS), ("version", _VERSION), ("logged", _LOGGED), ("run", _RUN)):
        if pattern.match(uri):
            return kind
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:/", uri):
        raise SourceError(f"cannot serve '{uri}': expected a path to an .onnx file, models:/<name>@<alias>, "
                          "models:/<name>/<version>, models:/<model id> or runs:/<run id>/<path>")
    return "file"


def _check_store() -> None:
    """An embedded store (sqlite file) that isn't there is the wrong working directory, not an empty
    registry: say so, instead of letting MLflow create an empty mlflow.db and report the model missing."""
    import mlflow

    uri = mlflow.get_registry_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise SourceError(f"no MLflow store at {uri[len('sqlite:///'):]}: run from the directory where the pipeline "
                          "wrote mlflow.db, or set MLFLOW_TRACKING_URI to the store that holds the model")


def alias_version(uri: str) -> str:
    """The version a models:/name@alias URI points at now (one registry call)."""
    name, alias = _ALIAS.match(uri).groups()
    import mlflow

    _check_store()
    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except Exception as exc:  # MlflowException for an unknown name or alias, connection errors
        raise SourceError(f"cannot resolve {uri} (registry {mlflow.get_registry_uri()}): {exc}") from exc


def load_model(uri: str, *, device: str, threads: int | None, name: str | None = None,
               version: str | None = None, device_id: int = 0) -> LoadedModel:
    """Fetch `uri` (pinned at `version` for an alias, when given), open it in an Engine, and name it.

    Name: `name` if given, else the registered name for registry models, else the model's
    `trainserve.model_name` metadata, else the file stem.
    """
    kind = check_source(uri)
    workdir = None
    registered = None
    try:
        if kind == "file":
            path, version = _find_onnx(Path(uri)), version or "1"
        else:
            workdir = tempfile.mkdtemp(prefix="trainserve-model-")
            if kind in ("alias", "version"):
                registered = (_ALIAS.match(uri) or _VERSION.match(uri)).group(1)
                if kind == "version":
                    version = _VERSION.match(uri).group(2)
                version = version or alias_version(uri)
                fetch_uri = f"models:/{registered}/{version}"
            else:
                fetch_uri, version = uri, version or "1"
            path = _find_onnx(Path(_download(fetch_uri, workdir)))
        engine = Engine(str(path), device=device, threads=threads, device_id=device_id)
    except BaseException:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    info = ModelInfo(
        name=name or registered or engine.metadata.get("trainserve.model_name") or path.stem,
        version=str(version), source=uri, labels=_labels(engine.metadata), lineage=lineage(engine.metadata))
    return LoadedModel(engine, info, workdir)


def _download(uri: str, dst: str) -> str:
    import mlflow

    _check_store()
    try:
        return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst)
    except Exception as exc:  # mlflow raises MlflowException, OSError, ... depending on the store
        raise SourceError(f"cannot fetch {uri} from MLflow "
                          f"(tracking URI {mlflow.get_tracking_uri()}): {exc}") from exc


def _find_onnx(path: Path) -> Path:
    """The .onnx file at `path`: the file itself, or the one inside a (model) directory."""
    if path.is_file():
        return path
    if not path.exists():
        raise SourceError(f"model file not found: {path}")
    found = sorted(path.rglob("*.onnx"))
    if not found:
        raise SourceError(f"no .onnx file under {path}")
    if len(found) > 1:
        named = [p for p in found if p.name == "model.onnx"]
        if len(named) != 1:
            raise SourceError(f"several .onnx files under {path}: {[str(p) for p in found]}; "
                              "point --model at one of them")
        return named[0]
    return found[0]


def lineage(metadata: dict[str, str]) -> dict[str, str]:
    """The LINEAGE_KEYS present in ONNX metadata, empty values left out."""
    return {key: str(metadata[prop]).strip() for key, prop in LINEAGE_KEYS.items()
            if str(metadata.get(prop) or "").strip()}


def _labels(metadata: dict[str, str]) -> tuple[str, ...] | None:
    raw = metadata.get("trainserve.labels")
    if raw is None:
        return None
    try:
        labels = json.loads(raw)
    except ValueError:
        log.warning("ignoring trainserve.labels metadata: not JSON: %.80s", raw)
        return None
    if not isinstance(labels, list):
        log.warning("ignoring trainserve.labels metadata: not a JSON list")
        return None
    return tuple(str(x) for x in labels)

