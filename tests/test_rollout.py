"""Replicas that roll to a new version with zero failed requests (issue 20).

Real server processes following models:/digits@champion at --reload-interval 2, a real MLflow store
(SQLite and local artifacts, versions registered through MLflow's API with the sha256 the export
records), real HTTP and gRPC clients in closed loops while the alias moves. The fleets of two
replicas run on two hosts (network namespaces from tests/hosts.py: each its own address and working
directory) where this machine can make them (root, `ip netns`), else as separate processes on
loopback, each with its own working and download directory. The hosts share the registry's SQLite
file and artifact directory (the MLflow store), nothing else.
"""

from __future__ import annotations

import time

import fleet
import pytest
import requests

# hosts: the fixture `machines` asks for
from hosts import hosts, namespaces_unavailable  # noqa: F401
from serving_fixtures import metric

pytestmark = pytest.mark.slow

# the bound at --reload-interval 2
CONVERGE_LIMIT = 60.0
# A partial batch waits up to 20 ms for more rows: requests are nearly always queued on a replica's
# batcher when its alias moves, so an old version dropped before its queue drained fails some of
# them.
BATCHING = ("--max-batch-size", "8", "--max-delay-ms", "20")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Versions 1-4 of 'digits': 1 and 2 good, 3 and 4 broken by the failure test; @champion ->
    1."""
    return fleet.registered_versions(tmp_path_factory.mktemp("rollout-registry"), 4)


@pytest.fixture
def machines(request):
    """`machines(n)`: n namespace hosts for the replicas where this machine can make them, else None
    (loopback)."""
    reason = namespaces_unavailable()
    if reason:
        print(f"\nreplicas on loopback: {reason}")
        return lambda n: None
    return request.getfixturevalue("hosts")


def roll(load: fleet.Load, tracking_uri: str, version: str, expected: set[str]) -> dict[str, float]:
    """Let the load run a moment on the old version, move @champion, wait for every replica to
    answer from `version`, and let it run a moment on the new one. Returns {replica: seconds to
    converge}."""
    time.sleep(1.0)
    moved = fleet.move_alias(tracking_uri, version)
    seen = fleet.wait_converged(load, moved, version, expected, CONVERGE_LIMIT, fail_fast=True)
    time.sleep(1.0)
    return seen


def check_rollout(answers, seen, old: str, new: str, expected: set[str]) -> None:
    bad = fleet.failures(answers)
    assert not bad, f"{len(bad)} failed of {len(answers)}; first: {bad[:3]}"
    tally = fleet.per_version(answers)
    print(f"\nrequests per version by replica: {tally}")
    print("converged after: " + ", ".join(f"{r} {s:.2f} s" for r, s in sorted(seen.items())))
    assert set(tally) == expected
    for replica, versions in tally.items():
        assert set(versions) == {old, new} and min(versions.values()) > 0, (replica, versions)
    assert max(seen.values()) <= CONVERGE_LIMIT
    # Once a replica answered from the new version, no request sent after that was answered by the
    # old one (in-flight ones drain on the old session, and may arrive just after).
    for a in answers:
        if (
            a.status == 200
            and a.done - a.seconds > first_answer_from(answers, a.replica, new)
            and a.version == old
        ):
            raise AssertionError(
                f"{a.replica} answered from version {old} a request sent after its switch: {a}"
            )


def first_answer_from(answers, replica: str, new: str) -> float:
    return min(
        (a.done for a in answers if a.replica == replica and a.version == new), default=float("inf")
    )


def test_two_replicas_follow_champion_under_load_with_zero_failed_requests(
    registry, tmp_path, machines
):
    fleet.move_alias(registry, "1")
    network = machines(2)
    with fleet.replicas(
        2, registry, tmp_path, grpc_first=True, extra=BATCHING, hosts=network and network.hosts
    ) as servers:
        urls = [s.url for s in servers]
        targets = [*urls, f"grpc:{servers[0].grpc}"]
        with fleet.ReadyWatch(urls) as watch, fleet.Load(targets, clients=3) as load:
            seen = roll(load, registry, "2", set(targets))
        answers = load.snapshot()
        check_rollout(answers, seen, "1", "2", set(targets))
        assert watch.checks > 20 and not watch.not_ready, watch.not_ready[:5]
        for server in servers:
            meta = requests.get(server.url + "/v2/models/digits").json()
            assert meta["versions"] == ["2"] and meta["parameters"]["alias"]["behind"] is False, (
                meta
            )
            text = requests.get(server.url + "/metrics").text
            assert metric(text, "trainserve_model_reloads_total", model="digits") == 1


def test_nginx_in_front_of_two_replicas(registry, tmp_path, machines):
    missing = fleet.nginx_missing()
    if missing:
        pytest.skip(missing)
    fleet.move_alias(registry, "1")
    network = machines(2)
    with fleet.replicas(
        2, registry, tmp_path, extra=BATCHING, hosts=network and network.hosts
    ) as servers:
        upstreams = {s.url.removeprefix("http://") for s in servers}
        with fleet.nginx([s.url for s in servers], tmp_path) as balancer:
            with (
                fleet.ReadyWatch([balancer, *[s.url for s in servers]]) as watch,
                fleet.Load([balancer], clients=4) as load,
            ):
                seen = roll(load, registry, "2", upstreams)
        answers = load.snapshot()
        # every answer names the replica that gave it
        check_rollout(answers, seen, "1", "2", upstreams)
        assert watch.checks > 20 and not watch.not_ready, watch.not_ready[:5]


def test_a_replica_whose_new_version_fails_to_load_keeps_serving_the_old_one(registry, tmp_path):
    """@champion moves to version 3, whose stored file was changed after registration (its sha256 no
    longer the recorded one), then to version 4, whose file is not ONNX at all but records its own
    hash (onnxruntime refuses it): the replica answers every request from version 1, stays ready,
    and says why."""
    import mlflow

    client = mlflow.MlflowClient(registry)
    corrupt = fleet.stored_onnx(client, "3")
    corrupt.write_bytes(corrupt.read_bytes()[:-16] + b"\0" * 16)
    broken = fleet.stored_onnx(client, "4")
    broken.write_bytes(b"not an onnx model")
    client.set_model_version_tag(
        "digits", "4", fleet.SHA_TAG, fleet.sha256_record(fleet.sha256(broken))
    )
    fleet.move_alias(registry, "1")
    with fleet.replicas(1, registry, tmp_path, extra=BATCHING) as (server,):
        with fleet.ReadyWatch([server.url]) as watch, fleet.Load([server.url], clients=2) as load:
            for version, why in (("3", "the version records"), ("4", "")):
                fleet.move_alias(registry, version)
                deadline = time.monotonic() + CONVERGE_LIMIT
                while (
                    metric(
                        requests.get(server.url + "/metrics").text,
                        "trainserve_model_reload_failures_total",
                        version=version,
                    )
                    < 1
                ):
                    assert time.monotonic() < deadline, server.log()
                    time.sleep(0.2)
                meta = requests.get(server.url + "/v2/models/digits").json()
                alias = meta["parameters"]["alias"]
                assert (
                    meta["versions"] == ["1"]
                    and alias["version"] == version
                    and alias["behind"] is True
                ), meta
                assert (
                    alias["error"].startswith(f"version {version} failed to load")
                    and why in alias["error"]
                ), alias
                index = requests.post(server.url + "/v2/repository/index", json={}).json()
                assert index == [
                    {
                        "name": "digits",
                        "version": "1",
                        "state": "READY",
                        "reason": f"models:/digits@champion names version {version}, which failed to load; "
                        "still serving version 1",
                    }
                ], index
                text = requests.get(server.url + "/metrics").text
                assert metric(text, "trainserve_model_behind_alias", model="digits") == 1
                time.sleep(0.5)
        answers = load.snapshot()
        assert not fleet.failures(answers), fleet.failures(answers)[:3]
        assert len(answers) > 20 and {a.version for a in answers} == {"1"}
        assert watch.checks > 20 and not watch.not_ready, watch.not_ready[:5]
        log = server.log()
        for version in ("3", "4"):
            assert (
                f"loading version {version} failed (attempt 1" in log
                and "still serving version 1" in log
            ), log


def test_a_new_version_with_another_dynamic_axis_is_warmed_up_with_the_last_request_answered(
    tmp_path, caplog
):
    """Zeros can't warm up a model whose input has a dynamic axis besides the batch axis (no size to
    guess): the new version runs the last request its model answered, through its own session,
    before it serves."""
    import asyncio
    import logging
    from types import SimpleNamespace

    import numpy as np
    from serving_fixtures import two_axes_model

    from serving.config import Settings
    from serving.core import Server
    from serving.envelope import Exchange
    from serving.loader import load_model

    old, new = two_axes_model(tmp_path / "old.onnx"), two_axes_model(tmp_path / "new.onnx")
    x = np.arange(10, dtype=np.float32).reshape(2, 5)

    async def scenario():
        server = Server(
            Settings(model=str(old)), load_model(str(old), device="cpu", threads=1, name="dyn")
        )
        async with server.lifespan():
            fresh = load_model(str(new), device="cpu", threads=1, name="dyn", version="2")
            # nothing answered yet: nothing to warm it with
            await server.warm_up.between_batches(fresh)
            answer = await server.answer(
                server.slot,
                SimpleNamespace(feeds={"x": x}, rows=2, request_id=None),
                Exchange("test"),
                endpoint="test",
                follow_swap=True,
            )
            np.testing.assert_allclose(answer.results["total"], x.sum(axis=1))
            await server.warm_up.between_batches(fresh)
            fresh.engine.close()
            # a warm-up that fails is said, the version not refused
            await server.warm_up.between_batches(fresh)

    with caplog.at_level(logging.INFO, logger="serving.core"):
        asyncio.run(scenario())
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "serving.core" and "warm-up" in r.getMessage()
    ]
    assert len(said) == 3, said
    assert (
        "no warm-up: an input has a dynamic axis besides the batch axis, and no request answered"
        in said[0]
    )
    assert "warm-up with the last request answered (an input has a dynamic axis" in said[1]
    assert (
        "warm-up with the last request answered failed (serving it anyway): the model was unloaded"
        in said[2]
    )
