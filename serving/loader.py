"""Where the model comes from, what it is called, and loading it into an Engine.

Sources:
    path/to/model.onnx, or a directory holding one (e.g. a downloaded MLflow model)
    models:/<name>@<alias>     a registered model by alias (the only source `--reload-interval`
                               polls)
    models:/<name>/<version>   a registered model version
    models:/<model id>         an MLflow logged model
    runs:/<run id>/<path>      an artifact of a run

mlflow is imported only for the registry and run sources: a server of a local file doesn't need it.
The tracking and registry servers come from MLflow's own environment (MLFLOW_TRACKING_URI, ...).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from serving import drift, lengths
from serving.engine import (
    CPU,
    GPU_PROVIDERS,
    BatchBuckets,
    Engine,
    EngineError,
    GpuOptions,
    choose_provider,
)
from serving.image_inputs import ImageInput, image_input
from serving.input_range import InputRanges, input_ranges
from serving.lineage import (
    DECISION,
    FASTEST_VARIANTS,
    LABELS,
    MODEL_NAME,
    PREDICTION,
    SHA256,
    Lineage,
    file_sha256,
    onnx_file,
    recorded_sha256,
    sha256_record,
)
from serving.model_config import ConfigError, ModelConfig, narrowed

log = logging.getLogger("serving.loader")

_ALIAS = re.compile(r"^models:/([^/@]+)@([^/@]+)$")
_VERSION = re.compile(r"^models:/([^/@]+)/(\d+)$")
_LOGGED = re.compile(r"^models:/([^/@]+)$")
_RUN = re.compile(r"^runs:/([^/]+)/(.+)$")
# The file of each variant in a model directory (the export logs them into the registered model).
# uint8: image inputs as UINT8 pixel values (its clients send those)
VARIANT_FILES = {
    "fp32": "model.onnx",
    "fp16": "model.fp16.onnx",
    "int8": "model.int8.onnx",
    "uint8": "model.uint8.onnx",
}


class SourceError(Exception):
    """The model source cannot be parsed, found or fetched, or is not the file its registry version
    records."""


def data_file_of(path: Path) -> Path | None:
    """The external data file beside an ONNX file, as the export names it (`<file>.data`), if there
    is one. The graph's own reference to it is covered by the ONNX file's hash; this file's bytes by
    its own."""
    data = path.with_name(path.name + ".data")
    return data if data.is_file() else None


@dataclass(frozen=True)
class ModelInfo:
    """What clients are told about the loaded model."""

    name: str
    version: str
    # the path or URI it was loaded from
    source: str
    labels: tuple[str, ...] | None = None
    # Lineage.served(): what the file's metadata says of where it came from, plus the loaded bytes'
    # onnx_sha256.
    lineage: dict[str, str] = field(default_factory=dict)
    # {input: {axis: longest length}} the model was exported for (serving/lengths.py); {} if not
    # recorded.
    max_lengths: dict[str, dict[int, int]] = field(default_factory=dict)
    # the registered model's name, for a registry source (the served name may differ)
    registered: str | None = None
    # What the model's outputs mean, as export recorded it (never a task's name): the output whose
    # argmax over axis 1 is its answer, and the one that carries its prediction; None when not
    # recorded.
    decision: str | None = None
    prediction: str | None = None
    # What its config.pbtxt says (a repository model): max_batch_size (a cap on its batches when >
    # 0) and each output's class names (label_filename, for the classification extension).
    max_batch_size: int | None = None
    output_labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Its dynamic_batching: how long a partial batch waits (ms), the most rows its queue holds
    # (None: the flags')
    max_delay_ms: float | None = None
    max_queue_rows: int | None = None

    def labels_for(self, output: str, classes: int) -> tuple[str, ...] | None:
        """The class names of `output` whose rows hold `classes` values: its config's label file,
        else the labels export recorded when there is one per value (a classifier's logits or
        probabilities), else None."""
        if output in self.output_labels:
            return self.output_labels[output]
        if self.labels is not None and len(self.labels) == classes:
            return self.labels
        return None

    @property
    def resolved_source(self) -> str:
        """Where this version's bytes came from, pinned: models:/<registered>/<version> for a
        registry source (an alias moves; this does not), else the source as given."""
        return f"models:/{self.registered}/{self.version}" if self.registered else self.source


@dataclass
class LoadedModel:
    engine: Engine
    info: ModelInfo
    # a download directory to delete when the model is dropped
    workdir: str | None = None
    # which file of the model directory runs (VARIANT_FILES)
    variant: str = "fp32"
    # the training data's statistics beside the file (serving/drift.py)
    drift_reference: dict | None = None
    # What it takes as encoded image files, when its export recorded its preprocessing
    # (serving/image_inputs.py).
    images: ImageInput | None = None
    # Where its float inputs' training values lie, from the drift reference
    # (serving/input_range.py), or None.
    ranges: InputRanges | None = None

    def discard(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


# A downloaded version's files live in a directory named for the process that holds them (its PID
# namespace and PID): a server killed with SIGKILL cannot remove its own, so the next one started on
# the machine does (sweep_orphaned_downloads).
DOWNLOADS_PREFIX = "trainserve-model-"


def _workdir_prefix() -> str:
    return f"{DOWNLOADS_PREFIX}{_pid_namespace()}-{os.getpid()}-"


def _pid_namespace() -> str:
    try:
        # "pid:[4026531836]" -> its inode: servers in other containers sharing the directory are
        # never judged by PIDs of this one
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"


def sweep_orphaned_downloads() -> list[str]:
    """Remove the download directories, in the temporary directory, of servers of this PID namespace
    that are no longer running; returns the directories removed."""
    removed, ours = [], f"{DOWNLOADS_PREFIX}{_pid_namespace()}-"
    for path in Path(tempfile.gettempdir()).glob(f"{ours}*-*"):
        pid = path.name.removeprefix(ours).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _running(pid: int) -> bool:
    # pipeline/checkpoint/run_dir.py's pid_alive, written again: serving/ imports nothing of pipeline/
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_source(uri: str) -> str:
    """The kind of `uri` ("file", "alias", "version", "logged", "run"), or SourceError explaining
    the forms."""
    for kind, pattern in (
        ("alias", _ALIAS),
        ("version", _VERSION),
        ("logged", _LOGGED),
        ("run", _RUN),
    ):
        if pattern.match(uri):
            return kind
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:/", uri):
        raise SourceError(
            f"cannot serve '{uri}': expected a path to an .onnx file, models:/<name>@<alias>, "
            "models:/<name>/<version>, models:/<model id> or runs:/<run id>/<path>"
        )
    return "file"


def _check_store() -> None:
    """An embedded store (sqlite file) that isn't there is the wrong working directory, not an empty
    registry: say so, instead of letting MLflow create an empty mlflow.db and report the model
    missing."""
    import mlflow

    uri = mlflow.get_registry_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise SourceError(
            f"no MLflow store at {uri[len('sqlite:///') :]}: run from the directory where the pipeline "
            "wrote mlflow.db, or set MLFLOW_TRACKING_URI to the store that holds the model"
        )


def alias_version(uri: str) -> str:
    """The version a models:/name@alias URI points at now (one registry call)."""
    name, alias = _ALIAS.match(uri).groups()
    import mlflow

    _check_store()
    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except Exception as exc:
        # MlflowException for an unknown name or alias, connection errors
        raise SourceError(
            registry_miss(name, alias=alias)
            or f"cannot resolve {uri} (registry {mlflow.get_registry_uri()}): {exc}"
        ) from exc


def registry_miss(name: str, alias: str | None = None, version: str | None = None) -> str | None:
    """Why models:/<name>@<alias> (or /<version>) is not in the registry, with the names that are:
    "no registered model 'resnet18-digit' in <store>; did you mean 'resnet18-digits'?",
    "resnet18-digits has no alias @champoin; its aliases: @champion", "resnet18-digits has no
    version 7; its versions: 1, 2". None when all of it is there (the failure was another) or the
    registry can't be asked (its own error says more)."""
    import difflib

    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    try:
        try:
            model = client.get_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                return None
            # its first page: enough to hint
            names = sorted(m.name for m in client.search_registered_models())
            close = difflib.get_close_matches(name, names, n=3)
            hint = (
                f"did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else f"it has {', '.join(repr(n) for n in names[:10])}{' ...' if len(names) > 10 else ''}"
                if names
                else "it has no registered model: run from the directory where the pipeline wrote mlflow.db, or set "
                "MLFLOW_TRACKING_URI to the store that holds the model"
            )
            return f"no registered model '{name}' in {mlflow.get_registry_uri()}; {hint}"
        aliases = sorted(model.aliases or {})
        if alias is not None and alias not in aliases:
            return f"{name} has no alias @{alias}; its aliases: {', '.join(f'@{a}' for a in aliases) or 'none'}"
        if version is not None:
            try:
                client.get_model_version(name, version)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    return None
                versions = sorted(
                    int(v.version) for v in client.search_model_versions(f"name='{name}'")
                )
                return f"{name} has no version {version}; its versions: {', '.join(map(str, versions)) or 'none'}"
    except Exception:  # noqa: BLE001
        # the registry can't be asked: the caller's message stands
        return None
    return None


