"""scripts/setup pins the installed torch in .venv/constraints.txt, so installing more packages with
`-c .venv/constraints.txt` can't quietly replace it (the newcomer review's `pip install timm`, which
turned a CPU set-up into a 6.9 GB CUDA torch). Proved with real pip on two tiny local wheels:
nothing is downloaded."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO

CONSTRAINTS = REPO / ".venv" / "constraints.txt"


def fake_wheel(
    directory: Path, name: str, version: str, requires: list[str] = (), files: dict[str, str] = {}
) -> Path:
    """The smallest wheel pip's resolver accepts: metadata, and `files` ({path in the wheel:
    text})."""
    dist_info = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    metadata = "".join(
        [
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist_info}/METADATA", metadata)
        whl.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        for inside, text in files.items():
            whl.writestr(inside, text)
        whl.writestr(f"{dist_info}/RECORD", "")
    return path


def pip_dry_run(wheels: Path, *args: str) -> subprocess.CompletedProcess:
    """--isolated: this machine's pip configuration (its own constraints, indexes) plays no part."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--isolated",
            "--dry-run",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(wheels),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def wheels(tmp_path):
    """A 'torch' of another version, and a package that wants it (as timm's torchvision wanted torch
    2.14.1)."""
    fake_wheel(tmp_path, "torch", "2.14.1")
    fake_wheel(tmp_path, "wants_other_torch", "1.0", ["torch==2.14.1"])
    return tmp_path


def test_setup_pins_the_installed_torch_exactly():
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("not running in the .venv scripts/setup made")
    # ...and beside a CPU torch its torchvision's CPU build (tests/test_first_hour.py: the
    # registry's is a CUDA build)
    version, _, build = torch.__version__.partition("+")
    minor, patch = (int(p) for p in version.split(".")[1:3])
    assert CONSTRAINTS.read_text().split() == [f"torch=={torch.__version__}"] + (
        [f"torchvision==0.{minor + 15}.{patch}+cpu"] if build == "cpu" else []
    )


def test_a_package_that_wants_another_torch_fails_loudly_under_the_constraints(wheels, tmp_path):
    constraints = CONSTRAINTS if CONSTRAINTS.is_file() else None
    if constraints is None:
        pytest.skip("no .venv/constraints.txt: run scripts/setup")
    unguarded = pip_dry_run(wheels, "wants_other_torch")
    # What the constraints are for: without them pip would replace the installed torch.
    assert unguarded.returncode == 0 and "torch-2.14.1" in unguarded.stdout, (
        unguarded.stdout + unguarded.stderr
    )
    guarded = pip_dry_run(wheels, "-c", str(constraints), "wants_other_torch")
    said = guarded.stdout + guarded.stderr
    assert guarded.returncode != 0, said
    pinned = [line for line in said.splitlines() if "(constraint) torch" in line]
    assert (
        "conflicting dependencies" in said and pinned and f"=={torch.__version__}" in pinned[0]
    ), said


def test_readme_tells_users_to_install_with_the_constraints():
    assert "-c .venv/constraints.txt" in (REPO / "README.md").read_text()
