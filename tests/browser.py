"""Headless Chromium (Debian's `chromium`) over the MLflow UI that `pipeline ui` starts: each page
as the text a person reads once its scripts have run, and as a screenshot kept for CI (under
$TRAINSERVE_TEST_ARTIFACTS, else test-artifacts/ in the repository)."""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, cli_env
from serving_fixtures import free_port

ARTIFACTS = Path(os.environ.get("TRAINSERVE_TEST_ARTIFACTS") or REPO / "test-artifacts")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        # scripts/setup installs it where it can
        if os.geteuid() == 0 and shutil.which("apt-get"):
            raise AssertionError(
                "chromium is not installed: run scripts/setup (it installs Debian's chromium)"
            )
        pytest.skip(
            "chromium is not installed and this user can't install it (scripts/setup does, as root)"
        )
    return found


@contextlib.contextmanager
def mlflow_ui(workdir: Path):
    """`pipeline ui` over the store in `workdir` (its mlflow.db), on a free port; yields its base
    URL once it has printed the address to open (`printed_address`), which must answer by then. Its
    output is kept in `workdir`/ui.log."""
    port = free_port()
    log = workdir / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "ui", "--port", str(port)],
            cwd=workdir,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while (address := printed_address(workdir)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"pipeline ui printed no address to open:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.2)
        # Printed once the UI answers, not before: the address works when the user reads it.
        answer = requests.get(address, timeout=5)
        assert answer.status_code == 200 and address.startswith(url), (address, answer)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def printed_address(workdir: Path) -> str | None:
    """The address `pipeline ui` (mlflow_ui) said to open, once it has."""
    found = re.search(r"^MLflow UI: open (\S+)", (workdir / "ui.log").read_text(), re.M)
    return found[1] if found else None


def page(url: str, name: str) -> tuple[str, str]:
    """(the page's visible text, its DOM) once its scripts have run; its screenshot saved as
    ARTIFACTS/<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix="trainserve-chromium-", ignore_cleanup_errors=True
    ) as profile:
        base = [
            chromium(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=2000,2000",
            "--virtual-time-budget=20000",
            f"--user-data-dir={profile}",
        ]
        run_chromium([*base, f"--screenshot={ARTIFACTS / f'{name}.png'}", url])
        dom = run_chromium([*base, "--dump-dom", url])
    return visible_text(dom), dom


def run_chromium(argv: list[str], timeout: float = 180) -> str:
    """Chromium in a session of its own, its stdout; its helper processes (renderer, zygote) go with
    it."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}: {err[-2000:]}"
    return out


def visible_text(dom: str) -> str:
    text = re.sub(r"<(style|script)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"\s+", " ", html.unescape(text)).strip()
