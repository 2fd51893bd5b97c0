"""What a client and the operator read when a request is wrong, on a real server of three models:
the limit a token model was exported for, which model /invocations serves, messages never cut
mid-word, each client error logged once in our format and never as onnxruntime's own
`[E:onnxruntime...]` line; and `pipeline serve`'s refusals in the stages' style."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as triton_grpc
from onnx import TensorProto, helper, numpy_helper
from serving_fixtures import ROOT, ServerProcess, _save_graph, free_port, gather_model, tiny_model
from tritonclient.utils import InferenceServerException

from serving import lineage

LIMIT = 8


def positions_model(path, limit: int = LIMIT):
    """`ids` INT64 [batch, n] -> `out` [batch, n, 3]: ids plus a position table of `limit` rows, as
    a token model's position embedding. Past `limit` onnxruntime fails inside (Gather out of
    bounds), as the review's model did with "invalid expand shape"; export recorded the limit in
    lineage.MAX_LENGTHS."""
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["ids"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
            helper.make_node("Range", ["zero", "n", "one"], ["positions"]),
            helper.make_node("Gather", ["table", "positions"], ["pos"], axis=0),
            helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["ids_f", "last"], ["ids_col"]),
            helper.make_node("Add", ["ids_col", "pos"], ["out"]),
        ],
        "positions",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "n"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "n", 3])],
        [
            numpy_helper.from_array(
                np.arange(limit * 3, dtype=np.float32).reshape(limit, 3), "table"
            ),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array(1, np.int64), "one"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
        ],
    )
    path = _save_graph(path, graph, 17)
    model = onnx.load(str(path))
    model.metadata_props.add(key=lineage.MAX_LENGTHS, value='{"ids": {"1": %d}}' % limit)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    models = [
        f"tokens={positions_model(tmp / 'tokens.onnx')}",
        f"tiny={tiny_model(tmp / 'tiny.onnx')}",
        f"gather={gather_model(tmp / 'gather.onnx')}",
    ]
    grpc_port = free_port()
    with ServerProcess(
        *[a for m in models for a in ("--model", m)],
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{grpc_port}"
        yield srv


def infer(server, model: str, ids: np.ndarray) -> requests.Response:
    return requests.post(
        f"{server.url}/v2/models/{model}/infer",
        timeout=30,
        json={
            "inputs": [
                {
                    "name": "ids",
                    "datatype": "INT64",
                    "shape": list(ids.shape),
                    "data": ids.ravel().tolist(),
                }
            ]
        },
    )


def test_a_sequence_longer_than_exported_is_a_400_naming_the_limit(server):
    assert infer(server, "tokens", np.ones((2, LIMIT), np.int64)).status_code == 200
    refused = infer(server, "tokens", np.ones((2, LIMIT + 1), np.int64))
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]
    assert (
        f"input 'ids' has length {LIMIT + 1} on axis 1; model 'tokens' was exported for at most {LIMIT}"
        in message
    )
    assert "Non-zero status" not in message and "onnxruntime" not in message
    meta = requests.get(f"{server.url}/v2/models/tokens", timeout=10).json()
    assert meta["parameters"]["max_lengths"] == {"ids": {"1": LIMIT}}


def test_invocations_on_a_many_model_server_says_which_model_it_serves(server):
    image = np.zeros((1, 1, 8, 8), np.float32).tolist()
    answer = requests.post(
        f"{server.url}/invocations", json={"inputs": {"input": image}}, timeout=30
    )
    assert answer.status_code == 400
    message = answer.json()["error"]
    assert (
        "/invocations serves 'tokens', this server's default model; for 'gather', 'tiny' POST "
        "/v2/models/{name}/infer, or start the server with --default-model NAME" in message
    ), message


def test_a_ragged_array_is_refused_in_whole_words(server):
    ragged = [[1, 2, 3, 4, 5, 6], [3]]
    message = requests.post(
        f"{server.url}/invocations", json={"inputs": {"ids": ragged}}, timeout=30
    ).json()["error"]
    try:
        np.asarray(ragged, dtype=np.int64)
    except ValueError as exc:
        numpy_said = str(exc).splitlines()[0]
    shown = re.search(r"data is not a regular array \((.*)\); expected", message).group(1)
    kept = shown.removesuffix(" ...")
    assert numpy_said.startswith(kept) and (kept == numpy_said or numpy_said[len(kept)] in " ,;"), (
        shown,
        numpy_said,
    )


def test_client_errors_are_logged_once_in_our_format_never_by_onnxruntime(server):
    past_vocabulary = requests.post(
        f"{server.url}/v2/models/gather/infer",
        timeout=30,
        json={"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1], "data": [7]}]},
    )
    # onnxruntime itself fails: its own error line must stay quiet
    assert past_vocabulary.status_code == 400
    too_long = infer(server, "tokens", np.ones((1, LIMIT + 3), np.int64))
    assert too_long.status_code == 400
    ids = triton_grpc.InferInput("ids", [1, LIMIT + 4], "INT64")
    ids.set_data_from_numpy(np.ones((1, LIMIT + 4), np.int64))
    # the same refusal over gRPC, logged the same way
    with pytest.raises(InferenceServerException) as refused:
        triton_grpc.InferenceServerClient(server.grpc).infer("tokens", [ids])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    log = server.log()
    assert "[E:onnxruntime" not in log and "Traceback" not in log, log
    ours = re.compile(
        r"^\d\d:\d\d:\d\d WARNING serving\.http: POST /v2/models/(\w+)/infer -> 400: ", re.M
    )
    assert [m.group(1) for m in ours.finditer(log)].count("gather") == 1, log
    assert (
        len([line for line in log.splitlines() if f"length {LIMIT + 3} on axis 1" in line]) == 1
    ), log
    assert re.search(
        rf"^\d\d:\d\d:\d\d WARNING serving\.grpc: gRPC ModelInfer -> INVALID_ARGUMENT: input 'ids' has "
        rf"length {LIMIT + 4}",
        log,
        re.M,
    ), log
    assert all(
        re.match(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) serving[\w.]*: ", line)
        for line in log.splitlines()
    ), log


@pytest.mark.parametrize(
    "command", [[sys.executable, "-m", "pipeline", "serve"], [sys.executable, "-m", "serving"]]
)
def test_serve_refuses_in_one_line_and_exit_2_like_every_stage(command, tmp_path):
    prog = "pipeline serve" if "pipeline" in command else "python -m serving"
    for args, words in (
        (["--model", str(tmp_path / "missing.onnx")], "model file not found"),
        (["--port", "80x"], "invalid int value"),
        (["--model", str(tmp_path / "x.onnx"), "--reload-interval", "5"], "alias"),
    ):
        proc = subprocess.run(
            [*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and lines[-1].startswith(f"{prog}: error: "), proc.stderr
        # argparse's own usage line comes first for a malformed flag
        if words != "invalid int value":
            assert len(lines) == 1, proc.stderr


def test_verbose_lets_the_libraries_speak(tmp_path):
    """Quiet by default (the fixture's log above holds only our lines); --verbose brings
    onnxruntime's back."""
    model = tiny_model(tmp_path / "tiny.onnx")
    for flags, heard in (([], False), (["--verbose"], True)):
        with ServerProcess("--model", str(model), *flags, log_path=tmp_path / "server.log") as srv:
            srv.terminate()
            log = srv.log()
        assert ("[I:onnxruntime" in log) is heard, log
        assert "listening on http://127.0.0.1:" in log
