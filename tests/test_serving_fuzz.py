"""Property-based fuzzing of both protocols against a live server: whatever a client sends, the
answer is never a 5xx and the server stays live. Hypothesis builds V2 bodies (JSON, and binary with
a header length), and MLflow scoring bodies, from near-valid to absurd: wrong types in every field,
odd shapes, huge and negative dimensions, strings and nulls for numbers, stray parameters, bytes
that do not add up.

Bounded: a fixed number of examples per protocol and a fixed seed (derandomize), so CI sees the same
requests every run; TRAINSERVE_FUZZ_RANDOM=1 explores new ones.
"""

from __future__ import annotations

import json
import os

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fixtures import ServerProcess, metric, two_input_model

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TRAINSERVE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("TRAINSERVE_FUZZ_RANDOM"),
    suppress_health_check=list(HealthCheck),
    database=None,
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
names = st.sampled_from(["features", "code", "input", "", "features ", "FEATURES"]) | st.text(
    max_size=6
)
datatypes = (
    st.sampled_from(["FP32", "INT64", "BOOL", "FP64", "INT8", "BYTES", "BF16", "fp32", ""])
    | json_scalars
)
dims = st.one_of(
    st.integers(min_value=-3, max_value=12),
    st.sampled_from([0, 2**31, 2**62, 2**63, 2**64]),
    json_scalars,
)
shapes = st.one_of(st.lists(dims, max_size=4), json_values)
numbers = st.lists(st.one_of(st.floats(-1e6, 1e6), st.integers(-5, 5), json_scalars), max_size=40)
parameters = st.one_of(
    st.none(),
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "binary_data_size": st.one_of(st.integers(-4, 64), json_scalars),
            "binary_data": json_scalars,
            "binary_data_output": json_scalars,
        },
    ),
)


@st.composite
def v2_input(draw):
    item = {"name": draw(names), "shape": draw(shapes), "datatype": draw(datatypes)}
    if draw(st.booleans()):
        item["data"] = draw(st.one_of(numbers, json_values))
    p = draw(parameters)
    if p is not None:
        item["parameters"] = p
    return item if draw(st.integers(0, 9)) else draw(json_values)


@st.composite
def v2_body(draw):
    body = {"inputs": draw(st.one_of(st.lists(v2_input(), max_size=3), json_values))}
    if draw(st.booleans()):
        body["outputs"] = draw(
            st.one_of(
                st.lists(
                    st.fixed_dictionaries({"name": names}, optional={"parameters": parameters}),
                    max_size=4,
                ),
                json_values,
            )
        )
    for key in ("id", "parameters"):
        if draw(st.booleans()):
            body[key] = draw(json_values)
    return body


@st.composite
def mlflow_body(draw):
    key = draw(
        st.sampled_from(
            ["inputs", "instances", "dataframe_split", "dataframe_records", "params", "other"]
        )
    )
    value = draw(
        st.one_of(
            json_values,
            st.dictionaries(names, numbers, max_size=3),
            st.fixed_dictionaries({"columns": json_values, "data": json_values}),
            st.lists(st.dictionaries(names, json_values, max_size=3), max_size=3),
        )
    )
    return {key: value} if draw(st.integers(0, 9)) else draw(json_values)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    with ServerProcess(
        "--model",
        str(two_input_model(d / "two.onnx")),
        "--max-rows-per-request",
        "16",
        "--max-body-bytes",
        "200000",
        log_path=d / "server.log",
    ) as srv:
        yield srv
        text = requests.get(srv.url + "/metrics").text
        for route in ("/v2/models/{name}/infer", "/invocations"):
            assert metric(text, "trainserve_requests_total", route=route, status="500") == 0
        assert "Traceback" not in srv.log(), srv.log()[-3000:]


def check(response: requests.Response, what) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]


def fuzz_json(server, path: str, bodies) -> None:
    """Every body `bodies` draws, POSTed as JSON to `path`: never a 5xx; the server live after."""
    session = requests.Session()

    @FUZZ
    @given(body=bodies)
    def fuzz(body):
        check(
            session.post(
                server.url + path,
                data=json.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=30,
            ),
            body,
        )

    fuzz()
    assert requests.get(server.url + "/v2/health/live").status_code == 200


def test_v2_json_bodies_never_get_a_5xx(server):
    fuzz_json(server, "/v2/models/two/infer", v2_body())


def test_v2_binary_bodies_never_get_a_5xx(server):
    session = requests.Session()

    @FUZZ
    @given(
        body=v2_body(),
        tail=st.binary(max_size=80),
        shift=st.integers(-4, 4),
        header=st.one_of(
            st.none(),
            st.text(max_size=6),
            st.sampled_from(["", "-1", "0", "99999999999999999999", "\u00b2"]),
        ),
    )
    def fuzz(body, tail, shift, header):
        head = json.dumps(body).encode()
        length = str(len(head) + shift) if header is None else header
        try:
            response = session.post(
                f"{server.url}/v2/models/two/infer",
                data=head + tail,
                timeout=30,
                headers={
                    "Inference-Header-Content-Length": length.encode("latin-1", "replace"),
                    "Content-Type": "application/octet-stream",
                },
            )
        except requests.exceptions.InvalidHeader:
            # a header value the client library itself refuses to send
            return
        check(response, (body, tail, length))

    fuzz()
    assert requests.get(server.url + "/v2/health/live").status_code == 200


def test_mlflow_bodies_never_get_a_5xx(server):
    fuzz_json(server, "/invocations", mlflow_body())
