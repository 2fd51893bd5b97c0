"""The READMEs and docs/ name only commands and flags that exist: every `pipeline <command>` and
`python -m serving` they show, and every `--flag` after it or on its own, is checked against that
command's real `--help`. The README stays one screenful with a table of contents, and every link in
it and in docs/ leads somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import REPO, cli_env

# bytes: what is more goes to a page in docs/
README_LIMIT = 15 * 1024
# The README, the server's, and the pages the README's topics moved to (docs/own-model.md,
# docs/cli.md, ...).
READMES = [
    REPO / "README.md",
    REPO / "serving" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
COMMAND = re.compile(
    r"(?:^|[\s(/$])(?:\.venv/bin/)?(pipeline|python -m serving|scripts/[\w-]+|benchmarks/\w+\.py)"
    r"(?=\s|$)(?:\s+([a-z][a-z-]*))?"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Lines that show another tool's flags (torchrun's, pip's, curl's, docker's): not ours to check.
OTHER_TOOLS = re.compile(
    r"\b(torchrun|pip|curl|docker|mlflow|git|tritonclient|grpcurl|perf_analyzer)\b"
)
# Other tools' flags that docs/docker.md names on their own in its prose (docker's, torchrun's,
# mlflow server's).
OTHER_TOOLS_FLAGS = {
    "--cap-add",
    "--ipc",
    "--network",
    "--shm-size",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--serve-artifacts",
}
# Flags of our scripts that are not `pipeline` commands, with the command whose --help lists them.
SCRIPTS = {"--dry-run-on-cpu": ("scripts/gpu-check",)}
# scripts with an argparse --help (benchmarks/gpu.py behind it)
WITH_HELP = {"scripts/gpu-check"}
# Shell scripts that take a flag but no --help (they would set up at once): the flag is checked
# against their source.
READ_FOR_FLAGS = {"scripts/setup"}


def chunks(text: str, inline: bool = True) -> list[str]:
    """Code: each line of a fenced block (backslash continuations joined), and each
    `inline span`."""
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
        elif inline:
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
                    loose.update(set(FLAG.findall(chunk)) - OTHER_TOOLS_FLAGS)
                continue
            command = ("pipeline", match[2]) if match[1] == "pipeline" and match[2] else (match[1],)
            commands.setdefault(command, set()).update(FLAG.findall(chunk[match.end() :]))
    return commands, loose


@lru_cache(maxsize=None)
def help_text(command: tuple[str, ...]) -> str:
    argv = {
        ("pipeline",): [sys.executable, "-m", "pipeline"],
        ("python -m serving",): [sys.executable, "-m", "serving"],
    }.get(command)
    if argv is None and command[0].endswith(".py"):
        argv = [sys.executable, str(REPO / command[0])]
    elif argv is None:
        argv = (
            [str(REPO / command[0])]
            if command[0].startswith("scripts/")
            else [sys.executable, "-m", "pipeline", *command[1:]]
        )
    proc = subprocess.run(
        [*argv, "--help"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (
        f"{' '.join(command)} --help exited {proc.returncode}: {proc.stderr[-2000:]}"
    )
    return proc.stdout


def test_every_command_and_flag_the_readmes_name_exists():
    from pipeline.cli import STAGES

    commands, loose = named()
    # the parser found them
    assert ("pipeline", "run") in commands and ("python -m serving",) in commands
    unknown = [
        " ".join(c)
        for c in commands
        if (len(c) == 2 and c[1] not in STAGES)
        or (c[0].startswith(("scripts/", "benchmarks/")) and not (REPO / c[0]).is_file())
    ]
    assert not unknown, f"the README names commands that don't exist: {unknown}"
    # --help only where a flag is named, and never to scripts/setup, test or gpu-wheelhouse: they
    # take no --help, and would set up, test or download.
    commands = {
        c: flags
        for c, flags in commands.items()
        if flags or c[0] in ("pipeline", "python -m serving")
    }
    unread = [
        f"{c[0]} {flag}"
        for c, flags in commands.items()
        if c[0] in READ_FOR_FLAGS
        for flag in sorted(flags)
        if not re.search(rf"(?<![\w-]){flag}(?![\w-])", (REPO / c[0]).read_text())
    ]
    assert not unread, f"the docs name flags these scripts don't take: {unread}"
    commands = {c: flags for c, flags in commands.items() if c[0] not in READ_FOR_FLAGS}
    assert not [c for c in commands if c[0].startswith("scripts/") and c[0] not in WITH_HELP], (
        commands
    )
    everything = [*commands, *{SCRIPTS[f] for f in loose if f in SCRIPTS}]
    # each --help imports torch: 2-3 s
    with ThreadPoolExecutor(4) as pool:
        helps = dict(zip(everything, pool.map(help_text, everything)))
    missing = [
        f"{' '.join(c)} {flag}"
        for c, flags in commands.items()
        for flag in sorted(flags)
        if not re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[c])
    ]
    anywhere = "\n".join(helps.values())
    missing += [
        f"(on its own) {flag}"
        for flag in sorted(loose)
        if not re.search(rf"(?<![\w-]){flag}(?![\w-])", anywhere)
    ]
    assert not missing, "the README names flags no command has:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "line, command, flags",
    [
        (
            "`pipeline verify models:/x@champion --server URL --trust 'a.*'`",
            ("pipeline", "verify"),
            {"--server", "--trust"},
        ),
        (
            ".venv/bin/python -m serving --model m.onnx --default-model x",
            ("python -m serving",),
            {"--model", "--default-model"},
        ),
    ],
)
def test_the_parser_reads_commands_and_their_flags(line, command, flags, monkeypatch, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"```\n{line}\n```\n" if not line.startswith("`") else line + "\n")
    monkeypatch.setattr(sys.modules[__name__], "READMES", [readme])
    assert named()[0] == {command: flags}


def test_the_readmes_agree_with_the_code_and_point_only_inside_the_repository():
    readme, serving_readme = (r.read_text() for r in READMES[:2])
    engine = (REPO / "serving" / "engine.py").read_text()
    graphs = (REPO / "serving" / "cuda_graphs.py").read_text()
    # What the serving README says: plain runs feed numpy batches (pinned buffers on CUDA), only
    # --cuda-graphs binds.
    assert (
        "io_binding" not in engine
        and "run_with_iobinding" not in engine
        and "io_binding()" in graphs
    )
    assert "with IO binding" not in readme and "bound once (IOBinding" in serving_readme
    for path in READMES:
        for doc in re.findall(r"[\w./-]*[\w-]+\.md\b", path.read_text()):
            if path.name == "security.md" and re.match(r"(\.\./)?shared/reviews/", doc):
                # it cites the reviews its findings came from, kept beside the repository
                continue
            where = REPO / doc if not doc.startswith("/") else None
            assert where is not None and (where.is_file() or (path.parent / doc).is_file()), (
                f"{path.relative_to(REPO)} points to {doc}, which is not in the repository"
            )


def headings(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings (those outside fenced code)."""
    anchors, block, seen = set(), False, {}
    for line in text.splitlines():
        if line.startswith("```"):
            block = not block
        elif not block and (match := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def links(text: str) -> list[str]:
    """The targets of a Markdown page's `[text](target)` links, outside fenced code."""
    outside = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"\]\(([^)\s]+)\)", outside)


