"""A repository model's config.pbtxt decides which of its versions are served and which shapes its
requests may have, as Triton's model configuration says.

`version_policy` (latest N, all, specific versions) picks the version directories loaded; the
server's --version-policy is the default for a model whose config says nothing. An input's `dims`
(after the batch axis when max_batch_size > 0) narrow the shape the model file accepts: a request of
another shape is a 400 naming the shape the model takes. A real `python -m serving` over a
repository, reached with tritonclient."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from onnx import TensorProto, helper
from serving_fixtures import ROOT, ServerProcess, _save_graph, free_port, triton_config
from tritonclient.utils import InferenceServerException

from serving import model_config


def scale_model(path, factor: float):
    """`X` FP32 [-1] -> `Y` = X * factor: each version answers with its own factor, so the answer
    says which version computed it."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "factor"], ["Y"])],
        "scale",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("factor", TensorProto.FLOAT, [], [factor])],
    )
    return _save_graph(path, graph, 17)


def identity_model(path):
    """`INPUT0` FP32 [-1, -1] -> `OUTPUT0`, the same tensor."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["b", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["b", "n"])],
    )
    return _save_graph(path, graph, 17)


def default_model(path):
    """`X` FP32 [-1] with a default in the file ([2.0]: ONNX's optional input) -> `Y` = X + X."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["Y"])],
        "defaults",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("X", TensorProto.FLOAT, [1], [2.0])],
    )
    return _save_graph(path, graph, 17)


POLICIES = {
    # model name -> (its config's version_policy, the versions served)
    "pinned": ("version_policy: { specific { versions: [1] }}", ["1"]),
    "newest2": ("version_policy: { latest { num_versions: 2 }}", ["2", "3"]),
    "every": ("version_policy: { all { }}", ["1", "2", "3"]),
    "unsaid": ("", ["3"]),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("repository")
    for name, (policy, _) in POLICIES.items():
        for version in (1, 2, 3):
            (root / name / str(version)).mkdir(parents=True)
            scale_model(root / name / str(version) / "model.onnx", float(version))
        triton_config(root / name, f'name: "{name}"\nmax_batch_size: 0\n{policy}\n')
    (root / "narrow" / "1").mkdir(parents=True)
    identity_model(root / "narrow" / "1" / "model.onnx")
    triton_config(
        root / "narrow",
        'max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n',
    )
    (root / "defaults" / "1").mkdir(parents=True)
    default_model(root / "defaults" / "1" / "model.onnx")
    triton_config(
        root / "defaults",
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] optional: true } ]\n',
    )
    (root / "queued" / "1").mkdir(parents=True)
    identity_model(root / "queued" / "1" / "model.onnx")
    triton_config(
        root / "queued",
        "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 1000000\n"
        "  default_queue_policy { max_queue_size: 1 } }\n",
    )
    grpc_port = free_port()
    with ServerProcess(
        "--repository",
        str(root),
        "--grpc-port",
        str(grpc_port),
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    ) as proc:
        proc.grpc = f"127.0.0.1:{grpc_port}"
        yield proc


def clients(server):
    return (
        (triton_http, triton_http.InferenceServerClient(server.url.removeprefix("http://"))),
        (triton_grpc, triton_grpc.InferenceServerClient(server.grpc)),
    )


def test_the_config_version_policy_picks_the_versions_and_the_flag_is_the_default(server):
    x = np.array([1.0, 2.0], dtype=np.float32)
    for module, client in clients(server):
        tensor = module.InferInput("X", [2], "FP32")
        tensor.set_data_from_numpy(x)
        for name, (_, served) in POLICIES.items():
            # No version named: the highest the policy serves, never a version it leaves out.
            got = client.infer(name, [tensor]).as_numpy("Y")
            np.testing.assert_array_equal(got, x * float(served[-1]), err_msg=name)
            for version in ("1", "2", "3"):
                if version in served:
                    got = client.infer(name, [tensor], model_version=version).as_numpy("Y")
                    np.testing.assert_array_equal(got, x * float(version))
                    assert client.is_model_ready(name, version)
                else:
                    with pytest.raises(InferenceServerException) as refused:
                        client.infer(name, [tensor], model_version=version)
                    # (Triton's first words, which its clients look for, then ours)
                    assert refused.value.message().startswith(
                        f"Request for unknown model: '{name}' has no version {version} loaded "
                        f"(loaded: {', '.join(served)})"
                    ), refused.value
                    ready = requests.get(f"{server.url}/v2/models/{name}/versions/{version}/ready")
                    assert ready.status_code == 404, ready.text
    index = requests.post(server.url + "/v2/repository/index").json()
    loaded = {(row["name"], row["version"]) for row in index if row["state"] == "READY"}
    for name, (_, served) in POLICIES.items():
        assert {v for n, v in loaded if n == name} == set(served), (name, index)


