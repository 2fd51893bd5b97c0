"""`pipeline export`: consolidated weights -> model.onnx behind gates -> MLflow model version + alias.

Input: a directory with `model.safetensors` and `model.json` (format trainserve-weights/1, written
by `pipeline consolidate`), given as a path or fetched from a run's `consolidated/` artifacts.
Output (default `<run_dir>/onnx/`, beside the weights): `model.onnx`, `export_report.json`, and the
optional variants `model.optimized.onnx` / `model.fp16.onnx`.

Every gate is measured and written to the report and to MLflow metrics; a model reaches the
registry only when all of them pass, and the alias (the one serving loads) moves with it. A failed
gate registers nothing and the CLI exits 1 pointing at the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.components import gates, onnx_export, tracking
from pipeline.tools import logs
from pipeline.config import (DEFAULT_OUTPUT_DIR, Config, ConfigError, ExportConfig, config_from_dict,
                             parse_override)
from pipeline.components.data import DataError, load_splits
from pipeline.models import build_model
from pipeline.components.safetensors_writer import file_sha256

log = logging.getLogger("pipeline.export")

WEIGHTS_FORMAT = "trainserve-weights/1"
REPORT_FORMAT = "trainserve-export-report/1"
WEIGHTS_FILE, META_FILE = "model.safetensors", "model.json"
STAGE_TAG = "trainserve.stage.export"
DOWNLOADS = Path(DEFAULT_OUTPUT_DIR)  # --run-id inputs land in outputs/<run_id>/consolidated, outputs beside them


class WeightsError(ValueError):
    """The consolidated weights can't be used; the message says what is wrong and what was expected."""


@dataclass
class Weights:
    directory: Path
    meta: dict[str, Any]
    config: Config
    state_dict: dict[str, torch.Tensor]

    @property
    def source(self) -> dict[str, Any]:
        return self.meta.get("source") or {}


@dataclass
class ExportResult:
    passed: bool
    report: dict[str, Any]
    report_path: Path
    onnx_path: Path
    model_version: str | None = None          # registry version, when registered
    registered_model_name: str = ""
    failed: list[str] = field(default_factory=list)


def main(weights_dir: str | Path | None = None, *, run_id: str | None = None,
         export_cfg: ExportConfig | None = None, overrides: Sequence[str] = (),
         output_dir: str | Path | None = None, tracking_uri: str = "", register: bool = True) -> ExportResult:
    """Exports and gates one model; registers it when every gate passes.

    `weights_dir` or `run_id` (its `consolidated/` artifacts) names the input. The export settings
    are the weights' own config section unless `export_cfg` is given; `overrides` ("export.atol=1e-5")
    apply on top. Raises WeightsError, TrackingError, ConfigError, DataError or ExportError on bad input.
    """
    # 1. Input: where the weights are, and which run they belong to. The store is checked first:
    #    an unreachable registry or a wrong run id fails in seconds, not after the export.
    if run_id:
        tracking.setup(_tracking_cfg(Config().tracking, tracking_uri))
        weights_dir = _download_weights(run_id)
    elif weights_dir is None:
        raise WeightsError("give a weights directory (with model.safetensors and model.json) or --run-id")
    weights = read_weights(Path(weights_dir))
    cfg = _export_settings(weights.config, export_cfg, overrides)
    if not run_id:
        tracking.setup(_tracking_cfg(weights.config.tracking, tracking_uri))
        run_id = weights.source.get("mlflow_run_id") or None
        if run_id:
            tracking.get_run(run_id)
    out = Path(output_dir) if output_dir else weights.directory.parent / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.registered_model_name or f"{weights.meta['model_args']['name']}-{weights.config.data.name}"

    # 2. The reference PyTorch model and the validation split it is judged on.
    reference = load_model(weights)
    splits = load_splits(weights.config.data)
    val_x, val_y = splits.val_x.float().numpy(), splits.val_y.numpy()

    # 3. Export a separate copy, so nothing the exporter does can touch the reference.
    metadata = onnx_export.metadata_for(name, weights.meta["labels"], {
        "trainserve.weights_sha256": weights.meta["sha256"], "trainserve.opset": str(cfg.opset)})
    exported = onnx_export.export(load_model(weights), torch.from_numpy(val_x[:2]), cfg.opset, metadata)
    # Gated under another name: model.onnx is only ever a model that passed (or the previous one).
    onnx_path = out / "model.candidate.onnx"
    _save(exported.model, onnx_path)
    log.info("exported with the %s exporter in %.1f s -> %s", exported.exporter, exported.seconds, onnx_path)

    # 4. Gates, then the optional variants, each with its own limits.
    results = {"checker": gates.check_model(onnx_path)}
    sess = gates.session(onnx_path)
    results.update(gates.parity(sess, reference, val_x, cfg.atol, cfg.rtol))
    results["accuracy"] = gates.accuracy(sess, reference, val_x, val_y, cfg.accuracy_tolerance_pp)
    variants: dict[str, Path] = {}
    if cfg.ort_optimize:
        variants["optimized"] = gates.ort_optimize(onnx_path, out / "model.optimized.onnx")
        results.update(_optimized_gates(variants["optimized"], reference, val_x, val_y, cfg))
    if cfg.fp16:
        variants["fp16"] = out / "model.fp16.onnx"
        _save(gates.to_fp16(exported.model), variants["fp16"])
        results.update(_fp16_gates(variants["fp16"], reference, val_x, val_y, cfg))

    # 5. Report, MLflow, registry.
    report = _report(weights, cfg, name, exported, results, variants)
    if report["passed"]:
        onnx_path = onnx_path.replace(out / "model.onnx")
    else:
        # Kept for debugging under a name no one serves by accident.
        onnx_path = onnx_path.replace(out / "model.rejected.onnx")
        for variant, path in list(variants.items()):
            variants[variant] = path.replace(path.with_name(path.name.replace(".onnx", ".rejected.onnx")))
        report["variants"] = {k: str(v) for k, v in variants.items()}
        report["rejected_model"] = str(onnx_path)
    report_path = out / "export_report.json"
    report_path.write_text(json.dumps(report, indent=2))
    result = ExportResult(report["passed"], report, report_path, onnx_path, None, name, report["failed_gates"])
    _publish(result, weights, run_id, cfg, exported, val_x, sess, variants, register)
    report_path.write_text(json.dumps(report, indent=2))  # now with the model version, if any
    return result


