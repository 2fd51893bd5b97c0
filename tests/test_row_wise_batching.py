"""Requests share a model run only when the model's rows are known to be independent, and every
shared run is checked: never a silently wrong answer.

A model is batched when its file records that export found its rows independent
(lineage.ROWS_INDEPENDENT), when its repository config.pbtxt says max_batch_size > 0, or when the
operator says `--batching NAME=on`; any other model runs each request alone, exactly the tensors it
was sent. A batched run whose outputs do not have its rows on their first axis fails its requests
with a 500 naming the model and the shapes, and that version runs unbatched from then on. The sum
model (Triton's kind of model without a batch axis: three [-1] inputs summed into [1]) is the case
that was answered wrongly with 200s. Real `python -m serving` processes, real tritonclient clients.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from serving_fixtures import (
    ROOT,
    ServerProcess,
    free_port,
    sum_model,
    tiny_model,
    triton_config,
)
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow
CLIENTS = 16


def sum_inputs(module, i: int, rank: int = 1, lengths=None) -> tuple[list, float]:
    """Client i's three inputs (of 1 to 3 values each, or `lengths`) and their total."""
    lengths = lengths or [1 + i % 3] * 3
    arrays = [np.arange(n, dtype=np.float32) + 10 * i + k for k, n in enumerate(lengths)]
    if rank == 2:
        arrays = [a.reshape(1, -1) for a in arrays]
    inputs = []
    for k, array in enumerate(arrays):
        tensor = module.InferInput(f"INPUT{k}", list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs, float(sum(a.sum() for a in arrays))


def concurrently(ask, clients: int = CLIENTS) -> list:
    """`ask(i)` from `clients` threads released together: their requests are in the server at
    once."""
    start = threading.Barrier(clients)

    def one(i):
        start.wait()
        return ask(i)

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(clients)))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Default flags: the sum model (no record, no config) and the tiny classifier (its export's
    record)."""
    tmp = tmp_path_factory.mktemp("plain")
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        f"sum={sum_model(tmp / 'sum.onnx')}",
        "--model",
        f"tiny={tiny_model(tmp / 'tiny.onnx')}",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    ) as server:
        server.grpc = f"127.0.0.1:{grpc_port}"
        yield server


def test_sixteen_concurrent_requests_to_the_sum_model_each_get_their_own_sum(plain):
    def over_http(i):
        inputs, want = sum_inputs(triton_http, i)
        with triton_http.InferenceServerClient(plain.url.removeprefix("http://")) as client:
            return client.infer("sum", inputs).as_numpy("OUTPUT").tolist(), [want]

    def over_grpc(i):
        inputs, want = sum_inputs(triton_grpc, i)
        with triton_grpc.InferenceServerClient(plain.grpc) as client:
            return client.infer("sum", inputs).as_numpy("OUTPUT").tolist(), [want]

    for ask in (over_http, over_grpc):
        answers = concurrently(ask)
        right = sum(got == want for got, want in answers)
        assert right == CLIENTS, f"{ask.__name__}: {right} of {CLIENTS} right: {answers}"
    # Exactly the tensors it was sent: inputs of three lengths, and empty ones, are the model's to
    # sum.
    for lengths in ([1, 2, 3], [0, 4, 0]):
        inputs, want = sum_inputs(triton_http, 5, lengths=lengths)
        with triton_http.InferenceServerClient(plain.url.removeprefix("http://")) as client:
            assert client.infer("sum", inputs).as_numpy("OUTPUT").tolist() == [want]
    config = requests.get(f"{plain.url}/v2/models/sum/config", timeout=10).json()
    assert config["max_batch_size"] == 0
    # the whole shape: no batch axis left out
    assert [i["dims"] for i in config["input"]] == [[-1]] * 3
    assert "sum version 1 from" in plain.log() and "one request a run: no record" in plain.log()


def test_a_model_whose_export_recorded_independent_rows_is_batched(plain):
    config = requests.get(f"{plain.url}/v2/models/tiny/config", timeout=10).json()
    assert config["max_batch_size"] == 32 and config["input"][0]["dims"] == [1, 8, 8]
    assert (
        "batched: its file records independent rows (trainserve.rows_independent: 1,7,64)"
        in plain.log()
    )


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    """A repository whose config.pbtxt files declare batching: two sum models of [-1, -1] inputs
    declared batchable wrongly (no size for a warm-up to guess: only live traffic can show it), one
    of [-1] inputs declared batchable wrongly (its warm-up shows it), and the tiny classifier capped
    at 4 and switched off; a partial batch waits for company (--max-delay-ms), so that concurrent
    requests certainly share a run."""
    tmp = tmp_path_factory.mktemp("declared")
    repo = tmp / "repo"
    for name, rank, batch in (("wrong_http", 2, 16), ("wrong_grpc", 2, 16), ("warm", 1, 8)):
        (repo / name / "1").mkdir(parents=True)
        sum_model(repo / name / "1" / "model.onnx", rank=rank)
        triton_config(repo / name, f'name: "{name}"\nmax_batch_size: {batch}\n')
    for name, batch in (("capped", 4), ("zero", 0)):
        (repo / name / "1").mkdir(parents=True)
        tiny_model(repo / name / "1" / "model.onnx")
        triton_config(
            repo / name, f"max_batch_size: {batch}\ninstance_group [{{ kind: KIND_CPU }}]\n"
        )
    grpc_port = free_port()
    with ServerProcess(
        "--repository",
        str(repo),
        "--model",
        f"flagged={tiny_model(tmp / 'tiny.onnx')}",
        "--batching",
        "flagged=off",
        "--max-delay-ms",
        "3000",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    ) as server:
        server.grpc = f"127.0.0.1:{grpc_port}"
        yield server


def max_batch_size(server, name: str) -> int:
    return requests.get(f"{server.url}/v2/models/{name}/config", timeout=10).json()[
        "max_batch_size"
    ]


def test_a_model_declared_batchable_wrongly_gets_500s_never_a_wrong_200(declared):
    assert max_batch_size(declared, "wrong_http") == 16

    def over_http(i):
        inputs, want = sum_inputs(triton_http, i, rank=2)
        with triton_http.InferenceServerClient(declared.url.removeprefix("http://")) as client:
            try:
                return client.infer("wrong_http", inputs).as_numpy("OUTPUT").tolist(), [want]
            except InferenceServerException as exc:
                return exc.status(), exc.message()

    def over_grpc(i):
        inputs, want = sum_inputs(triton_grpc, i, rank=2)
        with triton_grpc.InferenceServerClient(declared.grpc) as client:
            try:
                return client.infer("wrong_grpc", inputs).as_numpy("OUTPUT").tolist(), [want]
            except InferenceServerException as exc:
                return exc.status(), exc.message()

    for ask, status in ((over_http, "500"), (over_grpc, "StatusCode.INTERNAL")):
        answers = concurrently(ask)
        wrong = [a for a in answers if a[0] != status and a[0] != a[1]]
        assert not wrong, f"{ask.__name__}: wrong answers: {wrong}"
        refused = [message for got, message in answers if got == status]
        assert refused, f"{ask.__name__}: no run was shared: {answers}"
        model = "wrong_http" if ask is over_http else "wrong_grpc"
        assert f"model '{model}' version 1: a batched run of" in refused[0]
        assert "output(s) 'OUTPUT' of shape [1]" in refused[0], refused[0]
        # From then on that version runs each request alone: every answer right, and its config says
        # so.
        again = concurrently(ask)
        assert all(got == want for got, want in again), again
        assert max_batch_size(declared, model) == 0
    log = declared.log()
    # each version once
    assert log.count("batching is off for this version from now on") == 3, log
    assert "ERROR serving.batcher: model 'wrong_http' version 1: a batched run of" in log


def test_a_warm_up_that_shows_rows_are_not_independent_turns_batching_off_before_any_request(
    declared,
):
    assert max_batch_size(declared, "warm") == 0
    assert "model 'warm' version 1: warm-up: a batched run of 8 rows" in declared.log()
    answers = concurrently(
        lambda i: requests.post(
            f"{declared.url}/v2/models/warm/infer",
            json={
                "inputs": [
                    {"name": f"INPUT{k}", "shape": [2], "datatype": "FP32", "data": [i, k]}
                    for k in range(3)
                ]
            },
            timeout=30,
        ).json()["outputs"][0]["data"]
    )
    assert answers == [[3.0 * i + 3] for i in range(CLIENTS)]


def test_config_pbtxt_and_the_flag_decide_and_max_batch_size_is_a_cap(declared):
    # its config's cap, under --max-batch-size 32
    assert max_batch_size(declared, "capped") == 4
    # its record says batchable; its config says no
    assert max_batch_size(declared, "zero") == 0
    # --batching flagged=off
    assert max_batch_size(declared, "flagged") == 0
    config = requests.get(f"{declared.url}/v2/models/capped/config", timeout=10).json()
    assert config["input"][0]["dims"] == [1, 8, 8]
    log = declared.log()
    assert (
        "batched: max_batch_size 4 in " in log
        and "one request a run: --batching flagged=off" in log
    )


def test_what_cannot_batch_or_cannot_be_read_stops_the_server_with_one_line(tmp_path):
    def refused(*flags) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "serving", "--port", str(free_port()), *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    tiny = tiny_model(tmp_path / "tiny.onnx")
    assert "--batching 'tiny=yes': expected NAME=on or NAME=off" in refused(
        "--model", str(tiny), "--batching", "tiny=yes"
    )
    assert "--batching other: no such model (this server has 'tiny')" in refused(
        "--model", str(tiny), "--batching", "other=on"
    )
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    sum_model(repo / "m" / "1" / "model.onnx")
    triton_config(repo / "m", "max_batch_size: 8\ninput [ { name: 'INPUT0' dims [ 1 ] ]\n")
    said = refused("--repository", str(repo))
    assert f"{repo / 'm' / 'config.pbtxt'}:2:" in said, said
    triton_config(repo / "m", "max_batch_sise: 8\n")
    said = refused("--repository", str(repo))
    assert "'max_batch_sise' is not a field of Triton's ModelConfig" in said, said
    (repo / "f" / "1").mkdir(parents=True)
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(repo / "f" / "1" / "model.onnx"))
    triton_config(repo / "m", "max_batch_size: 0\n")
    triton_config(repo / "f", "max_batch_size: 4\n")
    said = refused("--repository", str(repo))
    assert (
        "max_batch_size 4 in" in said and "input 'x' [2,3] FP32 has no dynamic first axis" in said
    )
