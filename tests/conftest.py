"""Shared test helpers: a throwaway MLflow store, running the real CLI in a subprocess, and one
finished tiny run for the session.

Every subprocess a test starts runs in its own temporary directory, so the embedded default
store (./mlflow.db, ./mlartifacts) and ./outputs land there and are removed with it.

`tiny_run` is trained, consolidated, exported and registered once per session. Tests read it and
never change it (its teardown fails the session if one did); a test that changes a finished run
takes its own copy with `copy_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pipeline import checkpoint
from pipeline.components.build import ModelSpec, instantiate_model, state_manifest
from pipeline.distributed import DistInfo

# The launch table's runner, `launched` (tests/launches.py), for every test module.
pytest_plugins = ["launches"]

REPO = Path(__file__).resolve().parents[1]
# Scratch needs this much free room to go to memory (/dev/shm) rather than to disk.
SCRATCH_MIN_FREE = 4 * 2**30


def scratch_root() -> str | None:
    """Where the session's temporary directories go: $TRAINSERVE_TEST_TMPDIR when set, else /dev/shm
    when it is writable with room to spare, else the system's default (None)."""
    chosen = os.environ.get("TRAINSERVE_TEST_TMPDIR")
    if chosen:
        return chosen
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= SCRATCH_MIN_FREE:
        return str(shm)
    return None


def pytest_configure(config):
    """tmp_path and the working directories the CLI runs in (their MLflow stores, checkpoints and
    outputs) go to memory. On a disk, SQLite syncs every MLflow write, and a fresh store alone waits
    seconds on those syncs, which tests nothing. Subprocesses keep the system's TMPDIR for their own
    temporary files. A --basetemp given on the command line wins."""
    root = scratch_root()
    if root and not config.option.basetemp and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        # pytest's basetemp comes from tempfile.gettempdir(), which returns this once set.
        tempfile.tempdir = root


# The modules that read the launch table's rows (tests/launches.py): one worker runs them all, so each
# row launches once a session.
LAUNCH_TABLE_READERS = ("test_launches.py", "test_own_models.py")
# The groups that take most of a minute or more, longest first: handed out first, so that the workers
# end together rather than one waiting out a long module handed out last. Re-rank them from CI's
# --durations when they change.
LONGEST_FIRST = (
    "launch-table",
    "test_streamed_data.py",
    "test_exact_resume.py",
    "test_checkpoints.py",
    "test_train.py",
    "test_pipeline_run.py",
    "test_run_directories.py",
    "test_first_hour.py",
    "test_export.py",
    "test_ui.py",
    "test_consolidate.py",
    "test_live_judgement.py",
    "test_front_ends.py",
    "test_token_classification.py",
    "test_multi_node.py",
    "test_int8.py",
    "test_shards_bad_input.py",
    "test_image_requests.py",
    "test_rollout.py",
    "test_registry_integrity.py",
    "test_best_checkpoint.py",
)


