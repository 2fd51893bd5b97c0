"""The pure pieces of live judgement: the shadow comparison's pairs, labels and verdict, and the
drift statistic (the end-to-end story, with a real server and registry, is
tests/test_live_judgement.py)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from serving import drift
from serving.envelope import source_of
from serving.shadow import Rule, Shadow, input_digest

RNG = np.random.default_rng(0)


def logits(classes: np.ndarray, n_classes: int = 3) -> dict[str, np.ndarray]:
    out = np.zeros((len(classes), n_classes), np.float32)
    out[np.arange(len(classes)), classes] = 5
    return {"logits": out, "probabilities": out / 5}


def shadow_with_pairs(agree: int, disagree: int, rule: Rule | None = None) -> Shadow:
    # (pairs of no known client)
    shadow = Shadow(rule or Rule(min_pairs=10, min_labels=5, max_source_share=1.0))
    shadow.pairing("1", "2", "logits", None)
    for i in range(agree + disagree):
        champion = logits(np.array([i % 3]))
        challenger = champion if i < agree else logits(np.array([(i + 1) % 3]))
        shadow.answered(f"r{i}", champion)
        shadow.pair(f"r{i}", champion, challenger, 1.0, 2.0, ("1", "2"))
    return shadow


def test_the_verdict_waits_for_pairs_then_judges_agreement_then_labels():
    assert shadow_with_pairs(5, 0).report()["verdict"] == "undecided"
    # agreement alone, however high, never promotes: it waits for labels
    agreed = shadow_with_pairs(20, 0).report()
    assert agreed["verdict"] == "undecided" and agreed["decided_by"] == "labels", agreed
    assert "promoting takes labels (--feedback-token): 0 on mirrored requests" in agreed["reason"]
    rejected = shadow_with_pairs(10, 10).report()
    assert rejected["verdict"] == "reject" and rejected["agreement"] == 0.5
    assert rejected["decided_by"] == "agreement"
    # Labels decide once there are enough, after agreement: the challenger right as often as the
    # champion
    shadow = shadow_with_pairs(20, 0)
    shadow.feedback({f"r{i}": np.array([i % 3]) for i in range(20)})
    report = shadow.report()
    assert report["verdict"] == "promote" and report["decided_by"] == "labels", report
    assert "live accuracy 100.0% vs the champion's 100.0% on 20 labels" in report["reason"]
    # here the two agree on 19 of 20 (95%, the rule's floor), the champion is always right and the
    # challenger wrong once: 95% vs 100% is past the tolerance.
    shadow = shadow_with_pairs(19, 1)
    joined = shadow.feedback(
        {f"r{i}": np.array([i % 3]) for i in range(20)} | {"nobody": np.array([0])}
    )
    assert joined == {"joined": 20, "unknown": 1}
    report = shadow.report()
    assert (
        report["live"]["champion"]["accuracy"] == 1.0
        and report["live"]["challenger"]["accuracy"] == 0.95
    )
    assert report["verdict"] == "reject" and "live accuracy 95.0%" in report["reason"]
    # ...and labels can't outvote agreement: every label saying the half-wrong challenger is right
    # changes nothing
    shadow = shadow_with_pairs(10, 10)
    shadow.feedback({f"r{i}": np.array([(i + 1) % 3 if i >= 10 else i % 3]) for i in range(20)})
    report = shadow.report()
    assert report["live"]["challenger"]["accuracy"] == 1.0 and report["verdict"] == "reject"
    assert "agreement 50.0%" in report["reason"]


def test_agreement_alone_never_promotes_and_one_proxy_s_disagreement_rejects():
    """The review's F3: agreement steered from 4 addresses (near-copies of an input both versions
    answer alike) made a 7%-accurate challenger "promote"; and behind one proxy (every pair from one
    address) 600 pairs at 22.8% agreement stayed "undecided". Now agreement, from any number of
    clients, can reject; it never promotes."""

    def judged(agree: int, total: int, sources: list[str]) -> dict:
        # the server's defaults: 200 pairs, 95%, 100 labels, share 0.5
        shadow = Shadow(Rule())
        shadow.pairing("1", "2", "logits", None)
        for i in range(total):
            champion = logits(np.array([i % 3]))
            challenger = champion if i < agree else logits(np.array([(i + 1) % 3]))
            digest = input_digest({"input": np.full((1, 3), i, np.float32)})
            source = sources[i % len(sources)]
            shadow.pair(f"r{i}", champion, challenger, 1.0, 1.0, ("1", "2"), digest, source)
        return shadow.report()

    proxy = judged(137, 600, ["10.0.0.1"])
    assert round(proxy["agreement"], 3) == 0.228 and proxy["largest_source_share"] == 1.0
    assert proxy["verdict"] == "reject", proxy
    assert "top-1 agreement 22.8% < 95.0% over 600 pairs" in proxy["reason"]
    steered = judged(4400, 4400, [f"127.0.0.{2 + i}" for i in range(4)] + ["127.0.0.1"] * 3)
    assert steered["agreement"] == 1.0 and steered["largest_source_share"] < 0.5
    assert steered["verdict"] == "undecided" and "promoting takes labels" in steered["reason"]


def test_a_request_id_used_again_never_replaces_the_answers_kept():
    """The review's F3: the answers kept for an id were the last request's, and ids were a prefix
    and a counter, so a client re-sent its own answers under the ids other clients had got. An id
    kept is kept: the server's own ids never repeat, and one that does is no honest request's."""
    shadow = Shadow(Rule(min_pairs=1, min_labels=1, max_source_share=1.0))
    shadow.pairing("1", "2", "logits", None)
    honest = logits(np.array([2]))
    shadow.answered("server-id", honest)
    shadow.pair("server-id", honest, honest, 1.0, 1.0, ("1", "2"), b"honest", "10.0.0.1")
    attacker = logits(np.array([0]))
    shadow.answered("server-id", attacker)
    shadow.pair("server-id", attacker, attacker, 1.0, 1.0, ("1", "2"), b"attacker", "10.0.0.9")
    assert shadow.feedback({"server-id": np.array([2])}) == {"joined": 1, "unknown": 0}
    live = shadow.report()["live"]
    assert live["champion"]["accuracy"] == 1.0 and live["challenger"]["accuracy"] == 1.0, live


def test_server_request_ids_are_random_not_a_prefix_and_a_counter():
    """Ids a client can predict let it name other clients' requests: each is 128 random bits now."""
    from serving.envelope import new_request_id

    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == 2000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    # a prefix and a counter shared their first 16 digits and differed by one
    assert len({i[:8] for i in ids}) > 1900
    assert not any(int(b, 16) - int(a, 16) == 1 for a, b in zip(ids, ids[1:]))


