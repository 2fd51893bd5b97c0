"""Where a checkpoint comes from and goes besides the run directory: the tracking server. Uploads a
checkpoint to a run's `checkpoints/` artifacts (marker last), finds and downloads a run's complete
one, and resolves `--resume` (latest, a path, a run directory, or a run id) to a checkpoint.

A run whose directory is on an object store (train.output_dir=s3://...) keeps its checkpoints there,
and its MLflow run says where (tag lineage.RUN_DIR): a run id, or an s3://... path, is fetched from
there into a local directory (`fetch_checkpoint`, marker and checksums verified), which
consolidation then reads as any local checkpoint.

Kept apart from layout.py and dcp.py (the checkpoint on disk) and tracking.py (MLflow runs, metrics,
the registry): this is the one module that knows both.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

from pipeline import checkpoint, tracking
from pipeline.checkpoint import object_store
from pipeline.distributed import DistInfo, broadcast_object
from serving import lineage

log = logging.getLogger(__name__)


def resolve_resume(resume: str, checkpoint_root: Path, info: DistInfo) -> Path | None:
    """`latest`, a checkpoint path, a run directory, or an MLflow run id -> a complete checkpoint.

    Rank 0 resolves (and downloads, for a run id); every rank gets the same answer.
    """
    answer: str | None = None
    error: str | None = None
    if info.is_main:
        try:
            answer = str(
                _resolve_on_main(resume, object_store.location(str(checkpoint_root))) or ""
            )
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    answer, error = broadcast_object((answer, error), info)
    if error:
        raise checkpoint.CheckpointError(error)
    return object_store.location(answer) if answer else None


def _resolve_on_main(resume: str, checkpoint_root: Path) -> Path | None:
    # after a torchrun restart: the newest, or none yet (start over)
    if resume == "auto":
        return checkpoint.latest(checkpoint_root)
    if resume == "latest":
        found = checkpoint.latest(checkpoint_root)
        if found is None and object_store.is_url(checkpoint_root):
            raise checkpoint.CheckpointError(
                f"--resume latest: no complete checkpoint under {checkpoint_root}; set "
                "train.run_name=<the run to resume>"
            )
        if found is None:
            runs = sorted(
                p.parent.name for p in checkpoint_root.parent.parent.glob("*/checkpoints")
            )
            raise checkpoint.CheckpointError(
                f"--resume latest: no complete checkpoint under {checkpoint_root}; set "
                "train.run_name=<the run to resume>"
                + (f" (runs here: {', '.join(runs)})" if runs else "")
            )
        return found
    if object_store.is_url(resume):
        return _choose_on_store(object_store.check_url(resume, "--resume"), latest=True)
    p = Path(resume)
    if p.exists():
        if (p / checkpoint.MARKER).exists() or (p / ".metadata").exists():
            checkpoint.verify_complete(p)
            return p
        found = checkpoint.latest(p / "checkpoints") or checkpoint.latest(p)
        if found is None:
            raise checkpoint.CheckpointError(
                f"--resume {resume}: no complete checkpoint in that directory "
                "(expected step_*/ with a COMPLETE marker, or a run directory holding checkpoints/)"
            )
        return found
    if re.fullmatch(r"[0-9a-f]{32}", resume):
        where = tracking.get_run(resume).data.tags.get(lineage.RUN_DIR, "")
        # its checkpoints are on a store every rank reads: no download
        if object_store.is_url(where):
            return _choose_on_store(
                object_store.check_url(where, f"the run's {lineage.RUN_DIR}"), latest=False
            )
        if object_store.is_url(checkpoint_root):
            raise checkpoint.CheckpointError(
                f"--resume {resume}: that run's checkpoints are MLflow artifacts, which rank 0 would download to its "
                "own disk, out of the other hosts' reach; with train.output_dir on an object store, copy the "
                "checkpoint there and give --resume its s3:// path"
            )
        return download_checkpoint(resume, checkpoint_root.parent / "downloaded")
    raise checkpoint.CheckpointError(
        f"--resume {resume}: not 'latest', an existing path, nor an MLflow run id (32 hex digits)"
    )


def download_checkpoint(run_id: str, dest: Path, latest: bool = False) -> Path:
    """The run's best checkpoint (its lineage.BEST tag), else with `latest` or when
    the best was not uploaded its final one, else the newest complete one, downloaded under `dest`.

    Complete means its marker was uploaded: `log_checkpoint` sends the marker last, so an upload cut
    short (a rank killed mid-upload) is passed over for the one before it."""
    import mlflow

    where = tracking.get_run(run_id).data.tags.get(lineage.RUN_DIR, "")
    # trained with its run directory on an object store: fetched from there
    if object_store.is_url(where):
        log.info("run %s keeps its checkpoints in %s", run_id, where)
        return fetch_checkpoint(where, dest / run_id, latest)
    client = mlflow.MlflowClient()
    entries = client.list_artifacts(run_id, "checkpoints")
    steps = sorted(
        e.path for e in entries if e.is_dir and checkpoint.STEP_DIR.match(Path(e.path).name)
    )
    complete = [
        s
        for s in steps
        if any(Path(f.path).name == checkpoint.MARKER for f in client.list_artifacts(run_id, s))
    ]
    if not complete:
        found = (
            f"only incomplete uploads ({', '.join(steps)})" if steps else "no checkpoints/step_*"
        )
        raise checkpoint.CheckpointError(
            f"run {run_id} has no complete checkpoint logged: {found}; "
            "was it trained with checkpoint.log_to_mlflow=none?"
        )
    # The run's final checkpoint when it names one: after a resume from an older step, a higher step
    # uploaded earlier belongs to the abandoned timeline.
    tags = tracking.get_run(run_id).data.tags
    # (a run trained before the lineage contract named them otherwise: LEGACY_RUN, the latest as a
    # path)
    final = f"checkpoints/{tags.get(lineage.LATEST) or Path(tags.get(lineage.LEGACY_RUN['checkpoint'], '')).name}"
    best_name = tags.get(lineage.BEST) or tags.get(lineage.LEGACY_RUN["best"], "")
    best = f"checkpoints/{best_name}"
    chosen = final if final in complete else complete[-1]
    if not latest and best in complete:
        chosen = best
    elif not latest and best_name:
        log.warning(
            "run %s: its best checkpoint %s was not uploaded (checkpoint.log_to_mlflow); using %s",
            run_id,
            best,
            chosen,
        )
    log.info(
        "run %s: downloading %s (%s)",
        run_id,
        chosen,
        "the best" if chosen == best else "the final" if chosen == final else "the newest complete",
    )
    if chosen == complete[-1] and complete[-1] != steps[-1]:
        log.warning(
            "run %s: %s was not uploaded completely; using %s", run_id, steps[-1], complete[-1]
        )
    local = tracking.download_artifacts(run_id, chosen, dest / run_id)
    checkpoint.verify_checksums(local)
    return local


def log_checkpoint(path: Path, run_id: str) -> None:
    """A checkpoint directory to `checkpoints/<name>` of the run, its completeness marker last.

    Takes an explicit run id: background uploads run in a thread without MLflow's active run. Not
    `uninterrupted`: an upload writes no run state, and may outlast the grace before SIGKILL."""
    import mlflow

    client = mlflow.MlflowClient()
    path = Path(path)
    for f in sorted(
        (p for p in path.rglob("*") if p.is_file()), key=lambda p: (p.name == checkpoint.MARKER, p)
    ):
        client.log_artifact(
            run_id, str(f), "/".join(["checkpoints", path.name, *f.parent.relative_to(path).parts])
        )


def _choose_on_store(url: object_store.StoreUrl, latest: bool) -> object_store.StoreUrl:
    """A step directory as given; of a run directory (or its checkpoints/), the best (best.json)
    unless `latest`, else the newest complete one. Verified against its marker."""
    from pipeline.components.monitor import read_best

    if checkpoint.STEP_DIR.match(url.name) or (url / checkpoint.MARKER).exists():
        checkpoint.verify_complete(url)
        return url
    root = url / "checkpoints" if (url / "checkpoints").is_dir() else url
    found = checkpoint.latest(root)
    if found is None:
        raise checkpoint.CheckpointError(
            f"'{url}' holds no complete checkpoint (expected checkpoints/step_*/ with a "
            f"{checkpoint.MARKER} marker): was training interrupted before the first save?"
        )
    best = None if latest else read_best(root)
    return root / best["checkpoint"] if best else found


def _still_complete(url) -> bool:
    try:
        checkpoint.verify_complete(url)
        return True
    except checkpoint.CheckpointError:
        return False


def fetch_checkpoint(url: str, dest: Path, latest: bool = False) -> Path:
    """A checkpoint on an object store (a step directory, or a run directory: its best unless
    `latest`) copied into `dest/<run>/<step>/`, and verified there against its marker's sizes and
    checksums."""
    chosen = _choose_on_store(object_store.check_url(url, "the checkpoint"), latest)
    run = chosen.parent.parent.name if chosen.parent.name == "checkpoints" else chosen.parent.name
    local = Path(dest) / run / chosen.name
    # Into a directory of this fetch's own, renamed into place once verified: two fetches of one
    # checkpoint never delete each other's files, and a fetch cut short leaves no half copy under
    # the checkpoint's name.
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".fetch-{chosen.name}-", dir=local.parent))
    try:
        log.info("fetching %s into %s", chosen, local)
        try:
            object_store.fetch(chosen, staging)
            checkpoint.verify_checksums(staging)
        except (FileNotFoundError, checkpoint.CheckpointError) as exc:
            # damaged on the store or in transfer: said of the checkpoint, not our copy
            if _still_complete(chosen):
                raise checkpoint.CheckpointError(
                    str(exc).replace(str(staging), str(chosen))
                ) from None
            # The run is still training: its pruning removed the step meanwhile.
            raise checkpoint.CheckpointError(
                f"{chosen} was removed while it was being fetched: the run is probably "
                "still training and pruned it; fetch again (its newest complete "
                "checkpoint), or once the run has finished"
            ) from None
        # an older copy
        shutil.rmtree(local, ignore_errors=True)
        staging.rename(local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local