def load_model(
    uri: str,
    *,
    device: str,
    threads: int | None,
    name: str | None = None,
    version: str | None = None,
    device_id: int = 0,
    variant: str = "fp32",
    gpu: GpuOptions | None = None,
    batch_buckets: BatchBuckets | None = None,
    batching: dict[str, bool] | None = None,
    config: ModelConfig | None = None,
) -> LoadedModel:
    """Fetch `uri` (pinned at `version` for an alias, when given), open it in an Engine, and name
    it.

    Name: `name` if given, else the registered name for registry models, else the model's MODEL_NAME
    metadata, else the file stem. `variant` picks the file of a model directory (VARIANT_FILES), or
    `auto` the fastest the export measured for the provider (_auto_variant); fp16 is served on a GPU
    provider only (EngineError otherwise, before any download).

    Whether its requests share runs (Engine's `batching`), first that holds: `batching` {name: on}
    (--batching NAME=on|off), the repository's `config` (max_batch_size > 0 or 0), what the file
    records (export's check).
    """
    kind = check_source(uri)
    if variant == "auto":
        variant = _auto_variant(uri, kind, version, choose_provider(device))
    if variant == "fp16" and choose_provider(device) == CPU:
        raise EngineError(_FP16_ON_CPU)
    workdir = None
    registered = None
    try:
        if kind == "file":
            path, version = find_onnx(Path(uri), variant), version or "1"
        else:
            workdir = tempfile.mkdtemp(prefix=_workdir_prefix())
            if kind in ("alias", "version"):
                registered = (_ALIAS.match(uri) or _VERSION.match(uri)).group(1)
                if kind == "version":
                    version = _VERSION.match(uri).group(2)
                version = version or alias_version(uri)
                fetch_uri = f"models:/{registered}/{version}"
            else:
                fetch_uri, version = uri, version or "1"
            path = find_onnx(Path(_download(fetch_uri, workdir)), variant)
        # Hashed before onnxruntime reads it, and the hash is what the receipts name: the bytes that
        # compute.
        digest = file_sha256(path)
        if registered is not None:
            _check_recorded_hash(registered, version, onnx_file(variant), path, digest)
            # the weights of a graph past 2 GB: checked the same way
            if (data := data_file_of(path)) is not None:
                _check_recorded_hash(registered, version, data.name, data, file_sha256(data))
        batching = batching or {}
        known = name or registered
        asked, why = None, ""
        if known in batching:
            asked, why = batching[known], f"--batching {known}={'on' if batching[known] else 'off'}"
        elif config is not None and config.max_batch_size is not None:
            asked = config.max_batch_size > 0
            why = f"max_batch_size {config.max_batch_size} in {config.path}"
        engine = Engine(
            str(path),
            device=device,
            threads=threads,
            device_id=device_id,
            gpu=gpu,
            batch_buckets=batch_buckets,
            batching=asked,
            batching_why=why,
        )
        if config is not None:
            narrow_inputs(engine, config)
        served = known or engine.metadata.get(MODEL_NAME) or path.stem
        if known is None and served in batching:
            engine.set_batching(
                batching[served], f"--batching {served}={'on' if batching[served] else 'off'}"
            )
        # auto, and the GPU provider did not load
        if variant == "fp16" and engine.provider not in GPU_PROVIDERS:
            raise EngineError(
                f"{_FP16_ON_CPU} (onnxruntime runs on {engine.provider} here: see the warning above)"
            )
    except BaseException:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    info = ModelInfo(
        name=served,
        version=str(version),
        source=uri,
        labels=_labels(engine.metadata),
        lineage={**Lineage.read(engine.metadata).served(), "onnx_sha256": digest},
        registered=registered,
        max_lengths=lengths.read(engine.metadata),
        decision=engine.metadata.get(DECISION) or None,
        prediction=engine.metadata.get(PREDICTION) or None,
        max_batch_size=config.max_batch_size if config is not None else None,
        output_labels=config.output_labels() if config is not None else {},
        max_delay_ms=(
            config.max_queue_delay_us / 1000
            if config is not None and config.max_queue_delay_us is not None
            else None
        ),
        max_queue_rows=config.max_queue_size if config is not None else None,
    )
    where = f"model '{served}' version {version}"
    reference = _drift_reference(path)
    ranges = input_ranges(reference, engine.inputs, where)
    return LoadedModel(
        engine, info, workdir, variant, reference, image_input(engine, where), ranges
    )