def broken_links(page) -> list[str]:
    """Links of `page` to a file or folder that is not there, or to a heading its page does not
    have."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):
            # http(s), mailto: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(
                f"{target} (no {where.relative_to(REPO) if where.is_relative_to(REPO) else where})"
            )
        elif anchor and where.suffix == ".md" and anchor not in headings(where.read_text()):
            broken.append(f"{target} (no heading with that anchor in {where.relative_to(REPO)})")
    return broken


def test_the_readme_fits_a_screenful_with_contents_that_lead_to_its_headings():
    readme = REPO / "README.md"
    text = readme.read_text()
    size = len(text.encode())
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move a topic to a page in docs/"
    )
    contents = next((line for line in text.splitlines() if line.startswith("**Contents:**")), None)
    assert contents is not None, "README.md has no '**Contents:**' line"
    # The contents line may wrap: take every in-page link up to the first heading after it.
    toc = text[text.index(contents) :].split("\n## ", 1)[0]
    anchors = re.findall(r"\]\(#([^)]+)\)", toc)
    sections = [h for h in headings(text) if h != "trainserve"]
    assert anchors and set(anchors) <= headings(text), (anchors, sorted(headings(text)))
    assert set(sections) <= set(anchors), (
        f"headings the contents leave out: {set(sections) - set(anchors)}"
    )


def test_every_link_in_the_readme_and_docs_leads_somewhere():
    readme_docs = [
        t.split("#")[0] for t in links((REPO / "README.md").read_text()) if t.startswith("docs/")
    ]
    # the README's map of docs/
    assert len(readme_docs) >= 8, readme_docs
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme_docs, (
            f"README.md's map of docs/ does not name docs/{page.name}"
        )
    broken = {
        str(page.relative_to(REPO)): found for page in READMES if (found := broken_links(page))
    }
    assert not broken, f"links that lead nowhere: {broken}"


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading: yes, it is\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#a-code-heading-yes-it-is) [b](other.md#nope) [c](gone.md) [d](#here)\n\n"
        "```\n[e](inside-code.md)\n```\n## Here\n"
    )
    assert [b.split()[0] for b in broken_links(page)] == ["other.md#nope", "gone.md"]


# --- the commands the docs show, as a user pastes them --------------------------------------------

PASTED = re.compile(r"^(?:\S*/)?pipeline\s+(run|train|data|config)(?=\s|$)")
# What the docs' commands name as the user's own, and a fresh clone lacks: made by the test, each
# stand-in beside the path it replaces. `s3://...` is the docs' "or a directory".
STAND_INS = {
    "s3://my-bucket/data/digits": "digits-shards",
    "../shards/photos": "photo-shards",
    "../photos": "photos",
    "/data/fashion-mnist": "fashion-mnist",
}
# Commands shown that this test does not check, and where each is proven instead.
PROVEN_ELSEWHERE = {
    "mine.yaml": "tests/test_pipeline_run.py writes docs/own-model.md's my_project/ and mine.yaml and runs them",
}


def pasted_commands() -> list[tuple[str, str, str | None]]:
    """(page, command, the error line the page shows it printing, if any) of every
    `pipeline run|train|data|config` the README and docs/ show in a code block, as a user would
    paste it: the `$ ` prompt left out, `&&` chains split; the comment after `#` is dropped by the
    shell."""
    found = []
    for readme in READMES:
        lines = [re.sub(r"^\$\s+", "", c.strip()) for c in chunks(readme.read_text(), inline=False)]
        for i, line in enumerate(lines):
            for part in line.split("&&"):
                match = PASTED.match(part.strip())
                if match is None:
                    continue
                shown = lines[i + 1] if i + 1 < len(lines) else ""
                error = shown if shown.startswith(f"pipeline {match[1]}: error:") else None
                found.append((str(readme.relative_to(REPO)), part.strip(), error))
    return found


def stand_ins(root: Path) -> dict[str, str]:
    """The user's own files the docs' commands name, made small under `root`: a folder of grey PNG
    digits in class folders, the four Fashion-MNIST files (random pixels); shards are written by the
    docs' own `pipeline data shard` commands."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from test_data import write_fashion

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images[:200], digits.target[:200])):
        folder = root / "photos" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 16).astype(np.uint8)).save(folder / f"{i:04d}.png")
    (root / "fashion-mnist").mkdir()
    write_fashion(root / "fashion-mnist", gz=False)
    return {shown: str(root / made) for shown, made in STAND_INS.items()}