# ---------------------------------------------------------------------------------------------
# Input


def read_weights(directory: Path) -> Weights:
    """Reads and checks model.json + model.safetensors (format, checksum, config); loads tensors safely."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta_path, weights_path = directory / META_FILE, directory / WEIGHTS_FILE
    missing = [p.name for p in (weights_path, meta_path) if not p.is_file()]
    if missing:
        raise WeightsError(f"{directory}: missing {', '.join(missing)}; expected the output of "
                           "`pipeline consolidate` (model.safetensors and model.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != WEIGHTS_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise WeightsError(f"{meta_path}: format {got!r}, expected {WEIGHTS_FORMAT!r}")
    absent = [k for k in ("config", "model_args", "labels", "sha256") if not meta.get(k)]
    if absent:
        raise WeightsError(f"{meta_path}: missing field(s) {', '.join(absent)}")
    digest = file_sha256(weights_path)
    if digest != meta["sha256"]:
        raise WeightsError(f"{weights_path}: sha256 {digest} does not match model.json ({meta['sha256']}); "
                           "the file was changed or truncated after consolidation")
    config = config_from_dict(meta["config"])
    try:
        state_dict = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"{weights_path}: cannot be read as safetensors ({exc})") from None
    if len(meta["labels"]) != meta["model_args"].get("num_classes"):
        raise WeightsError(f"{meta_path}: {len(meta['labels'])} labels for a model with "
                           f"{meta['model_args'].get('num_classes')} classes")
    return Weights(directory, meta, config, state_dict)


def load_model(weights: Weights) -> torch.nn.Module:
    """The model rebuilt from model_args, with the weights checked key by key and shape by shape."""
    try:
        model = build_model(weights.meta["model_args"])
    except (KeyError, ValueError, TypeError) as exc:
        raise WeightsError(f"model_args in model.json cannot build a model: {exc}") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.state_dict.items()}
    problems = [f"missing {k} {list(s)}" for k, s in expected.items() if k not in got]
    problems += [f"unexpected {k} {list(s)}" for k, s in got.items() if k not in expected]
    problems += [f"{k}: file {list(got[k])}, model {list(s)}" for k, s in expected.items() if k in got and got[k] != s]
    if problems:
        shown = "; ".join(problems[:20]) + (f"; ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        args = weights.meta["model_args"]
        raise WeightsError(
            f"{weights.directory / WEIGHTS_FILE} does not match the model its config describes "
            f"({args.get('name')}, width {args.get('width')}, {args.get('num_classes')} classes): {shown}")
    model.load_state_dict({k: v.float() for k, v in weights.state_dict.items()}, strict=True)
    return model.float().eval()


def _download_weights(run_id: str) -> Path:
    """The run's consolidated/ artifacts, into outputs/<run_id>/ (where `pipeline consolidate --run-id` writes)."""
    local = tracking.download_artifacts(run_id, "consolidated", DOWNLOADS / run_id)
    log.info("downloaded the consolidated weights of run %s to %s", run_id, local)
    return local


