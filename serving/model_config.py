"""A Triton `config.pbtxt` beside a repository model (DIR/NAME/config.pbtxt): what this server takes
from it.

Read: `max_batch_size` (N > 0: the operator says the model's rows are independent along the first
axis and caps a batch at N; 0: every request runs alone, exactly as sent), `version_policy` (which
of its version directories are loaded: `latest { num_versions: N }`, `all {}`, `specific { versions:
[V, ...] }`; none given: the server's --version-policy), each input's `dims` (with max_batch_size >
0 the batch axis before them: the shapes requests may send, which may be narrower than the model
file's, never wider), and each output's `label_filename` (one class name a line, beside the config:
the labels of the classification extension), and of `dynamic_batching` its
`max_queue_delay_microseconds` (how long a partial batch of this model waits for more rows, over
--max-delay-ms) and `default_queue_policy { max_queue_size }` (the most rows its queue holds, under
--max-queue-rows: a request past it is a 503; Triton counts requests, this server rows). An input
with a `reshape` keeps the file's shape (the request's shape is the model's here). The rest of
Triton's ModelConfig (instance groups, dynamic batching, warm-up, ...) is allowed and not used; a
top-level name that is not one of ModelConfig's, a value of the wrong kind, or broken text is
refused, naming the file, line and column.

The text format is parsed with protobuf's own tokenizer into plain values (no message classes:
Triton's model_config.proto is not shipped with this server); only the fields read here are given
types.
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


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a repository model are loaded (Triton's ModelVersionPolicy): the `count`
    highest (latest), every one (all), or those listed that exist (specific)."""

    # latest | all | specific
    kind: str
    count: int = 1
    versions: tuple[str, ...] = ()

    def select(self, available: list[str]) -> list[str]:
        ordered = sorted(available, key=int)
        if self.kind == "all":
            return ordered
        if self.kind == "latest":
            return ordered[-self.count :]
        return [v for v in ordered if v in self.versions]

    def __str__(self) -> str:
        return {"all": "all", "latest": f"latest:{self.count}"}.get(
            self.kind, f"specific:{','.join(self.versions)}"
        )


class ConfigError(ValueError):
    """A config.pbtxt that cannot be read as Triton's ModelConfig text, or that says something
    impossible."""


@dataclass(frozen=True)
class ModelConfig:
    """What a config.pbtxt says that this server uses."""

    path: str
    # None: not given (Triton's default, 0)
    max_batch_size: int | None
    # None: not given (the server's --version-policy decides)
    version_policy: VersionPolicy | None = None
    # (input name, the full shape requests may send: [-1] + dims when max_batch_size > 0, else dims)
    input_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # dynamic_batching's max_queue_delay_microseconds and default_queue_policy.max_queue_size (None:
    # not given; a queue size of 0: no bound of its own)
    max_queue_delay_us: int | None = None
    max_queue_size: int | None = None
    # (output name, its class names)
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def output_labels(self) -> dict[str, tuple[str, ...]]:
        return dict(self.labels)


def read(model_dir: Path) -> ModelConfig | None:
    """The model directory's config.pbtxt, or None when it has none. ConfigError names what is
    wrong."""
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
    policy = _version_policy(fields, path)
    inputs = []
    for entry in fields.get("input", []):
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: every input must be a message {{ name: ... dims: [...] }}")
        input_name = _scalar(entry, "name", str, path)
        dims = entry.get("dims")
        # (an optional input is one the model file gives a default: onnxruntime does not list it as
        # an input)
        optional = entry.get("optional") == ["true"]
        if input_name is None or dims is None or "reshape" in entry or optional:
            continue
        if not all(type(d) is int and d >= -1 for d in dims):
            raise ConfigError(
                f"{path}: input {input_name!r}: dims must be sizes or -1 (any), got {dims!r:.80}"
            )
        inputs.append((input_name, tuple(([-1] if batch else []) + dims)))
    labels = []
    for output in fields.get("output", []):
        if not isinstance(output, dict):
            raise ConfigError(f"{path}: every output must be a message {{ name: ... }}")
        output_name = _scalar(output, "name", str, path)
        label_file = _scalar(output, "label_filename", str, path)
        if label_file is not None:
            labels.append((output_name or "", _labels(Path(model_dir), label_file, path)))
    delay, queue = _dynamic_batching(fields, path)
    return ModelConfig(
        str(path),
        batch,
        policy,
        tuple(inputs),
        delay,
        queue if queue else None,
        tuple(labels),
    )


