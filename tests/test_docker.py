"""The container files, linted without a Docker engine (none runs on CI's machines)."""

import subprocess

from conftest import REPO


def test_dockerfile_and_compose_pass_their_linters():
    proc = subprocess.run(
        [str(REPO / ".ci/lint-docker")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lint-docker: ok" in proc.stdout
