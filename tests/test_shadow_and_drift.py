"""The pure pieces of live judgement: the shadow comparison's pairs, labels and verdict, and the drift
statistic (the end-to-end story, with a real server and registry, is tests/test_live_judgement.py)."""

from __future__ import annotations

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
    shadow = Shadow(
        rule or Rule(min_pairs=10, min_labels=5, max_source_share=1.0)
    )  # (pairs of no known client)
    shadow.pairing("1", "2", "logits", None)
    for i in range(agree + disagree):
        champion = logits(np.array([i % 3]))
        challenger = champion if i < agree else logits(np.array([(i + 1) % 3]))
        shadow.answered(f"r{i}", champion)
        shadow.pair(f"r{i}", champion, challenger, 1.0, 2.0, ("1", "2"))
    return shadow


def test_the_verdict_waits_for_pairs_then_judges_agreement_then_labels():
    assert shadow_with_pairs(5, 0).report()["verdict"] == "undecided"
    assert shadow_with_pairs(20, 0).report()["verdict"] == "promote"
    rejected = shadow_with_pairs(10, 10).report()
    assert rejected["verdict"] == "reject" and rejected["agreement"] == 0.5
    # Labels decide once there are enough, after agreement: here the two agree on 19 of 20 (95%, the rule's
    # floor), the champion is always right and the challenger wrong once: 95% vs 100% is past the tolerance.
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
    # ...and labels can't outvote agreement: every label saying the half-wrong challenger is right changes nothing
    shadow = shadow_with_pairs(10, 10)
    shadow.feedback({f"r{i}": np.array([(i + 1) % 3 if i >= 10 else i % 3]) for i in range(20)})
    report = shadow.report()
    assert report["live"]["challenger"]["accuracy"] == 1.0 and report["verdict"] == "reject"
    assert "agreement 50.0%" in report["reason"]


def test_one_input_sent_again_and_again_counts_once():
    """The review's agreement poisoning: one input both versions answer alike, sent 400 times, gave 99% agreement
    over 405 pairs and "promote"; now it is one pair, and the others repeats."""
    shadow = Shadow(Rule(min_pairs=10))
    shadow.pairing("1", "2", "logits", None)
    same = input_digest({"input": np.zeros((1, 3), np.float32)})
    for i in range(5):  # 5 distinct inputs the challenger gets wrong
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
    assert (
        report["verdict"] == "undecided" and report["pairs"] == 6
    )  # 6 distinct pairs < min_pairs 10


def test_the_report_says_how_many_clients_sent_the_pairs_and_the_rule_can_bound_one_s_share():
    """One client's traffic is not everyone's: the report gives the number of client addresses and the largest
    share; --shadow-max-source-share 0.5 keeps a verdict undecided while one client sent more than half."""

    def judged(sources: list[str]) -> dict:
        shadow = Shadow(Rule(min_pairs=10, max_source_share=0.5))
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
        return shadow.report()

    one = judged(["10.0.0.7"] * 18 + ["10.0.0.8"] * 2)
    assert one["sources"] == 2 and one["largest_source_share"] == 0.9
    assert (
        one["verdict"] == "undecided"
        and "one client address sent 90.0% of the 20 pairs" in one["reason"]
    )
    many = judged([f"10.0.0.{i % 4}" for i in range(20)])
    from serving.config import Settings

    assert (
        Settings(model="m.onnx").shadow_rule()["max_source_share"] == 0.5
    )  # the server's default bounds it
    assert (
        many["sources"] == 4
        and many["largest_source_share"] == 0.25
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
    assert shadow.report()["labels"] == 0  # nothing counted


def test_a_label_of_the_wrong_size_is_refused_and_counts_nothing():
    shadow = shadow_with_pairs(20, 0)
    with pytest.raises(ValueError, match="the label of 'r3' has 2 values; its answer has 1"):
        shadow.feedback({"r1": np.array([1]), "r3": np.array([1, 2])})
    assert shadow.report()["labels"] == 0
    assert (
        shadow.feedback({"r1": np.array([1]), "r3": np.array([0])})["joined"] == 2
    )  # nothing was lost


def test_news_of_an_old_pairing_does_not_count_against_a_new_challenger():
    shadow = shadow_with_pairs(20, 0)
    shadow.pairing("1", "3", "logits", None)  # the alias moved on: a fresh comparison
    shadow.error(("1", "2"))  # the old challenger's late failure
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
    """Per-pixel answers would be megabytes each: only the decisions are kept, and the window is capped."""
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
        x[:, 2] += 0.5  # one feature moved by half its standard deviation
        shifted.observe({"x": x, "tokens": RNG.integers(0, 10, size=(1, 32))}, {})
    calm, moved = same.scores(), shifted.scores()
    assert calm[("inputs", "x")][0] < 0.1 and calm[("inputs", "tokens")][0] < 0.1, calm
    assert moved[("inputs", "x")][0] > 0.2 and moved[("inputs", "tokens")][0] > 0.2, moved


def test_pixel_values_of_a_uint8_variant_are_compared_with_the_training_data_once_scaled():
    ref = reference({"image": RNG.random((2000, 3, 4, 4), dtype=np.float32)})  # trained on [0, 1]
    scaled = drift.DriftWindow(ref, 500, {drift.PIXEL_INPUTS_KEY: "image"})
    unscaled = drift.DriftWindow(ref, 500)
    for _ in range(500):
        pixels = np.rint(RNG.random((1, 3, 4, 4)) * 255).astype(np.uint8)  # what its clients send
        scaled.observe({"image": pixels}, {})
        unscaled.observe({"image": pixels}, {})
    assert scaled.scores()[("inputs", "image")][0] < 0.1
    assert unscaled.scores()[("inputs", "image")][0] > 1.0  # what it would say without the metadata


def test_drift_skips_what_it_cannot_compare_instead_of_failing():
    ref = reference({"x": RNG.normal(size=(500, 8))})
    window = drift.DriftWindow(ref, 100)
    window.observe(
        {"x": RNG.normal(size=(4, 5)), "unknown": np.zeros((4, 2))}, {"out": np.zeros((4, 1))}
    )
    assert window.scores() == {}
    assert drift.psi(np.array([0.5, 0.5]), np.array([0.5, 0.5])) == 0.0


def test_labels_need_a_token_of_their_own(tmp_path):
    """The review's label poisoning: labels shared the inference token. Now the feedback route takes only
    --feedback-token, which answers nothing else; a server with an inference token but none for labels takes none."""
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
        assert (
            past_auth.status_code == 404 and "no shadow comparison" in past_auth.text
        )  # (no --shadow here)
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
