"""The tokens every front end checks (envelope.Auth), in process; the front ends' end of them is tested
through real servers elsewhere (test_serving.py, test_shared_memory.py, test_shadow_and_drift.py)."""

from __future__ import annotations

import pytest

from serving.envelope import Auth, Refused


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
