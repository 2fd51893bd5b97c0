"""Runs of one experiment that log at the same moment (a sweep, two jobs on one tracking server):
each records what it logged, none fails on another's rows. A real MLflow SQLite store; the runs in
threads, released together."""

from __future__ import annotations

import hashlib
import threading

import pytest

from pipeline import tracking

RUNS = 8


@pytest.fixture
def experiment(tmp_path):
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    try:
        yield mlflow.create_experiment("concurrent-runs")
    finally:
        mlflow.set_tracking_uri(previous)


def test_runs_logging_the_same_dataset_at_once_each_record_it(experiment):
    """MLflow's store looks a dataset up, then inserts it: released together, most runs missed
    each other's row and failed on the unique key until tracking._log_input_beside_others logged
    again. Three rounds of new data."""
    import mlflow

    inputs = [{"name": "input", "dtype": "float32", "shape": [4]}]
    for round_ in range(3):
        # (new data each round: a dataset not in the store yet)
        digests = {
            split: {"sha256": hashlib.sha256(f"{split}{round_}".encode()).hexdigest(), "samples": 9}
            for split in ("train", "val")
        }
        released = threading.Barrier(RUNS)
        run_ids, failures = [], []

        def run() -> None:
            # (the active run is the thread's own)
            with mlflow.start_run(experiment_id=experiment) as active:
                run_ids.append(active.info.run_id)
                released.wait()
                try:
                    tracking.log_datasets("tests:data", {}, digests, inputs)
                except Exception as exc:  # noqa: BLE001
                    failures.append(repr(exc)[:300])

        threads = [threading.Thread(target=run) for _ in range(RUNS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == [], failures[:2]
        want = {split: found["sha256"] for split, found in digests.items()}
        assert [tracking.dataset_digests(run_id) for run_id in run_ids] == [want] * RUNS
