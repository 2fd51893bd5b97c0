"""`pipeline verify models:/<name>@<alias> [--server URL]`: re-proves the chain behind the served
bytes.

One line per link, `ok`, `FAIL` or `skip` (a link whose artifact can't be reached is skipped, not
failed, and says why); exit 1 on any FAIL, else 3 when a link was skipped (the chain is incomplete:
not proven, not broken), 0 only when every link was checked:

    registry     the alias -> a version, with the lineage tags export wrote
    onnx         the registered ONNX file's sha256 equals the version's recorded one, and so does
                 its external data file's (model.onnx.data, the weights of a graph past 2 GB) when
                 it has one
    lineage      the ONNX's own metadata (weights and model.json hashes, run) equals the version's
                 tags
    weights      the run's model.safetensors hashes to what its model.json says, and model.json to
                 what the ONNX recorded
    checkpoint   the checkpoint the weights came from is intact (its marker's sha256 of every file),
                 and consolidating it again gives byte-identical weights
    graph        the registered ONNX is, node for node and initializer for initializer, a
                 fresh export of those weights (metadata aside): the bytes that compute
                 answers come from the weights
    gates        export's gates, run again on the registered ONNX against those weights, all pass

The sha256 record (`onnx`) and the metadata (`lineage`) are the store's word: whoever can write the
store can rewrite them with the file. `graph` is what ties the file to the weights, and `weights`
and `checkpoint` tie those to the training run; verify proves the chain from the checkpoint to the
served bytes, not who wrote the store (a checkpoint replaced with its marker is a chain that holds).
    data         the content digests of the training and validation splits the version names are the
                 ones its training run logged as its MLflow datasets, and the drift baseline
                 registered beside the ONNX hashes to the version's recorded sha256
    server       (--server) the live server serves this version, with these weights, and says so in
                 its model metadata and in the receipt headers of a real inference; the sha256 of
                 the ONNX bytes it loaded (X-Model-Onnx-Sha256) is one the version records
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# raised here, defined with the others
from pipeline.errors import VerifyError  # noqa: F401
from pipeline.tools import logs
from pipeline.tools.logs import clip, first_line
from serving import lineage
from serving.lineage import Lineage

log = logging.getLogger("pipeline.verify")


@dataclass
class Link:
    name: str
    # ok | FAIL | skip
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<11} {self.detail}"


def main(
    model_uri: str,
    server: str | None = None,
    tracking_uri: str = "",
    token: str = "",
    trusted: tuple[str, ...] = (),
    echo=print,
) -> list[Link]:
    from pipeline import tracking

    name, alias = parse_uri(model_uri)
    uri = tracking.resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise VerifyError(
            f"no MLflow store at {uri.removeprefix('sqlite:///')}: run where the pipeline wrote "
            "mlflow.db, or give --tracking-uri"
        )
    tracking.use_store(uri)
    links: list[Link] = []

    def report(link: Link) -> Link:
        links.append(link)
        echo(link.line())
        return link

    with tempfile.TemporaryDirectory(prefix="trainserve-verify-") as tmp:
        tmp = Path(tmp)
        version, tags = registry_link(name, alias, report)
        onnx_path, props = onnx_link(name, version, tags, tmp, report)
        weights_dir = weights_link(tags, props, tmp, report)
        if weights_dir:
            checkpoint_link(weights_dir, tmp, report)
            model_links(weights_dir, onnx_path, trusted, tmp, report)
        else:
            report(Link("checkpoint", "skip", "no weights to trace it from"))
            report(Link("graph", "skip", "no weights to export again"))
            report(Link("gates", "skip", "no weights to run them against"))
        data_link(tags, onnx_path, report)
        if server:
            server_link(server, name, version, tags, props, token, report)
    return links


def parse_uri(uri: str) -> tuple[str, str]:
    import re

    match = re.fullmatch(r"models:/([^/@]+)@([^/@]+)", uri)
    if not match:
        raise VerifyError(
            f"'{uri}' is not a registry alias: give models:/<name>@<alias>, e.g. "
            "models:/resnet18-digits@champion"
        )
    return match.group(1), match.group(2)


def registry_link(name: str, alias: str, report) -> tuple[str, dict]:
    from pipeline import tracking

    version = tracking.alias_version(name, alias)
    if version is None:
        from serving.loader import registry_miss

        raise VerifyError(
            registry_miss(name, alias=alias)
            or f"models:/{name}@{alias}: no such registered model or alias in {tracking.current_uri()}"
        )
    tags = tracking.version_tags(name, version)
    missing = [
        k for k in ("weights", lineage.onnx_file("fp32")) if not lineage.recorded_sha256(tags, k)
    ]
    report(
        Link(
            "registry",
            "FAIL" if missing else "ok",
            f"models:/{name}@{alias} -> version {version}"
            + (
                f"; its {lineage.SHA256} tag records no sha256 of {missing} (not registered by this trainserve's "
                "export)"
                if missing
                else f" (run {tags.get(lineage.RUN_ID) or 'none'})"
            ),
        )
    )
    return version, tags


def onnx_link(name: str, version: str, tags: dict, tmp: Path, report) -> tuple[Path | None, dict]:
    import onnx

    from pipeline import tracking
    from pipeline.artifact import onnx_export
    from serving.lineage import file_sha256
    from serving.loader import data_file_of

    try:
        path = tracking.download_version_onnx(name, version, tmp / "onnx")
    except Exception as exc:  # noqa: BLE001
        # whatever the store raises
        report(
            Link("onnx", "FAIL", f"models:/{name}/{version} can't be fetched: {first_line(exc)}")
        )
        return None, {}
    checked = [path]
    data_name = onnx_export.data_path(path).name
    # weights past 2 GB
    if (data := data_file_of(path)) is not None or lineage.recorded_sha256(tags, data_name):
        checked.append(data or onnx_export.data_path(path))
    said, ok = [], True
    for file in checked:
        digest = file_sha256(file) if file.is_file() else "(missing)"
        recorded = lineage.recorded_sha256(tags, file.name)
        ok = ok and digest == recorded
        said.append(
            f"{file.name} sha256 {digest[:16]}"
            + (
                ""
                if digest == recorded
                else f" != the version's recorded {recorded[:16] or '(none)'}"
            )
        )
    report(Link("onnx", "ok" if ok else "FAIL", "; ".join(said)))
    try:
        props = {
            p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props
        }
    except Exception as exc:  # noqa: BLE001
        # a damaged file
        report(Link("lineage", "FAIL", f"the ONNX file can't be parsed: {first_line(exc)}"))
        return path, {}
    said_file, said_version = Lineage.read(props), Lineage.read(tags)
    differs = [
        name
        for name in ("weights_sha256", "run_id", "config_sha256", "checkpoint")
        if getattr(said_file, name) != getattr(said_version, name)
    ]
    report(
        Link(
            "lineage",
            "FAIL" if differs else "ok",
            f"the ONNX's metadata differs from the version's tags in {differs}"
            if differs
            else f"weights {said_file.weights_sha256[:16]}, config {said_file.config_sha256[:16]}, checkpoint "
            f"{said_file.checkpoint} (step {said_file.step})",
        )
    )
    return path, props


def weights_link(tags: dict, props: dict, tmp: Path, report) -> Path | None:
    """model.safetensors + model.json from the training run's consolidated/ artifacts (else the
    local run directory), checked against each other and against what the ONNX recorded."""
    from pipeline import tracking
    from serving.lineage import file_sha256

    said = Lineage.read(props)
    run_id = said.run_id or tags.get(lineage.RUN_ID, "")
    directory, where = None, ""
    try:
        directory = tracking.download_artifacts(run_id, "consolidated", tmp / "weights")
        where = f"run {run_id} consolidated/"
    except Exception as exc:  # noqa: BLE001
        local = _local_run_dir(run_id) / "consolidated"
        if (local / "model.json").is_file():
            directory, where = local, str(local)
        else:
            report(
                Link(
                    "weights",
                    "skip",
                    f"neither run {run_id}'s consolidated/ ({first_line(exc)}) nor {local} "
                    "is reachable",
                )
            )
            return None
    problems = []
    meta_digest = (
        file_sha256(directory / "model.json") if (directory / "model.json").is_file() else ""
    )
    if said.weights_meta_sha256 and meta_digest != said.weights_meta_sha256:
        problems.append("model.json differs from the one the ONNX was exported from")
    try:
        recorded = json.loads((directory / "model.json").read_text()).get("sha256", "")
    except (OSError, ValueError) as exc:
        recorded = ""
        problems.append(f"model.json can't be read ({first_line(exc)})")
    weights = directory / "model.safetensors"
    digest = file_sha256(weights) if weights.is_file() else "(missing)"
    if digest != recorded:
        problems.append(f"model.safetensors sha256 {digest[:16]} != model.json's {recorded[:16]}")
    if recorded and said.weights_sha256 and recorded != said.weights_sha256:
        problems.append("model.json names other weights than the ONNX was exported from")
    report(
        Link(
            "weights",
            "FAIL" if problems else "ok",
            "; ".join(problems)
            if problems
            else f"{where}: model.safetensors sha256 {digest[:16]} = model.json "
            "= the ONNX's record",
        )
    )
    return None if problems else directory


def _local_run_dir(run_id: str) -> Path:
    """The run's directory on this machine, as its RUN_DIR tag names it (a version names no
    path)."""
    from pipeline import tracking

    try:
        return Path(tracking.get_run(run_id).data.tags.get(lineage.RUN_DIR) or "/nonexistent")
    except Exception:  # noqa: BLE001
        # no such run, the store unreachable
        return Path("/nonexistent")


def checkpoint_link(weights_dir: Path, tmp: Path, report) -> None:
    """Where the checkpoint is reachable (its local path, else the run's uploaded copy): intact, and
    it consolidates again to the very same bytes."""
    from pipeline import checkpoint, consolidate, tracking
    from serving.lineage import file_sha256

    meta = json.loads((weights_dir / "model.json").read_text())
    source = meta.get("source") or {}
    ckpt = Path(source.get("checkpoint") or "")
    if not (ckpt / checkpoint.MARKER).is_file():
        try:
            ckpt = tracking.download_artifacts(
                source.get("mlflow_run_id") or "", f"checkpoints/{ckpt.name}", tmp / "checkpoint"
            )
        except Exception as exc:  # noqa: BLE001
            report(
                Link(
                    "checkpoint",
                    "skip",
                    f"{ckpt} is not here and the run holds no upload of it ({first_line(exc)})",
                )
            )
            return
    try:
        checkpoint.verify_checksums(ckpt)
        again = consolidate.main(
            ckpt,
            output=tmp / "reconsolidated",
            dtype=meta.get("dtype", "fp32"),
            log_to_mlflow=False,
        )
    except Exception as exc:  # noqa: BLE001
        # CheckpointError names the file at fault
        report(Link("checkpoint", "FAIL", first_line(exc)))
        return
    digest = file_sha256(again)
    same = digest == meta.get("sha256")
    report(
        Link(
            "checkpoint",
            "ok" if same else "FAIL",
            f"{ckpt.name}: every file matches its marker's sha256; consolidated again -> "
            + (
                "the same bytes"
                if same
                else f"sha256 {digest[:16]}, not model.json's {meta.get('sha256', '')[:16]}"
            ),
        )
    )


def model_links(
    weights_dir: Path, onnx_path: Path | None, trusted: tuple[str, ...], tmp: Path, report
) -> None:
    """The registered graph against the weights: `graph` (a fresh export of them, compared node for
    node) and `gates` (export's gates run again on it), both on the reference rebuilt once from the
    weights."""
    from pipeline import export

    if onnx_path is None:
        report(Link("graph", "skip", "no ONNX file"))
        report(Link("gates", "skip", "no ONNX file"))
        return
    try:
        ref = export.reference(weights_dir, trusted)
    except Exception as exc:  # noqa: BLE001
        # an untrusted component, data that can't be read: said
        why = f"the model can't be rebuilt from the weights: {first_line(exc)}"
        report(Link("graph", "FAIL", why))
        report(Link("gates", "FAIL", f"could not run: {why}"))
        return
    graph_link(ref, onnx_path, tmp, report)
    gates_link(ref, onnx_path, report)


def graph_link(ref, onnx_path: Path, tmp: Path, report) -> None:
    import onnx
    import torch

    from pipeline import export

    try:
        differences, exported = export.rederive(ref, onnx_path, tmp)
    except Exception as exc:  # noqa: BLE001
        # a graph that does not parse, an exporter failure
        report(Link("graph", "FAIL", f"could not export the weights again: {first_line(exc)}"))
        return
    if not differences:
        report(
            Link(
                "graph",
                "ok",
                f"the registered ONNX is a fresh export of the weights ({exported}): every node "
                "and initializer the same",
            )
        )
        return
    made_by = onnx.load(str(onnx_path), load_external_data=False).producer_version
    if made_by and made_by != torch.__version__:
        report(
            Link(
                "graph",
                "skip",
                f"the registered ONNX says torch {made_by} exported it, a fresh export with this "
                f"torch {torch.__version__} differs ({clip('; '.join(differences), 300)}); verify "
                f"with torch {made_by} to prove it",
            )
        )
        return
    report(
        Link(
            "graph",
            "FAIL",
            "the registered ONNX is not what the weights export to: "
            + clip("; ".join(differences), 900),
        )
    )


def gates_link(ref, onnx_path: Path, report) -> None:
    from pipeline import export

    try:
        results = export.regate(ref, onnx_path)
    except Exception as exc:  # noqa: BLE001
        # a broken file fails the gates with the reason
        report(Link("gates", "FAIL", f"could not run: {first_line(exc)}"))
        return
    failed = [f"{k}: {v['message']}" for k, v in results.items() if not v["passed"]]
    report(
        Link(
            "gates",
            "FAIL" if failed else "ok",
            clip("; ".join(failed), 600)
            if failed
            else f"{len(results)} gates pass again on the registered ONNX",
        )
    )


def data_link(tags: dict, onnx_path: Path | None, report) -> None:
    """The data behind the version: its split digests against the run's logged datasets; the drift
    baseline (drift_reference.json, downloaded with the ONNX) against the version's recorded
    hash."""
    from pipeline import tracking
    from serving import drift
    from serving.lineage import file_sha256

    recorded = {split: lineage.recorded_sha256(tags, split) for split in ("train", "val")}
    if not all(recorded.values()):
        report(
            Link(
                "data",
                "skip",
                "the version names no data digests (exported before datasets were logged)",
            )
        )
        return
    try:
        logged = tracking.dataset_digests(tags.get(lineage.RUN_ID, ""))
    except Exception as exc:  # noqa: BLE001
        # whatever the store raises
        report(Link("data", "skip", f"the run's datasets can't be read: {first_line(exc)}"))
        return
    problems = [
        f"{split} {digest[:16]} != the run's {logged.get(split, '(none)')[:16]}"
        for split, digest in recorded.items()
        if logged.get(split) != digest
    ]
    manifests, notes = manifest_checks(tags.get(lineage.RUN_ID, ""), recorded)
    problems += manifests
    baseline = onnx_path.parent / "drift_reference.json" if onnx_path is not None else None
    drift_recorded = lineage.recorded_sha256(tags, drift.FILE)
    if drift_recorded:
        if baseline is None or not baseline.is_file():
            problems.append(f"{drift.FILE} is not beside the registered ONNX")
        elif file_sha256(baseline) != drift_recorded:
            problems.append(
                f"{drift.FILE} sha256 {file_sha256(baseline)[:16]} != the version's {drift_recorded[:16]}"
            )
    report(
        Link(
            "data",
            "FAIL" if problems else "ok",
            "; ".join(problems)
            if problems
            else f"train {recorded['train'][:16]}, val {recorded['val'][:16]} = the run's datasets"
            + (", drift baseline intact" if drift_recorded else "")
            + "".join(f"; {n}" for n in notes),
        )
    )


def manifest_checks(run_id: str, recorded: dict[str, str]) -> tuple[list[str], list[str]]:
    """A sharded split's digest is its manifest's (pipeline/shards/format.py): the manifests the
    run's datasets name, read again where they are, must still have the digests the version records.
    (problems, notes)"""
    from pipeline import tracking
    from pipeline.shards import format as shard_format

    problems, notes = [], []
    try:
        manifests = tracking.dataset_manifests(run_id)
    except Exception:  # noqa: BLE001
        # the digests above already said whether the run can be read
        return problems, notes
    for split, location in sorted(manifests.items()):
        try:
            manifest = shard_format.read_manifest(location)
            shard_format.check_against_store(manifest)
        except Exception as exc:  # noqa: BLE001
            # moved, unreachable store, damaged: said, not a crash
            notes.append(f"{split} manifest {location} not checked: {first_line(exc)}")
            continue
        if manifest.digest != recorded.get(split):
            problems.append(
                f"{split} manifest {location} now has digest {manifest.digest[:16]}, the version was "
                f"trained on {str(recorded.get(split))[:16]}"
            )
        else:
            notes.append(
                f"{split} manifest {location} has the digest trained on, and its {len(manifest.shards)} shards "
                "are there at the sizes it names (each row group's digest is checked as it is read)"
            )
    return problems, notes


def server_link(
    url: str, name: str, version: str, tags: dict, props: dict, token: str, report
) -> None:
    """The server's own word (model metadata) and its receipts on a real inference, against the
    registry: the weights the file claims, and the hash of the bytes the server loaded against the
    ones the version records (model.onnx's or a variant's), since a file's claims are only as good
    as its bytes."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = url.rstrip("/")
    try:
        meta = _get_json(f"{base}/v2/models/{name}", headers)
        receipt = _infer_receipt(base, name, meta, headers)
    except Exception as exc:  # noqa: BLE001
        # connection refused, 4xx, a non-JSON answer
        report(Link("server", "FAIL", f"{base}: {first_line(exc)}"))
        return
    served = {
        "version": receipt.get("x-model-version", ""),
        "weights": receipt.get("x-model-weights-sha256", ""),
        "onnx": receipt.get("x-model-onnx-sha256", ""),
    }
    recorded = set(lineage.recorded_files(tags).values())
    params = meta.get("parameters") or {}
    problems = []
    if served["version"] != version or version not in [str(v) for v in meta.get("versions", [])]:
        problems.append(
            f"serves version {served['version'] or meta.get('versions')}, the alias is at {version}"
        )
    weights = Lineage.read(props).weights_sha256
    if served["weights"] != weights or params.get("weights_sha256") != weights:
        problems.append(
            f"serves weights {served['weights'][:16] or '(unnamed)'}, the registered ONNX has "
            f"{weights[:16]}"
        )
    if served["onnx"] not in recorded or params.get("onnx_sha256") != served["onnx"]:
        named = served["onnx"][:16] or "(unnamed: X-Model-Onnx-Sha256 missing)"
        problems.append(
            f"serves ONNX bytes with sha256 {named}, the version records "
            f"{', '.join(sorted(r[:16] for r in recorded)) or '(none)'}"
        )
    report(
        Link(
            "server",
            "FAIL" if problems else "ok",
            "; ".join(problems)
            if problems
            else f"{base} serves {name} v{version}, weights "
            f"{served['weights'][:16]}, ONNX {served['onnx'][:16]} "
            f"(request {receipt.get('x-request-id')})",
        )
    )


def _get_json(url: str, headers: dict) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def _infer_receipt(base: str, name: str, meta: dict, headers: dict) -> dict[str, str]:
    """One V2 inference of zeros in the shapes the server declares (not the image files an image
    model also takes in place of its input: parameters.image_input); returns its response
    headers."""
    import numpy as np

    from serving.codec import V2_DTYPES

    inputs = []
    stand_in = ((meta.get("parameters") or {}).get("image_input") or {}).get("name")
    for spec in meta.get("inputs", []):
        if spec["name"] == stand_in:
            continue
        shape = [1 if d < 0 else d for d in spec["shape"]]
        inputs.append(
            {
                "name": spec["name"],
                "datatype": spec["datatype"],
                "shape": shape,
                "data": np.zeros(shape, V2_DTYPES.get(spec["datatype"], np.float32))
                .ravel()
                .tolist(),
            }
        )
    body = json.dumps({"id": "pipeline-verify", "inputs": inputs}).encode()
    request = urllib.request.Request(
        f"{base}/v2/models/{name}/infer",
        data=body,
        method="POST",
        headers={**headers, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return {k.lower(): v for k, v in r.headers.items()}


# --- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_uri", metavar="models:/NAME@ALIAS", help="the registry alias to verify"
    )
    parser.add_argument(
        "--server", help="also check the live server at this URL (e.g. http://127.0.0.1:8080)"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("TRAINSERVE_AUTH_TOKEN", ""),
        help="the server's bearer token (default: $TRAINSERVE_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, then ./mlflow.db)",
    )
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="PATTERN",
        help="import the components model.json names that match these comma-separated patterns (e.g. "
        "'my_project.*,timm.*'), to re-run the gates; repeatable",
    )


def cli(args: argparse.Namespace) -> int:
    # torch sets its loggers' levels when it is imported (its exporter's warnings among them):
    # imported first, so that the quiet levels configure sets are the last word.
    import torch  # noqa: F401

    # the links are the output
    logs.configure(level=logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from pipeline.tracking import TrackingError

    try:
        links = main(args.model_uri, args.server, args.tracking_uri, args.token, tuple(args.trust))
    except (VerifyError, TrackingError) as exc:
        print(f"pipeline verify: error: {exc}", file=sys.stderr)
        return 2
    return verdict(links, args.model_uri)


def verdict(links: list[Link], model_uri: str) -> int:
    """The last line and the exit code: a skipped link is no proof, so 'verified' needs every one
    checked."""
    broken = [link.name for link in links if link.status == "FAIL"]
    skipped = [link.name for link in links if link.status == "skip"]
    if broken:
        print(f"BROKEN: {', '.join(broken)}: {model_uri}")
        return 1
    if skipped:
        print(f"INCOMPLETE: {', '.join(skipped)} could not be checked (see why above): {model_uri}")
        return 3
    print(f"verified: {model_uri}")
    return 0