def narrow_inputs(engine: Engine, config: ModelConfig) -> None:
    """The shapes requests may send, as the config's dims narrow the file's (model_config.narrowed).
    An input the config names that the model lacks is refused: the config was written for another
    model."""
    specs = {s.name: s for s in engine.inputs}
    for name, declared in config.input_dims:
        if name not in specs:
            raise SourceError(
                f"{config.path}: input {name!r} is not one of the model's inputs "
                f"({', '.join(specs)})"
            )
        spec = specs[name]
        try:
            shape = narrowed(config.path, name, spec.shape if spec.ranked else None, declared)
        except ConfigError as exc:
            raise SourceError(str(exc)) from None
        specs[name] = replace(spec, shape=shape, ranked=True)
    engine.inputs = list(specs.values())


def _drift_reference(path: Path) -> dict | None:
    """The drift reference export put beside the model file, if any; a broken one is said and
    skipped (drift is then not measured): it must not keep a model from serving."""
    try:
        return drift.read(path.parent / drift.FILE)
    except (OSError, ValueError) as exc:
        log.warning("%s: no drift statistics: %s", path.parent / drift.FILE, exc)
        return None


def _check_recorded_hash(registered: str, version: str, file: str, path: Path, digest: str) -> None:
    """Refuse a registry file whose sha256 is not the one its version records (SHA256, under the
    file's name in a version): the file's own metadata (its lineage, what receipts name) is no
    proof, anyone who can write the store can change weights and keep it. A version that records
    none (registered by hand, not by `pipeline export`) is served with a warning."""
    import mlflow

    try:
        tags = mlflow.MlflowClient().get_model_version(registered, version).tags
    except Exception as exc:  # noqa: BLE001
        # MlflowException, connection errors
        raise SourceError(
            f"cannot read models:/{registered}/{version}'s tags to check {path.name}: {exc}"
        ) from exc
    try:
        record = sha256_record(tags)
    except ValueError as exc:
        # a record nobody can read proves nothing: refused, as a changed file is
        raise SourceError(
            f"models:/{registered}/{version}: {exc}; refusing to serve {path.name} unchecked (export "
            "the model again)"
        ) from None
    recorded = (record or {}).get(file, "")
    # a version that records its files records every one it carries
    if record is not None and not recorded:
        raise SourceError(
            f"{path.name} of models:/{registered}/{version} is not among the files the version records "
            f"({', '.join(sorted(k for k in record if '.' in k))}): added to the store after export; "
            "refusing to serve it"
        )
    if not recorded:
        log.warning(
            "models:/%s/%s records no sha256 of %s (its %s tag): serving %s (sha256 %s) unchecked; versions "
            "registered by `pipeline export` record it",
            registered,
            version,
            file,
            SHA256,
            path.name,
            digest,
        )
    elif recorded != digest:
        raise SourceError(
            f"{path.name} of models:/{registered}/{version} has sha256 {digest}, but the version "
            f"records {recorded} ({SHA256}): the stored file was changed after export; refusing to "
            "serve it (export the model again, or restore the file)"
        )


