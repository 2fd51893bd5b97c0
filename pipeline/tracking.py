"""Every MLflow call the stages make, in one place.

Calls that write run state are `uninterrupted`: a SIGTERM waits for them to finish (see
stopping.py).

Embedded default: tracking in `sqlite:///<cwd>/mlflow.db` and artifacts in `<cwd>/mlartifacts`,
nothing to start. A remote server (`http://...`) works the same way; it is checked before any
work starts so a wrong URI fails in seconds, not after an hour of training.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

# raised here, defined with the others
from pipeline.errors import TrackingError  # noqa: F401
from pipeline.tools.faults import inject_fault
from pipeline.tools.stopping import uninterrupted
from serving import lineage

log = logging.getLogger(__name__)

DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def resolve_tracking_uri(configured: str = "") -> str:
    """Config > $MLFLOW_TRACKING_URI > the embedded SQLite file in the current directory."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        uri = f"sqlite:///{Path.cwd() / DEFAULT_DB}"
    return uri


def default_artifact_root(tracking_uri: str = "") -> str:
    """Artifacts beside a SQLite store's file (./mlartifacts for the embedded default), not wherever
    the command happens to run."""
    if tracking_uri.startswith("sqlite:///"):
        return (
            Path(tracking_uri[len("sqlite:///") :]).resolve().parent / DEFAULT_ARTIFACTS
        ).as_uri()
    return (Path.cwd() / DEFAULT_ARTIFACTS).as_uri()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fails fast, with the URI and the fix in the message, when the store can't be used."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        import requests

        try:
            r = requests.get(uri.rstrip("/") + "/health", timeout=timeout)
            if r.status_code >= 500:
                raise TrackingError(
                    f"MLflow tracking server {uri} answered {r.status_code} on /health"
                )
        except requests.RequestException as exc:
            raise TrackingError(
                f"MLflow tracking server {uri} cannot be reached ({type(exc).__name__}). Start it "
                "(`pipeline ui` or `mlflow server`), fix tracking.tracking_uri / $MLFLOW_TRACKING_URI, "
                "or leave both empty for the embedded SQLite store"
            ) from None
    elif parsed.scheme == "sqlite":
        db = Path(uri[len("sqlite:///") :])
        if not db.parent.is_dir() or not os.access(db.parent, os.W_OK):
            raise TrackingError(
                f"MLflow store {uri}: directory {db.parent} does not exist or is not writable"
            )
    elif parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme else uri)
        if path.exists() and not os.access(path, os.W_OK):
            raise TrackingError(f"MLflow store {uri} is not writable")
    # Other schemes (databricks, postgresql, ...) are checked by MLflow on first use.


def use_store(configured: str = "") -> str:
    """Points MLflow at the store (config > env > embedded default), after checking it answers."""
    import mlflow

    uri = resolve_tracking_uri(configured)
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    return uri


@uninterrupted
def setup(tracking_cfg) -> str:
    """Points MLflow at the configured store and makes sure the experiment exists."""
    import mlflow

    uri = use_store(tracking_cfg.tracking_uri)
    # Retries on a dead server would hide the failure for minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    experiment = mlflow.get_experiment_by_name(tracking_cfg.experiment)
    if experiment is None:
        # With a local database, keep artifacts beside it rather than in ./mlruns.
        location = default_artifact_root(uri) if uri.startswith("sqlite:") else None
        # The kind makes MLflow 3's UI open the experiment on its runs, not on GenAI traces.
        mlflow.create_experiment(
            tracking_cfg.experiment,
            artifact_location=location,
            tags={"mlflow.experimentKind": "custom_model_development"},
        )
    mlflow.set_experiment(tracking_cfg.experiment)
    return uri


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def get_run(run_id: str):
    """The run, or a TrackingError saying the id is malformed or unknown to this store."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if not RUN_ID.match(run_id or ""):
        raise TrackingError(f"'{run_id}' is not an MLflow run id (32 lowercase hex digits)")
    try:
        return mlflow.MlflowClient().get_run(run_id)
    except MlflowException as exc:
        raise TrackingError(
            f"run {run_id} not found in {mlflow.get_tracking_uri()} "
            f"({exc.error_code}); check the id and tracking.tracking_uri"
        ) from None


def download_artifacts(run_id: str, artifact_path: str, dest: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    get_run(run_id)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=artifact_path, dst_path=str(dest)
            )
        )
    except (MlflowException, OSError) as exc:
        raise TrackingError(
            f"run {run_id} has no artifact '{artifact_path}' (or it can't be downloaded): {exc}"
        ) from None


def alias_version(name: str, alias: str) -> str | None:
    """The version a registry alias points at now, or None when the model or alias is gone."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow.MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


