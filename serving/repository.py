"""The models one server serves: where each comes from, which versions are loaded, loading and
unloading.

Sources (flags):
    --model URI               one model, named as before (registered name, ONNX metadata, file stem)
    --model NAME=URI          a model named NAME; NAME repeated with other URIs gives it more
                              versions: `--model digits=models:/digits@champion --model
                              digits=models:/digits@challenger` keeps the version behind every alias
                              named loaded
    --repository DIR          DIR/NAME/VERSION/model.onnx, as Triton lays a repository out; which
                              versions of each model are loaded is its config.pbtxt's
                              version_policy, else the --version-policy (latest:N, all,
                              specific:V,V); a DIR/NAME/config.pbtxt also says whether its
                              requests share runs (max_batch_size) and its outputs' class names
                              (serving/model_config.py)

Every loaded version is a `Slot`: its model and the batcher in front of it, made and dropped as one.
All slots share one engine thread (onnxruntime parallelizes inside a run; two runs at once on the
same cores only fight), and a batcher has at most one run queued on that thread at a time, so the
thread's FIFO queue takes the models' runs in turn: a flooded model gets every other run, never all
of them (benchmarks/serve.py measures a probed model's p99 with and without a flood on its
neighbour).

Loading (at start, or `POST /v2/repository/models/{name}/load`) runs off the event loop; a version
is warmed up on the engine thread, between live batches, before any request can reach it. A reload
serves the old versions until the new ones are ready. Unloading stops routing to the model, answers
what is queued, drops the sessions and hands the freed memory back to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from serving import model_config
from serving.batcher import Batcher
from serving.codec import BadRequest
from serving.console import clip
from serving.loader import (
    LoadedModel,
    ModelInfo,
    SourceError,
    alias_version,
    check_source,
)
from serving.model_config import VersionPolicy

log = logging.getLogger("serving.repository")

# A model name as it may appear in a URL and as a directory name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# a name NAME's characters make that starts with '.': a hidden directory's
HIDDEN = re.compile(r"\.[A-Za-z0-9_.-]{0,127}")
# Model states, as the V2 repository extension (and Triton) reports them.
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
# printable ASCII: safe in a response header
HEADER_SAFE = re.compile(r"[\x20-\x7e]{1,128}")


class RepositoryError(BadRequest):
    """A model a client named that this server cannot find, load or unload; `status` is the HTTP
    answer (a client's mistake like any other BadRequest: answered as one over HTTP and gRPC)."""


# ---- where models come from ---------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One `--model`, or one version directory of the repository."""

    uri: str
    # NAME= given (or the repository's directory name); else resolved when loaded
    name: str | None = None
    # a repository version directory's number
    version: str | None = None
    # a repository model's config.pbtxt
    config: model_config.ModelConfig | None = None

    @cached_property
    def alias(self) -> str | None:
        """The models:/name@alias this source follows, if it is one (read per request: parsed
        once)."""
        return self.uri if check_source(self.uri) == "alias" else None


def not_a_name(name: str) -> str:
    """Why `name` is not a model name, in Triton's words too where they apply (an empty name, a
    path)."""
    rule = "a model name is a letter or digit, then letters, digits, '_', '.', '-'; at most 128"
    if not name.strip():
        return f"Model name cannot be empty. Please enter a valid name to deploy. ({rule})"
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        return (
            f"{name[:60]!r}: model name must not contain path traversal characters ('/', or '..' "
            f"as the whole name); {rule}"
        )
    return f"{name[:60]!r} is not a model name ({rule})"


def parse_model_flag(value: str) -> Source:
    """`NAME=URI` or `URI`. A NAME= prefix is a model name before the first '=' (no '/' or ':' in
    it), so a path or URI with an '=' further on is still a plain URI."""
    head, sep, rest = value.partition("=")
    if sep and "/" not in head and ":" not in head:
        if not NAME.fullmatch(head):
            raise ValueError(
                f"--model {value!r}: {head!r} is not a model name (a letter or digit, then letters, "
                "digits, '_', '.', '-'; at most 128); give NAME=URI"
            )
        if not rest:
            raise ValueError(
                f"--model {value!r}: nothing after '='; give NAME=URI, e.g. digits=models:/digits@champion"
            )
        check_source(rest)
        return Source(rest, head)
    check_source(value)
    return Source(value)


def parse_version_policy(text: str) -> VersionPolicy:
    kind, _, arg = text.strip().partition(":")
    if kind == "all" and not arg:
        return VersionPolicy("all")
    if kind == "latest" and re.fullmatch(r"[1-9][0-9]{0,5}", arg):
        return VersionPolicy("latest", int(arg))
    if kind == "specific" and re.fullmatch(r"[0-9]{1,18}(,[0-9]{1,18})*", arg):
        return VersionPolicy("specific", versions=tuple(str(int(v)) for v in arg.split(",")))
    raise ValueError(
        f"--version-policy {text!r}: expected latest:N (the N highest versions), all, or "
        "specific:V[,V...] (those versions)"
    )


def scan_repository(directory: str | Path) -> dict[str, dict[str, Path]]:
    """{name: {version: version directory}} of DIR/NAME/VERSION/ directories holding an .onnx file.
    What is not a model name or a version number is skipped with a warning, never guessed at."""
    root = Path(directory)
    if not root.is_dir():
        raise SourceError(
            f"--repository {directory}: not a directory (expected DIR/NAME/VERSION/model.onnx)"
        )
    inside = root.resolve()
    found: dict[str, dict[str, Path]] = {}
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if not NAME.fullmatch(model_dir.name):
            log.warning(
                "repository: skipping %s: not a model name (letters, digits, '_', '.', '-')",
                model_dir,
            )
            continue
        versions = {}
        for version_dir in sorted(model_dir.iterdir()):
            if not version_dir.is_dir():
                continue
            if not re.fullmatch(r"[0-9]{1,18}", version_dir.name):
                log.warning(
                    "repository: skipping %s: a version directory is named by a number", version_dir
                )
                continue
            files = list(version_dir.rglob("*.onnx"))
            # A symlink out of the repository would serve whatever file it names: the repository is
            # what the operator vetted, so nothing outside it is loaded through it.
            outside = [
                f
                for f in [model_dir, version_dir, *files]
                if not f.resolve().is_relative_to(inside)
            ]
            if outside:
                log.warning(
                    "repository: skipping %s: %s leads outside --repository %s (a symlink); copy the model "
                    "into the repository instead",
                    version_dir,
                    outside[0],
                    directory,
                )
            elif files:
                versions[str(int(version_dir.name))] = version_dir
        if versions:
            found[model_dir.name] = versions
        else:
            log.warning(
                "repository: skipping %s: no VERSION/ directory with an .onnx file in it", model_dir
            )
    return found


# ---- what is loaded -----------------------------------------------------------------------------


@dataclass
class Slot:
    """A loaded version and the batcher in front of it. `headers`: the receipt naming this version,
    for every answer it computed."""

    model: LoadedModel
    batcher: Batcher
    source: Source
    headers: dict[str, str] = field(init=False)

    def __post_init__(self):
        self.headers = receipt_headers(self.model.info)

    @property
    def version(self) -> str:
        return self.model.info.version

    @property
    def healthy(self) -> bool:
        """The batcher's loop runs and no model run is past its deadline."""
        return self.batcher.alive and not self.batcher.stalled


def receipt_values(info: ModelInfo) -> dict[str, str]:
    return {
        "X-Model-Name": info.name,
        "X-Model-Version": info.version,
        "X-Model-Run-Id": info.lineage.get("run_id", ""),
        "X-Model-Weights-Sha256": info.lineage.get("weights_sha256", ""),
        # the file's own hash, as loaded: the weights' hash is the file's claim, this one is the
        # fact
        "X-Model-Onnx-Sha256": info.lineage.get("onnx_sha256", ""),
    }


def receipt_headers(info: ModelInfo) -> dict[str, str]:
    """X-Model-* headers naming a model; a value that is empty, or unsafe in a header, is left
    out."""
    return {k: v for k, v in receipt_values(info).items() if v and HEADER_SAFE.fullmatch(v)}


@dataclass
class Model:
    """One model name: where it comes from, its loaded versions, its state."""

    name: str
    # its --model flags; empty for a repository model
    sources: list[Source] = field(default_factory=list)
    # version -> slot
    slots: dict[str, Slot] = field(default_factory=dict)
    state: str = UNAVAILABLE
    reason: str = "not loaded"
    # alias -> the version it names, as last read
    alias_versions: dict[str, str] = field(default_factory=dict)
    # alias -> the version served for it
    alias_served: dict[str, str] = field(default_factory=dict)
    # alias -> why the version it names is not served (its load failed); cleared when the alias is
    # served again
    alias_errors: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        return (
            self.state == READY and bool(self.slots) and all(s.healthy for s in self.slots.values())
        )

    def default_slot(self) -> Slot | None:
        """The version a request naming none gets: the first --model's (the first alias named, e.g.
        @champion), else the highest version number."""
        if not self.slots:
            return None
        if self.sources:
            first = self.sources[0]
            if first.alias is not None and self.alias_served.get(first.alias) in self.slots:
                return self.slots[self.alias_served[first.alias]]
            for slot in self.slots.values():
                if slot.source == first:
                    return slot
        return max(self.slots.values(), key=lambda s: version_key(s.version))

    def behind(self, alias: str) -> bool:
        """The alias names a version not served for it (a failed or pending reload)."""
        named = self.alias_versions.get(alias)
        return named is not None and named != self.alias_served.get(alias)


def version_key(version: str) -> tuple:
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


class Repository:
    """Every model of one server, by name. Its coroutines run on the server's event loop; loads in
    threads.

    open_source(source) -> LoadedModel: blocking, opens one source (pinned at a version for an
    alias). make_batcher(model) -> Batcher: the batcher in front of a version. warm_up(model):
    awaited before a version takes requests. on_change(): called whenever what is loaded changed
    (the server updates its metrics).
    """

    def __init__(
        self,
        open_source: Callable[[Source, str | None], LoadedModel],
        make_batcher: Callable[[LoadedModel], Batcher],
        warm_up: Callable[[LoadedModel], Awaitable[None]],
        *,
        directory: str | None = None,
        policy: VersionPolicy | None = None,
        default_model: str | None = None,
    ):
        self.open_source = open_source
        self.make_batcher = make_batcher
        self.warm_up = warm_up
        self.directory = directory
        self.policy = policy or VersionPolicy("latest", 1)
        self.default_name = default_model
        self.models: dict[str, Model] = {}
        self.on_change: Callable[[], None] = lambda: None
        self._warned: set[str] = set()
        self._scan_lock = threading.Lock()
        self._last_scan: tuple[float, dict | None] = (0.0, None)

    # ---- lookups ----

    def model(self, name: str) -> Model:
        model = self.models.get(name)
        if model is None:
            raise RepositoryError(
                f"unknown model '{name[:128]}'; this server has {self.describe()}", 404
            )
        return model

    def describe(self, limit: int = 10) -> str:
        """The models, the first `limit` named: a refusal carries this, and gRPC sends it in a
        trailer that a client refuses past 8 KiB (300 names made NOT_FOUND arrive as
        RESOURCE_EXHAUSTED)."""
        names = [
            f"'{n}'" + ("" if m.state == READY else f" ({m.state.lower()})")
            for n, m in self.models.items()
        ]
        if len(names) > limit:
            return (
                ", ".join(names[:limit])
                + f" and {len(names) - limit} more (GET or POST /v2/repository/index)"
            )
        return ", ".join(names) if names else "no models"

    def slot(self, name: str, version: str | None) -> Slot:
        """`name` at `version` (None: its default version); RepositoryError 404 when it is not
        loaded."""
        model = self.model(name)
        if version is None:
            slot = model.default_slot()
            if slot is None:
                raise RepositoryError(
                    f"model '{name}' is {model.state.lower()} ({model.reason}); load it with "
                    f"POST /v2/repository/models/{name}/load",
                    404,
                )
            return slot
        slot = model.slots.get(version)
        if slot is None:
            loaded = ", ".join(sorted(model.slots, key=version_key)) or "none"
            raise RepositoryError(
                f"Request for unknown model: '{name}' has no version {version[:40]} loaded "
                f"(loaded: {loaded}); name one of those, or none for the highest",
                404,
            )
        return slot

    def default_model(self) -> Model:
        """The model /invocations serves: --default-model, else the first one."""
        name = self.default_name or next(iter(self.models), None)
        if name is None or name not in self.models:
            raise RepositoryError(
                "this server has no default model for /invocations; use /v2/models/{name}/infer",
                404,
            )
        return self.models[name]

    def slots(self):
        """(model name, slot) of every loaded version."""
        for model in list(self.models.values()):
            for slot in list(model.slots.values()):
                yield model.name, slot

    def index(self) -> list[dict]:
        """The V2 repository index: a row per loaded version, and one per model with none loaded."""
        rows = []
        for name, model in sorted(self.models.items()):
            if model.slots:
                rows += [
                    {"name": name, "version": v, "state": model.state, "reason": model.reason}
                    for v in sorted(model.slots, key=version_key)
                ]
            else:
                rows.append(
                    {"name": name, "version": "", "state": model.state, "reason": model.reason}
                )
        return rows

    # ---- what to load ----

    def add_repository_models(
        self, strict: bool = False, max_age: float = 0.0
    ) -> dict[str, dict[str, Path]]:
        """(Re)read the repository directory (blocking: call it off the loop while serving): its
        models are registered, unloaded until loaded. A directory named as a --model is an error at
        start (`strict`) and skipped later, with one warning: a stray directory must not break
        loading every other model. `max_age`: a scan at most that many seconds old will do (the
        index); loads always read it afresh."""
        if self.directory is None:
            return {}
        found = self._scan(max_age)
        for name in list(found):
            model = self.models.get(name)
            if model is not None and model.sources:
                message = (
                    f"model '{name}' is both a --model and a directory of --repository {self.directory}; "
                    "rename one"
                )
                if strict:
                    raise SourceError(message)
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("%s (the directory is skipped)", message)
                del found[name]
            else:
                self.models.setdefault(name, Model(name))
        return found

    def _scan(self, max_age: float) -> dict[str, dict[str, Path]]:
        """scan_repository, or its last result when younger than `max_age` s. One scan at a time:
        callers arriving during one wait for it and take its result (300 models: ~20 ms a scan,
        1,000 index calls made 1,000 scans and held liveness off for seconds)."""
        with self._scan_lock:
            at, found = self._last_scan
            if found is None or time.monotonic() - at > max_age:
                found = scan_repository(self.directory)
                self._last_scan = (time.monotonic(), found)
            return {name: dict(versions) for name, versions in found.items()}

    def sources_of(self, name: str) -> list[Source]:
        """What loading `name` opens: its --model sources, or its repository versions the policy
        selects."""
        model = self.models.get(name)
        if model is not None and model.sources:
            return model.sources
        found = self.add_repository_models().get(name) if self.directory else None
        if not found:
            where = f" or in --repository {self.directory}" if self.directory else ""
            # (Triton's words first: its clients look for them)
            raise RepositoryError(
                f"failed to poll from model repository: no model '{name[:128]}' among the --model "
                f"flags{where}; this server has {self.describe()}",
                404,
            )
        # The model's own config.pbtxt says which of its versions it serves; the flag is the
        # default.
        try:
            config = model_config.read(next(iter(found.values())).parent)
        except model_config.ConfigError as exc:
            raise SourceError(str(exc)) from None
        if config is not None and config.version_policy is not None:
            policy, said = config.version_policy, f"the version_policy of {config.path}"
        else:
            policy, said = self.policy, "--version-policy"
        versions = policy.select(list(found))
        if not versions:
            raise RepositoryError(
                f"model '{name}': {said} ({policy}) selects none of its versions "
                f"({', '.join(sorted(found, key=int))})"
            )
        missing = [v for v in policy.versions if v not in found]
        if missing:
            log.warning(
                "model '%s': %s names version(s) %s, which the repository does not have; loading %s",
                name,
                said,
                ", ".join(missing),
                ", ".join(versions),
            )
        return [Source(str(found[v]), name, v, config) for v in versions]

    def open_all(self, sources: list[Source]) -> list[tuple[Source, LoadedModel]]:
        """Open every source (blocking). All or nothing: on a failure those already open are
        dropped."""
        opened: list[tuple[Source, LoadedModel]] = []
        try:
            for source in sources:
                opened.append((source, self.open_source(source, None)))
        except BaseException:
            for _, loaded in opened:
                close_model(loaded)
            raise
        return opened

    def place(self, opened: list[tuple[Source, LoadedModel]]) -> list[Slot]:
        """Opened (and warmed) versions become the versions of their models, replacing what those
        served; returns the replaced slots for the caller to close. A model's versions must
        differ."""
        by_name: dict[str, list[tuple[Source, LoadedModel]]] = {}
        for source, loaded in opened:
            by_name.setdefault(loaded.info.name, []).append((source, loaded))
        for name, pairs in by_name.items():
            seen: dict[str, Source] = {}
            for source, loaded in pairs:
                other = seen.setdefault(loaded.info.version, source)
                # an alias may name a loaded version
                if other is not source and not (other.alias or source.alias):
                    raise SourceError(
                        f"model '{name}': {other.uri} and {source.uri} are both version "
                        f"{loaded.info.version}; give each version of a model its own source (a "
                        "registry version, an alias, or --repository DIR/NAME/VERSION)"
                    )
        replaced: list[Slot] = []
        for name, pairs in by_name.items():
            model = self.models.setdefault(name, Model(name))
            # --model sources: remembered, a later load reopens them
            if pairs[0][0].version is None:
                model.sources = [s for s, _ in pairs]
            replaced += model.slots.values()
            model.slots = {}
            for source, loaded in pairs:
                slot = model.slots.get(loaded.info.version)
                # an alias naming a version already loaded: one copy
                if slot is not None:
                    close_model(loaded)
                    if source.alias is None:
                        # pinned by a plain source: no alias move may drop it
                        slot.source = source
                else:
                    model.slots[loaded.info.version] = Slot(
                        loaded, self.make_batcher(loaded), source
                    )
            model.alias_versions = {s.alias: lm.info.version for s, lm in pairs if s.alias}
            model.alias_served = dict(model.alias_versions)
            model.alias_errors = {}
            model.state, model.reason = READY, ""
        return replaced

    # ---- at start (before the loop serves) ----

    def open_at_start(
        self, sources: list[Source], repository_names: list[str] | None
    ) -> list[tuple[Source, LoadedModel]]:
        """Open the --model sources and the repository models named (None: all of them), blocking,
        for `place`. Raises the first failure: the server does not start half-loaded."""
        found = self.add_repository_models(strict=True)
        names = list(found) if repository_names is None else repository_names
        unknown = [n for n in names if n not in found]
        if unknown:
            raise SourceError(
                f"--load-model {', '.join(unknown)}: not a model of --repository {self.directory} "
                f"(it has {', '.join(found) or 'none'})"
            )
        opened = self.open_all(list(sources) + [s for n in names for s in self.sources_of(n)])
        clash = sorted({lm.info.name for s, lm in opened if s.version is None} & set(found))
        if clash:
            for _, loaded in opened:
                close_model(loaded)
            raise SourceError(
                f"--model {', '.join(clash)}: also a model of --repository {self.directory}; give the "
                "--model another name with NAME=URI"
            )
        return opened

    def start(self) -> None:
        """Start the batchers not started yet (on the running loop); one whose loop died stays down,
        so that readiness keeps saying so."""
        for _, slot in self.slots():
            if not slot.batcher.started:
                slot.batcher.start()

    # ---- while serving ----

    async def load(self, name: str) -> None:
        """Load (or reload) `name`: its versions are opened off the loop and warmed up before they
        take requests; meanwhile the versions it served go on serving. RepositoryError, or the
        load's own error."""
        if HIDDEN.fullmatch(name) and name not in (".", "..") and self.directory:
            # a directory of that name would be hidden: never a model, so none is found (not refused
            # as a bad name: Triton takes such names, and finds no model)
            raise RepositoryError(
                f"failed to poll from model repository: no model {name[:128]!r} in --repository "
                f"{self.directory} (a name starting with '.' is a hidden directory, never a model); "
                f"this server has {self.describe()}",
                404,
            )
        if not NAME.fullmatch(name):
            raise RepositoryError(not_a_name(name))
        # may read the repository directory
        sources = await off_loop(self.sources_of, name)
        model = self.models[name]
        async with model.lock:
            if not model.slots:
                model.state, model.reason = LOADING, "loading"
            started = time.perf_counter()
            try:
                opened = await off_loop(self.open_all, sources)
                try:
                    others = {lm.info.name for _, lm in opened} - {name}
                    if others:
                        raise SourceError(
                            f"loading '{name}' gave a model named {', '.join(sorted(others))}"
                        )
                    for _, loaded in opened:
                        await self.warm_up(loaded)
                    replaced = self.place(opened)
                except BaseException:
                    for _, loaded in opened:
                        close_model(loaded)
                    raise
            except BaseException as exc:
                if not model.slots:
                    model.state, model.reason = UNAVAILABLE, clip(f"load failed: {exc}", 500)
                else:
                    # still serving what it served: READY, and the index says the reload failed
                    model.reason = clip(f"reload failed: {exc}", 500)
                raise
            self.start()
            log.info(
                "loaded %s version(s) %s in %.2f s",
                name,
                ", ".join(model.slots),
                time.perf_counter() - started,
            )
            # the new versions are announced now; the replaced ones drain, then leave
            self.on_change()
            await close_slots(replaced)
            if replaced:
                self.on_change()

    async def unload(self, name: str) -> None:
        """Stop serving `name`: new requests get 404, queued ones are answered, then its memory is
        freed."""
        model = self.model(name)
        async with model.lock:
            if not model.slots:
                model.state, model.reason = UNAVAILABLE, "unloaded"
                return
            model.state, model.reason = UNLOADING, "unloading"
            slots, model.slots = list(model.slots.values()), {}
            self.on_change()
            try:
                await close_slots(slots)
            finally:
                model.state, model.reason = UNAVAILABLE, "unloaded"
                model.alias_versions, model.alias_served, model.alias_errors = {}, {}, {}
                self.on_change()
        log.info("unloaded %s", name)

    async def move_alias(
        self, name: str, alias: str, version: str, loaded: LoadedModel | None
    ) -> None:
        """`alias` of `name` now names `version`: `loaded` (warmed up) joins the model's versions,
        or None when that version is already loaded for another alias. The version the alias served
        before leaves unless another alias still serves it."""
        model = self.models[name]
        async with model.lock:
            # unloaded meanwhile
            if not model.slots:
                if loaded is not None:
                    close_model(loaded)
                return
            stale = []
            if loaded is not None:
                source = next(s for s in model.sources if s.alias == alias)
                slot = Slot(loaded, self.make_batcher(loaded), source)
                slot.batcher.start()
                # loaded meanwhile for another alias: keep that one
                if version in model.slots:
                    stale.append(slot)
                else:
                    model.slots[version] = slot
            previous = model.alias_served.get(alias)
            model.alias_served[alias] = version
            caught_up(model, alias)
            # a pinned version stays
            if (
                previous is not None
                and previous != version
                and previous in model.slots
                and previous not in model.alias_served.values()
                and model.slots[previous].source.alias is not None
            ):
                stale.append(model.slots.pop(previous))
            await close_slots(stale)
            self.on_change()

    async def close(self) -> None:
        slots = [slot for _, slot in self.slots()]
        for model in self.models.values():
            model.slots = {}
        await close_slots(slots)

    # ---- alias following ----

    def aliases(self) -> list[tuple[str, str]]:
        """(model name, alias) of every --model that is a registry alias."""
        return [(m.name, s.alias) for m in self.models.values() for s in m.sources if s.alias]

    async def follow(
        self, name: str, alias: str, interval: float, report: Callable[[str, str, str, str], None]
    ) -> None:
        """Poll one alias every `interval` s. A new version is opened, warmed up and served; then
        the old one leaves. A failed load is retried after interval x 2^failures (at most 10 min).
        `report(name, alias, event, version)` with event "poll", "failed" or "moved" (for
        metrics)."""
        failures: dict[str, int] = {}
        retry_at: dict[str, float] = {}
        while True:
            await asyncio.sleep(interval)
            model = self.models.get(name)
            # unloaded: nothing to follow until loaded again
            if model is None or not model.slots:
                continue
            source = next(s for s in model.sources if s.alias == alias)
            current = model.alias_served.get(alias)
            try:
                version = await off_loop(alias_version, alias)
            except SourceError as exc:
                log.warning(
                    "cannot read alias %s; still serving version %s: %s", alias, current, exc
                )
                continue
            model.alias_versions[alias] = version
            report(name, alias, "poll", version)
            if version == current:
                # moved back to what is served: an earlier failure no longer matters
                caught_up(model, alias)
                continue
            if time.monotonic() < retry_at.get(version, 0.0):
                continue
            # already served for another alias: no second copy
            if version in model.slots:
                log.info(
                    "alias %s moved from version %s to %s, which is loaded", alias, current, version
                )
                await self.move_alias(name, alias, version, None)
                report(name, alias, "moved", version)
                continue
            log.info("alias %s moved from version %s to %s; loading it", alias, current, version)
            try:
                loaded = await off_loop(self.open_source, source, version)
                try:
                    await self.warm_up(loaded)
                except BaseException:
                    close_model(loaded)
                    raise
            except Exception as exc:  # noqa: BLE001
                # any failure of a load: keep serving, try again later
                failures[version] = failures.get(version, 0) + 1
                delay = min(interval * 2 ** failures[version], 600.0)
                retry_at[version] = time.monotonic() + delay
                report(name, alias, "failed", version)
                log.warning(
                    "loading version %s failed (attempt %d, next in %.0f s); still serving version %s: %s",
                    version,
                    failures[version],
                    delay,
                    current,
                    exc,
                )
                # Said where a client looks (the model's metadata and the repository index), not
                # only in the log.
                model.alias_errors[alias] = clip(
                    f"version {version} failed to load (attempt {failures[version]}, "
                    f"next in {delay:.0f} s): {exc}",
                    500,
                )
                model.reason = f"{alias} names version {version}, which failed to load; still serving version {current}"
                continue
            failures.pop(version, None)
            await self.move_alias(name, alias, version, loaded)
            report(name, alias, "moved", version)


def caught_up(model: Model, alias: str) -> None:
    """`alias` is served at the version it names: forget its failed load."""
    if model.alias_errors.pop(alias, None) is not None:
        # The reason names one failing alias: the one just fixed may be it, so say what still fails,
        # if anything.
        model.reason = "; ".join(f"{other}: {error}" for other, error in model.alias_errors.items())


def close_model(model: LoadedModel) -> None:
    """Drop a model's session and its download directory."""
    model.engine.close()
    model.discard()


async def close_slots(slots: list[Slot]) -> None:
    """Drain each slot's batcher (what is queued is answered), drop its session, and give the freed
    memory back to the system: onnxruntime's weights and arena go back to the C heap, which glibc
    keeps unless trimmed."""
    for slot in slots:
        await slot.batcher.close()
        close_model(slot.model)
    if slots:
        gc.collect()
        release_free_memory()


def release_free_memory() -> bool:
    """malloc_trim(0): freed heap pages back to the kernel (glibc; elsewhere nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    return False


async def off_loop(fn, *args):
    """`fn(*args)` in a daemon thread: unlike asyncio.to_thread's executor, nothing waits for it at
    exit (a registry call stuck at shutdown held SIGTERM up past the container's grace period)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value):
        if not future.done():
            setter(value)

    def work():
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001
            # handed to the awaiting coroutine
            outcome = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        # the loop closed meanwhile (shutdown): nobody is waiting
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(
        target=work, name=f"off-loop-{getattr(fn, '__name__', 'call')}", daemon=True
    ).start()
    return await future
