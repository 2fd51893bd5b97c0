"""Exports that finish at once into one registered name: one promotion decision at a time, each
against the champion of its turn, so that @champion ends on the best of them and every loser's
report names whom it lost to. A real MLflow SQLite store and real logged models; the contenders run
in threads, as concurrent exports' registry calls interleave. What stands in for measuring a model
is its accuracy, read from a version tag."""

from __future__ import annotations

import threading
import time

import onnx
import pytest
from serving_fixtures import tiny_model

from pipeline import tracking
from pipeline.artifact import promotion
from serving import lineage

ACCURACY_TAG = "test.accuracy"


@pytest.fixture
def store(tmp_path):
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.set_experiment("promotion-race")
    try:
        yield mlflow.MlflowClient()
    finally:
        mlflow.set_tracking_uri(previous)


def logged_model(tmp_path, seed: int) -> str:
    import mlflow

    path = tiny_model(tmp_path / f"m{seed}.onnx", seed=seed)
    with mlflow.start_run():
        return mlflow.onnx.log_model(
            onnx.load(str(path)), name="model", pip_requirements=["onnxruntime"]
        ).model_uri


def compare_as_export_does(name: str, accuracy: float):
    """promotion.decide's shape, against whoever holds @champion when called; slow as a measurement
    is, so that contenders' comparisons overlap."""

    def compare() -> dict:
        holder = tracking.alias_version(name, "champion")
        time.sleep(0.5)
        decision = {"candidate": {"accuracy": accuracy}, "champion": None, "metric": "accuracy"}
        if holder is None:
            return decision | {
                "promote": True,
                "reason": f"first model: {name} has no @champion yet",
            }
        theirs = float(tracking.version_tags(name, holder)[ACCURACY_TAG])
        moves, gain, why = promotion.verdict(accuracy, theirs, "max", "if_better", 0.0)
        return decision | {
            "promote": moves,
            "gain": gain,
            "champion": {"version": holder, "accuracy": theirs},
            "reason": f"accuracy: candidate {why.format(f'@champion v{holder}')}",
        }

    return compare


def test_concurrent_exports_are_compared_with_each_other_and_the_best_holds_the_alias(
    store, tmp_path
):
    """The review's H4: two exports at once both printed "registered ... as @champion"; @champion
    ended on the worse one (0.2145 over 0.9248, never compared), and a 0.9721 candidate was replaced
    by a 0.9248 re-export. Here four contenders all compare against the same champion (0.95) before
    any registers, then register at once: @champion ends on the best, each decision was made against
    the holder of its turn, and none is left pending."""
    name = "racey"
    uris = [logged_model(tmp_path, seed) for seed in range(5)]
    version = tracking.register_version(uris[0], name, "champion", {ACCURACY_TAG: "0.95"})
    assert version == "1"
    accuracies = [0.9721, 0.2145, 0.99, 0.9248]
    start = threading.Barrier(len(accuracies))
    results: dict[float, tuple] = {}
    errors: list[BaseException] = []

    def export(uri: str, accuracy: float) -> None:
        try:
            compare = compare_as_export_does(name, accuracy)
            # every contender saw v1 as the champion
            first = compare()
            start.wait()
            results[accuracy] = promotion.promote_in_turn(
                uri, name, "champion", "challenger", {ACCURACY_TAG: str(accuracy)}, first, compare
            )
        except BaseException as exc:  # noqa: BLE001
            # reported by the test
            errors.append(exc)

    threads = [
        threading.Thread(target=export, args=(uri, acc)) for uri, acc in zip(uris[1:], accuracies)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    champion = str(store.get_model_version_by_alias(name, "champion").version)
    best = results[0.99][0]
    assert champion == best, {acc: (v, a, d["reason"]) for acc, (v, a, d) in results.items()}
    assert time.monotonic() - started < 60
    for accuracy, (version, alias, decision) in results.items():
        tags = store.get_model_version(name, version).tags
        assert tags[promotion.TAG] == ("promoted" if decision["promote"] else "not promoted")
        assert alias == ("champion" if decision["promote"] else "challenger")
        # a loser says whom it lost to, and that one was better
        if not decision["promote"]:
            assert (
                decision["champion"]["accuracy"] > accuracy
                and f"@champion v{decision['champion']['version']}" in decision["reason"]
            ), decision
    # decided one at a time, in version order: each compared against the previous winner
    order = sorted(results.values(), key=lambda r: int(r[0]))
    holder, holder_accuracy = "1", 0.95
    for version, alias, decision in order:
        assert (decision["champion"] or {}).get("version") == holder, (version, decision)
        if decision["promote"]:
            holder, holder_accuracy = version, decision["candidate"]["accuracy"]
    assert holder == champion and holder_accuracy == 0.99
    assert not tracking.versions_tagged(name, promotion.TAG, promotion.PENDING)


def test_when_pipeline_promote_moves_the_alias_both_versions_records_say_who_holds_what(
    store, tmp_path
):
    """The newcomer's friction 8, as `pipeline promote` leaves it: v1's page said "Why it holds
    @champion" and its run's verdict "v1 @champion" after @champion had moved. The two records
    `pipeline promote` writes through (the same as export's): the old holder names the new one; the
    promoted version's "Why it holds @challenger" and its run's verdict say it holds @champion
    now."""
    import mlflow

    name = "promoted-live"
    esc = tracking.markdown_escaped
    versions = {}
    for seed, alias, why in ((1, "champion", "first model"), (2, "challenger", "worse")):
        path = tiny_model(tmp_path / f"m{seed}.onnx", seed=seed)
        with mlflow.start_run() as run:
            uri = mlflow.onnx.log_model(
                onnx.load(str(path)), name="model", pip_requirements=["onnxruntime"]
            ).model_uri
            version = tracking.register_version(uri, name, alias, {})
            mlflow.set_tag(lineage.VERDICT, f"{name} v{version} @{alias}")
        tracking.describe_version(name, version, f"gates\n\nWhy it holds {esc('@' + alias)}: {why}")
        versions[alias] = (version, run.info.run_id)
    tracking.move_alias(name, "champion", "2")
    said = "pipeline promote: shadow verdict promote"
    promotion.record_alias_moved(name, "champion", "1", "2", said)
    promotion.record_alias_taken(name, "2", "challenger", "champion", said)

    old = store.get_model_version(name, "1").description.replace("\\", "")
    assert "Why it held @champion: first model" in old, old
    assert old.rsplit("\n\n", 1)[1].startswith("@champion is on v2 since ")
    assert old.endswith(f": {said}. This version no longer holds it."), old
    verdict = store.get_run(versions["champion"][1]).data.tags[lineage.VERDICT]
    assert verdict.startswith(f"{name} v1: @champion moved to v2 ("), verdict
    new = store.get_model_version(name, "2").description.replace("\\", "")
    assert "Why it held @challenger: worse" in new, new
    assert store.get_run(versions["challenger"][1]).data.tags[lineage.VERDICT] == (
        f"{name} v2 @champion ({said})"
    )
