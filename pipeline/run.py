"""`pipeline run`: every stage in order for one config, the server last if asked.

    train -> consolidate -> export (gates, registry alias) -> [serve + a sample request]

A stage whose result is already there for this run (same `train.run_name`) is skipped unless
`--force`: a finished training, weights consolidated from its newest checkpoint, an export of
those exact weights that passed its gates. Each stage leaves its tag on the MLflow run, and the
run's description (the note the MLflow UI shows) links the stages' outputs together.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline import checkpoint, tracking
from pipeline.checkpoint import object_store
from pipeline.checkpoint import run_dir as run_dir_owner
from pipeline.components.build import component_references, preflight
from pipeline.config import Config, ConfigError, check_runtime, load_config, to_yaml

# raised here, defined with the others
from pipeline.errors import ServeCheckError  # noqa: F401
from pipeline.tools import logs, stopping
from pipeline.tools.files import StateFileError, read_json, write_atomically
from serving.codec import V2_DTYPES

log = logging.getLogger("pipeline.run")


def main(
    cfg: Config,
    nproc_per_node: int = 0,
    serve: bool = False,
    serve_check: bool = False,
    force: bool = False,
) -> int:
    from pipeline import consolidate, export, train

    # checked an s3:// URL at load; this stage's outputs are local files
    if object_store.is_url(cfg.train.output_dir):
        raise ConfigError(
            f"pipeline run keeps every stage's outputs in one local run directory, and "
            f"train.output_dir={cfg.train.output_dir} is an object store: run the stages one by one "
            "(pipeline train ..., then pipeline consolidate --run-id <run> and pipeline export "
            "--run-id <run>), or give pipeline run a local train.output_dir"
        )
    cfg.train.run_name = cfg.train.run_name or train.default_run_name(cfg)
    run_dir = Path(cfg.train.output_dir) / cfg.train.run_name
    # Fail in seconds, before any stage and before anything is written: a bad component (checked on
    # real samples), a taken port, a store that can't be reached.
    preflight(cfg.data, cfg.task, cfg.model, cfg.train, cfg.export)
    if (serve or serve_check) and cfg.serve.port:
        check_port_free(cfg.serve.host, cfg.serve.port)
    # this process owns the run directory through every stage
    run_dir_owner.claim(run_dir)
    tracking.setup(cfg.tracking)
    # left RUNNING by a process that died (SIGKILL, a rank 0 under torchrun)?
    if train.read_run_id(run_dir):
        tracking.close_if_orphaned(train.read_run_id(run_dir))

    if force or not train_done(run_dir):
        code = run_train(cfg, run_dir, nproc_per_node, force)
        if code:
            # Exit 2: a rank met bad input and said so in one line; nothing to add to it.
            if code != 2:
                log.error("train failed (exit %d); see its log above", code)
            return code
    else:
        log.info("train: already done for %s (--force to redo)", run_dir)
    run_id = train.read_run_id(run_dir)

    weights = run_dir / "consolidated" / "model.safetensors"
    if force or not consolidated_from_chosen(run_dir):
        # the best checkpoint
        weights = consolidate.main(run_dir, tracking_uri=cfg.tracking.tracking_uri)
    else:
        log.info(
            "consolidate: %s is already from the run's best checkpoint (--force to redo)", weights
        )

    report = passed_export(run_dir, weights, cfg.export)
    if force or report is None:
        # The components the user's own config names are trusted when model.json names them back.
        result = export.main(
            weights.parent,
            export_cfg=cfg.export,
            tracking_uri=cfg.tracking.tracking_uri,
            trusted=component_references(cfg.model, cfg.data, cfg.task),
        )
        if not result.passed:
            log.error(
                "export gates failed: %s; see %s",
                "; ".join(
                    f"{gate}: {result.report['gates'].get(gate, {}).get('message', '')}"
                    for gate in result.failed
                ),
                result.report_path,
            )
            return 1
        report = result.report
    else:
        log.info(
            "export: version %s of %s already passed its gates for these weights (--force to redo)",
            report["model_version"],
            report["registered_model_name"],
        )

    decision = report.get("promotion") or {}
    if decision and not decision["promote"]:
        log.warning(
            "not promoted: %s; %s v%s is @%s, @%s stays at v%s",
            decision["reason"],
            report["registered_model_name"],
            report["model_version"],
            report["alias"],
            decision["alias"],
            (decision.get("champion") or {}).get("version"),
        )
    model_uri = f"models:/{report['registered_model_name']}@{report['alias']}"
    write_run_note(run_id, run_dir, weights, report, model_uri)
    log.info("done: %s -> %s (MLflow run %s)", run_dir, model_uri, run_id)
    below = (report["gates"].get("baseline") or {}).get("below_baseline")
    # registered only because export.allow_below_baseline said so
    if below:
        log.warning(
            "%s is below the baseline: %s", model_uri, report["gates"]["baseline"]["message"]
        )
    if serve or serve_check:
        code = serve_with_sample(cfg, model_uri, weights.parent, keep_serving=not serve_check)
        if serve_check and below:
            log.error(
                "--serve-check: the server answers, but %s failed its baseline gate (see above)",
                model_uri,
            )
            return code or 1
        return code
    return 0


# --- what is done already --------------------------------------------------------------------


def train_done(run_dir: Path) -> bool:
    from pipeline.train import read_run_id

    run_id = read_run_id(run_dir)
    if run_id is None or checkpoint.latest(run_dir / "checkpoints") is None:
        return False
    return tracking.stage_state(run_id, "train") == "done"


def consolidated_from_chosen(run_dir: Path) -> bool:
    """Whether consolidated/ holds the checkpoint consolidate would take now: the best (or
    newest)."""
    from pipeline.consolidate import resolve_checkpoint

    meta_file = run_dir / "consolidated" / "model.json"
    if not meta_file.is_file() or checkpoint.latest(run_dir / "checkpoints") is None:
        return False
    source = read_json(meta_file, "consolidate again with --force").get("source", {})
    return Path(source.get("checkpoint", "")) == resolve_checkpoint(run_dir).resolve()


def passed_export(run_dir: Path, weights: Path, export_cfg) -> dict | None:
    """The export report, if it passed for exactly these weights and export settings, and the
    registry alias still points at the version it registered."""
    report_file = run_dir / "onnx" / "export_report.json"
    meta_file = weights.parent / "model.json"
    if not report_file.is_file() or not meta_file.is_file():
        return None
    report = read_json(report_file, "export again with --force")
    same_weights = report.get("weights", {}).get("sha256") == read_json(meta_file).get("sha256")
    wanted = export_cfg.model_dump(mode="json")
    # empty name = the default, resolved in the report
    same_settings = all(
        report.get("export_config", {}).get(k) == v
        for k, v in wanted.items()
        if k != "registered_model_name" or v
    )
    if not (
        report.get("passed") and report.get("model_version") and same_weights and same_settings
    ):
        return None
    return (
        report
        if tracking.alias_version(report["registered_model_name"], report["alias"])
        == str(report["model_version"])
        else None
    )


# --- stages ------------------------------------------------------------------------------------


def run_train(cfg: Config, run_dir: Path, nproc_per_node: int, force: bool) -> int:
    """Under torchrun when asked for processes, else in this process. The resolved config is
    written once and handed to every rank, so all of them train exactly what was resolved here.

    An interrupted training of this run continues from its newest checkpoint; with --force the old
    run directory is set aside (renamed, nothing deleted) and training starts over.
    """
    import torch

    from pipeline import train

    if force and run_dir.exists():
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        log.info("--force: the previous %s is kept as %s", run_dir, aside)
    resume = "latest" if checkpoint.latest(run_dir / "checkpoints") else None
    if resume:
        log.info("train: continuing %s from its newest checkpoint", run_dir)
    if not nproc_per_node:
        train.main(cfg, resume=resume)
        return 0
    check_runtime(cfg, nproc_per_node, torch.cuda.is_available(), nproc_per_node)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "requested_config.yaml"
    write_atomically(resolved, to_yaml(cfg))
    argv = train.torchrun_arguments(nproc_per_node, 0, str(resolved), resume, [])
    return train.run_torchrun(argv, cfg, run_dir)


def write_run_note(
    run_id: str | None, run_dir: Path, weights: Path, report: dict, model_uri: str
) -> None:
    """The run's description in the MLflow UI: each stage's outcome and where its output is."""
    if not run_id:
        return
    sha = report.get("weights", {}).get("sha256", "")
    note = "\n".join(
        [
            "**trainserve pipeline**",
            "",
            f"- train: done, checkpoints in `{run_dir.resolve() / 'checkpoints'}` (artifacts: `checkpoints/`)",
            f"- consolidate: `{weights.resolve()}` sha256 `{sha[:16]}…` (artifacts: `consolidated/`)",
            f"- export: gates passed ({report['exporter']['used']} exporter, opset {report['exporter']['opset']}); "
            f"registered **{report['registered_model_name']}** version {report['model_version']} as "
            f"`@{report['alias']}` (the logged model `model`; report in artifacts `onnx/`)",
            *(
                [
                    f"- promotion: {'promoted' if report['promotion']['promote'] else 'not promoted'}: "
                    f"{tracking.markdown_escaped(report['promotion']['reason'])}"
                ]
                if report.get("promotion")
                else []
            ),
            f"- serve: `pipeline serve --model {model_uri}`; verify: `pipeline verify {model_uri}`",
        ]
    )
    tracking.set_tags({"mlflow.note.content": note}, run_id=run_id)
    tracking.mark_stage("pipeline", "done", run_id)


def serve_with_sample(cfg: Config, model_uri: str, weights_dir: Path, keep_serving: bool) -> int:
    """Starts the server and proves it with a real validation sample: the served answer must equal
    the PyTorch model's on the same inputs. Then serves (or stops)."""
    s = cfg.serve
    port = s.port or tracking.free_port()
    cmd = [
        sys.executable,
        "-m",
        "serving",
        "--model",
        model_uri,
        "--host",
        s.host,
        "--port",
        str(port),
        "--device",
        s.device,
        "--max-batch-size",
        str(s.max_batch_size),
        "--max-delay-ms",
        str(s.max_delay_ms),
    ]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking.resolve_tracking_uri(cfg.tracking.tracking_uri),
    }
    server = subprocess.Popen(cmd, env=env)
    try:
        base = f"http://{'127.0.0.1' if s.host in ('0.0.0.0', '::') else s.host}:{port}"
        sample = ServeSample.prepare(
            cfg.data,
            cfg.task,
            cfg.export,
            weights_dir,
            component_references(cfg.model, cfg.data, cfg.task),
        )
        wait_ready(base, server)
        # a registry model is served under its registered name
        name = model_uri.split("/")[1].split("@")[0]
        matches = sample.check(base, name)
        if not keep_serving:
            return 0 if matches else 1
        log.info("serving %s at %s (Ctrl-C to stop)", model_uri, base)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=60)