def worker_group(nodeid: str) -> str:
    """The tests one pytest-xdist worker runs together: a module's (its module-scoped servers and
    runs are made once), and the launch table's readers'."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "launch-table" if module in LAUNCH_TABLE_READERS else module


def pytest_collection_modifyitems(config, items):
    """The longest groups first (LONGEST_FIRST); within a group, and among the others, the order is
    the collection's."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(worker_group(item.nodeid), []).append(item)
    rank = {group: index for index, group in enumerate(LONGEST_FIRST)}
    ordered = sorted(groups, key=lambda group: rank.get(group, len(rank)))
    items[:] = [item for group in ordered for item in groups[group]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (scripts/test) with worker_group as the scope, handed out in the
    collection's order (with --no-loadscope-reorder). xdist's own `loadgroup` would take marks, but
    it renames node ids in a way pytest 9 no longer reads."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)


TINY = REPO / "tests" / "configs" / "tiny.yaml"
CPU1 = DistInfo(0, 1, 0, 1, torch.device("cpu"))


def mlp_spec(hidden=(16,), classes: int = 10, image_size: int = 8) -> ModelSpec:
    """The built-in MLP on 8x8 one-channel images, with the args the digits data set would fill
    in."""
    return ModelSpec(
        "pipeline.models:mlp",
        {
            "num_classes": classes,
            "in_channels": 1,
            "image_size": image_size,
            "hidden": list(hidden),
            "mean": [0.3],
            "std": [0.4],
        },
    )


def resnet_spec(width: float = 0.125, classes: int = 10) -> ModelSpec:
    return ModelSpec(
        "pipeline.models:resnet18",
        {"num_classes": classes, "in_channels": 1, "width": width, "mean": [0.5], "std": [0.25]},
    )


def checkpoint_meta(model: torch.nn.Module, spec: ModelSpec, **extra) -> dict:
    """What training writes into a checkpoint's trainserve.json about its model."""
    return {"model": spec.to_json(), "model_state": state_manifest(model), **extra}


def model_from_checkpoint(ckpt: Path) -> torch.nn.Module:
    """The model a checkpoint records, its weights loaded the way training resumes them."""
    model = instantiate_model(ModelSpec(**checkpoint.read_meta(ckpt)["model"]))
    checkpoint.load(ckpt, model, None, CPU1)
    return model


# Where mlflow.set_tracking_uri() / set_registry_uri() keep the store besides os.environ.
MLFLOW_GLOBALS = (
    ("MLFLOW_TRACKING_URI", "mlflow.tracking._tracking_service.utils", "_tracking_uri"),
    ("MLFLOW_REGISTRY_URI", "mlflow.tracking._model_registry.utils", "_registry_uri"),
)


@pytest.fixture(autouse=True)
def mlflow_store_left_as_found():
    """mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into os.environ and a module global: a
    test calling a stage in-process would otherwise hand its store, deleted with its directory, to
    every later in-process stage and subprocess."""
    before = [
        (key, os.environ.get(key), module, name, getattr(sys.modules.get(module), name, None))
        for key, module, name in MLFLOW_GLOBALS
    ]
    yield
    for key, value, module, name, held in before:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
        if module in sys.modules:
            setattr(sys.modules[module], name, held)


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("MLFLOW_REGISTRY_URI", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`pipeline <args>` as a user types it, in `cwd`."""
    proc = run_killing_group(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, env=cli_env(env), timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pipeline {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def run_killing_group(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout kills torchrun's workers too, not only the launcher."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout}s\n--- stderr\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in; its mlflow.db is the embedded default store."""
    return tmp_path


def mlflow_client(workdir: Path):
    import mlflow

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(uri)


def only_run(workdir: Path, experiment: str):
    client = mlflow_client(workdir)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def run_lineage(run_id: str, client=None) -> dict:
    """A run's lineage.json artifact (serving/lineage.py: RUN_FILE), every stage's part."""
    import json
    import tempfile

    import mlflow

    client = client or mlflow.MlflowClient()
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, "lineage.json", tmp)).read_text())


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str):
    """A tmpfs of `size` (e.g. "64k") mounted at `directory` for a full-disk test, unmounted after;
    skips the test where it can't be mounted (not root, no mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    directory.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            check=False,
            capture_output=True,
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    """A run `pipeline run` took through every stage, in `workdir` (its mlflow.db and mlartifacts/
    beside outputs/). `proc` is the command's CompletedProcess: its console, its exit status."""

    workdir: Path
    name: str
    proc: subprocess.CompletedProcess

    @property
    def run_dir(self) -> Path:
        return self.workdir / "outputs" / self.name

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.workdir / 'mlflow.db'}"

    @property
    def run_id(self) -> str:
        return json.loads((self.run_dir / "mlflow_run.json").read_text())["run_id"]


# tests/configs/tiny.yaml's registered model: 12 steps leave it below the baseline, which the config
# allows, so `--serve-check` exits 1 after the server's answer was checked.
TINY_MODEL = "resnet18-digits"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> FinishedRun:
    """`pipeline run --config tests/configs/tiny.yaml --serve-check` once for the session, on one
    process: trained (checkpoints at steps 6 and 12), consolidated, exported, registered as
    resnet18-digits v1 @champion, served and checked. Read only: `copy_run` for a test that
    writes. Under pytest-xdist the first worker to ask trains it, in the directory the workers'
    own temporary directories share, and the others wait for it and read the same run."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    workdir, record = shared / "tiny_run", shared / "tiny_run.json"
    with (shared / "tiny_run.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            proc = run_cli(
                ["run", "--config", str(TINY), "--serve-check", "serve.port=0"]
                + ["train.run_name=tiny"],
                cwd=workdir,
                check=False,
            )
            assert proc.returncode == 1 and "failed its baseline gate" in proc.stderr, (
                f"exited {proc.returncode}\n{proc.stderr[-4000:]}"
            )
            record.write_text(json.dumps(dataclasses.asdict(Console.of(proc))))
    proc = Console(**json.loads(record.read_text())).completed()
    before = tree_digest(workdir)
    yield FinishedRun(workdir, "tiny", proc)
    assert tree_digest(workdir) == before, "a test changed the session's tiny_run: use copy_run"


@dataclasses.dataclass(frozen=True)
class Console:
    """A command's CompletedProcess as the workers pass it on (JSON)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, proc: subprocess.CompletedProcess) -> Console:
        return cls([str(a) for a in proc.args], proc.returncode, proc.stdout, proc.stderr)

    def completed(self) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(self.args, self.returncode, self.stdout, self.stderr)


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` by its sha256 (the MLflow store's logs of a read excluded)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.endswith(("-journal", "-wal", "-shm"))
    }


def copy_run(run: FinishedRun, workdir: Path) -> FinishedRun:
    """`run` copied into `workdir` for a test that changes it: the files, and its store with every
    path that named the old directory (artifact locations, the run-directory tag) naming the new."""
    shutil.copytree(run.workdir, workdir, dirs_exist_ok=True)
    old, new = str(run.workdir), str(workdir)
    with contextlib.closing(sqlite3.connect(workdir / "mlflow.db")) as db, db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for column in db.execute(f'PRAGMA table_info("{table}")').fetchall():
                if column[2].upper().startswith(("VARCHAR", "TEXT")):
                    db.execute(
                        f'UPDATE "{table}" SET "{column[1]}" = replace("{column[1]}", ?, ?) '
                        f'WHERE instr("{column[1]}", ?) > 0',
                        (old, new, old),
                    )
    return dataclasses.replace(run, workdir=workdir)