_FP16_ON_CPU = (
    "--variant fp16 is served on the CUDA provider only (on the CPU onnxruntime runs fp16 nodes through "
    "casts to fp32: slower than the fp32 model); use --device cuda on a GPU, or --variant fp32"
)


def _auto_variant(uri: str, kind: str, version: str | None, provider: str) -> str:
    """--variant auto: the variant the export measured fastest on `provider` among those that passed
    their gates (the version's FASTEST_VARIANTS tag); fp32 where nothing was measured (not a
    registered version, or no variant)."""
    if kind not in ("alias", "version"):
        log.info(
            "--variant auto: %s is not a registered version (no measurements to choose by): serving fp32",
            uri,
        )
        return "fp32"
    import mlflow

    name = (_ALIAS.match(uri) or _VERSION.match(uri)).group(1)
    version = version or (_VERSION.match(uri).group(2) if kind == "version" else alias_version(uri))
    try:
        tags = mlflow.MlflowClient().get_model_version(name, version).tags
    except Exception as exc:
        # MlflowException, connection errors
        raise SourceError(
            f"cannot read {name} version {version} (registry {mlflow.get_registry_uri()}): {exc}"
        ) from exc
    try:
        measured = json.loads(tags.get(FASTEST_VARIANTS) or "{}")
        chosen = measured.get(provider)
    except (ValueError, AttributeError):
        measured, chosen = {}, None
    why = "the fastest the export measured"
    if chosen is None and provider in GPU_PROVIDERS and recorded_sha256(tags, onnx_file("fp16")):
        # The export ran where there was no GPU to measure on (a CPU machine): fp16 is a GPU's fast
        # path (tensor cores, half the bytes; ResNet-50 on an H100: bf16 2.1x fp32), and the
        # version's fp16 file passed its gates.
        chosen, why = "fp16", "the export measured nothing on a GPU; its gated fp16 variant"
    if chosen not in VARIANT_FILES:
        chosen, why = "fp32", why if measured else "no variant measured"
    log.info("--variant auto: %s v%s on %s -> %s (%s)", name, version, provider, chosen, why)
    return chosen