def _message_of(fields: dict, name: str, path: Path) -> dict | None:
    """The field's one nested message, or None when absent."""
    values = fields.get(name)
    if values is None:
        return None
    if len(values) != 1 or not isinstance(values[0], dict):
        raise ConfigError(f"{path}: {name} must be one message {{ ... }}, got {values!r:.80}")
    return values[0]


def _dynamic_batching(fields: dict, path: Path) -> tuple[int | None, int | None]:
    """dynamic_batching's max_queue_delay_microseconds and default_queue_policy.max_queue_size."""
    batching = _message_of(fields, "dynamic_batching", path)
    if batching is None:
        return None, None
    delay = _scalar(batching, "max_queue_delay_microseconds", int, path)
    policy = _message_of(batching, "default_queue_policy", path)
    queue = _scalar(policy, "max_queue_size", int, path) if policy is not None else None
    for name, value in (("max_queue_delay_microseconds", delay), ("max_queue_size", queue)):
        if value is not None and not 0 <= value < 1 << 63:
            raise ConfigError(f"{path}: dynamic_batching {name} must be 0 or more, got {value}")
    return delay, queue


def narrowed(
    path: str, name: str, graph: tuple[int, ...] | None, declared: tuple[int, ...]
) -> tuple[int, ...]:
    """The shape input `name` takes: the model file's (`graph`; None when it gives no rank) narrowed
    by the config's `declared` (an axis either gives a size for is that size). ConfigError where
    they disagree: another rank, or two different sizes for one axis (the config may narrow what the
    model takes, never widen it)."""
    if graph is None:
        return declared
    fits = len(graph) == len(declared) and all(
        g == d or -1 in (g, d) for g, d in zip(graph, declared)
    )
    if not fits:
        raise ConfigError(
            f"{path}: input {name!r} is [{','.join(map(str, declared))}] there (the batch axis "
            f"first when max_batch_size > 0), but the model takes [{','.join(map(str, graph))}]; "
            "the config may only narrow the model's shape (a size where the model has -1)"
        )
    return tuple(d if g == -1 else g for g, d in zip(graph, declared))


POLICY_FORMS = "version_policy: { latest { num_versions: N } }, { all { } } or { specific { versions: [V, ...] } }"


def _version_policy(fields: dict, path: Path) -> VersionPolicy | None:
    """The config's version_policy: exactly one of latest (N >= 1), all, specific (versions >=
    0)."""
    values = fields.get("version_policy")
    if values is None:
        return None
    if len(values) != 1 or not isinstance(values[0], dict) or len(values[0]) != 1:
        raise ConfigError(
            f"{path}: version_policy must be one of {POLICY_FORMS}; got {values!r:.80}"
        )
    ((kind, inner),) = values[0].items()
    if (
        kind not in ("latest", "all", "specific")
        or len(inner) != 1
        or not isinstance(inner[0], dict)
    ):
        raise ConfigError(f"{path}: version_policy must be one of {POLICY_FORMS}; got {kind!r}")
    body = inner[0]
    allowed = {"latest": {"num_versions"}, "all": set(), "specific": {"versions"}}[kind]
    if set(body) - allowed:
        raise ConfigError(
            f"{path}: version_policy {kind} has no field {sorted(set(body) - allowed)[0]!r}; "
            f"use {POLICY_FORMS}"
        )
    if kind == "all":
        return VersionPolicy("all")
    if kind == "latest":
        count = _scalar(body, "num_versions", int, path)
        if count is None or count < 1:
            raise ConfigError(
                f"{path}: version_policy latest needs num_versions of 1 or more, got {count}"
            )
        return VersionPolicy("latest", count)
    versions = body.get("versions", [])
    if not versions or not all(type(v) is int and v >= 0 for v in versions):
        raise ConfigError(
            f"{path}: version_policy specific needs versions: [V, ...], whole numbers of 0 or "
            f"more; got {versions!r:.80}"
        )
    return VersionPolicy("specific", versions=tuple(str(v) for v in versions))


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
    """Protobuf text format -> {field: [values]}: a value is an int, float, string, identifier (str
    of an enum or bool), or a nested message as such a dict. ParseError (with line and column) for
    what is not that format."""
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