def test_one_input_sent_again_and_again_counts_once():
    """The review's agreement poisoning: one input both versions answer alike, sent 400 times, gave
    99% agreement over 405 pairs and "promote"; now it is one pair, and the others repeats."""
    shadow = Shadow(Rule(min_pairs=10))
    shadow.pairing("1", "2", "logits", None)
    same = input_digest({"input": np.zeros((1, 3), np.float32)})
    # 5 distinct inputs the challenger gets wrong
    for i in range(5):
        champion = logits(np.array([i % 3]))
        shadow.pair(
            f"d{i}",
            champion,
            logits(np.array([(i + 1) % 3])),
            1.0,
            1.0,
            ("1", "2"),
            input_digest({"input": np.full((1, 3), i + 1, np.float32)}),
        )
    for i in range(400):
        shadow.pair(
            f"s{i}", logits(np.array([0])), logits(np.array([0])), 1.0, 1.0, ("1", "2"), same
        )
    report = shadow.report()
    assert report["distinct_inputs"] == 6 and report["repeated_inputs"] == 399
    # 6 distinct pairs < min_pairs 10
    assert report["verdict"] == "undecided" and report["pairs"] == 6


def test_the_report_says_how_many_clients_sent_the_pairs_and_the_rule_bounds_one_s_share_of_labels():
    """One client's traffic is not everyone's: the report gives the number of client addresses and
    the largest share, of the pairs and of the labelled pairs; --shadow-max-source-share 0.5 keeps a
    verdict by labels undecided while one client sent more than half of the labelled pairs
    (agreement rejects from any number)."""

    def judged(sources: list[str]) -> dict:
        shadow = Shadow(Rule(min_pairs=10, min_labels=10, max_source_share=0.5))
        shadow.pairing("1", "2", "logits", None)
        for i, source in enumerate(sources):
            champion = logits(np.array([i % 3]))
            shadow.pair(
                f"r{i}",
                champion,
                champion,
                1.0,
                1.0,
                ("1", "2"),
                input_digest({"input": np.full((1, 3), i, np.float32)}),
                source,
            )
        shadow.feedback({f"r{i}": np.array([i % 3]) for i in range(len(sources))})
        return shadow.report()

    one = judged(["10.0.0.7"] * 18 + ["10.0.0.8"] * 2)
    assert one["sources"] == 2 and one["largest_source_share"] == 0.9
    assert one["labelled_sources"] == 2 and one["largest_labelled_source_share"] == 0.9
    assert (
        one["verdict"] == "undecided"
        and "one client address sent 90.0% of the 20 labelled pairs" in one["reason"]
    )
    many = judged([f"10.0.0.{i % 4}" for i in range(20)])
    from serving.config import Settings

    # the server's default bounds it
    assert Settings(model="m.onnx").shadow_rule()["max_source_share"] == 0.5
    assert (
        many["sources"] == 4
        and many["largest_labelled_source_share"] == 0.25
        and many["verdict"] == "promote"
    )
    # what each front end knows of its client, as one address: a socket's peername, grpc's peer
    assert source_of(("127.0.0.1", 50123)) == "127.0.0.1" and source_of(("::1", 5, 0, 0)) == "::1"
    assert source_of("ipv4:10.1.2.3:50123") == "10.1.2.3" and source_of("ipv6:[::1]:443") == "::1"
    assert source_of("ipv6:%5B::1%5D:443") == "::1" and source_of(None) == ""