class ServeSample:
    """One real validation sample, and what the PyTorch model answers for it."""

    def __init__(self, feeds, target, expected, task, atol: float, rtol: float):
        self.feeds, self.target, self.expected, self.task = feeds, target, expected, task
        self.atol, self.rtol = atol, rtol

    @classmethod
    def prepare(
        cls, data_cfg, task_cfg, export_cfg, weights_dir: Path, trusted: list[str]
    ) -> "ServeSample":
        """The first validation sample, and the PyTorch model's answer (rebuilt from model.json,
        whose components are imported when they are the config's own or otherwise trusted)."""
        from pipeline.artifact import gates
        from pipeline.artifact.rebuild import rebuild
        from pipeline.artifact.weights import read_weights
        from pipeline.components.data import first_batch

        ref = rebuild(read_weights(weights_dir), trusted, data_cfg, task_cfg)
        inputs, target = first_batch(ref.splits.val, 1)
        feeds = gates.feeds_of(inputs)
        return cls(
            feeds,
            target,
            gates.run_torch(ref.head, feeds),
            ref.task,
            export_cfg.atol,
            export_cfg.rtol,
        )

    def check(self, base: str, name: str) -> bool:
        """One Open Inference Protocol request with every named input; prints what came back."""
        import numpy as np
        import requests

        from pipeline.artifact import gates

        body = {
            "inputs": [
                {
                    "name": n,
                    "shape": list(a.shape),
                    "datatype": V2_DATATYPES[a.dtype],
                    "data": a.reshape(-1).tolist(),
                }
                for n, a in self.feeds.items()
            ]
        }
        response = requests.post(f"{base}/v2/models/{name}/infer", json=body, timeout=30)
        if response.status_code != 200:
            raise ServeCheckError(
                f"the sample request got HTTP {response.status_code}: "
                f"{logs.clip(response.text, 500)}"
            )
        answer = {
            o["name"]: np.asarray(o["data"], dtype=self.expected[o["name"]].dtype).reshape(
                o["shape"]
            )
            for o in response.json()["outputs"]
        }
        parity = gates.compare(
            answer,
            self.expected,
            self.atol,
            self.rtol,
            derived=self.task.derived,
            decision=self.task.decision,
        )
        print(
            f"sample request: {self.task.describe(answer, self.target)}\n"
            f"  the server's answer {'equals' if parity['passed'] else 'DIFFERS FROM'} the PyTorch model's "
            f"({parity['message']})\n  POST {base}/v2/models/{name}/infer",
            flush=True,
        )
        return parity["passed"]


