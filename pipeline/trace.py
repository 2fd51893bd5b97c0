"""`pipeline trace REQUEST_ID --payload-log DIR`: from one served prediction back to what made it.

The server's payload log (`--payload-log DIR`) records each sampled request with the request id its
response carried in `X-Request-Id`, and the model version, run and weights hash that answered. This
finds that record and walks on through the registry and the MLflow run: the version (its aliases and
promotion), the training run, the checkpoint, the config and the data. Links it can't reach are
said, not guessed.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

# raised here, defined with the others
from pipeline.errors import TraceError  # noqa: F401
from pipeline.tools import logs
from pipeline.tools.logs import first_line
from serving import lineage
from serving.lineage import Lineage

log = logging.getLogger("pipeline.trace")


def find_requests(log_dir: Path, request_id: str) -> list[dict]:
    """Every payload log record of `request_id`, oldest first. Clients choose their ids: one reused
    is found as several records, and each is traced, never one silently in place of another."""
    log_dir = Path(log_dir)
    files = sorted(log_dir.glob("*.jsonl")) if log_dir.is_dir() else []
    if not files:
        raise TraceError(
            f"no payload log files (*.jsonl) in {log_dir}: start the server with --payload-log "
            f"{log_dir} (requests are logged only while it is on, and only those sampled)"
        )
    # as it appears in the JSON line
    needle = json.dumps(request_id)
    found = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if needle in line:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        # a line cut short by a crash
                        continue
                    if record.get("request_id") == request_id:
                        found.append(record)
    if not found:
        raise TraceError(
            f"request {request_id} is not in the payload log {log_dir} ({len(files)} files): not "
            "sampled (--payload-log-sample), rotated out by the size cap, or served elsewhere"
        )
    return sorted(found, key=lambda r: str(r.get("time", "")))


def main(request_id: str, log_dir: Path, tracking_uri: str = "", echo=print) -> list[dict]:
    records = find_requests(log_dir, request_id)
    if len(records) > 1:
        echo(
            f"NOTE        {len(records)} records carry request id {request_id} (a client reused it); each is "
            "traced below, oldest first"
        )
    return [trace_record(request_id, record, tracking_uri, echo) for record in records]


def trace_record(request_id: str, record: dict, tracking_uri: str, echo) -> dict:
    model = record.get("model") or {}
    name, version = model.get("name", "?"), str(model.get("version", "?"))
    echo(
        f"request     {request_id} at {record.get('time')} on {record.get('endpoint')}: status {record.get('status')}"
    )
    echo(
        f"model       {name} v{version}, weights sha256 {model.get('weights_sha256') or '(unknown)'}"
    )
    echo(
        f"io          inputs {_shapes(record.get('inputs'))} -> outputs {_shapes(record.get('outputs'))}"
    )
    trail = {"record": record}
    try:
        trail |= walk_registry(model, tracking_uri, echo)
    except Exception as exc:  # noqa: BLE001
        # the store is gone or another one: say so, keep the record's facts
        echo(
            f"registry    not reachable ({first_line(exc)}); "
            f"the record names run {model.get('run_id') or '(none)'}"
        )
    return trail


def registry_version(model: dict) -> tuple[str, str] | None:
    """(registered name, version) the record's model was loaded from, or None when it was not a
    registry version. A record of an older server names no source: its served name is taken as the
    registered one."""
    source = model.get("source")
    if source is None:
        return model.get("name", "?"), str(model.get("version", "?"))
    match = re.fullmatch(r"models:/([^/@]+)/(\d+)", source)
    return (match.group(1), match.group(2)) if match else None


def walk_registry(model: dict, tracking_uri: str, echo) -> dict:
    import mlflow

    from pipeline import tracking

    tracking.use_store(tracking_uri)
    client = mlflow.MlflowClient()
    registered = registry_version(model)
    tags: dict = {}
    if registered is None:
        echo(
            f"source      {model.get('source')}: not a registry version, so no registry entry is followed"
        )
    else:
        name, version = registered
        v = client.get_model_version(name, version)
        tags = dict(v.tags)
        aliases = ", ".join(f"@{a}" for a in v.aliases) or "no alias now"
        promotion = tags.get(lineage.PROMOTION, "promotion not recorded")
        echo(
            f"version     models:/{name}/{version} ({aliases}); {promotion}"
            + (
                f"; shadow verdict {tags[lineage.SHADOW_VERDICT]}"
                if tags.get(lineage.SHADOW_VERDICT)
                else ""
            )
        )
        weights = lineage.recorded_sha256(tags, "weights")
        if model.get("weights_sha256") and weights and weights != model["weights_sha256"]:
            echo(
                f"WARNING     the version's weights sha256 {weights[:16]} differs from what answered "
                f"({model['weights_sha256'][:16]}): run `pipeline verify models:/{name}@<alias>`"
            )
        files = lineage.recorded_files(tags)
        if model.get("onnx_sha256") and files and model["onnx_sha256"] not in files.values():
            echo(
                f"WARNING     the ONNX that answered ({model['onnx_sha256'][:16]}) is none of the version's files "
                f"({', '.join(f'{k} {v[:16]}' for k, v in files.items())}): run `pipeline verify "
                f"models:/{name}@<alias>`"
            )
    found = Lineage.read(tags)
    # The record's run is the one whose file answered; the registry's tag is what it should have
    # been.
    run_id = model.get("run_id") or found.run_id
    if found.run_id and model.get("run_id") and found.run_id != model["run_id"]:
        echo(
            f"WARNING     the version's run tag {found.run_id} differs from the run the answering file "
            f"names ({model['run_id']}); following the file's"
        )
    if not run_id:
        echo("run         none recorded (a file without trainserve lineage)")
        return {"version": tags, "run_id": None}
    run = client.get_run(run_id)
    echo(
        f"run         {run_id} '{run.info.run_name}' {run.info.status}, experiment {run.info.experiment_id}, "
        f"git {run.data.tags.get(lineage.GIT, '?')[:12]}"
    )
    best = run.data.tags.get(lineage.BEST)
    echo(
        f"checkpoint  {found.checkpoint or '?'} (step {found.step or '?'})"
        + (f"; the run's best is {best}" if best else "")
    )
    echo(
        f"config      sha256 {found.config_sha256[:16] or '?'}; the run's config/resolved.yaml and params hold it"
    )
    data_args = {
        k.removeprefix("data.args."): v
        for k, v in run.data.params.items()
        if k.startswith("data.args.")
    }
    echo(
        f"data        {found.data or run.data.params.get('data.component', '?')} {data_args or ''}".rstrip()
    )
    digests = found.data_sha256
    # the run's MLflow datasets carry the same digests (pipeline verify checks it)
    if digests.get("train") and digests.get("val"):
        echo(
            f"datasets    train sha256 {digests['train'][:16]}, val sha256 {digests['val'][:16]} (the run's "
            "MLflow datasets)"
        )
    return {"version": tags, "run_id": run_id}


def _shapes(tensors) -> str:
    if not isinstance(tensors, dict):
        return "?"
    return (
        ", ".join(
            f"{k} {v.get('shape')} {v.get('datatype', v.get('dtype', ''))}".rstrip()
            for k, v in tensors.items()
            if isinstance(v, dict)
        )
        or "?"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="the X-Request-Id of a response")
    parser.add_argument(
        "--payload-log", required=True, metavar="DIR", help="the server's --payload-log directory"
    )
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, then ./mlflow.db)",
    )


def cli(args: argparse.Namespace) -> int:
    logs.configure(level=logging.WARNING)
    try:
        main(args.request_id, Path(args.payload_log), args.tracking_uri)
    except TraceError as exc:
        print(f"pipeline trace: error: {exc}", file=sys.stderr)
        return 2
    return 0
