"""Images in, class names out (serving/image_inputs.py): a version whose export recorded how an
image file becomes its input takes encoded files, as the BYTES input its metadata lists
(tritonclient over HTTP and gRPC) and as the file itself POSTed to /invocations and
/v2/models/NAME/infer; each is decoded and transformed exactly as training transformed its files,
and the answer is the class names with their scores, best first. Bad files are a 400 naming what is
wrong; FP32 values far outside the training data's range get a Warning header and a log line
(serving/input_range.py). A real server process, real PNG and JPEG files, tritonclient's clients."""

from __future__ import annotations

import io
import json

import grpc
import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from serving_fixtures import ServerProcess, free_port, heavy_model, run_onnx, tiny_model
from tritonclient.utils import InferenceServerException

from serving import drift, lineage
from serving.grpc import schema
from serving.images import Preprocessing, apply, record

LABELS = ["zero", "one", "two"]
GREY = Preprocessing(mode="L", size=(8, 8))


def image_model(path, preprocessing: Preprocessing = GREY):
    """tiny_model ([batch, 1, 8, 8] -> logits, probabilities over 3 classes) recording
    `preprocessing` and its scores output, as `pipeline export` records them, with a drift reference
    of values in [0, 1] beside it."""
    tiny_model(path, labels=LABELS)
    recording(path, preprocessing)
    reference = drift.ReferenceBuilder()
    reference.add("inputs", {"input": np.random.default_rng(0).random((300, 1, 8, 8), np.float32)})
    drift.write(reference.build(), path.parent / drift.FILE)
    return path


