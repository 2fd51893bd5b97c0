"""`pipeline config`: the resolved config of a file plus overrides, or every field explained."""

from __future__ import annotations

import argparse
import sys

from pipeline.config import ConfigError, describe, load_config, to_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config to resolve")
    parser.add_argument("--describe", action="store_true", help="list every field, its default and meaning")
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def cli(args) -> int:
    if args.describe:
        print(describe())
        return 0
    try:
        print(to_yaml(load_config(args.config, args.overrides)), end="")
    except ConfigError as exc:
        print(f"pipeline config: error: {exc}", file=sys.stderr)
        return 2
    return 0
