"""`pipeline config`: the resolved config of a file plus overrides, or every field explained."""

from __future__ import annotations

import argparse
import re
import sys

from pydantic import BaseModel

from pipeline.config import Config, ConfigError, describe, load_config, to_yaml

MARKDOWN_COMMAND = ".venv/bin/pipeline config --describe --markdown > docs/config.md"
MARKDOWN_INTRO = f"""\
<!-- Generated from the config's code by `{MARKDOWN_COMMAND}`; do not edit by hand. -->
# Configuration

A typed tree with defaults in code; YAML files in `configs/` (`digits_resnet18.yaml` is the
embedded demo, `fashion_mnist_resnet18.yaml` the classic multi-GPU example); precedence is
**command line `key=value` > YAML file > defaults**. Unknown keys and wrong types are refused;
rules across fields (fp16 needs CUDA; the global batch must divide by world size × accumulation
steps) are checked before anything starts. The resolved config is saved with every run
(`config/resolved.yaml` in MLflow, `outputs/<run>/config.yaml`) and inside every checkpoint.
`pipeline config --describe` prints the fields below as plain text, `pipeline config --config C [k=v ...]`
the resolved config of a file.

**How an override combines with the file.** The value after `=` is read as YAML. A dotted key sets that
one key and keeps the rest of its section: `data.args.root=DIR` changes `root` and keeps the file's other
`data.args` (the digits config's `val_fraction`, say). A mapping or a list as the value replaces the
file's whole mapping or list: `"data.args={{root: DIR}}"` (quoted for the shell) leaves only `root`.
`data.name=X` and `data.component=X` (and `model.*`) replace each other, not the args: a component of
another kind takes its args as a mapping, e.g. `data.name=sharded "data.args={{root: DIR}}"`.

The built-in data sets and models, and the contract your own components follow: [own-model.md](own-model.md).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config to resolve")
    parser.add_argument(
        "--describe", action="store_true", help="list every field, its default and meaning"
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help=f"with --describe: as the Markdown page docs/config.md ({MARKDOWN_COMMAND})",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def markdown() -> str:
    """Every field as `describe()` lists it, one table per section: the page docs/config.md."""
    sections: list[str] = []

    def cell(text: str) -> str:
        # A table cell: `|` would end it; `<name>` would be read as an HTML tag and `*` as emphasis.
        return re.sub(r"<(?=[A-Za-z/])", r"\\<", text.replace("|", r"\|").replace("*", r"\*"))

    def code(value: object) -> str:
        # in a code span only the table's `|` needs escaping
        return "`" + repr(value).replace("|", r"\|") + "`"

    def walk(cls: type[BaseModel], prefix: str, title: str) -> None:
        rows, nested = [], []
        for name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((ann, f"{prefix}{name}", field.description))
            else:
                default = field.default_factory() if field.default_factory else field.default
                rows.append(f"| `{prefix}{name}` | {code(default)} | {cell(field.description)} |")
        if rows:
            sections.append(
                f"## {prefix.rstrip('.')}\n\n{title}\n\n| key | default | meaning |\n| --- | --- | --- |\n"
                + "\n".join(rows)
                + "\n"
            )
        for ann, path, description in nested:
            walk(ann, f"{path}.", description)

    walk(Config, "", "")
    return MARKDOWN_INTRO + "\n" + "\n".join(sections)


def cli(args) -> int:
    if args.markdown and not args.describe:
        print(
            f"pipeline config: error: --markdown goes with --describe ({MARKDOWN_COMMAND})",
            file=sys.stderr,
        )
        return 2
    if args.describe:
        print(markdown() if args.markdown else describe(), end="" if args.markdown else "\n")
        return 0
    try:
        print(to_yaml(load_config(args.config, args.overrides)), end="")
    except ConfigError as exc:
        print(f"pipeline config: error: {exc}", file=sys.stderr)
        return 2
    return 0