def test_labels_that_no_answer_could_match_are_refused_naming_the_first():
    shadow = shadow_with_pairs(20, 0)
    for bad, words in (
        (np.array([-1]), "holds -1, not a class of this model"),
        (np.array([3]), "from 0 to 2"),
        (np.array([1.5]), "holds 1.5"),
        (np.array([np.nan]), "NaN or Inf"),
    ):
        with pytest.raises(ValueError, match=words):
            shadow.feedback({"r0": bad})
    # nothing counted
    assert shadow.report()["labels"] == 0


def test_a_label_of_the_wrong_size_is_refused_and_counts_nothing():
    shadow = shadow_with_pairs(20, 0)
    with pytest.raises(ValueError, match="the label of 'r3' has 2 values; its answer has 1"):
        shadow.feedback({"r1": np.array([1]), "r3": np.array([1, 2])})
    assert shadow.report()["labels"] == 0
    # nothing was lost
    assert shadow.feedback({"r1": np.array([1]), "r3": np.array([0])})["joined"] == 2


def test_news_of_an_old_pairing_does_not_count_against_a_new_challenger():
    shadow = shadow_with_pairs(20, 0)
    # the alias moved on: a fresh comparison
    shadow.pairing("1", "3", "logits", None)
    # the old challenger's late failure
    shadow.error(("1", "2"))
    shadow.dropped(("1", "2"))
    shadow.pair("late", logits(np.array([0])), logits(np.array([1])), 1.0, 1.0, ("1", "2"))
    report = shadow.report()
    assert (
        report["challenger_version"] == "3"
        and report["pairs"] == 0
        and report["challenger_errors"] == 0
    )
    assert report["dropped"] == 0


def test_answers_are_kept_small_and_bounded():
    """Per-pixel answers would be megabytes each: only the decisions are kept, and the window is
    capped."""
    shadow = Shadow(Rule())
    shadow.pairing("1", "2", "logits", None)
    big = {"logits": RNG.normal(size=(1, 11, 64, 64)).astype(np.float32)}
    for i in range(50):
        shadow.answered(f"r{i}", big)
    kept = shadow.state.answers["r0"][0]
    assert (
        kept.shape == (1, 64, 64)
        and kept.dtype == np.int16
        and shadow.state.answer_bytes == 50 * kept.nbytes
    )


def reference(train: dict[str, np.ndarray]) -> dict:
    builder = drift.ReferenceBuilder()
    builder.add("inputs", train)
    return builder.build()