def _download(uri: str, dst: str) -> str:
    import mlflow

    _check_store()
    started = time.perf_counter()
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst)
    except Exception as exc:
        # mlflow raises MlflowException, OSError, ... depending on the store
        named = _VERSION.match(uri)
        raise SourceError(
            (named and registry_miss(named.group(1), version=named.group(2)))
            or f"cannot fetch {uri} from MLflow (tracking URI {mlflow.get_tracking_uri()}): {exc}"
        ) from exc
    # Said once here: MLflow's own progress bar is off outside a terminal (see serving/console.py).
    files = [p for p in Path(local).rglob("*") if p.is_file()]
    log.info(
        "downloaded %s: %d files, %.1f MB in %.1f s",
        uri,
        len(files),
        sum(p.stat().st_size for p in files) / 1e6,
        time.perf_counter() - started,
    )
    return local


def find_onnx(path: Path, variant: str = "fp32") -> Path:
    """The .onnx file at `path`: the file itself, or the `variant`'s one inside a (model) directory.

    A directory holding one model (a downloaded MLflow model: model.onnx, and model.fp16.onnx when
    the export made one; a run's onnx/ also has model.optimized.onnx) serves model.onnx for fp32 and
    model.fp16.onnx for fp16. A directory with a single .onnx file of another name serves it as
    fp32.
    """
    if path.is_file():
        return path
    if not path.exists():
        raise SourceError(f"model file not found: {path}")
    found = sorted(path.rglob("*.onnx"))
    if not found:
        raise SourceError(f"no .onnx file under {path}")
    wanted = VARIANT_FILES[variant]
    named = [p for p in found if p.name == wanted]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise SourceError(
            f"several {wanted} files under {path}: {[str(p) for p in named]}; point --model at one"
        )
    if variant != "fp32":
        setting = "export.uint8_inputs=true" if variant == "uint8" else f"export.{variant}=true"
        raise SourceError(
            f"no {wanted} under {path} (found {[p.name for p in found]}): export with "
            f"{setting} to log the {variant} variant with the model, or serve --variant fp32"
        )
    others = [
        p for p in found if p.name not in [f for v, f in VARIANT_FILES.items() if v != "fp32"]
    ]
    if len(others) == 1:
        return others[0]
    if not others:
        raise SourceError(
            f"only variant models under {path} ({[p.name for p in found]}): serve one with --variant "
            "fp16, int8 or uint8"
        )
    raise SourceError(
        f"several .onnx files under {path}: {[str(p) for p in found]}; point --model at one of them"
    )


def _labels(metadata: dict[str, str]) -> tuple[str, ...] | None:
    raw = metadata.get(LABELS)
    if raw is None:
        return None
    try:
        labels = json.loads(raw)
    except ValueError:
        log.warning("ignoring %s metadata: not JSON: %.80s", LABELS, raw)
        return None
    if not isinstance(labels, list):
        log.warning("ignoring %s metadata: not a JSON list", LABELS)
        return None
    return tuple(str(x) for x in labels)