def check_as_written(argv: list[str]) -> None:
    """What `pipeline <argv>` checks before it starts anything, in this process: the config and its
    overrides, the launch's rules, and the data, task and model components on real samples
    (pipeline/components/build.py: preflight); `pipeline data shard` runs for real (it takes
    seconds), writing the shards later commands train from."""
    import argparse
    import importlib

    from pipeline import data_cli
    from pipeline.cli import STAGES
    from pipeline.components.build import preflight
    from pipeline.config import check_runtime, load_config

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    importlib.import_module(STAGES[argv[0]][0]).add_arguments(parser)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_intermixed_args(argv[1:])
    if argv[0] == "data":
        data_cli.main(args.config, args.overrides, args.out)
        return
    cfg = load_config(args.config, args.overrides)
    if argv[0] in ("run", "train"):
        processes = args.nproc_per_node or 1
        check_runtime(cfg, processes, False, processes)
        preflight(cfg.data, cfg.task, cfg.model, cfg.train, cfg.export)


def test_every_command_the_docs_show_passes_its_checks_as_written(tmp_path, monkeypatch):
    """Each `pipeline run|train|data|config` the README and docs/ show, from the repository root as
    they say, with a stand-in for the user's own files: a command that stops at its first check as
    written (the digits config with `data.args.root=...`, which keeps the file's val_fraction) fails
    here. A command shown with its error is run for real and must print that error."""
    import shlex

    from pipeline.errors import ConfigError, DataError

    commands = pasted_commands()
    pages = {page for page, _, _ in commands}
    assert {"README.md", "docs/data.md", "docs/cli.md", "docs/own-model.md"} <= pages, pages
    made = stand_ins(tmp_path)
    monkeypatch.chdir(REPO)
    # `examples` is importable from the repository root
    monkeypatch.syspath_prepend(str(REPO))
    failed, elsewhere = [], set()
    for page, command, error in commands:
        argv = shlex.split(command, comments=True)[1:]
        argv = [made.get(a, a) for a in argv]
        argv = [re.sub(r"(?<=root: )[^,}]+", lambda m: made.get(m[0], m[0]), a) for a in argv]
        argv = [re.sub(r"(?<==)\S+$", lambda m: made.get(m[0], m[0]), a) for a in argv]
        if reason := next((why for key, why in PROVEN_ELSEWHERE.items() if key in argv), None):
            elsewhere.add(reason)
            continue
        if error is not None:
            proc = subprocess.run(
                [sys.executable, "-m", "pipeline", *argv],
                cwd=REPO,
                env=cli_env(),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode != 2 or proc.stderr.strip() != error:
                failed.append(
                    f"{page}: {command}\n  shows: {error}\n  prints: {proc.stderr.strip()}"
                )
            continue
        try:
            check_as_written(argv)
        except (ConfigError, DataError, SystemExit) as exc:
            failed.append(f"{page}: {command}\n  {type(exc).__name__}: {exc}")
    assert not failed, "commands in the docs that fail as written:\n" + "\n".join(failed)
    assert elsewhere == set(PROVEN_ELSEWHERE.values()), (
        "PROVEN_ELSEWHERE names a command no page shows"
    )
