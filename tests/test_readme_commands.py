"""The READMEs name only commands and flags that exist: every `pipeline <command>` and `python -m serving`
they show, and every `--flag` after it or on its own, is checked against that command's real `--help`."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import pytest

from conftest import REPO, cli_env

READMES = [REPO / "README.md", REPO / "serving" / "README.md"]
COMMAND = re.compile(r"(?:^|[\s(/$])(?:\.venv/bin/)?(pipeline|python -m serving|scripts/[\w-]+|benchmarks/\w+\.py)"
                     r"(?=\s|$)(?:\s+([a-z][a-z-]*))?")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Lines that show another tool's flags (torchrun's, pip's, curl's, docker's): not ours to check.
OTHER_TOOLS = re.compile(r"\b(torchrun|pip|curl|docker|mlflow|git|tritonclient|grpcurl|perf_analyzer)\b")
# Flags of our scripts that are not `pipeline` commands, with the command whose --help lists them.
SCRIPTS = {"--dry-run-on-cpu": ("scripts/gpu-check",)}
WITH_HELP = {"scripts/gpu-check"}  # scripts with an argparse --help (benchmarks/gpu.py behind it)


def chunks(text: str) -> list[str]:
    """Code: each line of a fenced block (backslash continuations joined), and each `inline span`."""
    found, block, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block, pending = not block, ""
            continue
        if block:
            pending += line.rstrip("\\") + " "
            if not line.endswith("\\"):
                found.append(pending)
                pending = ""
        else:
            found += re.findall(r"`([^`]+)`", line)
    return found


def named() -> tuple[dict[tuple[str, ...], set[str]], set[str]]:
    """{command: flags shown after it}, and the flags shown on their own."""
    commands: dict[tuple[str, ...], set[str]] = {}
    loose: set[str] = set()
    for readme in READMES:
        for chunk in (part for c in chunks(readme.read_text()) for part in re.split(r"&&|;", c)):
            match = COMMAND.search(chunk)
            if match is None:
                if not OTHER_TOOLS.search(chunk):
                    loose.update(FLAG.findall(chunk))
                continue
            command = ("pipeline", match[2]) if match[1] == "pipeline" and match[2] else (match[1],)
            commands.setdefault(command, set()).update(FLAG.findall(chunk[match.end():]))
    return commands, loose


@lru_cache(maxsize=None)
def help_text(command: tuple[str, ...]) -> str:
    argv = {("pipeline",): [sys.executable, "-m", "pipeline"],
            ("python -m serving",): [sys.executable, "-m", "serving"]}.get(command)
    if argv is None and command[0].endswith(".py"):
        argv = [sys.executable, str(REPO / command[0])]
    elif argv is None:
        argv = [str(REPO / command[0])] if command[0].startswith("scripts/") else \
            [sys.executable, "-m", "pipeline", *command[1:]]
    proc = subprocess.run([*argv, "--help"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)} --help exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def test_every_command_and_flag_the_readmes_name_exists():
    from pipeline.cli import STAGES

    commands, loose = named()
    assert ("pipeline", "run") in commands and ("python -m serving",) in commands  # the parser found them
    unknown = [" ".join(c) for c in commands if (len(c) == 2 and c[1] not in STAGES)
               or (c[0].startswith(("scripts/", "benchmarks/")) and not (REPO / c[0]).is_file())]
    assert not unknown, f"the README names commands that don't exist: {unknown}"
    # --help only where a flag is named, and never to scripts/setup, test or gpu-wheelhouse: they take no
    # --help, and would set up, test or download.
    commands = {c: flags for c, flags in commands.items() if flags or c[0] in ("pipeline", "python -m serving")}
    assert not [c for c in commands if c[0].startswith("scripts/") and c[0] not in WITH_HELP], commands
    everything = [*commands, *{SCRIPTS[f] for f in loose if f in SCRIPTS}]
    with ThreadPoolExecutor(4) as pool:  # each --help imports torch: 2-3 s
        helps = dict(zip(everything, pool.map(help_text, everything)))
    missing = [f"{' '.join(c)} {flag}" for c, flags in commands.items() for flag in sorted(flags)
               if not re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[c])]
    anywhere = "\n".join(helps.values())
    missing += [f"(on its own) {flag}" for flag in sorted(loose)
                if not re.search(rf"(?<![\w-]){flag}(?![\w-])", anywhere)]
    assert not missing, "the README names flags no command has:\n" + "\n".join(missing)


@pytest.mark.parametrize("line, command, flags", [
    ("`pipeline verify models:/x@champion --server URL --trust 'a.*'`", ("pipeline", "verify"), {"--server", "--trust"}),
    (".venv/bin/python -m serving --model m.onnx --default-model x", ("python -m serving",), {"--model", "--default-model"}),
])
def test_the_parser_reads_commands_and_their_flags(line, command, flags, monkeypatch, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"```\n{line}\n```\n" if not line.startswith("`") else line + "\n")
    monkeypatch.setattr(sys.modules[__name__], "READMES", [readme])
    assert named()[0] == {command: flags}


def test_the_readmes_agree_with_the_code_and_point_only_inside_the_repository():
    readme, serving_readme = (r.read_text() for r in READMES)
    engine = (REPO / "serving" / "engine.py").read_text()
    graphs = (REPO / "serving" / "cuda_graphs.py").read_text()
    # What the serving README says: plain runs feed numpy batches (pinned buffers on CUDA), only --cuda-graphs binds.
    assert "io_binding" not in engine and "run_with_iobinding" not in engine and "io_binding()" in graphs
    assert "with IO binding" not in readme and "bound once (IOBinding" in serving_readme
    for path in READMES:
        for doc in re.findall(r"[\w./-]*[\w-]+\.md\b", path.read_text()):
            where = REPO / doc if not doc.startswith("/") else None
            assert where is not None and (where.is_file() or (path.parent / doc).is_file()), \
                f"{path.relative_to(REPO)} points to {doc}, which is not in the repository"