@uninterrupted
def log_params(flat: dict[str, Any]) -> None:
    import mlflow

    # MLflow caps a value at 6000 chars and a batch at 100 params.
    items = [(k, str(v)[:6000]) for k, v in flat.items()]
    for i in range(0, len(items), 100):
        mlflow.log_params(dict(items[i : i + 100]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the training run -------------------------------------------------------------------------


def warn_without_gpu_metrics() -> bool:
    """MLflow samples NVIDIA GPUs only through pynvml (the nvidia-ml-py package) and otherwise skips
    them with an INFO line nobody sees: say it once, as a warning, and how to get them. True if
    warned."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        log.warning(
            "MLflow system metrics will have no GPU utilization or memory: pynvml is not installed; "
            "pip install 'trainserve[gpu]' (nvidia-ml-py)"
        )
        return True
    return False


@uninterrupted
def start_run(
    run_name: str,
    run_id: str | None,
    tags: dict[str, str],
    system_metrics: bool,
    skip_logged_steps: bool = False,
    gpu: bool = False,
) -> str:
    """Starts a run, or continues `run_id` (a resume keeps one run, not two); `skip_logged_steps`:
    don't log again the steps it already holds (see `_logged_through`); `gpu`: training runs on
    CUDA."""
    import mlflow

    if system_metrics and gpu:
        warn_without_gpu_metrics()
    if system_metrics:
        # Short runs would log no sample at the default 10 s interval.
        mlflow.set_system_metrics_sampling_interval(2)
        mlflow.set_system_metrics_samples_before_logging(1)
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow.start_run(
            run_id=run_id, run_name=None if run_id else run_name, log_system_metrics=system_metrics
        )
    except MlflowException as exc:
        raise TrackingError(
            f"cannot continue MLflow run {run_id} in {mlflow.get_tracking_uri()} ({exc.error_code}): "
            "a checkpoint resumed from another store? Point tracking.tracking_uri at the "
            "store it was trained with"
        ) from None
    mlflow.set_tags(tags)
    # MLflow's own monitor lines are quiet (serving/console.py): said once here instead.
    log.info(
        "MLflow run %s: system metrics %s",
        run.info.run_id,
        "on (CPU, memory, disk, network; every 2 s)"
        if system_metrics
        else "off (tracking.system_metrics)",
    )
    global _logged_through
    _logged_through = (
        last_training_step_logged(run.info.run_id) if run_id and skip_logged_steps else None
    )
    if _logged_through is not None:
        log.info(
            "run %s already holds metrics up to step %d; the replay of those steps is not logged again",
            run_id,
            _logged_through,
        )
    return run.info.run_id


# A torchrun restart replays the steps between its checkpoint and the crash (bit-identically on
# CPU): logged again, each would appear twice in the run's history. `start_run` sets this on such a
# restart.
_logged_through: int | None = None


def last_training_step_logged(run_id: str) -> int | None:
    import mlflow

    client = mlflow.MlflowClient()
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(("train/", "val/"))]
    return max((m.step for k in keys for m in client.get_metric_history(run_id, k)), default=None)


@uninterrupted
def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    """Logs to the active run; a step the continued run already holds is skipped (see
    `_logged_through`)."""
    import mlflow

    if step is not None and _logged_through is not None and step <= _logged_through:
        return
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


@uninterrupted
def log_artifact(path: Path, artifact_path: str | None = None) -> None:
    import mlflow

    if Path(path).is_dir():
        mlflow.log_artifacts(str(path), artifact_path=artifact_path)
    else:
        mlflow.log_artifact(str(path), artifact_path=artifact_path)


def markdown_escaped(text: str) -> str:
    """`text` as literal words in a description the MLflow UI renders as Markdown: "@champion" would
    become a link to a code host's user page, `*` emphasis, `[..](..)` a link."""
    return re.sub(r"([\\`*_{}\[\]()#+!|<>@~-])", r"\\\1", text)


def split_dataset(component: str, args: dict, found: dict, split: str, inputs: list[dict]):
    """One split as an MLflow dataset: the data component and its args as the source, the content
    digest (MLflow keeps 36 characters of it), the inputs as its schema (name, dtype, shape: one
    sample's, -1 first for the batch) and a profile (samples, inputs, the targets' class counts or
    statistics), which the UI's dataset drawer shows."""
    import numpy as np
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.schema import Schema, TensorSpec

    class SplitDataset(MetaDataset):
        @property
        def profile(self):
            return {
                "samples": found["samples"],
                **({"manifest": found["manifest"]} if found.get("manifest") else {}),
                **({"note": found["note"]} if found.get("note") else {}),
                "inputs": {i["name"]: {"dtype": i["dtype"], "shape": i["shape"]} for i in inputs},
                "targets": found.get("targets") or {},
            }

        # (MetaDataset's leaves the profile out)
        def to_dict(self):
            return super().to_dict() | {"profile": json.dumps(self.profile)}

    # A sharded split is its manifest (the digest is the manifest's: pipeline/shards/format.py):
    # named beside the component.
    shards = (
        {"manifest": found["manifest"], "shards": str(found["shards"])}
        if found.get("manifest")
        else {}
    )
    source = CodeDatasetSource(
        {"component": component, "args": json.dumps(args, sort_keys=True), **shards}
    )
    schema = (
        Schema(
            [
                TensorSpec(
                    np.dtype(i["dtype"] if i["dtype"] != "bfloat16" else "float32"),
                    (-1, *i["shape"]),
                    i["name"],
                )
                for i in inputs
            ]
        )
        if inputs
        else None
    )
    return SplitDataset(
        source,
        name=f"{component.rpartition(':')[2]}-{split}",
        digest=found["sha256"][:32],
        schema=schema,
    )


@uninterrupted
def log_table(rows: list[dict], artifact_file: str) -> None:
    """`rows` (dicts of the same keys) as an MLflow table artifact of the active run, which the UI
    shows as one; replaced, not appended to as mlflow.log_table would (an export run again would
    list both exports' rows)."""
    import mlflow
    import pandas as pd
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    folder, _, name = artifact_file.rpartition("/")
    with tempfile.TemporaryDirectory(prefix="trainserve-table-") as scratch:
        path = Path(scratch) / name
        # (mlflow.log_table's own format)
        pd.DataFrame(rows).to_json(path, orient="split", index=False)
        mlflow.log_artifact(str(path), artifact_path=folder or None)
    listed = json.loads(
        mlflow.get_run(mlflow.active_run().info.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]")
    )
    if {"path": artifact_file, "type": "table"} not in listed:
        mlflow.set_tag(
            MLFLOW_LOGGED_ARTIFACTS, json.dumps([*listed, {"path": artifact_file, "type": "table"}])
        )


@uninterrupted
def log_datasets(component: str, args: dict, digests: dict[str, dict], inputs: list[dict]) -> None:
    """The run's training and validation splits as MLflow datasets (the run page's "Datasets",
    `split_dataset`); the whole sha256 is the input's DATASET_SHA256 tag, beside the sample
    count."""
    import mlflow

    for split, found in digests.items():
        dataset = split_dataset(component, args, found, split, inputs)
        # a stream of the component's own
        samples = "unknown" if found["samples"] is None else str(found["samples"])
        _log_input_beside_others(
            lambda: mlflow.log_input(
                dataset,
                context="training" if split == "train" else "validation",
                tags={
                    lineage.DATASET_SHA256: found["sha256"],
                    lineage.DATASET_SAMPLES: samples,
                    lineage.DATASET_INPUTS: json.dumps(inputs)[:5000],
                },
            )
        )


def _log_input_beside_others(log_input, tries: int = 3) -> None:
    """`log_input()`, again where another run logged the same dataset at the same moment. MLflow's
    store looks the dataset up, then inserts it: two runs of one experiment (a sweep, two jobs on
    one tracking server) can both miss it, and the second insert fails on the datasets' unique
    key, its transaction rolled back. The first run's row is there by then: the next try links it."""
    from mlflow.exceptions import MlflowException

    for attempt in range(tries):
        try:
            return log_input()
        except MlflowException as exc:
            said = str(exc).lower()
            raced = "datasets" in said and ("unique" in said or "duplicate" in said)
            if not raced or attempt == tries - 1:
                raise
            log.info("another run logged the same dataset at the same moment; logging it again")


def _logged_splits(run_id: str):
    """(split, the input's tags, the input) of each dataset a run logged (`log_datasets`)."""
    contexts = {"training": "train", "validation": "val"}
    for item in get_run(run_id).inputs.dataset_inputs:
        tags = {t.key: t.value for t in item.tags}
        split = contexts.get(tags.get("mlflow.data.context", ""))
        if split:
            yield split, tags, item


def dataset_digests(run_id: str) -> dict[str, str]:
    """{"train"|"val": sha256} of the datasets a run logged (`log_datasets`)."""
    return {
        split: tags[lineage.DATASET_SHA256]
        for split, tags, _ in _logged_splits(run_id)
        if tags.get(lineage.DATASET_SHA256)
    }


def dataset_manifests(run_id: str) -> dict[str, str]:
    """{"train"|"val": manifest location} of the sharded splits a run logged (their source names the
    manifest)."""
    found = {}
    for split, _, item in _logged_splits(run_id):
        try:
            source = json.loads(item.dataset.source or "{}").get("tags") or {}
        except (ValueError, AttributeError):
            continue
        if source.get("manifest"):
            found[split] = source["manifest"]
    return found


@uninterrupted
def log_code(files: dict[str, Path], packages: dict[str, str]) -> None:
    """The run's component source under `code/` (see code_capture.py) and what it was installed
    with."""
    import mlflow

    for name, path in files.items():
        parent = str(Path(name).parent)
        mlflow.log_artifact(
            str(path), artifact_path="code" + ("" if parent == "." else f"/{parent}")
        )
    if packages:
        mlflow.log_text(
            "".join(f"{k}=={v}\n" for k, v in packages.items()), "code/requirements.txt"
        )


@uninterrupted
def log_text(text: str, artifact_file: str) -> None:
    import mlflow

    mlflow.log_text(text, artifact_file)


@uninterrupted
def set_tags(tags: dict[str, str], run_id: str | None = None) -> None:
    import mlflow

    if run_id is None:
        mlflow.set_tags(tags)
    else:
        client = mlflow.MlflowClient()
        for k, v in tags.items():
            client.set_tag(run_id, k, v)


@uninterrupted
def end_run(status: str = "FINISHED", failed_stage: str | None = None) -> str | None:
    """Ends this process's active run, if any, after marking `failed_stage` failed on it and
    dropping its PROCESS tag (the process ends its run itself: nothing to close after it). The run's
    id, or None if there was no active run."""
    import mlflow

    global _logged_through
    _logged_through = None
    if mlflow.active_run() is None:
        return None
    run_id = mlflow.active_run().info.run_id
    if failed_stage:
        mark_stage(failed_stage, "failed")
    mlflow.end_run(status=status)
    # After the run is ended: a process killed between the two leaves a stale PROCESS on an ended
    # run, which close_if_orphaned never reads (it looks at RUNNING runs only); the other order
    # could leave a RUNNING run that names no process, which nothing could close.
    release_process(run_id)
    return run_id


def process_tag(status_before: str = "") -> dict[str, str]:
    """The run's PROCESS tag while a stage runs: the process that made it RUNNING (host, pid, start
    time, command), and the status a later stage's reopening found, to put back should that process
    die. Gone when it ends."""
    from pipeline.checkpoint.run_dir import this_process

    return {lineage.PROCESS: json.dumps({**this_process(), "status_before": status_before})}


@uninterrupted
def mark_stage(stage: str, state: str, run_id: str | None = None) -> None:
    """One stage's state (running | done | failed) in the run's STAGES tag; the others' kept."""
    import mlflow

    run_id = run_id or mlflow.active_run().info.run_id
    stages = lineage.read_stages(get_run(run_id).data.tags.get(lineage.STAGES))
    set_tags({lineage.STAGES: lineage.write_stages(stages | {stage: state})}, run_id)


def stage_state(run_id: str, stage: str) -> str:
    """running | done | failed, or "" for a stage the run never started (a run of before the lineage
    contract: its LEGACY_STAGE tag)."""
    tags = get_run(run_id).data.tags
    return lineage.read_stages(tags.get(lineage.STAGES)).get(stage) or tags.get(
        lineage.LEGACY_STAGE + stage, ""
    )


@uninterrupted
def release_process(run_id: str | None = None) -> None:
    """Removes the PROCESS tag of a stage that ended: bookkeeping, not something to read on a
    finished run."""
    import mlflow
    from mlflow.exceptions import MlflowException

    run_id = run_id or mlflow.active_run().info.run_id
    # (already gone)
    with contextlib.suppress(MlflowException):
        mlflow.MlflowClient().delete_tag(run_id, lineage.PROCESS)


@uninterrupted
def close_if_orphaned(run_id: str) -> str | None:
    """A run left RUNNING by a process that is gone (SIGKILL, the OOM killer, rank 0 under a plain
    torchrun, an export stopped mid-way): puts back the status a later stage found before reopening
    it, else FAILED, and marks its running stage failed. Returns the status set, or None when the
    run is not RUNNING or its owner is alive (or on another host, where nothing can be told)."""
    import mlflow

    from pipeline.checkpoint.run_dir import alive, describe

    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    if run.info.status != "RUNNING":
        return None
    try:
        owner = json.loads(run.data.tags.get(lineage.PROCESS, ""))
    except ValueError:
        return None
    if not isinstance(owner, dict) or alive(owner) is not False:
        return None
    status = owner.get("status_before") or "FAILED"
    stages = lineage.read_stages(run.data.tags.get(lineage.STAGES))
    stages |= {stage: "failed" for stage, state in stages.items() if state == "running"}
    set_tags(
        {
            lineage.STAGES: lineage.write_stages(stages),
            lineage.PROCESS: f"gone: {describe(owner)} left the run RUNNING; marked {status}",
        },
        run_id,
    )
    client.set_terminated(run_id, status)
    log.warning(
        "MLflow run %s was left RUNNING by %s, which is gone: marked %s",
        run_id,
        describe(owner),
        status,
    )
    return status


@uninterrupted
def fail_if_running(run_id: str, stage: str) -> bool:
    """Marks another process's run FAILED (and its `stage` failed) if it is still RUNNING; True if
    it was."""
    import mlflow

    client = mlflow.MlflowClient()
    if client.get_run(run_id).info.status != "RUNNING":
        return False
    mark_stage(stage, "failed", run_id)
    set_tags({lineage.PROCESS: "gone: stopped while it ran"}, run_id)
    client.set_terminated(run_id, "FAILED")
    return True


# --- later stages: consolidate and export ------------------------------------------------------


@uninterrupted
def log_consolidated(
    run_id: str, out_dir: Path, files: Sequence[str], artifact_path: str, record: dict
) -> None:
    """`files` of `out_dir` under `artifact_path` of the source run, then `record` as its lineage's
    "consolidated" part and the stage done."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    try:
        for name in files:
            client.log_artifact(run_id, str(out_dir / name), artifact_path)
        record_lineage(
            "consolidated",
            record | {"files": [f"{artifact_path}/{name}" for name in files]},
            run_id,
        )
        mark_stage("consolidate", "done", run_id)
    except (MlflowException, OSError) as exc:
        raise TrackingError(
            f"consolidated weights are in {out_dir}, but logging them to run {run_id} "
            f"failed ({exc}); rerun, or pass --no-log to keep them local"
        ) from None


@contextlib.contextmanager
def stage_run(stage: str, run_id: str | None, run_name: str):
    """The active run a later stage logs to, as its id: `run_id` re-opened, else a new run
    `run_name`.

    Re-opening a training run marks it RUNNING; its own status (FINISHED, or FAILED) is put back on
    the way out, whatever happened inside. MLflow refusing a record becomes a TrackingError."""
    import mlflow
    from mlflow.exceptions import MlflowException

    run = get_run(run_id) if run_id else None
    if run is not None and close_if_orphaned(run.info.run_id):
        run = get_run(run_id)
    try:
        # who reopens it, and what to put back, recorded before it turns RUNNING
        if run is not None:
            stages = lineage.read_stages(run.data.tags.get(lineage.STAGES)) | {stage: "running"}
            set_tags(
                {**process_tag(run.info.status), lineage.STAGES: lineage.write_stages(stages)},
                run.info.run_id,
            )
        active = _open_run(run, run_name)
        if run is None:
            set_tags(
                {**process_tag("FAILED"), lineage.STAGES: lineage.write_stages({stage: "running"})}
            )
        try:
            # test hook: a stop while the run is reopened
            inject_fault(f"stage_{stage}", 0)
            yield active
        except BaseException:
            end_run("FAILED", failed_stage=stage)
            raise
        end_run("FINISHED")
    except MlflowException as exc:
        raise TrackingError(
            f"MLflow at {mlflow.get_tracking_uri()} refused the {stage}'s records: {exc}"
        ) from None
    finally:
        if run is not None and run.info.status != "RUNNING":
            _set_terminated(run.info.run_id, run.info.status)


@uninterrupted
def _open_run(run, run_name: str) -> str:
    import mlflow

    if run is None:
        return mlflow.start_run(run_name=run_name).info.run_id
    # MLflow refuses to resume a run outside the active experiment: follow the run.
    mlflow.set_experiment(experiment_id=run.info.experiment_id)
    return mlflow.start_run(run_id=run.info.run_id).info.run_id


@uninterrupted
def _set_terminated(run_id: str, status: str) -> None:
    import mlflow

    mlflow.MlflowClient().set_terminated(run_id, status)


@uninterrupted
def log_onnx_model(
    model,
    inputs: dict[str, Any],
    signature,
    providers: list[str],
    metadata: dict[str, str],
    data_file: Path | None = None,
    step: int = 0,
) -> str:
    """The ONNX model as `model` of the active run, with its signature and one example; returns its
    URI. `step`: the checkpoint's training step: MLflow links the run's metrics of that step (its
    validation metrics, and through them the validation dataset) to the logged model. `data_file`:
    the file `model` keeps its weights in (ONNX external data; `model` is then the graph only),
    logged beside model.onnx under its own name, the one the graph names."""
    import mlflow

    info = mlflow.onnx.log_model(
        model,
        name="model",
        signature=signature,
        # MLflow checks an example by running the model in onnxruntime before the data file can be
        # put beside it (it fails, with a warning), and would hold another copy of the weights doing
        # so; the export's gates ran the very file already. So a model with a data file is logged
        # with its signature only.
        input_example=None if data_file else inputs,
        onnx_execution_providers=providers,
        # onnx + onnxruntime is all the model needs; inferring them spawns a process (~4 s).
        pip_requirements=mlflow.onnx.get_default_pip_requirements(),
        save_as_external_data=False,
        metadata=metadata,
        step=step,
    )
    if data_file is not None:
        log_beside_model(info.model_uri, data_file)
    if step:
        _link_validation(info.model_id, step)
    return info.model_uri


def _link_validation(model_id: str, step: int) -> None:
    """The active run's metrics of `step` once more, now with the logged model and the split they
    were measured on: val/* with the validation dataset, train/* (the last logged at or before
    `step`) with the training one. MLflow's SQL store keeps no dataset on a run's metrics, and a
    logged model lists as "Datasets used" those of the metrics linked to it."""
    import mlflow

    client = mlflow.MlflowClient()
    run = client.get_run(mlflow.active_run().info.run_id)
    for context, prefix in (("training", "train/"), ("validation", "val/")):
        dataset = next(
            (
                d.dataset
                for d in run.inputs.dataset_inputs
                if any(t.key == "mlflow.data.context" and t.value == context for t in d.tags)
            ),
            None,
        )
        metrics = {}
        for key in (k for k in run.data.metrics if k.startswith(prefix)):
            at = [m for m in client.get_metric_history(run.info.run_id, key) if m.step <= step]
            last = max(at, key=lambda m: m.step) if at else None
            if last is not None and (prefix == "train/" or last.step == step):
                metrics[key] = last.value
        if dataset is not None and metrics:
            mlflow.log_metrics(metrics, step=step, model_id=model_id, dataset=dataset)


@uninterrupted
def register_version(model_uri: str, name: str, alias: str | None, tags: dict[str, str]) -> str:
    """A new version of registered model `name`, with `tags`, and `alias` (if any) moved to it;
    returns the version. Version numbers are handed out atomically by the registry: promotion orders
    its decisions by them."""
    import mlflow

    # MLflow prints "Successfully registered model"/"Created version" itself, past logging; export
    # says it once in its own words ("registered NAME version N as @alias").
    with contextlib.redirect_stderr(io.StringIO()):
        version = mlflow.register_model(model_uri, name, tags=tags)
    if alias:
        move_alias(name, alias, version.version)
    return str(version.version)


@uninterrupted
def set_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    import mlflow

    client = mlflow.MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)


# MLflow's SQL stores keep a description in a String(5000)
DESCRIPTION_LIMIT = 5000


@uninterrupted
def describe_version(name: str, version: str, description: str) -> None:
    """The version's description, within what every MLflow store keeps (5,000 characters): past
    that, its middle is cut, and its last paragraph (why it holds its alias, the newest) is kept."""
    import mlflow

    if len(description) > DESCRIPTION_LIMIT:
        head, _, last = description.rpartition("\n\n")
        last = last[:2000]
        cut = "\n\n(cut: every gate figure is in the run's onnx/gates.json)\n\n"
        description = head[: DESCRIPTION_LIMIT - len(last) - len(cut)] + cut + last
    mlflow.MlflowClient().update_model_version(name, version, description=description)


def version_description(name: str, version: str) -> str:
    import mlflow

    return mlflow.MlflowClient().get_model_version(name, version).description or ""


@uninterrupted
def describe_registered_model(name: str, description: str) -> None:
    """Sets the registered model's description where it has none (a person's own is kept)."""
    import mlflow

    client = mlflow.MlflowClient()
    if not (client.get_registered_model(name).description or "").strip():
        client.update_registered_model(name, description=description)


@uninterrupted
def record_lineage(section: str, value: dict, run_id: str | None = None) -> None:
    """One stage's part of the run's whole lineage, in its one JSON artifact (lineage.RUN_FILE): the
    parts other stages wrote are kept. The run's tags are the handful a person reads; this file is
    everything."""
    import mlflow

    run_id = run_id or mlflow.active_run().info.run_id
    client = mlflow.MlflowClient()
    whole: dict = {}
    # else none yet; a failed read raises
    if any(a.path == lineage.RUN_FILE for a in client.list_artifacts(run_id)):
        # rather than rewrite the file with this part alone
        with tempfile.TemporaryDirectory() as tmp:
            whole = json.loads(
                Path(client.download_artifacts(run_id, lineage.RUN_FILE, tmp)).read_text()
            )
    whole = (whole if isinstance(whole, dict) else {}) | {section: value}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / lineage.RUN_FILE
        path.write_text(json.dumps(whole, indent=2, sort_keys=True, default=str) + "\n")
        client.log_artifact(run_id, str(path))


def versions_tagged(name: str, key: str, value: str) -> list[tuple[str, int]]:
    """(version, creation time in ms) of `name`'s versions whose tag `key` is `value`."""
    import mlflow

    found = mlflow.MlflowClient().search_model_versions(f"name='{name}' and tags.`{key}`='{value}'")
    return [(str(v.version), int(v.creation_timestamp or 0)) for v in found]


def download_version_onnx(name: str, version: str, dest: Path) -> Path:
    """The ONNX file of a registered model version, downloaded under `dest`."""
    import mlflow

    from serving.loader import SourceError, find_onnx

    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}/{version}", dst_path=str(dest)
        )
    )
    try:
        # the file a server of this version loads
        return find_onnx(local)
    except SourceError as exc:
        raise TrackingError(f"models:/{name}/{version}: {exc}") from None


def move_alias(name: str, alias: str, version: str) -> None:
    import mlflow

    mlflow.MlflowClient().set_registered_model_alias(name, alias, version)


@uninterrupted
def delete_alias(name: str, alias: str) -> None:
    import mlflow

    mlflow.MlflowClient().delete_registered_model_alias(name, alias)


def version_tags(name: str, version: str) -> dict[str, str]:
    import mlflow

    return dict(mlflow.MlflowClient().get_model_version(name, version).tags)


def version_run_id(name: str, version: str) -> str:
    """The run a version's model was logged to ("" for one registered from elsewhere)."""
    import mlflow

    return mlflow.MlflowClient().get_model_version(name, version).run_id or ""


def run_tags(run_id: str) -> dict[str, str]:
    import mlflow

    return dict(mlflow.MlflowClient().get_run(run_id).data.tags)


def current_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def log_beside_model(model_uri: str, path: Path) -> None:
    """`path` into the artifacts of the logged model `model_uri` (models:/<model id>), beside its
    model.onnx: registered and downloaded with it (serving.loader picks a variant's file by
    name)."""
    import mlflow

    mlflow.MlflowClient().log_model_artifact(model_uri.removeprefix("models:/"), str(path))
