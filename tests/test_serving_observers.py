"""What the inference path asks of what surrounds it, in process: the tokens (envelope.Auth) and the
observers of answers (core.Observer: the payload log, the shadow's mirror and the warm-up subscribe
there). Real servers test the front ends' side elsewhere (test_serving_receipts.py,
test_payload_log.py, test_shadow_and_drift.py); here, the rules they share."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from serving_fixtures import tiny_model

from serving.envelope import Auth, Exchange, Refused


def refused(check, header: str) -> tuple[int, str]:
    with pytest.raises(Refused) as caught:
        check(header)
    return caught.value.status, str(caught.value)


def test_any_client_s_token_opens_inference_and_labels_take_only_their_own():
    # A loopback server with no token: everything open, labels too.
    Auth([]).check("")
    Auth([]).check_labels("")
    auth = Auth([b"alice", b"bob"], "labels")
    for header in ("Bearer alice", "bearer bob", "Bearer  bob "):
        auth.check(header)
    for header in ("", "Bearer carol", "Basic alice", "alice", "Bearer labels"):
        assert refused(auth.check, header)[0] == 401, header
    auth.check_labels("Bearer labels")
    status, message = refused(auth.check_labels, "Bearer alice")
    assert status == 403 and "not the inference token" in message
    assert refused(auth.check_labels, "Bearer carol")[0] == 401
    # Tokens for inference and none for labels: no one may send labels.
    status, message = refused(Auth([b"alice"]).check_labels, "Bearer alice")
    assert status == 403 and "--feedback-token" in message


class Watcher:
    """An observer keeping the inputs of the requests whose id is 'kept'."""

    def __init__(self):
        self.seen = []

    def keeps(self, slot, request_id: str) -> bool:
        return request_id == "kept"

    def answered(self, answer) -> None:
        self.seen.append(answer)


class Broken:
    def keeps(self, slot, request_id: str) -> bool:
        return False

    def answered(self, answer) -> None:
        raise RuntimeError("a bug in an observer")


def test_observers_are_told_each_answer_once_and_one_that_fails_fails_no_answer(tmp_path, caplog):
    from serving.config import Settings
    from serving.core import Server
    from serving.loader import load_model

    path = str(tiny_model(tmp_path / "m.onnx"))
    settings = Settings(model=path, max_rows_per_request=2)
    server = Server(settings, load_model(path, device="cpu", threads=1))
    watcher = Watcher()
    server.observers = (Broken(), watcher, *server.observers)
    x = np.random.default_rng(0).normal(size=(2, 1, 8, 8)).astype(np.float32)

    async def ask(rows: int, body_id: str | None, header_id: str | None = None):
        exchange = Exchange("test")
        exchange.slot, exchange.request_id = server.slot, header_id
        request = SimpleNamespace(
            feeds={"input": x[:1].repeat(rows, 0)}, rows=rows, request_id=body_id
        )
        try:
            await server.answer(server.slot, request, exchange, endpoint="test", follow_swap=True)
        except Refused as exc:
            assert exc.status == 400 and "at most 2 per request" in str(exc)
        return exchange, request

    async def scenario():
        async with server.lifespan():
            return [await ask(2, "kept"), await ask(2, "kept", header_id="h-1"), await ask(3, None)]

    with caplog.at_level(logging.ERROR, logger="serving.core"):
        asked = asyncio.run(scenario())
    assert [a.request_id for a in watcher.seen] == ["kept", "h-1", asked[2][0].request_id]
    assert [a.status for a in watcher.seen] == [200, 200, 400]
    # The receipt: the headers' id, else the body's, else a fresh one; a server's id each time.
    for (exchange, _), answer in zip(asked, watcher.seen):
        assert answer.exchange is exchange and len(exchange.server_id) == 32
        assert exchange.receipt["X-Request-Id"] == answer.request_id
    assert len(asked[2][0].request_id) == 32
    # Kept inputs are the observer's own copy; the others are the request's arrays.
    kept, not_kept, _ = watcher.seen
    assert kept.inputs is not asked[0][1].feeds and kept.keepers == (watcher,)
    np.testing.assert_array_equal(kept.inputs["input"], asked[0][1].feeds["input"])
    assert not_kept.inputs is asked[1][1].feeds and not_kept.keepers == ()
    assert watcher.seen[2].results is None and "at most 2 per request" in watcher.seen[2].error
    said = [r.getMessage() for r in caplog.records]
    assert said.count("Broken failed on request kept") == 1, said