def test_drift_stays_low_for_the_same_data_and_rises_for_a_half_sigma_shift():
    ref = reference(
        {"x": RNG.normal(size=(2000, 6)), "tokens": RNG.integers(0, 20, size=(2000, 32))}
    )
    same, shifted = drift.DriftWindow(ref, 500), drift.DriftWindow(ref, 500)
    for _ in range(500):
        same.observe(
            {"x": RNG.normal(size=(1, 6)), "tokens": RNG.integers(0, 20, size=(1, 32))}, {}
        )
        x = RNG.normal(size=(1, 6))
        # one feature moved by half its standard deviation
        x[:, 2] += 0.5
        shifted.observe({"x": x, "tokens": RNG.integers(0, 10, size=(1, 32))}, {})
    calm, moved = same.scores(), shifted.scores()
    assert calm[("inputs", "x")][0] < 0.1 and calm[("inputs", "tokens")][0] < 0.1, calm
    assert moved[("inputs", "x")][0] > 0.2 and moved[("inputs", "tokens")][0] > 0.2, moved


def test_pixel_values_of_a_uint8_variant_are_compared_with_the_training_data_once_scaled():
    # trained on [0, 1]
    ref = reference({"image": RNG.random((2000, 3, 4, 4), dtype=np.float32)})
    scaled = drift.DriftWindow(ref, 500, {drift.PIXEL_INPUTS_KEY: "image"})
    unscaled = drift.DriftWindow(ref, 500)
    for _ in range(500):
        # what its clients send
        pixels = np.rint(RNG.random((1, 3, 4, 4)) * 255).astype(np.uint8)
        scaled.observe({"image": pixels}, {})
        unscaled.observe({"image": pixels}, {})
    assert scaled.scores()[("inputs", "image")][0] < 0.1
    # what it would say without the metadata
    assert unscaled.scores()[("inputs", "image")][0] > 1.0


def test_drift_skips_what_it_cannot_compare_instead_of_failing():
    ref = reference({"x": RNG.normal(size=(500, 8))})
    window = drift.DriftWindow(ref, 100)
    window.observe(
        {"x": RNG.normal(size=(4, 5)), "unknown": np.zeros((4, 2))}, {"out": np.zeros((4, 1))}
    )
    assert window.scores() == {}
    assert drift.psi(np.array([0.5, 0.5]), np.array([0.5, 0.5])) == 0.0


def test_labels_need_a_token_of_their_own(tmp_path):
    """The review's label poisoning: labels shared the inference token. Now the feedback route takes
    only --feedback-token, which answers nothing else; a server with an inference token but none for
    labels takes none."""
    import requests
    from serving_fixtures import ServerProcess, tiny_model

    model = str(tiny_model(tmp_path / "m.onnx"))
    labels = {"labels": [{"id": "r1", "target": 0}]}
    env = {"TRAINSERVE_AUTH_TOKEN": "infer-secret", "TRAINSERVE_FEEDBACK_TOKEN": "label-secret"}
    with ServerProcess("--model", model, env=env, log_path=tmp_path / "a.log") as srv:
        url = f"{srv.url}/v2/models/tiny/feedback"
        bearer = lambda token: {"Authorization": f"Bearer {token}"}  # noqa: E731
        refused = requests.post(url, json=labels, headers=bearer("infer-secret"), timeout=10)
        assert refused.status_code == 403 and "not the inference token" in refused.text
        assert requests.post(url, json=labels, timeout=10).status_code == 401
        past_auth = requests.post(url, json=labels, headers=bearer("label-secret"), timeout=10)
        # (no --shadow here)
        assert past_auth.status_code == 404 and "no shadow comparison" in past_auth.text
        assert (
            requests.get(
                f"{srv.url}/v2/models/tiny", headers=bearer("label-secret"), timeout=10
            ).status_code
            == 401
        )
    with ServerProcess(
        "--model", model, env={"TRAINSERVE_AUTH_TOKEN": "infer-secret"}, log_path=tmp_path / "b.log"
    ) as srv:
        refused = requests.post(
            f"{srv.url}/v2/models/tiny/feedback",
            json=labels,
            headers={"Authorization": "Bearer infer-secret"},
            timeout=10,
        )
        assert refused.status_code == 403 and "--feedback-token" in refused.text


