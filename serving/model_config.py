"""A Triton `config.pbtxt` beside a repository model (DIR/NAME/config.pbtxt): what this server takes from it.

Read: `max_batch_size` (N > 0: the operator says the model's rows are independent along the first axis and
caps a batch at N; 0: every request runs alone, exactly as sent), and each output's `label_filename` (one class
name a line, beside the config: the labels of the classification extension). The rest of Triton's ModelConfig
(instance groups, dynamic batching, warm-up, ...) is allowed and not used; a top-level name that is not one of
ModelConfig's, a value of the wrong kind, or broken text is refused, naming the file, line and column.

The text format is parsed with protobuf's own tokenizer into plain values (no message classes: Triton's
model_config.proto is not shipped with this server); only the fields read here are given types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

FILE = "config.pbtxt"
MAX_LABELS_BYTES = 16 << 20
# Triton's ModelConfig fields (model_config.proto): any of them may appear; no other.
FIELDS = (
    "name",
    "platform",
    "backend",
    "runtime",
    "version_policy",
    "max_batch_size",
    "input",
    "output",
    "batch_input",
    "batch_output",
    "optimization",
    "dynamic_batching",
    "sequence_batching",
    "ensemble_scheduling",
    "instance_group",
    "default_model_filename",
    "cc_model_filenames",
    "metric_tags",
    "parameters",
    "model_warmup",
    "model_operations",
    "model_transaction_policy",
    "model_repository_agents",
    "response_cache",
    "model_metrics",
)
_INTEGER = re.compile(r"-?(0[xX][0-9a-fA-F]+|[0-9]+)")
_FLOAT = re.compile(
    r"-?([0-9]+\.?[0-9]*([eE][-+]?[0-9]+)?|\.[0-9]+([eE][-+]?[0-9]+)?)[fF]?|-?inf|nan"
)


class ConfigError(ValueError):
    """A config.pbtxt that cannot be read as Triton's ModelConfig text, or that says something impossible."""


@dataclass(frozen=True)
class ModelConfig:
    """What a config.pbtxt says that this server uses."""

    path: str
    max_batch_size: int | None  # None: not given (Triton's default, 0)
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (output name, its class names)

    def output_labels(self) -> dict[str, tuple[str, ...]]:
        return dict(self.labels)


def read(model_dir: Path) -> ModelConfig | None:
    """The model directory's config.pbtxt, or None when it has none. ConfigError names what is wrong."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text: {exc}") from None
    try:
        fields = parse(text)
    except text_format.ParseError as exc:
        raise ConfigError(f"{path}:{exc}") from None
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        raise ConfigError(
            f"{path}: {unknown[0]!r} is not a field of Triton's ModelConfig; its fields: "
            f"{', '.join(FIELDS)}"
        )
    name = _scalar(fields, "name", str, path)
    if name is not None and name != Path(model_dir).name:
        raise ConfigError(
            f"{path}: name {name!r} is not the model's directory name {Path(model_dir).name!r}"
        )
    batch = _scalar(fields, "max_batch_size", int, path)
    if batch is not None and not 0 <= batch < 1 << 31:
        raise ConfigError(f"{path}: max_batch_size must be 0 or a positive count, got {batch}")
    labels = []
    for output in fields.get("output", []):
        if not isinstance(output, dict):
            raise ConfigError(f"{path}: every output must be a message {{ name: ... }}")
        output_name = _scalar(output, "name", str, path)
        label_file = _scalar(output, "label_filename", str, path)
        if label_file is not None:
            labels.append((output_name or "", _labels(Path(model_dir), label_file, path)))
    return ModelConfig(str(path), batch, tuple(labels))


def _labels(model_dir: Path, name: str, config: Path) -> tuple[str, ...]:
    """The class names of a label file beside the config, one a line (Triton's label_filename)."""
    path = model_dir / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(model_dir.resolve()):
        raise ConfigError(f"{config}: label_filename {name!r} must name a file beside it")
    try:
        if path.stat().st_size > MAX_LABELS_BYTES:
            raise ConfigError(f"{path}: a label file of more than {MAX_LABELS_BYTES} bytes")
        return tuple(path.read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config}: label_filename {name!r} cannot be read: {exc}") from None


def _scalar(fields: dict, name: str, kind: type, path: Path):
    """The field's one value, of `kind`, or None when absent."""
    values = fields.get(name)
    if values is None:
        return None
    if len(values) != 1 or isinstance(values[0], (dict, list)) or type(values[0]) is not kind:
        want = "a whole number" if kind is int else "a quoted string"
        raise ConfigError(f"{path}: {name} must be {want}, once; got {values!r:.80}")
    return values[0]


def parse(text: str) -> dict[str, list]:
    """Protobuf text format -> {field: [values]}: a value is an int, float, string, identifier (str of an enum or
    bool), or a nested message as such a dict. ParseError (with line and column) for what is not that format."""
    tokenizer = text_format.Tokenizer(text.splitlines())
    fields = _message(tokenizer, None)
    if not tokenizer.AtEnd():
        raise tokenizer.ParseError(f"unexpected {tokenizer.token!r}")
    return fields


def _message(tokenizer, end: str | None) -> dict[str, list]:
    fields: dict[str, list] = {}
    while not tokenizer.AtEnd() and not (end and tokenizer.LookingAt(end)):
        name = tokenizer.ConsumeIdentifier()
        colon = tokenizer.TryConsume(":")
        values = fields.setdefault(name, [])
        if tokenizer.TryConsume("["):
            while not tokenizer.TryConsume("]"):
                values.append(_value(tokenizer))
                if not tokenizer.LookingAt("]"):
                    tokenizer.Consume(",")
        elif colon or tokenizer.LookingAt("{") or tokenizer.LookingAt("<"):
            values.append(_value(tokenizer))
        else:
            raise tokenizer.ParseError(f"expected ':' or '{{' after {name!r}")
        if not tokenizer.TryConsume(","):
            tokenizer.TryConsume(";")
    if end is None and not tokenizer.AtEnd():
        raise tokenizer.ParseError(f"unexpected {tokenizer.token!r}")
    return fields


def _value(tokenizer):
    for opening, closing in (("{", "}"), ("<", ">")):
        if tokenizer.TryConsume(opening):
            inner = _message(tokenizer, closing)
            tokenizer.Consume(closing)
            return inner
    token = tokenizer.token
    if token[:1] in ("'", '"'):
        return tokenizer.ConsumeString()
    if _INTEGER.fullmatch(token):
        tokenizer.NextToken()
        return int(token, 16 if "x" in token.lower() else 10)
    if _FLOAT.fullmatch(token.lower()):
        tokenizer.NextToken()
        return float(token.lower().rstrip("f"))
    return tokenizer.ConsumeIdentifier()