def _export_settings(config: Config, export_cfg: ExportConfig | None, overrides: Sequence[str]) -> ExportConfig:
    tree = config.model_dump(mode="json")
    if export_cfg is not None:
        tree["export"] = export_cfg.model_dump(mode="json")
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != "export":
            raise ConfigError(f"override '{text}': `pipeline export` takes export.<key>=value; "
                              f"keys: {', '.join('export.' + k for k in ExportConfig.model_fields)}")
        tree["export"][keys[1]] = value
    return config_from_dict(tree).export


def _tracking_cfg(tracking_cfg, uri: str):
    return tracking_cfg.model_copy(update={"tracking_uri": uri}) if uri else tracking_cfg


def config_digest(config_tree: dict) -> str:
    return hashlib.sha256(json.dumps(config_tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Gates of the variants, report, MLflow


def _save(model, path: Path) -> None:
    import onnx

    # One self-contained file is what the server loads; only a model past protobuf's 2 GB needs external data.
    big = model.ByteSize() > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)


def _optimized_gates(path: Path, reference, val_x, val_y, cfg: ExportConfig) -> dict[str, dict]:
    """The optimized graph must compute what the plain one does: the same fp32 limits."""
    res = {"optimized.checker": gates.check_model(path)}
    sess = gates.session(path)
    res.update({f"optimized.{k}": v for k, v in gates.parity(sess, reference, val_x, cfg.atol, cfg.rtol).items()})
    res["optimized.accuracy"] = gates.accuracy(sess, reference, val_x, val_y, cfg.accuracy_tolerance_pp)
    return res


def _fp16_gates(path: Path, reference, val_x, val_y, cfg: ExportConfig) -> dict[str, dict]:
    """fp16 runs where it is meant to: CUDA when a device exists; else the CPU provider, if it can."""
    res = {"fp16.checker": gates.check_model(path)}
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if _cuda() else ["CPUExecutionProvider"]
    try:
        sess = gates.session(path, providers)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own untyped errors
        res["fp16.parity"] = {"passed": False, "message": f"onnxruntime cannot run the fp16 model on {providers[0]}: {exc}"}
        return res
    limits = {"prob_atol": gates.FP16_PROB_ATOL, "min_agreement": gates.FP16_MIN_AGREEMENT}
    # Logits are checked with limits scaled for fp16's precision; probabilities and decisions carry the gate.
    atol, rtol = cfg.atol * gates.FP16_LOGIT_SCALE[0], cfg.rtol * gates.FP16_LOGIT_SCALE[1]
    res |= {f"fp16.{k}": v for k, v in gates.parity(sess, reference, val_x, atol, rtol, **limits).items()}
    res["fp16.accuracy"] = gates.accuracy(sess, reference, val_x, val_y, max(cfg.accuracy_tolerance_pp, gates.FP16_ACCURACY_PP))
    return res


def _cuda() -> bool:
    import onnxruntime as ort

    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def _report(weights: Weights, cfg: ExportConfig, name: str, exported, results: dict, variants: dict) -> dict:
    failed = [k for k, v in results.items() if not v["passed"]]
    return {
        "format": REPORT_FORMAT,
        "passed": not failed,
        "failed_gates": failed,
        "failures": {k: results[k]["message"] for k in failed},
        "registered_model_name": name,
        "model_version": None,
        "exporter": {"used": exported.exporter, "fallback_reason": exported.fallback_reason,
                     "opset": cfg.opset, "seconds": round(exported.seconds, 2), "torch": torch.__version__},
        "gates": results,
        "variants": {k: str(v) for k, v in variants.items()},
        "export_config": cfg.model_dump(mode="json"),
        "weights": {"directory": str(weights.directory), "sha256": weights.meta["sha256"],
                    "config_sha256": config_digest(weights.meta["config"]), "source": weights.source},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def lineage_tags(weights: Weights, report: dict) -> dict[str, str]:
    """Tags that walk a model version back to its run, checkpoint, weights and config."""
    src = weights.source
    return {
        "trainserve.run_id": str(src.get("mlflow_run_id") or ""),
        "trainserve.checkpoint": str(src.get("checkpoint") or ""),
        "trainserve.step": str(src.get("step", "")),
        "trainserve.world_size": str(src.get("world_size", "")),
        "trainserve.strategy": str(src.get("strategy", "")),
        "trainserve.weights_sha256": weights.meta["sha256"],
        "trainserve.config_sha256": report["weights"]["config_sha256"],
        "trainserve.exporter": report["exporter"]["used"],
        "trainserve.opset": str(report["exporter"]["opset"]),
    }


def _publish(result: ExportResult, weights: Weights, run_id: str | None, cfg: ExportConfig, exported,
             val_x: np.ndarray, sess, variants: dict, register: bool) -> None:
    """Metrics and report always; the model, a registry version and the alias only when all gates pass."""
    report = result.report
    with tracking.stage_run("export", run_id, f"export-{result.registered_model_name}") as logged_to:
        tracking.log_metrics(gates.metrics(report["gates"]))
        tracking.set_tags({"trainserve.export.exporter": exported.exporter,
                           "trainserve.weights_sha256": weights.meta["sha256"],
                           "trainserve.config_sha256": report["weights"]["config_sha256"]})
        tracking.log_artifact(result.report_path, "onnx")
        if not result.passed:
            tracking.set_tags({STAGE_TAG: "failed"})
            return
        for path in variants.values():
            tracking.log_artifact(path, "onnx")
        example = {"input": gates.batch_of(val_x, 2)}
        logits, probs = sess.run(["logits", "probabilities"], example)
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if _cuda() else ["CPUExecutionProvider"])
        report["model_uri"] = tracking.log_onnx_model(
            exported.model, example, {"logits": logits, "probabilities": probs}, providers,
            metadata={"trainserve.report": report["gates"]["parity.val"]["message"]})
        if register:
            tags = lineage_tags(weights, report)
            tags["trainserve.run_id"] = logged_to
            result.model_version = tracking.register_version(report["model_uri"], result.registered_model_name,
                                                             cfg.alias, tags)
            report["model_version"] = result.model_version
            report["alias"] = cfg.alias
            log.info("registered %s version %s as @%s", result.registered_model_name, result.model_version, cfg.alias)
        tracking.set_tags({STAGE_TAG: "done"})


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("weights_dir", nargs="?", help="directory with model.safetensors and model.json")
    parser.add_argument("--run-id", help="take the weights from this MLflow run's consolidated/ artifacts")
    parser.add_argument("--output", help="output directory (default: <run_dir>/onnx, beside the weights)")
    parser.add_argument("--tracking-uri", default="", help="MLflow tracking URI (default: the weights' config, "
                        "$MLFLOW_TRACKING_URI, then sqlite:///mlflow.db)")
    parser.add_argument("--no-register", action="store_true", help="log to the run but register no version")
    parser.add_argument("overrides", nargs="*", default=[], metavar="export.key=value",
                        help="override the export settings, e.g. export.opset=17 export.fp16=true")
    # `DIR --output X export.atol=1e-5`: plain parse_args stops matching positionals after the first
    # option and refuses the overrides as unrecognized; the intermixed parser takes them anywhere.
    parser.parse_args = parser.parse_intermixed_args


def cli(args: argparse.Namespace) -> int:
    logs.configure()
    weights_dir, overrides = args.weights_dir, list(args.overrides)
    if weights_dir and "=" in weights_dir:  # argparse can't tell `export.x=1` from a path on its own
        overrides.insert(0, weights_dir)
        weights_dir = None
    try:
        result = main(weights_dir, run_id=args.run_id, overrides=overrides, output_dir=args.output,
                      tracking_uri=args.tracking_uri, register=not args.no_register)
    except (WeightsError, ConfigError, DataError, tracking.TrackingError, onnx_export.ExportError) as exc:
        one_line = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"pipeline export: error: {one_line}", file=sys.stderr)
        return 2
    if not result.passed:
        failures = "; ".join(f"{k}: {v}" for k, v in result.report["failures"].items())
        print(f"pipeline export: gate failed, nothing registered: {failures}. Report: {result.report_path}",
              file=sys.stderr)
        return 1
    where = (f"registered {result.registered_model_name} v{result.model_version} @{result.report.get('alias')}"
             if result.model_version else "not registered")
    print(f"{result.onnx_path} ({result.report['exporter']['used']} exporter, opset "
          f"{result.report['exporter']['opset']}): every gate passed; {where}. Report: {result.report_path}")
    return 0