def test_config_dims_narrow_the_shapes_a_request_may_send(server):
    for module, client in clients(server):
        metadata = client.get_model_metadata("narrow")
        shape = (
            metadata["inputs"][0]["shape"] if module is triton_http else metadata.inputs[0].shape
        )
        assert [int(d) for d in shape] == [-1, 2]
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        tensor = module.InferInput("INPUT0", [3, 2], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("narrow", [tensor]).as_numpy("OUTPUT0"), x)
        # The model file takes [-1, -1]; its config says [-1, 2]: a [2, 3] request is refused,
        # naming that.
        wide = module.InferInput("INPUT0", [2, 3], "FP32")
        wide.set_data_from_numpy(x.reshape(2, 3))
        with pytest.raises(InferenceServerException, match=r"\[-1,2\]") as refused:
            client.infer("narrow", [wide])
        assert "INPUT0" in str(refused.value)


def test_config_dynamic_batching_sets_the_models_own_wait_and_queue_bound(server):
    """max_queue_delay_microseconds: a lone request waits that long for others to share its run;
    default_queue_policy.max_queue_size: what the queue holds past it is refused with a 503, retry
    later."""
    url = f"{server.url}/v2/models/queued/infer"
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    first = {}

    def send_first():
        started = time.monotonic()
        first["response"] = requests.post(url, json=body, timeout=30)
        first["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=send_first)
    thread.start()
    time.sleep(0.3)
    second = requests.post(url, json=body, timeout=30)
    thread.join()
    assert second.status_code == 503 and "queue is full" in second.json()["error"], second.text
    assert first["response"].status_code == 200, first["response"].text
    assert first["seconds"] > 0.8, first
    # the queue empty again: served
    assert requests.post(url, json=body, timeout=30).status_code == 200


def test_a_model_whose_inputs_all_have_defaults_answers_a_request_of_none(server):
    """(Triton's optional inputs: here an input the ONNX file gives a default, which onnxruntime
    does not list as an input; the config's `optional: true` says the same.)"""
    answer = requests.post(
        f"{server.url}/v2/models/defaults/infer", json={"inputs": []}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [4.0]
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        assert client.infer("defaults", []).as_numpy("Y").tolist() == [4.0]


def test_a_config_that_contradicts_its_model_stops_the_server_with_one_line(tmp_path):
    repo = tmp_path / "repo"
    (repo / "narrow" / "1").mkdir(parents=True)
    identity_model(repo / "narrow" / "1" / "model.onnx")

    def refused() -> str:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "serving",
                "--port",
                str(free_port()),
                "--repository",
                str(repo),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    # a rank the model does not have
    triton_config(repo / "narrow", 'max_batch_size: 0\ninput [ { name: "INPUT0" dims: [ 4 ] } ]\n')
    said = refused()
    assert "input 'INPUT0' is [4]" in said and "the model takes [-1,-1]" in said, said
    # an input the model does not have
    triton_config(repo / "narrow", 'max_batch_size: 4\ninput [ { name: "IN" dims: [ 4 ] } ]\n')
    said = refused()
    assert "input 'IN' is not one of the model's inputs (INPUT0)" in said, said
    # a policy that selects none of its versions
    triton_config(repo / "narrow", "version_policy: { specific { versions: [2] }}\n")
    said = refused()
    assert "the version_policy of" in said and "selects none of its versions (1)" in said, said


@pytest.mark.parametrize(
    "text, said",
    [
        ("version_policy: { latest { num_versions: 0 }}", "num_versions of 1 or more, got 0"),
        ("version_policy: { newest { }}", "version_policy must be one of"),
        ("version_policy: { all { } latest { num_versions: 1 } }", "version_policy must be one of"),
        ("version_policy: { specific { versions: [] }}", "needs versions: [V, ...]"),
        ("version_policy: { specific { versions: [-1] }}", "needs versions: [V, ...]"),
        ("version_policy: { latest { versions: [1] }}", "latest has no field 'versions'"),
        ('input [ { name: "X" dims: [ -2 ] } ]', "dims must be sizes or -1"),
        (
            "dynamic_batching { max_queue_delay_microseconds: -1 }",
            "dynamic_batching max_queue_delay_microseconds must be 0 or more, got -1",
        ),
    ],
)
def test_config_pbtxt_refusals_name_the_field_and_the_forms_it_takes(tmp_path, text, said):
    (tmp_path / "config.pbtxt").write_text(text + "\n")
    with pytest.raises(model_config.ConfigError) as refused:
        model_config.read(tmp_path)
    assert said in str(refused.value) and str(tmp_path / "config.pbtxt") in str(refused.value)


def test_config_pbtxt_version_policy_forms_as_triton_writes_them(tmp_path):
    forms = {
        "version_policy: { all { }}": "all",
        "version_policy: { latest { num_versions: 2 }}": "latest:2",
        "version_policy { specific { versions: [1, 3] } }": "specific:1,3",
        "version_policy: { specific: { versions: 1 versions: 3 }}": "specific:1,3",
        "max_batch_size: 4": None,
    }
    for text, policy in forms.items():
        (tmp_path / "config.pbtxt").write_text(text + "\n")
        read = model_config.read(tmp_path).version_policy
        assert (str(read) if read else None) == policy, text