def recording(path, preprocessing: Preprocessing):
    """The ONNX file at `path` with `preprocessing` and its scores output in its metadata."""
    model = onnx.load(str(path))
    model.metadata_props.add(key=lineage.PREPROCESSING, value=record("input", preprocessing))
    model.metadata_props.add(key=lineage.SCORES, value="probabilities")
    onnx.save(model, str(path))
    return path


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def pixels(seed: int, shape=(8, 8)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def as_training_made_it(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return apply(GREY, image)[None]


def ranked(scores: np.ndarray) -> list[tuple[str, float]]:
    return [(LABELS[i], float(scores[i])) for i in np.argsort(-scores, kind="stable")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("images")
    (tmp / "images").mkdir()
    (tmp / "plain").mkdir()
    grpc_port = free_port()
    heavy = recording(heavy_model(tmp / "heavy.onnx"), Preprocessing(mode="L", size=(28, 28)))
    srv = ServerProcess(
        "--model",
        f"digits={image_model(tmp / 'images' / 'model.onnx')}",
        "--model",
        f"plain={tiny_model(tmp / 'plain' / 'model.onnx', labels=LABELS)}",
        "--model",
        f"heavy={heavy}",
        "--default-model",
        "digits",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "server.log",
    )
    with srv:
        srv.grpc, srv.http = f"127.0.0.1:{grpc_port}", srv.url.removeprefix("http://")
        srv.onnx, srv.heavy = tmp / "images" / "model.onnx", heavy
        yield srv


def test_a_posted_png_is_answered_with_class_names_and_scores_best_first(server):
    data = png(pixels(1))
    expected = ranked(run_onnx(server.onnx, as_training_made_it(data))["probabilities"][0])
    answer = requests.post(
        server.url + "/invocations", data=data, headers={"Content-Type": "image/png"}
    )
    assert answer.status_code == 200, answer.text
    found = answer.json()["predictions"]
    assert [(p["label"], pytest.approx(p["score"], rel=1e-6)) for p in found[0]] == expected
    assert "Warning" not in answer.headers
    # the same file to the V2 route: the classification extension's strings, best first
    v2 = requests.post(
        server.url + "/v2/models/digits/infer", data=data, headers={"Content-Type": "image/png"}
    )
    assert v2.status_code == 200, v2.text
    (output,) = v2.json()["outputs"]
    assert output["name"] == "probabilities" and output["datatype"] == "BYTES"
    assert [s.split(":")[2] for s in output["data"]] == [label for label, _ in expected]
    assert float(output["data"][0].split(":")[0]) == pytest.approx(expected[0][1], rel=1e-6)


def test_a_jpeg_with_its_content_type_is_decoded_as_training_decoded_it(server):
    data = jpeg(pixels(2))
    want = run_onnx(server.onnx, as_training_made_it(data))["probabilities"][0]
    answer = requests.post(
        server.url + "/invocations", data=data, headers={"Content-Type": "image/jpeg"}
    )
    assert answer.status_code == 200, answer.text
    assert [p["label"] for p in answer.json()["predictions"][0]] == [
        label for label, _ in ranked(want)
    ]


def test_the_metadata_lists_the_bytes_input_that_tritonclient_sends_files_as(server):
    client = triton_http.InferenceServerClient(server.http)
    metadata = client.get_model_metadata("digits")
    assert metadata["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]},
        {"name": "image", "datatype": "BYTES", "shape": [-1]},
    ]
    assert metadata["parameters"]["image_input"]["in_place_of"] == "input"
    # the model's configuration lists it too, each of the two forms optional
    config = client.get_model_config("digits")
    assert [(i["name"], i["data_type"], i.get("optional")) for i in config["input"]] == [
        ("input", "TYPE_FP32", True),
        ("image", "TYPE_STRING", True),
    ]
    files = [png(pixels(3)), jpeg(pixels(4))]
    sent = triton_http.InferInput("image", [2], "BYTES")
    sent.set_data_from_numpy(np.array(files, dtype=object))
    asked = triton_http.InferRequestedOutput("probabilities", class_count=1)
    got = client.infer("digits", [sent], outputs=[asked]).as_numpy("probabilities")
    for row, data in zip(got, files):
        best = ranked(run_onnx(server.onnx, as_training_made_it(data))["probabilities"][0])[0]
        assert row[0].decode().split(":")[2] == best[0]
    # the tensor itself still works, and the two forms together are refused
    tensor = triton_http.InferInput("input", [1, 1, 8, 8], "FP32")
    tensor.set_data_from_numpy(as_training_made_it(files[0]))
    assert client.infer("digits", [tensor]).as_numpy("probabilities").shape == (1, 3)
    with pytest.raises(InferenceServerException, match="two forms of the same input; send one"):
        client.infer("digits", [sent, tensor])


def test_grpc_takes_the_bytes_input_too(server):
    client = triton_grpc.InferenceServerClient(server.grpc)
    inputs = client.get_model_metadata("digits", as_json=True)["inputs"]
    assert [(i["name"], i["datatype"]) for i in inputs] == [("input", "FP32"), ("image", "BYTES")]
    data = png(pixels(5))
    sent = triton_grpc.InferInput("image", [1], "BYTES")
    sent.set_data_from_numpy(np.array([data], dtype=object))
    asked = triton_grpc.InferRequestedOutput("probabilities", class_count=3)
    got = client.infer("digits", [sent], outputs=[asked]).as_numpy("probabilities")
    expected = ranked(run_onnx(server.onnx, as_training_made_it(data))["probabilities"][0])
    assert [s.decode().split(":")[2] for s in got[0]] == [label for label, _ in expected]
    sent.set_data_from_numpy(np.array([b"not an image"], dtype=object))
    with pytest.raises(
        InferenceServerException, match="input 'image' element 0: not an image file"
    ):
        client.infer("digits", [sent])


@pytest.mark.parametrize(
    "body, why",
    [
        (b"\x89PNG\r\n\x1a\nthis is no PNG", "not an image file Pillow can read as PNG, JPEG"),
        (png(pixels(6))[:60], "a PNG file that can't be decoded"),
        (b"", "the body is empty"),
    ],
    ids=["garbage", "truncated", "empty"],
)
def test_a_bad_file_is_a_400_naming_what_is_wrong(server, body, why):
    for route in ("/invocations", "/v2/models/digits/infer"):
        answer = requests.post(server.url + route, data=body, headers={"Content-Type": "image/png"})
        assert answer.status_code == 400, answer.text
        assert why in answer.json()["error"], answer.json()


def test_an_image_too_large_is_refused_before_its_pixels_are_decoded(server):
    # a valid 9000 x 9000 grey PNG of zeros: 81 megapixels in a few kilobytes
    answer = requests.post(
        server.url + "/invocations",
        data=png(np.zeros((9000, 9000), np.uint8)),
        headers={"Content-Type": "image/png"},
    )
    assert answer.status_code == 400
    assert "a 9000 x 9000 PNG: more than the 50000000 pixels" in answer.json()["error"]


def test_a_model_that_records_no_preprocessing_takes_no_files_and_says_so(server):
    answer = requests.post(
        server.url + "/v2/models/plain/infer",
        data=png(pixels(7)),
        headers={"Content-Type": "image/png"},
    )
    assert answer.status_code == 415
    assert "model 'plain' version 1 takes no image files" in answer.json()["error"]
    listed = requests.get(server.url + "/v2/models/plain").json()
    assert [i["name"] for i in listed["inputs"]] == ["input"]
    assert "image_input" not in listed["parameters"]


def test_values_far_outside_the_training_range_get_a_warning_header_and_one_log_line(server):
    in_range = np.random.default_rng(8).random((1, 1, 8, 8), np.float32)
    answer = requests.post(server.url + "/invocations", json={"inputs": in_range.tolist()})
    assert answer.status_code == 200 and "Warning" not in answer.headers
    # pixel values 0-255 where training saw [0, 1]: answered, with a warning each time
    for _ in range(3):
        answer = requests.post(
            server.url + "/invocations", json={"inputs": (in_range * 255).tolist()}
        )
        assert answer.status_code == 200, answer.text
        warning = answer.headers["Warning"]
        assert warning.startswith(
            "299 - \"input 'input' is far outside the range the model was trained"
        )
        assert "send values scaled as training scaled them" in warning
    said = [line for line in server.log().splitlines() if "far outside the range" in line]
    # the log line is rate-limited: one a minute
    assert len(said) == 1, said
    # over gRPC the same warning is initial metadata
    channel = grpc.insecure_channel(server.grpc)
    request = schema.ModelInferRequest(model_name="digits")
    item = request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
    item.contents.fp32_contents.extend((in_range * 255).reshape(-1).tolist())
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=schema.ModelInferRequest.SerializeToString,
        response_deserializer=schema.ModelInferResponse.FromString,
    )
    _, call = infer.with_call(request)
    assert "far outside the range" in dict(call.initial_metadata())["warning"]
    channel.close()


def test_image_requests_share_runs_and_each_gets_its_own_rows(server):
    """Concurrent files to a model that takes milliseconds a run: the rows they are decoded into
    queue while it runs and share the next runs (the batcher copies them into batch rows like any
    request's), and each answer is its own file's."""
    from concurrent.futures import ThreadPoolExecutor

    files = [png(pixels(i, (28, 28))) for i in range(24)]

    def post(data: bytes) -> str:
        answer = requests.post(
            server.url + "/v2/models/heavy/infer", data=data, headers={"Content-Type": "image/png"}
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["outputs"][0]["data"][0]

    with ThreadPoolExecutor(len(files)) as pool:
        best = list(pool.map(post, files))
    for said, data in zip(best, files):
        with Image.open(io.BytesIO(data)) as image:
            x = apply(Preprocessing(mode="L", size=(28, 28)), image)[None]
        scores = run_onnx(server.heavy, x)["probabilities"][0]
        assert said == f"{scores.max()}:{scores.argmax()}"
    metrics = requests.get(server.url + "/metrics").text
    counted = {
        name: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        for name in ("count", "sum")
        if line.startswith(f"trainserve_batch_size_{name}{{") and 'model="heavy"' in line
    }
    assert counted["sum"] == len(files) and counted["count"] < len(files), counted


def test_pipeline_verify_asks_an_image_model_with_its_tensor_input_only(server):
    """`pipeline verify --server` sends zeros for the inputs the metadata lists: not the image input
    too, which stands in for the tensor (both together are refused)."""
    from pipeline.verify import _infer_receipt

    meta = requests.get(server.url + "/v2/models/digits").json()
    receipt = _infer_receipt(server.url, "digits", meta, {})
    assert receipt["x-model-version"] == "1" and receipt["x-request-id"] == "pipeline-verify"


def test_the_model_metadata_says_how_files_become_the_input(server):
    described = requests.get(server.url + "/v2/models/digits").json()["parameters"]["image_input"]
    assert described["preprocessing"] == json.loads(record("input", GREY))["input"]
    assert described["scores"] == "probabilities"
    assert "image/png" in described["content_types"]


@pytest.mark.slow
def test_grey_photos_to_shards_to_a_served_model_that_names_a_seven(tmp_path):
    """Issue 51's first hour with one's own images, as a user does it: grey PNG digits in class
    folders named `zero` ... `nine` -> docs/data.md's `pipeline data shard` (at the digits' own 8x8)
    -> the train command it prints, pasted as printed (a small MLP and a few epochs after it) ->
    export and registry -> a server of the registered version -> curl POSTs seven.png and hears
    "seven" with its score; tritonclient over HTTP and gRPC sends the same file as the BYTES input
    and hears the same."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO, cli_env, run_cli
    from test_first_hour import docs_image_folder_shard_command, grey_photos

    photos = grey_photos(tmp_path / "photos", 1797)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    argv = [a.replace("image_size: 32", "image_size: 8") for a in docs_image_folder_shard_command()]
    assert any("image_size: 8" in a for a in argv), argv
    wrote = run_cli(argv, cwd=work, timeout=120)
    printed = wrote.stdout.strip().splitlines()[-1].strip()
    assert printed.startswith(f"{sys.executable} -m pipeline run "), printed
    small = "model.component=pipeline.models:mlp 'model.args={hidden: [64]}' train.epochs=5"
    trained = subprocess.run(
        ["bash", "-c", f"{printed} {small}"],
        cwd=work,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stderr[-6000:]
    assert "registered photos-resnet18 version 1 as @champion" in trained.stderr
    shutil.copy(sorted((photos / "seven").iterdir())[0], work / "seven.png")
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        "models:/photos-resnet18@champion",
        "--grpc-port",
        str(grpc_port),
        cwd=work,
        env=cli_env(),
        log_path=tmp_path / "server.log",
    ) as srv:
        curl = subprocess.run(
            f"curl -s --data-binary @seven.png -H 'content-type: image/png' {srv.url}/invocations",
            shell=True,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
        )
        best = json.loads(curl.stdout)["predictions"][0][0]
        assert best["label"] == "seven" and best["score"] > 0.5, curl.stdout
        data = (work / "seven.png").read_bytes()
        for triton, address in (
            (triton_http, srv.url.removeprefix("http://")),
            (triton_grpc, f"127.0.0.1:{grpc_port}"),
        ):
            client = triton.InferenceServerClient(address)
            sent = triton.InferInput("image", [1], "BYTES")
            sent.set_data_from_numpy(np.array([data], dtype=object))
            asked = triton.InferRequestedOutput("probabilities", class_count=1)
            (said,) = client.infer("photos-resnet18", [sent], outputs=[asked]).as_numpy(
                "probabilities"
            )[0]
            score, _, label = said.decode().split(":")
            assert label == "seven" and float(score) == pytest.approx(best["score"], rel=1e-6)