@pytest.mark.slow
def test_labels_join_the_server_s_own_ids_and_a_client_reusing_them_changes_nothing(tmp_path):
    """A real server shadowing a registered challenger: every answer's receipt carries the server's
    own id (X-Server-Request-Id, over HTTP and gRPC), random and never the client's; a client
    sending its requests under other clients' ids (as X-Request-Id and the V2 "id") replaces none of
    their kept answers; 100% agreement alone stays undecided, and the labeller's labels, posted
    under the server's ids, decide."""
    import grpc
    import mlflow
    import onnx
    import requests
    from serving_fixtures import ServerProcess, free_port, tiny_model

    from serving import lineage
    from serving.grpc import schema

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.create_experiment("shadow", (tmp_path / "artifacts").as_uri())
        # the challenger: the champion's very weights (every answer agrees)
        for _ in range(2):
            model = onnx.load(str(tiny_model(tmp_path / "m.onnx", seed=1, name="digits")))
            model.metadata_props.add(key=lineage.DECISION, value="logits")
            with mlflow.start_run(experiment_id=experiment):
                mlflow.onnx.log_model(
                    model, name="model", registered_model_name="digits", pip_requirements=[]
                )
        client = mlflow.MlflowClient()
        client.set_registered_model_alias("digits", "champion", "1")
        client.set_registered_model_alias("digits", "challenger", "2")
    finally:
        mlflow.set_tracking_uri(None)
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        "models:/digits@champion",
        "--shadow",
        "1.0",
        "--shadow-min-pairs",
        "40",
        "--shadow-min-labels",
        "20",
        "--shadow-max-source-share",
        "1",
        "--grpc-port",
        str(grpc_port),
        env={"MLFLOW_TRACKING_URI": uri, "TRAINSERVE_FEEDBACK_TOKEN": "labels"},
        log_path=tmp_path / "server.log",
    ) as srv:
        rng = np.random.default_rng(11)

        def ask(x, rid):
            body = {
                "id": rid,
                "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32"}],
            }
            body["inputs"][0]["data"] = x.ravel().tolist()
            r = requests.post(
                f"{srv.url}/v2/models/digits/infer",
                json=body,
                headers={"X-Request-Id": rid},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            return r.headers, int(np.argmax(r.json()["outputs"][0]["data"]))

        honest = {}
        for i in range(30):
            headers, answer = ask(rng.random((1, 1, 8, 8), dtype=np.float32), f"honest-{i}")
            assert headers["X-Request-Id"] == f"honest-{i}"
            assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Server-Request-Id"]), headers
            honest[headers["X-Server-Request-Id"]] = answer
        # other clients' ids, reused: their own answers
        for i, server_id in enumerate(honest):
            ask(rng.random((1, 1, 8, 8), dtype=np.float32) * 4 - 2, server_id)
        message = schema.ModelInferRequest(model_name="digits", id="grpc-1")
        message.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
        message.raw_input_contents.append(np.full(64, 0.5, np.float32).tobytes())
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            _, call = infer.with_call(message.SerializeToString(), timeout=30)
        receipt = dict(call.initial_metadata())
        assert receipt["x-request-id"] == "grpc-1"
        assert re.fullmatch(r"[0-9a-f]{32}", receipt["x-server-request-id"]), receipt
        report = {}
        for _ in range(100):
            report = requests.get(f"{srv.url}/v2/models/digits/shadow", timeout=10).json()
            if report["pairs"] + report["dropped"] >= 61:
                break
            time.sleep(0.1)
        assert report["pairs"] >= 40 and report["agreement"] == 1.0, report
        assert report["verdict"] == "undecided" and "promoting takes labels" in report["reason"]
        labels = [{"id": k, "target": v} for k, v in honest.items()]
        # a client's ids: unknown
        labels += [{"id": f"honest-{i}", "target": 0} for i in range(5)]
        joined = requests.post(
            f"{srv.url}/v2/models/digits/feedback",
            json={"labels": labels},
            headers={"Authorization": "Bearer labels"},
            timeout=30,
        ).json()
        assert joined["unknown"] == 5 and joined["joined"] == 30, joined
        report = joined["report"]
        # the answers joined are the honest ones: the labels are what the champion told them
        assert report["live"]["champion"]["accuracy"] == 1.0, report["live"]
        assert report["labelled_pairs"] >= 20 and report["verdict"] == "promote", report
        assert report["decided_by"] == "labels"
