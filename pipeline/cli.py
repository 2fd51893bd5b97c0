"""`pipeline <stage> ...`: one subcommand per stage.

Each stage module exposes `add_arguments(parser)` and `cli(args) -> int`; its `main(...)` holds
the stage itself. Modules are imported only for the subcommand asked for, so `pipeline serve`
never pays for torch and `pipeline --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

STAGES = {
    "train": (
        "pipeline.train",
        "train a model under torchrun (DDP or FSDP, AMP), tracked in MLflow",
    ),
    "consolidate": ("pipeline.consolidate", "sharded DCP checkpoint -> one model.safetensors"),
    "export": (
        "pipeline.export",
        "model.safetensors -> model.onnx behind parity and accuracy gates; register it",
    ),
    "serve": (
        "pipeline.serve",
        "serve an ONNX model over HTTP with onnxruntime (delegates to `python -m serving`)",
    ),
    "run": (
        "pipeline.run",
        "every stage in order for one config: train, consolidate, export, [serve]",
    ),
    "verify": (
        "pipeline.verify",
        "re-prove a registered model's chain: registry, ONNX, weights, checkpoint, gates, server",
    ),
    "promote": (
        "pipeline.promote",
        "move @champion to the @challenger a server's shadow comparison says to promote",
    ),
    "trace": (
        "pipeline.trace",
        "walk a logged request (its request id) back to the model version, run and data",
    ),
    "ui": ("pipeline.ui", "the MLflow UI over the store the stages write to"),
    "data": (
        "pipeline.data_cli",
        "write a config's data as Parquet shards with a manifest, to train from as a stream",
    ),
    "config": ("pipeline.config_cli", "print the resolved config, or every field with its meaning"),
}

log = logging.getLogger("pipeline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline",
        allow_abbrev=False,
        description="trainserve: train -> consolidate -> export -> serve",
    )
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    for name, (_, help_text) in STAGES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(
                f"pipeline: unknown stage '{argv[0]}'; choose from {', '.join(STAGES)}",
                file=sys.stderr,
            )
            return 2
        parser.print_help()
        return 0
    stage, rest = argv[0], argv[1:]
    module = importlib.import_module(STAGES[stage][0])
    parser = argparse.ArgumentParser(
        prog=f"pipeline {stage}", allow_abbrev=False, description=STAGES[stage][1]
    )
    module.add_arguments(parser)
    # `pipeline serve` has its own, the server's
    if "--verbose" not in parser._option_string_actions:
        parser.add_argument(
            "--verbose",
            action="store_true",
            help="let the libraries (MLflow, torch's exporter, "
            "onnxruntime) speak for themselves, and show Python warnings [env TRAINSERVE_VERBOSE=1]",
        )
    args = parser.parse_intermixed_args(rest)
    from serving.console import set_verbose

    # before the stage sets up logging; its child processes inherit it
    set_verbose(args.verbose)
    return module.cli(args) or 0


if __name__ == "__main__":
    sys.exit(main())
