"""The source of a run's component modules, logged with the run (as MLflow's `code_paths` does).

A stage on another machine (consolidate needs no user code; export and serve-check do) can then say
exactly what it needs when a component can't be imported there, and where the run keeps that code.
The code is never imported from the store: a user downloads it and puts it on PYTHONPATH on purpose.

What is captured, per component module that is not trainserve's own:
- code the user wrote (not under site-packages or the standard library): the module's top-level
  package directory (its .py files, within limits), or the lone module file;
- an installed distribution: its name and version only.
Artifact layout: `code/<path relative to the directory on sys.path>`, so that `code/` itself is the
directory to put on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAX_FILES = 200
MAX_BYTES = 5 << 20
ARTIFACT_DIR = "code"


@dataclass
class CodeSnapshot:
    # artifact path under code/ -> local file
    files: dict[str, Path] = field(default_factory=dict)
    # installed distribution -> version
    packages: dict[str, str] = field(default_factory=dict)
    # why something was not captured
    skipped: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        """For checkpoints and model.json: every file's sha256, and the installed packages."""
        return {
            "files": {name: _sha256(path) for name, path in sorted(self.files.items())},
            "packages": dict(sorted(self.packages.items())),
        }


def capture(references: list[str]) -> CodeSnapshot:
    """What to log for the modules `references` name (already imported by the run), and for the
    other local modules the run imported from the same directories (a helper package beside the
    model's)."""
    snapshot = CodeSnapshot()
    installed = _installed_roots()
    bases: set[Path] = set()
    for reference in dict.fromkeys(references):
        top = reference.partition(":")[0].split(".")[0]
        origin = _origin(top)
        if top in OWN:
            continue
        if origin is None:
            snapshot.skipped.append(f"{top}: no source file")
        elif any(_is_under(origin, root) for root in installed):
            dist = _distribution_of(top)
            if dist:
                snapshot.packages[dist[0]] = dist[1]
        else:
            bases.add(origin.parent)
    tops = sorted({name.split(".")[0] for name in list(sys.modules)} - OWN)
    local = [
        (top, origin)
        for top in tops
        if (origin := _origin(top)) is not None and origin.parent in bases
    ]
    for top, origin in local:
        files = (
            sorted(p for p in origin.rglob("*.py") if "__pycache__" not in p.parts)
            if origin.is_dir()
            else [origin]
        )
        if (
            len(snapshot.files) + len(files) > MAX_FILES
            or sum(p.stat().st_size for p in [*snapshot.files.values(), *files]) > MAX_BYTES
        ):
            snapshot.skipped.append(
                f"{top}: past {MAX_FILES} files or {MAX_BYTES >> 20} MB of code in all"
            )
            continue
        for path in files:
            snapshot.files[path.relative_to(origin.parent).as_posix()] = path
    return snapshot


# trainserve's own code, and the script that runs it
OWN = {"pipeline", "serving", "__main__"}


def _origin(top: str) -> Path | None:
    """A top-level module's directory (a package, namespace packages included) or file."""
    module = sys.modules.get(top)
    if module is None:
        return None
    paths = list(getattr(module, "__path__", []) or [])
    origin = paths[0] if paths else getattr(module, "__file__", None)
    return Path(origin).resolve() if origin else None


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [
        Path(paths[k]).resolve()
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if k in paths
    ]


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def _distribution_of(top_level: str) -> tuple[str, str] | None:
    for dist in importlib.metadata.packages_distributions().get(top_level, []):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def missing_code_hint(code: dict | None, run_id: str | None) -> str:
    """For an import error on another machine: what the run recorded, and how to fetch it."""
    if not code:
        return ""
    parts = []
    if code.get("files") and run_id:
        parts.append(
            f"; the training run logged that code: `mlflow artifacts download -r {run_id} -a {ARTIFACT_DIR} "
            f"-d .` then PYTHONPATH=./{ARTIFACT_DIR} (files: {', '.join(sorted(code['files'])[:5])})"
        )
    if code.get("packages"):
        parts.append(
            f"; it was trained with {', '.join(f'{k}=={v}' for k, v in code['packages'].items())}"
        )
    return "".join(parts)
