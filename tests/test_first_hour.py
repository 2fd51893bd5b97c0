"""The first hour of a newcomer (shared/reviews/newcomer-d80ae6e.md), each friction replayed as they met it: the
CLI in a subprocess, a server process and an HTTP request, scripts/setup as typed. Each answer must be one line
that names what is wrong and the fix."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from pipeline.components import checkpoint
from conftest import REPO, TINY, run_cli


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


# --- 6. checkpoint saves: one summary line, each save only at --verbose --------------------------------------------


@pytest.mark.slow
def test_checkpoint_saves_are_one_summary_line_unless_verbose(tmp_path):
    args = ["train", "--config", str(TINY), "train.run_name=quiet", "train.max_steps=6", "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=2"]
    console = run_cli(args, cwd=tmp_path, timeout=180).stderr
    assert "checkpoint saved" not in console, console
    summary = [line for line in console.splitlines() if "checkpoints to" in line]
    kept = [p.name for p in checkpoint.list_complete(tmp_path / "outputs/quiet/checkpoints")]
    assert len(summary) == 1 and re.search(r"INFO pipeline\.components\.saver: saved 6 checkpoints to "
                                           r"outputs/quiet/checkpoints \(\d+\.\d s in all\), kept (\d) \((.*)\)$",
                                           summary[0]).groups() == (str(len(kept)), ", ".join(kept)), console
    verbose = run_cli([*args, "--verbose", "train.run_name=loud"], cwd=tmp_path, timeout=180).stderr
    assert sum("checkpoint saved: outputs/loud/checkpoints/step_" in line for line in verbose.splitlines()) == 6, verbose