# numpy dtype -> KServe V2 datatype
V2_DATATYPES = {np.dtype(t): name for name, t in V2_DTYPES.items()}


def check_port_free(host: str, port: int) -> None:
    """The server would find its port taken only after training, exporting and registering."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServeCheckError(
                f"serve.port={port} on {host} is taken ({exc.strerror}); choose another with "
                "serve.port=<port>, or serve.port=0 for any free one"
            ) from None


def wait_ready(base: str, server: subprocess.Popen, timeout: float = 120) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServeCheckError(
                f"the server exited with code {server.returncode} before it was ready"
            )
        try:
            if requests.get(f"{base}/v2/health/ready", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise ServeCheckError(f"the server at {base} was not ready after {timeout:.0f} s")


# --- CLI -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (configs/*.yaml)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=0, help="train under torchrun with N processes"
    )
    serve = parser.add_mutually_exclusive_group()
    serve.add_argument(
        "--serve",
        action="store_true",
        help="then serve the registered alias, prove it with a sample request, keep serving",
    )
    serve.add_argument(
        "--serve-check",
        action="store_true",
        help="then serve, send the sample request, stop; exit 0 only if the served answer equals "
        "the PyTorch model's",
    )
    parser.add_argument(
        "--force", action="store_true", help="redo stages already done for this run"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.epochs=3"
    )


def cli(args) -> int:
    from pipeline.artifact.onnx_export import ExportError
    from pipeline.components.data import DataError
    from pipeline.consolidate import ConsolidateError
    from pipeline.export import WeightsError

    logs.configure()
    # SIGTERM (docker stop, a scheduler) exits through every stage's failure path: runs are closed,
    # the server is stopped, the run directory released.
    previous = stopping.exit_on_sigterm()
    try:
        cfg = load_config(args.config, args.overrides)
        return main(cfg, args.nproc_per_node, args.serve, args.serve_check, args.force)
    except (
        ConfigError,
        DataError,
        checkpoint.CheckpointError,
        tracking.TrackingError,
        ConsolidateError,
        WeightsError,
        ExportError,
        ServeCheckError,
        run_dir_owner.RunDirBusy,
        StateFileError,
    ) as exc:
        print(f"pipeline run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
