"""The first hour of a newcomer (shared/reviews/newcomer-d80ae6e.md), each friction replayed as they met it: the
CLI in a subprocess, a server process and an HTTP request, scripts/setup as typed. Each answer must be one line
that names what is wrong and the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

from conftest import REPO, run_cli


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# --- 5. a config key's error names the YAML file it is in ----------------------------------------------------------


def test_a_misspelt_key_in_a_config_file_names_the_file_and_line(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(textwrap.dedent("""\
        data:
          name: digits
        train:
          max_steps: 2
          epoch: 3
        """))
    proc = run_cli(["train", "--config", str(config)], cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert f"{config}:5: unknown config key 'train.epoch' in section 'train'. Did you mean 'train.epochs'?" in lines[0]
    # The same key on the command line is named as the override it came from.
    proc = run_cli(["train", "--config", str(config), "train.epoch=3"], cwd=tmp_path, check=False, timeout=60)
    assert "override train.epoch=3: unknown config key 'train.epoch'" in proc.stderr, proc.stderr
