"""`pipeline export`: consolidated weights -> model.onnx behind gates -> MLflow model version +
alias.

Input: a directory with `model.safetensors` and `model.json` (format trainserve-weights/2, written
by `pipeline consolidate`), given as a path or fetched from a run's `consolidated/` artifacts.
Output (default `<run_dir>/onnx/`, beside the weights): `model.onnx`, `export_report.json`, and the
optional variants `model.optimized.onnx` / `model.fp16.onnx` / `model.int8.onnx` /
`model.uint8.onnx`. fp16, int8 and uint8 are also logged inside the registered MLflow model, beside
model.onnx: `python -m serving --variant fp16|int8|uint8` serves one, and `--variant auto` the
fastest for the server's provider, as export measured them here (`variants_measured` in the report,
the version's tag lineage.FASTEST_VARIANTS); never uint8, whose clients send other bytes (UINT8
image inputs: pipeline/artifact/uint8_inputs.py).

The int8 variant (export.int8, pipeline/artifact/int8.py) is gated like the others, with its own
limits; unlike them, its failure drops only it (named model.int8.rejected.onnx, never logged), not
the export: it is an optional speed-up of a model that passed.

Gates run on the CPU provider, and on the CUDA provider too (with the server's default options: TF32
off) when it really loads here; each gate records the provider it ran on, and fails if onnxruntime
fell back to another one. The report's `providers` says which were gated, or why not.

The model, its data and its task are rebuilt from the components model.json records; those are
imported only when trusted (built in, $TRAINSERVE_TRUSTED_COMPONENTS, --trust, or the config
`pipeline run` was given): model.json may come from a shared store. The graph's inputs are the
validation data's (names, dtypes, shapes), its outputs the task's.

Every gate is measured and written to the report and to MLflow metrics; a model reaches the
registry only when all of them pass, and the alias (the one serving loads) moves with it. A failed
gate registers nothing and the CLI exits 1 pointing at the report.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline import tracking
from pipeline.artifact import (
    baseline,
    gates,
    int8,
    length_limits,
    onnx_export,
    promotion,
    uint8_inputs,
)
from pipeline.artifact.rebuild import gate_file, rebuild, run_gates
from pipeline.artifact.weights import META_FILE, Weights, read_weights
from pipeline.checkpoint import run_dir as run_dir_owner
from pipeline.components.data import DataError, Splits, first_batch, named
from pipeline.components.reference import short_name
from pipeline.config import (
    DEFAULT_OUTPUT_DIR,
    Config,
    ConfigError,
    ExportConfig,
    config_from_dict,
    parse_override,
)
from pipeline.errors import WeightsError
from pipeline.tools import logs, stopping
from pipeline.tools.files import write_json
from serving import drift, images, lineage
from serving.lineage import Lineage, file_sha256

log = logging.getLogger("pipeline.export")

REPORT_FORMAT = "trainserve-export-report/1"
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
DOWNLOADS = Path(DEFAULT_OUTPUT_DIR)
# training samples the drift baseline is computed on (quantiles settle well before)  # --run-id
# inputs land in outputs/<run_id>/consolidated, outputs beside them
DRIFT_SAMPLES = 2000


@dataclass
class ExportResult:
    passed: bool
    report: dict[str, Any]
    report_path: Path
    onnx_path: Path
    # registry version, when registered
    model_version: str | None = None
    registered_model_name: str = ""
    failed: list[str] = field(default_factory=list)


def main(
    weights_dir: str | Path | None = None,
    *,
    run_id: str | None = None,
    export_cfg: ExportConfig | None = None,
    overrides: Sequence[str] = (),
    output_dir: str | Path | None = None,
    tracking_uri: str = "",
    register: bool = True,
    trusted: Sequence[str] = (),
) -> ExportResult:
    """Exports and gates one model; registers it when every gate passes.

    `weights_dir` or `run_id` (its `consolidated/` artifacts) names the input. The export settings
    are the weights' own config section unless `export_cfg` is given; `overrides`
    ("export.atol=1e-5") apply on top. `trusted`: component patterns to import besides the built-in
    and environment ones. Raises WeightsError, TrackingError, ConfigError, DataError or ExportError
    on bad input.
    """
    # 1. Input: where the weights are, and which run they belong to. The store is checked first:
    #    an unreachable registry or a wrong run id fails in seconds, not after the export.
    if run_id:
        tracking.setup(_tracking_cfg(Config().tracking, tracking_uri))
        weights_dir = _download_weights(run_id)
    elif weights_dir is None:
        raise WeightsError(
            "give a weights directory (with model.safetensors and model.json) or --run-id"
        )
    weights = read_weights(Path(weights_dir))
    cfg = _export_settings(weights.config, export_cfg, overrides)
    if not run_id:
        tracking.setup(_tracking_cfg(weights.config.tracking, tracking_uri))
        run_id = weights.source.get("mlflow_run_id") or None
        if run_id:
            tracking.get_run(run_id)
    out = Path(output_dir) if output_dir else weights.directory.parent / "onnx"
    # as consolidate: not under a live training's or run's feet
    run_dir_owner.claim_for_output(out)
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.registered_model_name or default_model_name(weights)

    # 2. The reference PyTorch model, its task, and the validation split it is judged on, all
    #    rebuilt from the components model.json records (once trusted).
    ref = rebuild(weights, trusted)
    task, splits = ref.task, ref.splits
    example = named(first_batch(splits.val, onnx_export.EXPORT_BATCH)[0])
    length_limits.warn_fixed_lengths(splits.val, cfg.dynamic_axes)
    # once the weights proved loadable
    log.info("exporting %s", describe_source(weights.source))

    # 3. Export a separate copy, so nothing the exporter does can touch the reference.
    metadata = onnx_export.metadata_for(
        name,
        task.name,
        weights.meta.get("labels"),
        {
            **lineage_of(weights).metadata(),
            lineage.OPSET: str(cfg.opset),
            # What the outputs mean, for the server's shadow comparison and live metrics (it knows
            # no tasks).
            lineage.DECISION: task.decision or "",
            lineage.PREDICTION: task.prediction or "",
            **image_metadata(splits, task, ref.head.output_names),
        },
    )
    # Gated under another name: model.onnx is only ever a model that passed (or the previous one).
    onnx_path = out / "model.candidate.onnx"
    exported = onnx_export.export(
        ref.fresh_head(),
        example,
        cfg.dynamic_axes,
        cfg.opset,
        metadata,
        onnx_path,
        cfg.external_data,
    )
    # the exporter's copy of the weights goes before onnxruntime maps its own
    gc.collect()
    log.info(
        "exported with the %s exporter in %.1f s -> %s",
        exported.exporter,
        exported.seconds,
        onnx_path,
    )

    # 4. Gates, then the optional variants, each with its own limits. On the CPU provider always; on
    #    the CUDA provider too, with the server's options, when it runs here: that is what a GPU
    #    server runs.
    batches, axes_failed = gates.parity_batches(splits.val, cfg.dynamic_axes, ref.head)
    # Whether the rows are the samples' own (the server batches requests together only then), and
    # the longest token inputs (the server's 400 past them): into the file's metadata, before any
    # gate or variant reads it.
    rows = gates.rows_independent(ref.head, batches, cfg.atol, cfg.rtol)
    log.info("%s", rows["message"])
    if rows["independent"]:
        metadata[lineage.ROWS_INDEPENDENT] = ",".join(map(str, rows["batch_sizes"]))
        exported.model.metadata_props.add(
            key=lineage.ROWS_INDEPENDENT, value=metadata[lineage.ROWS_INDEPENDENT]
        )
    limited = length_limits.record(exported.model, ref.head.model, batches, cfg.dynamic_axes)
    if limited or rows["independent"]:
        onnx_export.save(exported.model, onnx_path)
    results = {"checker": gates.check_model(onnx_path), **axes_failed}
    results |= gates.preprocessing(onnx_path, splits.val)
    # the gates' session; the drift baseline is computed with it too
    cpu_sess = gates.session(onnx_path)
    kept: dict = {}
    results.update(run_gates(cpu_sess, ref, batches, cfg, kept=kept))
    if (
        "onnx" in kept
        and (found := baseline.gate(task, kept["onnx"], cfg, ref.head, splits.val)) is not None
    ):
        # clearly better than the trivial predictor, or not registered
        results["baseline"] = found
    # the exported model's own figure (a confusion matrix), named by its checkpoint's step
    figure = (
        task.plot(
            kept["onnx"],
            out / "validation.png",
            subject=f"exported model (step {weights.step}), validation",
        )
        if "onnx" in kept
        else None
    )
    cuda_sess, not_on_cuda = _cuda_session(onnx_path)
    if cuda_sess is not None:
        results.update(
            {
                f"cuda.{k}": v
                for k, v in run_gates(cuda_sess, ref, batches, cfg, provider=CUDA).items()
            }
        )
    providers = {
        CPU: "gated",
        CUDA: f"gated with {_cuda_options()}"
        if cuda_sess is not None
        else f"not gated: {not_on_cuda}",
    }
    variants: dict[str, Path] = {}
    if cfg.ort_optimize:
        variants["optimized"] = gates.ort_optimize(onnx_path, out / "model.optimized.onnx")
        results["optimized.checker"] = gates.check_model(variants["optimized"])
        sess = gates.session(variants["optimized"])
        results.update({f"optimized.{k}": v for k, v in run_gates(sess, ref, batches, cfg).items()})
    if cfg.fp16:
        variants["fp16"] = out / "model.fp16.onnx"
        onnx_export.save(
            gates.to_fp16(onnx_export.with_weights(exported.model, onnx_path)), variants["fp16"]
        )
        results.update(_fp16_gates(variants["fp16"], ref, batches, cfg, cuda_sess is not None))
    if cfg.uint8_inputs:
        path, gated = uint8_inputs.make_variant(
            exported.model, onnx_path, out, ref, batches, cfg, cfg.uint8_inputs
        )
        results.update(gated)
        if path is not None:
            variants["uint8"] = path
    int8_report = None
    if cfg.int8 != "off":
        int8_report = int8.make_variant(onnx_path, out, ref, batches, cfg, metadata)
        if int8_report["passed"]:
            variants["int8"] = Path(int8_report["path"])
    measured = _measure_variants(onnx_path, variants, splits.val, cuda_sess is not None)

    # 5. Report, MLflow, registry.
    report = _report(
        weights, cfg, name, exported, results, variants, task, splits, ref.head.output_names
    )
    report["providers"] = providers
    report["rows_independent"] = rows
    if lineage.PREPROCESSING in metadata:
        report["preprocessing"] = metadata[lineage.PREPROCESSING]
    if figure:
        # the exported model's on the validation split (logged to the run's onnx/)
        report["figure"] = str(figure)
    if int8_report is not None:
        report["int8"] = int8_report
    if measured:
        report["variants_measured"] = measured
        report["fastest_variants"] = {provider: int8.fastest(m) for provider, m in measured.items()}
    if report["passed"]:
        exported.model = _moved(exported.model, onnx_path, out / "model.onnx")
        onnx_path = out / "model.onnx"
        report["drift_reference"] = str(drift_reference(cpu_sess, splits.train, out / drift.FILE))
    else:
        # Kept for debugging under a name no one serves by accident.
        onnx_export.move(onnx_path, out / "model.rejected.onnx")
        onnx_path = out / "model.rejected.onnx"
        for variant, path in list(variants.items()):
            variants[variant] = path.with_name(path.name.replace(".onnx", ".rejected.onnx"))
            onnx_export.move(path, variants[variant])
        report["variants"] = {k: str(v) for k, v in variants.items()}
        report["rejected_model"] = str(onnx_path)
    # champion vs challenger, on the same split, the same way (again at registration if the champion
    # moved)
    compare = partial(
        promotion.decide,
        onnx_path,
        name,
        cfg.alias,
        splits.val,
        task,
        cfg.promote,
        cfg.promote_tolerance,
        cfg.allow_contract_change,
    )
    if report["passed"] and register:
        report["promotion"] = compare()
        log.info(
            "%s: %s",
            "promote" if report["promotion"]["promote"] else "not promoted",
            report["promotion"]["reason"],
        )
    report_path = out / "export_report.json"
    write_json(report_path, report)
    result = ExportResult(
        report["passed"], report, report_path, onnx_path, None, name, report["failed_gates"]
    )
    _publish(result, weights, run_id, cfg, exported, example, variants, register, compare)
    return result


def reference(weights_dir: Path, trusted: Sequence[str] = ()):
    """The PyTorch reference of a weights directory, rebuilt as export rebuilds it (`pipeline
    verify`)."""
    return rebuild(read_weights(Path(weights_dir)), trusted)


def regate(ref, onnx_path: Path) -> dict[str, dict]:
    """The gates of an export, run again on an ONNX file against the reference `ref` of the weights
    it was exported from (with the export settings those weights recorded): `pipeline verify` on a
    registered model."""
    return gate_file(onnx_path, ref, ref.weights.config.export)


def rederive(ref, onnx_path: Path, workdir: Path) -> tuple[list[str], str]:
    """How the ONNX graph at `onnx_path` differs from a fresh export of the weights of `ref` ([]: it
    is one), and what was exported. The export is the one `main` makes (the same model rebuilt from
    the weights, the same task head, the same example rows of the validation split), with the opset
    and the dynamic axes the graph itself declares: whatever those say, the fresh graph is the
    exporter's own work from the weights, so a node, an initializer or a value that the weights and
    the exporter would not make is a difference."""
    import onnx

    registered = onnx.load(str(onnx_path), load_external_data=False)
    opset = onnx_export.opset_of(registered)
    axes = onnx_export.dynamic_axes_of(registered, ref.splits.input_names)
    example = named(first_batch(ref.splits.val, onnx_export.EXPORT_BATCH)[0])
    fresh = onnx_export.export(
        ref.fresh_head(), example, axes, opset, {}, workdir / "fresh.onnx", "auto"
    )
    gc.collect()
    said = f"{fresh.exporter} exporter, opset {opset}" + (f", dynamic axes {axes}" if axes else "")
    return onnx_export.graph_difference(onnx_path, workdir / "fresh.onnx"), said


def drift_reference(sess, train, path: Path, samples: int = DRIFT_SAMPLES) -> Path:
    """The drift baseline the server compares its traffic with (serving/drift.py): features of every
    input and of every output of the gated ONNX file's session `sess` (what the server will answer),
    on evenly spaced samples of the training split."""
    from pipeline.components.data import eval_loader, spread_sample

    sample, how = spread_sample(train, samples)
    builder = drift.ReferenceBuilder()
    for inputs, _ in eval_loader(sample, gates.VAL_BATCH):
        feeds = gates.feeds_of(inputs)
        builder.add("inputs", feeds)
        builder.add("outputs", gates.run_onnx(sess, feeds))
    return drift.write(builder.build(f"training split, {how}"), path)


def image_metadata(splits: Splits, task, output_names: list[str]) -> dict[str, str]:
    """For a model of images whose data says how a file became its input: that transform (a server
    applies it to the files it is sent; the `preprocessing` gate proves it), and the output whose
    row holds a score per class (what the server's answer to an image ranks). {} for other data, and
    for images of formats a server does not decode (TIFF: said in the log; the model then takes
    tensors only)."""
    if splits.preprocessing is None:
        return {}
    try:
        files = splits.val.source_images() if hasattr(splits.val, "source_images") else []
    except DataError:
        # (the gate names what is wrong with them)
        files = []
    suffixes = {suffix.lower() for _, suffix, _ in files}
    if suffixes and not suffixes & set(images.SUFFIXES):
        log.warning(
            "the model's images are %s files, which a server does not decode (%s): it will take tensors only",
            ", ".join(sorted(suffixes)),
            ", ".join(images.FORMATS),
        )
        return {}
    found = {lineage.PREPROCESSING: images.record(splits.input_names[0], splits.preprocessing)}
    scores = [o for o in getattr(task, "derived", ()) if o in output_names and task.decision]
    if scores:
        found[lineage.SCORES] = scores[0]
    return found


def describe_source(source: dict) -> str:
    """Which checkpoint the weights are, as consolidate recorded it: the run's best, or which
    step."""
    name = Path(str(source.get("checkpoint") or "?")).name
    metrics = source.get("val_metrics") or {}
    shown = ", ".join(f"val/{k} {v:.6g}" for k, v in list(metrics.items())[:2])
    kind = "the run's best checkpoint" if source.get("best") else "checkpoint"
    return f"{kind} {name} (step {source.get('step', '?')}{', ' + shown if shown else ''})"


def default_model_name(weights: "Weights") -> str:
    """<model>-<data> from the components' names, e.g. resnet18-digits."""
    return f"{short_name(weights.meta['model']['component'])}-{short_name(weights.config.data.component)}"


# ---------------------------------------------------------------------------------------------
# Input


def _download_weights(run_id: str) -> Path:
    """The run's consolidated/ artifacts, into outputs/<run_id>/ (where
    `pipeline consolidate --run-id` writes)."""
    local = tracking.download_artifacts(run_id, "consolidated", DOWNLOADS / run_id)
    log.info("downloaded the consolidated weights of run %s to %s", run_id, local)
    return local


def _export_settings(
    config: Config, export_cfg: ExportConfig | None, overrides: Sequence[str]
) -> ExportConfig:
    tree = config.model_dump(mode="json")
    if export_cfg is not None:
        tree["export"] = export_cfg.model_dump(mode="json")
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != "export":
            raise ConfigError(
                f"override '{text}': `pipeline export` takes export.<key>=value; "
                f"keys: {', '.join('export.' + k for k in ExportConfig.model_fields)}"
            )
        tree["export"][keys[1]] = value
    return config_from_dict(tree).export


def _tracking_cfg(tracking_cfg, uri: str):
    return tracking_cfg.model_copy(update={"tracking_uri": uri}) if uri else tracking_cfg


def config_digest(config_tree: dict) -> str:
    return hashlib.sha256(
        json.dumps(config_tree, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


# ---------------------------------------------------------------------------------------------
# Gates of the variants, report, MLflow


def _moved(graph, src: Path, dst: Path):
    """The passed candidate renamed to `dst` with its data file, if any; the graph as saved
    there."""
    return onnx_export.move(src, dst) or graph


def _fp16_gates(path: Path, ref, batches, cfg: ExportConfig, on_cuda: bool) -> dict[str, dict]:
    """fp16 runs where it is meant to: the CUDA provider (the server's options) when it runs here;
    else the CPU provider, which runs fp16 nodes through casts to fp32 (so that gate mostly checks
    the conversion)."""
    res = {"fp16.checker": gates.check_model(path)}
    provider = CUDA if on_cuda else CPU
    providers = [(CUDA, _cuda_options()), CPU] if on_cuda else [CPU]
    try:
        sess = gates.session(path, providers)
    except Exception as exc:  # noqa: BLE001
        # onnxruntime raises its own untyped errors
        res["fp16.parity"] = {
            "passed": False,
            "provider": provider,
            "message": f"onnxruntime cannot run the fp16 model on {provider}: {exc}",
        }
        return res
    gated = run_gates(sess, ref, batches, cfg, provider=provider, variant="fp16")
    return res | {f"fp16.{k}": v for k, v in gated.items()}


def _measure_variants(
    fp32_path: Path, variants: dict[str, Path], val, on_cuda: bool
) -> dict[str, dict]:
    """Samples/s at batch 1 and 32, in this process through the server's Engine, of each servable
    variant that passed, on each provider that serves it (fp32 and int8 on the CPU; fp32 and fp16 on
    CUDA when it runs here): what `serve --variant auto` chooses by. A provider with nothing to
    choose between is not measured."""
    choices = {
        CPU: {"fp32": fp32_path} | ({"int8": variants["int8"]} if "int8" in variants else {})
    }
    if on_cuda:
        choices[CUDA] = {"fp32": fp32_path} | (
            {"fp16": variants["fp16"]} if "fp16" in variants else {}
        )
    choices = {provider: paths for provider, paths in choices.items() if len(paths) > 1}
    if not choices:
        return {}
    feeds = {b: gates.feeds_of(first_batch(val, b)[0]) for b in (1, 32)}
    measured = {
        provider: int8.measure(paths, feeds, device="cuda" if provider == CUDA else "cpu")
        for provider, paths in choices.items()
    }
    log.info(
        "variants measured (samples/s at batch 1, 32): %s",
        "; ".join(
            f"{p.removesuffix('ExecutionProvider')} {v} {m['batch1_per_s']:.0f}, {m['batch32_per_s']:.0f}"
            for p, per in measured.items()
            for v, m in per.items()
        ),
    )
    return measured


def int8_metrics(int8_report: dict | None) -> dict[str, float]:
    """Whether the int8 variant passed (not part of export.passed: a failed int8 drops only itself)
    and how many nodes stayed in float; its gates' figures are in the table (figures_table)."""
    if not int8_report:
        return {}
    return {
        "export.int8.passed": float(int8_report["passed"]),
        "export.int8.excluded_nodes": float(len(int8_report["excluded"])),
    }


def figures_table(report: dict) -> list[dict]:
    """Every figure the export measured, a row each: the gates, the int8 variant's, and the
    comparison with the champion (logged as the run's `onnx/gates.json`, a table the MLflow UI
    shows)."""
    rows = gates.table(report["gates"])
    if report.get("int8"):
        rows += gates.table(report["int8"]["gates"], "int8.")
    # both sides' figures and the gain, as one more "gate"
    if decision := report.get("promotion"):
        compared = {
            f"{who}.{key}": value
            for who in ("candidate", "champion")
            for key, value in (decision.get(who) or {}).items()
            if key != "version"
        }
        rows += gates.table(
            {"compare": {**compared, "gain": decision.get("gain"), "passed": decision["promote"]}}
        )
    return rows


def verdict_of(result: ExportResult, decision: dict) -> str:
    """The run's VERDICT tag: what export made of the model, in a few words."""
    name, version = result.registered_model_name, result.model_version
    return f"{name} v{version} @{result.report['alias']}" + (
        "" if decision["promote"] else ": not promoted"
    )


def model_description(found: Lineage, alias: str) -> str:
    """The registered model's description: what its versions are, and what its alias means."""
    esc = tracking.markdown_escaped
    return (
        f"{esc(found.model)} ({esc(found.task)}), first trained on {esc(found.data)}, then every "
        f"version trained, exported and gated by trainserve. Its alias {esc('@' + alias)} is on a "
        "version that passed every export gate, has the input/output contract of the one before it "
        "(unless a change was allowed) and won the comparison `export.promote` asks for on the "
        "validation metric, or won `pipeline promote`'s shadow verdict, or replaced one that could "
        "not be served; each version's description lists its gates and why it holds, or held, its "
        "alias."
    )


def export_lineage(found: Lineage, weights: Weights, report: dict) -> dict:
    """Export's part of the run's lineage.json: the model's lineage, the checkpoint it came from,
    the exporter, every file's sha256, and what the registry made of it."""
    decision = report.get("promotion") or {}
    return {
        "model": found.as_dict(),
        "source": weights.source,
        "exporter": report["exporter"],
        "sha256": report.get("sha256", {}),
        "registered": {
            "name": report.get("registered_model_name"),
            "version": report.get("model_version"),
            "alias": report.get("alias"),
            "model_uri": report.get("model_uri"),
            "promoted": decision.get("promote"),
            "reason": decision.get("reason"),
        },
    }


def version_description(report: dict, found: Lineage, decision: dict, alias: str) -> str:
    """A registered version's description (Markdown, every outside word escaped): what the model is,
    where it came from, its gates, and why it holds its alias."""
    esc = tracking.markdown_escaped
    results = report["gates"]
    passed = sum(bool(g.get("passed")) for g in results.values())
    lines = [
        f"**{esc(found.model)}** ({esc(found.task)}) trained on {esc(found.data)}; checkpoint "
        f"{esc(found.checkpoint)} (step {esc(found.step)}) of run {esc(found.run_id or 'none')}; weights sha256 "
        f"{found.weights_sha256[:16]}.",
        "",
        f"**Gates**: {passed} of {len(results)} passed (every figure: the run's onnx/gates.json).",
        "",
    ]
    lines += [
        f"- {'passed' if g.get('passed') else 'FAILED'} {esc(name)}: {esc(str(g.get('message', '')))}"
        for name, g in results.items()
    ]
    # (plain text: MLflow's Markdown shows the backslash of an escaped "@" inside bold)
    lines += ["", f"Why it holds {esc('@' + alias)}: {esc(decision['reason'])}"]
    return "\n".join(lines)


def _cuda() -> bool:
    import onnxruntime as ort

    return torch.cuda.is_available() and CUDA in ort.get_available_providers()


def _cuda_options() -> dict[str, str]:
    """The CUDA provider's options a server runs with by default (serving.engine.GpuOptions): TF32
    off, so the CUDA gates hold it to the fp32 limits."""
    from serving.engine import GpuOptions

    return GpuOptions().cuda()


def _cuda_session(path: Path):
    """(a session of `path` on the CUDA provider with the server's default options, "") when that
    provider really runs here, else (None, why not). A GPU and onnxruntime-gpu are not enough: the
    provider's library loads only when the CUDA and cuDNN libraries it was built for are found."""
    if not _cuda():
        return None, (
            "no CUDA device here"
            if not torch.cuda.is_available()
            else "this onnxruntime has no CUDA provider (install onnxruntime-gpu)"
        )
    from serving.engine import preload_cuda_libraries

    said = preload_cuda_libraries()
    sess = gates.session(path, [(CUDA, _cuda_options()), CPU])
    ran = sess.get_providers()[0]
    if ran != CUDA:
        why = (
            f"a CUDA device and onnxruntime-gpu are here, but its CUDA provider did not load (the session ran "
            f"on {ran}): the CUDA and cuDNN libraries it was built for were not found"
            + (f" (onnxruntime: {logs.clip(said, 300)})" if said else "")
        )
        log.warning("the CUDA gates are skipped: %s", why)
        return None, why
    return sess, ""


def _report(
    weights: Weights,
    cfg: ExportConfig,
    name: str,
    exported,
    results: dict,
    variants: dict,
    task,
    splits: Splits,
    output_names: list[str],
) -> dict:
    failed = [k for k, v in results.items() if not v["passed"]]
    return {
        "format": REPORT_FORMAT,
        "passed": not failed,
        "failed_gates": failed,
        "failures": {k: results[k]["message"] for k in failed},
        "registered_model_name": name,
        "model_version": None,
        "exporter": {
            "used": exported.exporter,
            "fallback_reason": exported.fallback_reason,
            "opset": cfg.opset,
            "seconds": round(exported.seconds, 2),
            "torch": torch.__version__,
        },
        "task": task.facts(),
        "inputs": [s.to_json() for s in splits.inputs],
        "outputs": list(output_names),
        "dynamic_axes": cfg.dynamic_axes,
        "gates": results,
        "variants": {k: str(v) for k, v in variants.items()},
        "export_config": cfg.model_dump(mode="json"),
        "weights": {
            "directory": str(weights.directory),
            "sha256": weights.meta["sha256"],
            "config_sha256": config_digest(weights.meta["config"]),
            "source": weights.source,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# logged beside model.onnx; `optimized` stays the run's artifact
SERVED_VARIANTS = (
    "fp16",
    "int8",
    "uint8",
)


def lineage_of(weights: Weights) -> Lineage:
    """Where the weights came from, as the ONNX file's metadata and the registered version both say
    it: the server reads it from the bytes it serves (receipts, /v2/models parameters),
    `pipeline verify` checks one against the other and against model.json."""
    src = weights.source
    digests = (weights.meta.get("data") or {}).get("digests") or {}
    return Lineage(
        run_id=str(src.get("mlflow_run_id") or ""),
        checkpoint=Path(str(src.get("checkpoint") or "")).name,
        step=str(src.get("step", "")),
        model=weights.meta["model"]["component"],
        data=weights.config.data.component,
        task=weights.config.task.name,
        config_sha256=config_digest(weights.meta["config"]),
        weights_sha256=weights.meta["sha256"],
        weights_meta_sha256=file_sha256(weights.directory / META_FILE),
        data_sha256={split: found["sha256"] for split, found in digests.items()},
    )


def version_record(found: Lineage, result: ExportResult, variants: dict) -> dict[str, str]:
    """The registered version's tags: the handful a person reads, and the sha256 of every file it
    carries (the server checks what it downloads against them) and of the weights, config and data
    behind it."""
    report = result.report
    files = {
        lineage.onnx_file("fp32"): result.onnx_path,
        **{lineage.onnx_file(v): p for v, p in variants.items() if v in SERVED_VARIANTS},
    }
    for path in list(files.values()):
        # a graph's weights past 2 GB
        if (data := onnx_export.data_file(path)) is not None:
            files[data.name] = data
    files[drift.FILE] = Path(report["drift_reference"])
    sha256 = {name: file_sha256(path) for name, path in files.items()} | found.digests()
    report["sha256"] = sha256
    tags = found.version_tags() | {lineage.SHA256: json.dumps(sha256, sort_keys=True)}
    # how an image file becomes its input, as its ONNX file records it
    if report.get("preprocessing"):
        tags[lineage.PREPROCESSING] = report["preprocessing"]
    # what `serve --variant auto` reads
    if report.get("fastest_variants"):
        tags[lineage.FASTEST_VARIANTS] = json.dumps(report["fastest_variants"], sort_keys=True)
    return tags


def _publish(
    result: ExportResult,
    weights: Weights,
    run_id: str | None,
    cfg: ExportConfig,
    exported,
    example: dict[str, torch.Tensor],
    variants: dict,
    register: bool,
    compare=None,
) -> None:
    """Metrics and report always; the model, a registry version and the alias only when all gates
    pass."""
    # (hashes model.json: once)
    report, found = result.report, lineage_of(weights)
    with tracking.stage_run("export", run_id, f"export-{result.registered_model_name}"):
        # A few headline figures as metrics; every figure in one table (figures_table), logged once
        # complete
        tracking.log_metrics(
            gates.headline(report["gates"])
            | promotion_metrics(report.get("promotion"))
            | int8_metrics(report.get("int8"))
        )
        # (a failed export's is final; a passed one's again below)
        tracking.log_artifact(result.report_path, "onnx")
        if report.get("figure") and Path(report["figure"]).is_file():
            tracking.log_artifact(Path(report["figure"]), "onnx")
        if not result.passed:
            tracking.log_table(figures_table(report), "onnx/gates.json")
            tracking.mark_stage("export", "failed")
            return
        for path in variants.values():
            tracking.log_artifact(path, "onnx")
        inputs = {k: np.ascontiguousarray(v[:2].numpy()) for k, v in example.items()}
        providers = [CUDA, CPU] if _cuda() else [CPU]
        report["model_uri"] = tracking.log_onnx_model(
            exported.model,
            inputs,
            signature(exported.model),
            providers,
            metadata={lineage.REPORT: report["gates"]["parity.val"]["message"]},
            data_file=onnx_export.data_file(result.onnx_path),
            step=weights.step,
        )
        # a server of this version picks one with --variant
        for variant in SERVED_VARIANTS:
            if variant in variants:
                tracking.log_beside_model(report["model_uri"], variants[variant])
                # its weights, past 2 GB
                if (data := onnx_export.data_file(variants[variant])) is not None:
                    tracking.log_beside_model(report["model_uri"], data)
        # the server's drift baseline
        tracking.log_beside_model(report["model_uri"], Path(report["drift_reference"]))
        if register:
            tags = version_record(found, result, variants)
            # One decision at a time per registered model, each against the holder at its turn
            # (promotion.py).
            result.model_version, alias, decision = promotion.promote_in_turn(
                report["model_uri"],
                result.registered_model_name,
                cfg.alias,
                cfg.challenger_alias,
                tags,
                report["promotion"],
                compare,
            )
            if "compared_again" in decision:
                tracking.log_metrics(promotion_metrics(decision))
            report["promotion"] = decision
            report["model_version"] = result.model_version
            report["alias"] = alias
            tracking.set_tags({lineage.VERDICT: verdict_of(result, decision)})
            tracking.describe_version(
                result.registered_model_name,
                result.model_version,
                version_description(report, found, decision, alias),
            )
            tracking.describe_registered_model(
                result.registered_model_name, model_description(found, cfg.alias)
            )
            log.info(
                "registered %s version %s as @%s%s",
                result.registered_model_name,
                result.model_version,
                alias,
                ""
                if decision["promote"]
                else f" (@{cfg.alias} stays at v{decision['champion']['version']})",
            )
        # the run's exported checkpoint
        tracking.set_tags({lineage.CHECKPOINT: found.checkpoint})
        tracking.record_lineage("export", export_lineage(found, weights, report))
        # Logged once complete (the model's URI, the version, its alias and hashes filled): the copy
        # people browse in MLflow is the one on disk.
        write_json(result.report_path, report)
        tracking.log_artifact(result.report_path, "onnx")
        tracking.log_table(figures_table(report), "onnx/gates.json")
        tracking.mark_stage("export", "done")


def promotion_metrics(decision: dict | None) -> dict[str, float]:
    """compare.gain, for the MLflow run (both sides' figures are in the table: figures_table)."""
    return {"compare.gain": float(decision["gain"])} if decision and "gain" in decision else {}


def signature(model):
    """The MLflow signature of the graph itself: every named input and output, its dtype, and -1 on
    each dynamic axis (an inferred signature would fix a sequence axis at the example's length)."""
    import onnx
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    def specs(values):
        return Schema(
            [
                TensorSpec(
                    onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type),
                    tuple(
                        d.dim_value if d.HasField("dim_value") else -1
                        for d in v.type.tensor_type.shape.dim
                    ),
                    v.name,
                )
                for v in values
            ]
        )

    return ModelSignature(inputs=specs(model.graph.input), outputs=specs(model.graph.output))


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "weights_dir", nargs="?", help="directory with model.safetensors and model.json"
    )
    parser.add_argument(
        "--run-id", help="take the weights from this MLflow run's consolidated/ artifacts"
    )
    parser.add_argument(
        "--output", help="output directory (default: <run_dir>/onnx, beside the weights)"
    )
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: the weights' config, "
        "$MLFLOW_TRACKING_URI, then sqlite:///mlflow.db)",
    )
    parser.add_argument(
        "--no-register", action="store_true", help="log to the run but register no version"
    )
    parser.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="PATTERN",
        help="import components model.json names that match these comma-separated patterns (e.g. "
        "'my_project.*,timm.*'), besides the built-ins and $TRAINSERVE_TRUSTED_COMPONENTS; "
        "repeatable",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="export.key=value",
        help="override the export settings, e.g. export.opset=17 export.fp16=true",
    )
    # `DIR --output X export.atol=1e-5`: plain parse_args stops matching positionals after the first
    # option and refuses the overrides as unrecognized; the intermixed parser takes them anywhere.
    parser.parse_args = parser.parse_intermixed_args


def cli(args: argparse.Namespace) -> int:
    logs.configure()
    # a stop mid-way closes the reopened run with its own status (tracking.stage_run)
    stopping.exit_on_sigterm()
    weights_dir, overrides = args.weights_dir, list(args.overrides)
    # argparse can't tell `export.x=1` from a path on its own
    if weights_dir and "=" in weights_dir:
        overrides.insert(0, weights_dir)
        weights_dir = None
    try:
        result = main(
            weights_dir,
            run_id=args.run_id,
            overrides=overrides,
            output_dir=args.output,
            tracking_uri=args.tracking_uri,
            register=not args.no_register,
            trusted=args.trust,
        )
    except (
        WeightsError,
        ConfigError,
        DataError,
        tracking.TrackingError,
        onnx_export.ExportError,
        run_dir_owner.RunDirBusy,
    ) as exc:
        one_line = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"pipeline export: error: {one_line}", file=sys.stderr)
        return 2
    if not result.passed:
        failures = "; ".join(f"{k}: {v}" for k, v in result.report["failures"].items())
        print(
            f"pipeline export: gate failed, nothing registered: {failures}. Report: {result.report_path}",
            file=sys.stderr,
        )
        return 1
    where = (
        f"registered {result.registered_model_name} v{result.model_version} @{result.report.get('alias')}"
        if result.model_version
        else "not registered"
    )
    decision = result.report.get("promotion")
    if decision:
        where += f" ({'promoted' if decision['promote'] else 'not promoted'}: {decision['reason']})"
    print(
        f"{result.onnx_path} ({result.report['exporter']['used']} exporter, opset "
        f"{result.report['exporter']['opset']}): every gate passed; {where}. Report: {result.report_path}"
    )
    return 0
