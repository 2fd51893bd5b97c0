"""Triton's own client tests (`qa/` of triton-inference-server/server) against this server.

    python benchmarks/triton_qa.py TRITON_REPO [--suites L0_http,L0_grpc] [--workdir DIR] \
        [--server-root DIR]

TRITON_REPO is a clone of triton-inference-server/server (a bare git directory will do): its qa/
files are read with `git archive` (--commit, default HEAD) into a temporary directory; none of
Triton's code is kept here.

1. Models: Triton's generators (qa/common/gen_qa_models.py, its --variable run,
   gen_qa_identity_models.py, gen_qa_ort_scalar_models.py) make the ONNX models of its QA
   repositories with their config.pbtxt, as qa/common/gen_qa_model_repository does, at --onnx_opset
   17 and that opset's IR version (Triton pins an older onnx for this; a newer one writes an IR
   version this onnxruntime cannot read). BF16 models are left out on this CPU, as L0_infer's
   test.sh does for its CPU target. The models of docs/examples/model_repository that are ONNX files
   in Triton's tree (`simple`, `simple_string`, ...) are used as they are, in the suites' models/
   directories as Triton's Dockerfile.QA fills them. The few that are python or custom backend
   models, a download, or a test.sh's sed are made as the test.sh makes them or as ONNX models of
   the same signature (EXTRA_MODELS: e.g. `custom_identity_int32`, an identity calibrated to take 3
   s a run as that backend's execute_delay_ms does). Kept in --workdir between runs.
2. Configurations: each python test run of each test.sh (`runs()` below), with the models it copies
   into its repository and this server started over it on the ports the tests call (HTTP 8000, gRPC
   8001), with the flags that match Triton's: --allow-client-shm=true -> `--shared-memory on`, its
   absence -> off; --model-control-mode=explicit -> `--model-control explicit`, its absence -> none;
   --http-max-input-size -> --max-body-bytes. A server per test case where the test.sh starts one
   per case (L0_shared_memory), and the suite's nginx.conf in front of it where the test.sh runs
   nginx (basic auth, port 8004). A repository holding a model this server cannot load stops it at
   start: it is then started with nothing loaded (and explicit control) and each model loaded on its
   own; the table names the models that failed.
3. Tests: each file runs as its test.sh runs it (`python test.py`, unittest's runner) with the
   environment it sets, unchanged but for what this environment has: BACKENDS=onnx and ENSEMBLES=0
   where the tests read them, and qa/common/test_util.py's probes for TensorRT, libtorch, OpenVINO
   and ensemble models answering none. Each test case of each configuration is a run (a test whose
   subtests fail is one failed run). Left out (not run, not counted), as issue 49 lists them:
   ensembles; TensorRT models (the shape-tensor case of L0_input_validation); python-backend cases
   whose python model is the point of the test (L0_grpc's client plugin test: a model that checks
   the headers the server forwards to it); the generate endpoint (and the size-limit test that posts
   to it); tracing; restricted-protocol cases. Also left out, because they cannot run here:
   infer_test over CUDA shared memory (its client needs a GPU; the CUDA shared-memory calls that
   need none run), the C++ clients and the example clients of Triton's client repository (not in its
   qa/), L0_scalar_io's start-failure check (not a python test).

It prints, per L0 directory, the runs, passed and failed per configuration, and the failures grouped
by reason (REASONS: first what differs from Triton on purpose, as docs/serving.md lists it, then the
items of issue 49), each with an example. A test that asserts Triton's own error wording or status
fails here as written: the table is what Triton's tests say, unchanged.
--server-root runs another checkout's `python -m serving` (e.g. main's) under the same harness."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# the addresses Triton's tests call (localhost:8000, :8001)
HTTP_PORT, GRPC_PORT = 8000, 8001
SUITES = (
    "L0_http",
    "L0_grpc",
    "L0_shared_memory",
    "L0_infer",
    "L0_infer_zero",
    "L0_infer_variable",
    "L0_input_validation",
    "L0_client_nobatch",
    "L0_client_timeout",
    "L0_scalar_io",
)
# one configuration's test file, at most
RUN_TIMEOUT_S = 1500
# custom_identity_int32's run (its config's execute_delay_ms: 3000)
SLOW_MODEL_S = 3.0
# execute_delayed_model's run (its time.sleep(15))
DELAYED_MODEL_S = 15.0
# The generators' --onnx_opset (Triton's default, 0, is the installed onnx's newest) and its IR
# version.
ONNX_OPSET, ONNX_IR_VERSION = 17, 8


@dataclass
class Run:
    """One configuration of a test.sh: a test file (or some of its tests) against a server over a
    repository."""

    suite: str
    script: str
    label: str
    # repository models: "REPOSITORY/NAME" (a glob in NAME), "REPOSITORY/NAME=COPY" a renamed copy,
    # "REPOSITORY/NAME@V" with only its version V
    models: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # unittest names in the file (Class[.test]); all if none
    tests: list[str] = field(default_factory=list)
    # cases left out (not run, not counted): a class or test name, or a word in a test's name
    exclude: list[str] = field(default_factory=list)
    # this server's, beyond the repository and ports
    flags: list[str] = field(default_factory=list)
    # the repository's folder name (client_test.py names it)
    directory: str = "models"
    # each test in `tests` against a server of its own, in a process of its own (as
    # L0_shared_memory's test.sh)
    per_case: bool = False
    # an nginx.conf of the suite (basic auth on port 8004) run in front of the server, as its
    # test.sh does
    proxy: str = ""


# Words of test names left out everywhere: tracing is not this server's (the generate endpoint's
# tests are in files of their own, not run). (The CUDA shared-memory tests of the aio files ask for
# status, an invalid registration and an unregister: they need no GPU, and run.)
LEFT_OUT = ["trace", "generate"]
# Appended to the tests' copy of qa/common/test_util.py: the probes its tests ask which other
# backends' models (TensorRT, libtorch, OpenVINO) and ensembles this environment has answer none, as
# BACKENDS=onnx and ENSEMBLES=0 say to the tests that read them (infer_zero_test.py and
# infer_variable_test.py only ask these).
ONNX_ONLY = """

# (benchmarks/triton_qa.py of trainserve) ONNX models only in this environment:
def validate_for_trt_model(*args, **kwargs):
    return False


def validate_for_libtorch_model(*args, **kwargs):
    return False


def validate_for_openvino_model(*args, **kwargs):
    return False


def validate_for_ensemble_model(*args, **kwargs):
    return False
"""
SHM_TESTS = [
    "test_invalid_create_shm",
    "test_valid_create_set_register",
    "test_unregister_before_register",
    "test_unregister_after_register",
    "test_reregister_after_register",
    "test_unregister_after_inference",
    "test_register_after_inference",
    "test_too_big_shm",
    "test_mixed_raw_shm",
    "test_unregisterall",
    "test_infer_offset_out_of_bound",
    "test_infer_byte_size_out_of_bound",
    "test_infer_integer_overflow",
    "test_register_out_of_bound",
    "test_register_reserved_names",
    "test_register_invalid_shm_key",
    "test_python_client_leak",
]
SIZE_LIMIT_DEFAULT = [
    "test_default_limit_raw_binary",
    "test_default_limit_json",
    "test_large_string_in_json",
    "test_default_limit_compressed",
    # (test_json_dtype_size_expansion_exceeds_limit_error, which its test.sh runs here too, posts to
    # the generate endpoint: left out)
    "test_no_leak_on_invalid_inference_header_length",
]
SIZE_LIMIT_LARGE = [
    "test_large_input_raw_binary",
    "test_large_input_json",
    "test_large_input_compressed",
]
TIMEOUT_TESTS = [
    "test_grpc_infer",
    "test_grpc_async_infer",
    "test_grpc_stream_infer",
    "test_http_infer",
    "test_http_async_infer",
]
UNREGISTER_TESTS = [
    "test_unregister_shm_during_inference_single_req",
    "test_unregister_shm_during_inference_multiple_req",
    "test_unregister_shm_after_inference",
]
QA, VARIABLE, IDENTITY, SCALAR, EXAMPLES, EXTRA = (
    "qa_model_repository",
    "qa_variable_model_repository",
    "qa_identity_model_repository",
    "qa_scalar_models",
    "examples",
    "extra",
)
# Triton's docs/examples/model_repository models that are ONNX files in its git tree (qa's
# Dockerfile copies them into the suites' models/ directories)
EXAMPLE_MODELS = (
    "simple",
    "simple_int8",
    "simple_string",
    "simple_sequence",
    "simple_dyna_sequence",
)
# (bf16 models are not generated here: see `generate`)
ONNX_NO_BF16 = f"{QA}/onnx_*"
SHM_ON = ["--shared-memory", "on"]
SHM_OFF = ["--shared-memory", "off"]
EXPLICIT = ["--model-control", "explicit"]
# qa/L0_http/models as Triton's Dockerfile.QA fills it, and the copy its test.sh adds
HTTP_MODELS = [
    f"{EXAMPLES}/simple",
    f"{EXAMPLES}/simple_dyna_sequence",
    f"{EXTRA}/simple_identity",
    f"{EXAMPLES}/simple_sequence",
    f"{EXAMPLES}/simple_string",
    f"{EXTRA}/densenet_onnx",
    f"{EXTRA}/simple_string_dyna_sequence",
]
GRPC_MODELS = [*HTTP_MODELS, f"{EXAMPLES}/simple_int8"]
# L0_http's python_unit_test_models, as its test.sh makes them
HTTP_UNIT_MODELS = [
    f"{IDENTITY}/onnx_zero_1_float32",
    f"{IDENTITY}/onnx_zero_1_object",
    f"{IDENTITY}/onnx_zero_1_float16",
    f"{IDENTITY}/onnx_zero_3_float32",
    f"{EXTRA}/onnx_zero_1_object_1_element",
    f"{EXTRA}/onnx_zero_1_float32_queue",
    f"{EXTRA}/simple_identity",
    f"{EXTRA}/simple_identity_int64",
]


def runs() -> list[Run]:
    """Each test.sh's python test runs: its test files, environment, server flags and models (their
    configurations as the test.sh runs them; see the module's docstring for what is left out)."""
    found = [
        Run("L0_http", "http_test.py", "explicit", HTTP_UNIT_MODELS, flags=SHM_OFF + EXPLICIT),
        Run("L0_http", "python_http_aio_test.py", "shm", HTTP_MODELS, flags=SHM_ON),
        # (its tests stub the connection out: they never reach a server)
        Run("L0_http", "http_client_plugin_test.py", "client side only", HTTP_MODELS, flags=SHM_ON),
        Run(
            "L0_http",
            "http_basic_auth_test.py",
            "through nginx",
            HTTP_MODELS,
            flags=SHM_ON,
            proxy="L0_http/nginx.conf",
        ),
        Run(
            "L0_http",
            "http_input_size_limit_test.py",
            "default limit",
            [f"{IDENTITY}/onnx_zero_1_float32", f"{EXTRA}/simple_identity"],
            tests=[f"InferSizeLimitTest.{t}" for t in SIZE_LIMIT_DEFAULT],
            flags=SHM_OFF,
        ),
        Run(
            "L0_http",
            "http_input_size_limit_test.py",
            "--http-max-input-size=2**27",
            [f"{IDENTITY}/onnx_zero_1_float32", f"{EXTRA}/simple_identity"],
            tests=[f"InferSizeLimitTest.{t}" for t in SIZE_LIMIT_LARGE],
            flags=SHM_OFF + ["--max-body-bytes", str(2**27)],
        ),
        Run(
            "L0_http",
            "http_request_many_chunks.py",
            "explicit, simple",
            HTTP_MODELS,
            flags=SHM_ON + EXPLICIT + ["--load-model", "simple"],
        ),
        Run(
            "L0_grpc",
            "python_unit_test.py",
            "default",
            [f"{EXAMPLES}/simple", f"{EXTRA}/string_identity"],
            # (its test.sh runs RestrictedProtocolTest against a server started with
            # --grpc-restricted-protocol: left out)
            tests=["GrpcTest"],
            flags=SHM_OFF,
        ),
        Run("L0_grpc", "python_grpc_aio_test.py", "shm", GRPC_MODELS, flags=SHM_ON),
        Run(
            "L0_grpc",
            "grpc_basic_auth_test.py",
            "through nginx",
            GRPC_MODELS,
            flags=SHM_OFF,
            proxy="L0_grpc/nginx.conf",
        ),
    ]
    for client in ("http", "grpc"):
        found += [
            Run(
                "L0_shared_memory",
                "shared_memory_test.py",
                f"{client}, shm off",
                [f"{EXAMPLES}/simple"],
                env={"CLIENT_TYPE": client},
                tests=["SharedMemoryTest.test_client_shm_disabled_by_default"],
                flags=SHM_OFF,
            ),
            Run(
                "L0_shared_memory",
                "shared_memory_test.py",
                f"{client}, shm on",
                [f"{EXAMPLES}/simple"],
                env={"CLIENT_TYPE": client},
                tests=[f"SharedMemoryTest.{t}" for t in SHM_TESTS],
                flags=SHM_ON,
                per_case=True,
            ),
            Run(
                "L0_shared_memory",
                "shared_memory_test.py",
                f"{client}, unregister during a 15 s run",
                [f"{EXTRA}/execute_delayed_model=simple"],
                env={"CLIENT_TYPE": client},
                tests=[f"TestSharedMemoryUnregister.{t}_{client}" for t in UNREGISTER_TESTS],
                flags=SHM_ON,
                per_case=True,
            ),
            Run(
                "L0_shared_memory",
                "shared_memory_test.py",
                f"{client}, large offset",
                [f"{QA}/onnx_int32_int32_int32@1"],
                env={"CLIENT_TYPE": client, "BACKENDS": "onnx"},
                tests=["SharedMemoryTest.test_large_shm_register_offset"],
                flags=SHM_ON,
            ),
        ]
    onnx_only = {"BACKENDS": "onnx", "ENSEMBLES": "0", "TRITON_SERVER_CPU_ONLY": "1"}
    found += [
        Run("L0_infer", "infer_test.py", "cpu", [ONNX_NO_BF16], env=onnx_only, flags=SHM_OFF),
        Run(
            "L0_infer",
            "infer_test.py",
            "cpu, system shm",
            [ONNX_NO_BF16],
            env=onnx_only | {"TEST_SYSTEM_SHARED_MEMORY": "1"},
            flags=SHM_ON,
        ),
        Run(
            "L0_infer_zero",
            "infer_zero_test.py",
            "default",
            [f"{IDENTITY}/*"],
            env=onnx_only,
            flags=SHM_OFF,
        ),
        Run(
            "L0_infer_variable",
            "infer_variable_test.py",
            "cpu",
            [f"{VARIABLE}/*"],
            env=onnx_only,
            flags=SHM_OFF,
        ),
        Run(
            "L0_input_validation",
            "input_validation_test.py",
            "shape",
            [f"{QA}/onnx_object_int32_int32", f"{EXTRA}/pt_identity"],
            tests=["InputShapeTest"],
            # (the shape-tensor models are TensorRT ones)
            exclude=["test_wrong_input_shape_tensor_size"],
            flags=SHM_ON,
        ),
        Run(
            "L0_input_validation",
            "input_validation_test.py",
            "required and optional inputs",
            [
                f"{EXTRA}/input_all_required",
                f"{EXTRA}/input_optional",
                f"{EXTRA}/input_all_optional",
            ],
            tests=["InputValTest"],
            flags=SHM_OFF,
        ),
        Run(
            "L0_input_validation",
            "input_validation_test.py",
            "model names",
            [],
            tests=["ModelNameValidationTest"],
            flags=SHM_OFF + EXPLICIT,
        ),
        Run(
            "L0_client_nobatch",
            "client_test.py",
            "default",
            [ONNX_NO_BF16],
            flags=SHM_OFF,
            directory=QA,
        ),
        Run(
            "L0_client_timeout",
            "client_infer_timeout_test.py",
            "default",
            [f"{EXTRA}/custom_identity_int32"],
            tests=[f"ClientInferTimeoutTest.{t}" for t in TIMEOUT_TESTS],
            flags=SHM_OFF,
        ),
        Run(
            "L0_client_timeout",
            "client_non_infer_timeout_test.py",
            "explicit, shm",
            [f"{EXTRA}/custom_identity_int32"],
            env={"TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC": "2"},
            flags=SHM_ON + EXPLICIT,
        ),
        Run(
            "L0_scalar_io",
            "scalar_test.py",
            "default",
            [f"{SCALAR}/*"],
            env={"BACKENDS": "onnx"},
            flags=SHM_OFF,
        ),
    ]
    return found


# ---- Triton's files and models -------------------------------------------------------------------


def fetch_qa(repo: Path, commit: str, into: Path) -> Path:
    """qa/common, the suites' directories and docs/examples/model_repository of `repo` at `commit`,
    copied into `into` (qa/ and docs/ there)."""
    paths = ["qa/common", *(f"qa/{suite}" for suite in SUITES), "docs/examples/model_repository"]
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", commit, *paths], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "qa"


def generate(qa: Path, models: Path) -> None:
    """Triton's ONNX QA repositories (as gen_qa_model_repository makes them), and the few models it
    takes from elsewhere. Kept in `models` between runs of this script."""
    common = qa / "common"
    opset = ["--onnx_opset", str(ONNX_OPSET)]
    steps = {
        QA: ["gen_qa_models.py", "--onnx", *opset],
        VARIABLE: ["gen_qa_models.py", "--onnx", "--variable", *opset],
        IDENTITY: ["gen_qa_identity_models.py", "--onnx", *opset],
        SCALAR: ["gen_qa_ort_scalar_models.py", *opset],
    }
    for repository, command in steps.items():
        target = models / repository
        if target.is_dir() and any(target.iterdir()):
            continue
        print(f"generating {repository} ({' '.join(command)})", flush=True)
        subprocess.run(
            [PYTHON, *command, "--models_dir", str(target)],
            cwd=common,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        # onnxruntime has no CPU kernels for their BF16 arithmetic (L0_infer removes them on its CPU
        # target)
        for bf16 in target.glob("*bf16*"):
            shutil.rmtree(bf16)
        for path in target.glob("*/*/model.onnx"):
            readable_ir(path)
    examples = qa.parent / "docs" / "examples" / "model_repository"
    for name in EXAMPLE_MODELS:
        if not (models / EXAMPLES / name).is_dir():
            shutil.copytree(examples / name, models / EXAMPLES / name)
    extra = models / EXTRA
    for name, make in EXTRA_MODELS.items():
        if not (extra / name).is_dir():
            make(models, examples, extra / name)


def readable_ir(path: Path) -> None:
    """Triton generates its models with the onnx it pins (1.20.1); a newer onnx writes an IR version
    that this onnxruntime may not read yet. The generators' ops are those of ONNX_OPSET: the model
    is stamped with that opset's IR version (its graph is unchanged)."""
    import onnx

    model = onnx.load(str(path))
    if model.ir_version > ONNX_IR_VERSION:
        model.ir_version = ONNX_IR_VERSION
        onnx.save(model, str(path))


def copy_model(source: Path, target: Path) -> None:
    """A model directory under another name: its config.pbtxt's name follows (as test.sh's sed
    does)."""
    shutil.copytree(source, target)
    config = target / "config.pbtxt"
    if config.exists():
        text = re.sub(
            r'^name: ".*"', f'name: "{target.name}"', config.read_text(), count=1, flags=re.M
        )
        config.write_text(text)


def sed(path: Path, pattern: str, replacement: str, count: int = 0) -> None:
    """`sed -i s/pattern/replacement/` on a file (count 1: its first match only, as `0,/re/`
    does)."""
    path.write_text(re.sub(pattern, replacement, path.read_text(), count=count, flags=re.M))


def save_onnx(path: Path, nodes, inputs, outputs, initializers=()) -> None:
    from onnx import helper

    path.parent.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(nodes, path.parent.parent.name, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ONNX_IR_VERSION
    import onnx

    onnx.save(model, str(path))


def identity_onnx(path: Path, elem_type: int, dims: list) -> None:
    from onnx import helper

    save_onnx(
        path,
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        [helper.make_tensor_value_info("INPUT0", elem_type, dims)],
        [helper.make_tensor_value_info("OUTPUT0", elem_type, dims)],
    )


# The models Triton's QA takes from its python and custom backends, from a download, or makes with
# sed in a test.sh: each made here as its test.sh has it, or as an ONNX model of the same signature
# (name -> maker).


def simple_identity(models: Path, examples: Path, target: Path) -> None:
    """Its python model is a BYTES identity, max_batch_size 8, [-1]: the generated
    onnx_zero_1_object."""
    copy_model(models / IDENTITY / "onnx_zero_1_object", target)


def string_identity(models: Path, examples: Path, target: Path) -> None:
    """Its python model is an unbatched BYTES identity (L0_grpc's test.sh makes its dims [-1])."""
    copy_model(models / IDENTITY / "onnx_nobatch_zero_1_object", target)


def simple_identity_int64(models: Path, examples: Path, target: Path) -> None:
    """L0_http's test.sh: simple_identity with TYPE_STRING made TYPE_INT64 (an INT64 identity)."""
    from onnx import TensorProto

    identity_onnx(target / "1" / "model.onnx", TensorProto.INT64, [-1, -1])
    (target / "config.pbtxt").write_text(
        (examples / "simple_identity" / "config.pbtxt")
        .read_text()
        .replace("TYPE_STRING", "TYPE_INT64")
        .replace('name: "simple_identity"', f'name: "{target.name}"')
        .replace('backend: "python"', 'backend: "onnxruntime"')
    )


def one_element_object(models: Path, examples: Path, target: Path) -> None:
    """L0_http's test.sh: onnx_zero_1_object with its first -1 made 1 (INPUT0's dims [1])."""
    copy_model(models / IDENTITY / "onnx_zero_1_object", target)
    sed(target / "config.pbtxt", "-1", "1", count=1)


def queue_of_one(models: Path, examples: Path, target: Path) -> None:
    """L0_http's test.sh: onnx_zero_1_float32 with a dynamic batcher that waits 1 s and queues 1
    request."""
    copy_model(models / IDENTITY / "onnx_zero_1_float32", target)
    with open(target / "config.pbtxt", "a") as config:
        config.write(
            "dynamic_batching { \n    max_queue_delay_microseconds: 1000000\n"
            "    preferred_batch_size: [ 8 ]\n    default_queue_policy {\n"
            "        max_queue_size: 1\n    }\n}\n"
        )


def densenet_onnx(models: Path, examples: Path, target: Path) -> None:
    """Triton's Dockerfile.QA downloads densenet-7.onnx; here a model of its signature (data_0 FP32
    [1,3,224,224] -> fc6_1 [1,1000,1,1]: a pooling and a 1x1 convolution) with its config and
    labels."""
    from onnx import TensorProto, helper, numpy_helper

    shutil.copytree(examples / "densenet_onnx", target)
    weights = np.random.default_rng(0).normal(size=(1000, 3, 1, 1)).astype(np.float32)
    save_onnx(
        target / "1" / "model.onnx",
        [
            helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"]),
            helper.make_node("Conv", ["pooled", "W"], ["fc6_1"]),
        ],
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, 1000, 1, 1])],
        [numpy_helper.from_array(weights, "W")],
    )


def string_dyna_sequence(models: Path, examples: Path, target: Path) -> None:
    """L0_http's and L0_grpc's test.sh: simple_dyna_sequence renamed, its correlation id a string,
    run by the dyna_sequence custom backend (here: simple_dyna_sequence's ONNX file stays)."""
    copy_model(examples / "simple_dyna_sequence", target)
    config = target / "config.pbtxt"
    sed(config, "simple_dyna_sequence", target.name)
    sed(config, "^platform: .*", 'backend: "dyna_sequence"')
    text = config.read_text()
    at = text.index("CONTROL_SEQUENCE_CORRID")
    following = text.index("data_type:", at)
    end = text.index("\n", following)
    config.write_text(text[:following] + "data_type: TYPE_STRING" + text[end:])


def pt_identity(models: Path, examples: Path, target: Path) -> None:
    """L0_input_validation's test.sh scripts torch.nn.Identity as a PyTorch model: here an FP32
    identity of its config's shape, with that config."""
    from onnx import TensorProto

    identity_onnx(target / "1" / "model.onnx", TensorProto.FLOAT, [-1, 8])
    (target / "config.pbtxt").write_text(
        'name: "pt_identity"\nbackend: "pytorch"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [8] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [8] } ]\n'
        "dynamic_batching {\n    max_queue_delay_microseconds: 1000000\n}\n"
    )


def custom_identity_int32(models: Path, examples: Path, target: Path) -> None:
    """Its custom backend is an INT32 identity whose run takes SLOW_MODEL_S (execute_delay_ms:
    3000)."""
    write_slow_model(target / "1" / "model.onnx", SLOW_MODEL_S, add_sub=False)
    (target / "config.pbtxt").write_text(
        'name: "custom_identity_int32"\nbackend: "onnxruntime"\nmax_batch_size: 1024\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
    )


def execute_delayed_model(models: Path, examples: Path, target: Path) -> None:
    """qa/python_models/execute_delayed_model: `simple`'s sum and difference after a 15 s sleep,
    with `simple`'s config (the same signature; L0_shared_memory serves it as `simple`)."""
    write_slow_model(target / "1" / "model.onnx", DELAYED_MODEL_S, add_sub=True)
    shutil.copy(examples / "simple" / "config.pbtxt", target / "config.pbtxt")
    sed(target / "config.pbtxt", r'^name: ".*"', f'name: "{target.name}"', count=1)


def input_validation_model(models: Path, examples: Path, target: Path) -> None:
    """qa/L0_input_validation/models' python models answer OUTPUT0 [1] and nothing else: here an
    ONNX model of the same inputs (each FP32 [-1]; an `optional: true` one with a default in the
    file, as ONNX makes an input optional) giving OUTPUT0 = [1], with its config (the test is of the
    server's input checks)."""
    from onnx import TensorProto, helper, numpy_helper

    source = examples.parents[2] / "qa" / "L0_input_validation" / "models" / target.name
    config = (source / "config.pbtxt").read_text()
    names = re.findall(r'name: "(INPUT\d)"', config)
    optional = [
        name
        for name, block in zip(names, re.split(r'name: "INPUT\d"', config)[1:])
        if "optional: true" in block.split("}")[0]
    ]
    save_onnx(
        target / "1" / "model.onnx",
        [
            helper.make_node(
                "Constant",
                [],
                ["OUTPUT0"],
                value=numpy_helper.from_array(np.ones(1, np.float32), "one"),
            )
        ],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [-1]) for name in names],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.zeros(1, np.float32), name) for name in optional],
    )
    (target / "config.pbtxt").write_text(
        config.replace('backend: "python"', 'backend: "onnxruntime"')
    )


EXTRA_MODELS = {
    "simple_identity": simple_identity,
    "string_identity": string_identity,
    "simple_identity_int64": simple_identity_int64,
    "onnx_zero_1_object_1_element": one_element_object,
    "onnx_zero_1_float32_queue": queue_of_one,
    "densenet_onnx": densenet_onnx,
    "simple_string_dyna_sequence": string_dyna_sequence,
    "pt_identity": pt_identity,
    "custom_identity_int32": custom_identity_int32,
    "execute_delayed_model": execute_delayed_model,
    "input_all_required": input_validation_model,
    "input_optional": input_validation_model,
    "input_all_optional": input_validation_model,
}


def slow_model(iterations: int, add_sub: bool):
    """OUTPUT0 = INPUT0 + 0 * (a loop of `iterations` 256x256 matrix products that depends on the
    input, so that onnxruntime cannot fold it away); `add_sub`: INT32 INPUT0, INPUT1 [-1, 16] ->
    OUTPUT0 their sum and OUTPUT1 their difference (plus the same zero), as Triton's `simple`."""
    from onnx import TensorProto, helper, numpy_helper

    size = 256
    weights = np.random.default_rng(0).normal(scale=1 / 16, size=(size, size)).astype(np.float32)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_in", "W"], ["product"]),
            helper.make_node("Tanh", ["product"], ["x_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [size, size]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [size, size]),
        ],
    )
    nodes = [
        helper.make_node("ReduceSum", ["INPUT0"], ["total"], keepdims=0),
        helper.make_node("Cast", ["total"], ["total_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["total_f", "zero_f"], ["nothing_f"]),
        helper.make_node("Add", ["W", "nothing_f"], ["x0"]),
        helper.make_node("Loop", ["trips", "true", "x0"], ["x_final"], body=body),
        helper.make_node("ReduceSum", ["x_final"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "zero_f"], ["z"]),
        helper.make_node("Cast", ["z"], ["z_i"], to=TensorProto.INT32),
    ]
    shape = [-1, 16] if add_sub else [-1, -1]
    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, shape)]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, shape)]
    if add_sub:
        inputs.append(helper.make_tensor_value_info("INPUT1", TensorProto.INT32, shape))
        outputs.append(helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, shape))
        nodes += [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["sum"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["difference"]),
            helper.make_node("Add", ["sum", "z_i"], ["OUTPUT0"]),
            helper.make_node("Add", ["difference", "z_i"], ["OUTPUT1"]),
        ]
    else:
        nodes.append(helper.make_node("Add", ["INPUT0", "z_i"], ["OUTPUT0"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        inputs,
        outputs,
        [
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero_f"),
            numpy_helper.from_array(np.array(iterations, np.int64), "trips"),
            numpy_helper.from_array(np.array(True), "true"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def write_slow_model(path: Path, seconds: float, add_sub: bool) -> None:
    """The slow model, its loop count calibrated on this machine (one onnxruntime thread) to take
    `seconds` at the least."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    trial = 200
    session = ort.InferenceSession(slow_model(trial, add_sub).SerializeToString(), options)
    feed = {name: np.ones((1, 16), np.int32) for name in ("INPUT0", "INPUT1")[: 1 + add_sub]}
    session.run(None, feed)
    # CPU time of this thread (onnxruntime runs a one-thread session on it): what a busy machine
    # adds to the wall time is not counted, so that a later run takes `seconds` at the least
    timings = []
    for _ in range(3):
        started = time.thread_time()
        session.run(None, feed)
        timings.append(time.thread_time() - started)
    per_iteration = min(timings) / trial
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(slow_model(max(1, round(seconds / per_iteration)), add_sub), str(path))


def build_repository(run: Run, models: Path, into: Path) -> Path:
    repository = into / run.directory
    repository.mkdir(parents=True)
    for spec in run.models:
        source, _, renamed = spec.partition("=")
        source, _, version = source.partition("@")
        parent, _, pattern = source.rpartition("/")
        for found in sorted((models / parent).glob(pattern)):
            target = repository / (renamed or found.name)
            copy_model(found, target)
            if version:
                # only that version directory, as a test.sh's `cp -r MODEL/1` copies it
                for other in target.iterdir():
                    if other.is_dir() and other.name != version:
                        shutil.rmtree(other)
    return repository


# ---- the server ----------------------------------------------------------------------------------


class Server:
    """`python -m serving` over a repository on the tests' ports; killed by its pid."""

    def __init__(self, repository: Path, flags: list[str], log: Path, root: Path = ROOT):
        self.repository, self.flags, self.log_path = repository, flags, log
        # the checkout whose `serving` runs
        self.root = root
        self.process: subprocess.Popen | None = None
        # how it was started, when not as asked
        self.note = ""
        # model -> why it did not load
        self.unloadable: dict[str, str] = {}

    def _start(self, extra: list[str]) -> bool:
        # Triton's default --model-control-mode is none (no load API); this server's, with a
        # repository, is explicit
        control = [] if "--model-control" in self.flags + extra else ["--model-control", "none"]
        command = [
            PYTHON,
            "-m",
            "serving",
            "--repository",
            str(self.repository),
            "--port",
            str(HTTP_PORT),
            "--grpc-port",
            str(GRPC_PORT),
            "--threads",
            "1",
            *self.flags,
            *control,
            *extra,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            code = http_status("/v2/health/live")
            if code == 200:
                # live; ready once every model it loads at start is warm (or none is asked)
                if http_status("/v2/health/ready") == 200 or "--load-model" in extra:
                    return True
            time.sleep(0.2)
        self.stop()
        return False

    def start(self) -> None:
        """Over the whole repository, as Triton starts; if that stops it, with nothing loaded and
        then each model loaded on its own (the ones that fail are `unloadable`)."""
        models = sorted(p.name for p in self.repository.iterdir() if p.is_dir())
        if models and self._start([]):
            return
        if models:
            why = last_error(self.log_path)
            self.note = (
                f"refused to start over the repository ({why[:160]}); models loaded one by one"
            )
        explicit = [] if "--model-control" in self.flags else EXPLICIT
        if not self._start([*explicit, "--load-model", ""]):
            raise RuntimeError(f"the server did not start: {last_error(self.log_path)}")
        for model in models:
            code, body = http_post(f"/v2/repository/models/{model}/load")
            if code != 200:
                self.unloadable[model] = body[:200]

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None


def http_status(path: str) -> int:
    import requests

    try:
        return requests.get(f"http://127.0.0.1:{HTTP_PORT}{path}", timeout=2).status_code
    except requests.RequestException:
        return 0


def http_post(path: str) -> tuple[int, str]:
    import requests

    try:
        response = requests.post(f"http://127.0.0.1:{HTTP_PORT}{path}", timeout=300)
        return response.status_code, response.text
    except requests.RequestException as exc:
        return 0, str(exc)


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    wanted = [line for line in lines if "error" in line.lower()]
    return (wanted or lines or ["(no log)"])[-1][:300]


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ports_free() -> bool:
    return all(port_free(port) for port in (HTTP_PORT, GRPC_PORT, PROXY_PORT))


# the port the suites' nginx.conf listens on (the basic-auth tests call it)
PROXY_PORT = 8004


def start_proxy(conf: Path, prefix: Path) -> subprocess.Popen:
    """The suite's nginx.conf (basic auth, user `username`, password `password`, in front of the
    server) run in the foreground from `prefix`: its log, pid and password file there instead of the
    system's."""
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    hashed = subprocess.run(
        ["openssl", "passwd", "-apr1", "password"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (prefix / "pswd").write_text(f"username:{hashed}\n")
    text = conf.read_text()
    text = re.sub(r"error_log\s+[^;]*;", f"error_log {prefix}/logs/error.log;", text)
    text = re.sub(r"auth_basic_user_file\s+[^;]*;", f"auth_basic_user_file {prefix}/pswd;", text)
    # (as root, nginx's workers run as `nobody`, who may not read this run's private directory)
    user = "user root;\n" if os.geteuid() == 0 else ""
    (prefix / "nginx.conf").write_text(f"{user}pid {prefix}/nginx.pid;\n{text}")
    process = subprocess.Popen(
        ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process.poll() is None:
        if not port_free(PROXY_PORT):
            return process
        time.sleep(0.1)
    stop(process)
    raise RuntimeError(f"nginx did not start on port {PROXY_PORT} (see {prefix / 'logs'})")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# ---- running and reading the tests ---------------------------------------------------------------


@dataclass
class Outcome:
    run: Run
    # test -> (passed|failed|skipped, the failure's message)
    results: dict[str, tuple[str, str]]
    note: str = ""


# Runs a test file's unittest cases as its test.sh does (`python test.py`: their TestResultCollector
# needs unittest's runner, not pytest's) and writes each case's outcome to a JSON file after every
# case.
RUNNER = """
import importlib, json, os, sys, unittest

module_name, out, *names = sys.argv[1:]
sys.argv = sys.argv[:1]
sys.path.insert(0, ".")
module = importlib.import_module(module_name)
loader = unittest.TestLoader()
suite = loader.loadTestsFromNames(names, module) if names else loader.loadTestsFromModule(module)
excluded = [word for word in os.environ.get("TRITON_QA_EXCLUDE", "").split(",") if word]


def cases(tests):
    for test in tests:
        if isinstance(test, unittest.TestSuite):
            yield from cases(test)
        elif not any(word in test.id() for word in excluded):
            yield test


suite = unittest.TestSuite(cases(suite))


class Result(unittest.TextTestResult):
    outcomes = {}

    def note(self, test, status, text=""):
        self.outcomes[test.id()] = (status, text)
        with open(out, "w") as f:
            json.dump(self.outcomes, f)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.note(test, "failed", self._exc_info_to_string(err, test)[-1500:])

    def addError(self, test, err):
        super().addError(test, err)
        self.note(test, "failed", self._exc_info_to_string(err, test)[-1500:])

    def addSubTest(self, test, subtest, err):
        # unittest reports a failed subtest here, never calling addFailure for its test: it fails
        super().addSubTest(test, subtest, err)
        if err is not None:
            self.note(test, "failed", self._exc_info_to_string(err, test)[-1500:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.note(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.note(test, "passed")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.note(test, "failed", "unexpected success")


with open(out, "w") as f:
    json.dump({}, f)
unittest.TextTestRunner(resultclass=Result, verbosity=2).run(suite)
"""


def run_tests(
    run: Run, qa: Path, work: Path, report: Path, server_pid: int, log: Path
) -> dict[str, tuple[str, str]]:
    """The test file's cases in a copy of its suite's directory; test -> (status, message)."""
    suite = work / run.suite
    if not suite.exists():
        shutil.copytree(qa / run.suite, suite)
    if not (work / "common").exists():
        # the tests import qa/common's helpers from ../common
        os.symlink(qa / "common", work / "common", target_is_directory=True)
    runner = work / "run_unittest.py"
    runner.write_text(RUNNER)
    command = [PYTHON, str(runner), run.script.removesuffix(".py"), str(report), *run.tests]
    env = (
        os.environ
        | {
            "PYTHONPATH": str(qa / "common"),
            "SERVER_PID": str(server_pid),
            "TRITON_QA_EXCLUDE": ",".join(run.exclude + LEFT_OUT),
        }
        | run.env
    )
    with open(log, "ab") as output:
        try:
            subprocess.run(
                command,
                cwd=suite,
                env=env,
                timeout=RUN_TIMEOUT_S,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        except subprocess.TimeoutExpired:
            pass
    results = {}
    if report.exists():
        for test, (status, message) in json.loads(report.read_text()).items():
            results[test.removeprefix(run.script.removesuffix(".py") + ".")] = (status, message)
    if not results:
        results["(the whole file)"] = ("failed", f"no test ran (see {log})")
    return results


def reason(test: str, message: str) -> str:
    """A failure as a reason: the first of REASONS that matches "<test id> | <the last line of its
    traceback>" (the server's or the assertion's words), else that line with numbers and names made
    alike."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = lines[-1] if lines else message
    for pattern, reason_ in REASONS:
        if re.search(pattern, f"{test} | {text}"):
            return reason_
    text = re.sub(r"'[^']{0,80}'", "'…'", text)
    text = re.sub(r"\b\d+(\.\d+)?\b", "N", text)
    return text[:140]


# First match wins, over "<test id> | <last line>": the reasons found. First what differs on purpose
# or is not built (docs/serving.md lists them with their reasons), then the items of issue 49 (a
# failure there is a regression), then what keeps a test from running at all.
REASONS = [
    (
        r"ClientNonInferTimeoutTest",
        "Triton's server-side delay hook TRITONSERVER_SERVER_DELAY_* (not built, on purpose)",
    ),
    (r"400 != 413", "413 for a body over --max-body-bytes where Triton says 400 (on purpose)"),
    (
        r"Received message larger than max|test_bytes_contents_many_elements_serialization",
        "a gRPC message over --max-body-bytes, 16 MiB (on purpose; Triton's limit: 2 GiB)",
    ),
    (r"test_get_server_metadata", "the server's name asserted ('triton')"),
    (
        r"not allowed if polling is enabled",
        "load/unload with model control off: 403 naming the flag, not Triton's words on polling",
    ),
    (r"500 != 400", "Triton's 500 for a client's mistake, a 400 here (on purpose)"),
    (
        r"test_content_encoding_chunked_manually",
        "Content-Length with Transfer-Encoding: chunked refused (RFC 9112 6.3, on purpose)",
    ),
    (r"non-empty chunks", "Triton's limit on the number of HTTP chunks (not built)"),
    (
        r"reserved prefix",
        "Triton's python-backend shared memory key prefix (no python backend here)",
    ),
    (r"Invalid value for 'ready'", "JSON nested past the parser's depth limit refused as not JSON"),
    (
        r"Unable to open shared memory region",
        "shared memory registration's bad arguments: INVALID_ARGUMENT, Triton's INTERNAL",
    ),
    (
        r"string elements for inference input 'INPUT1'",
        "of two wrong inputs, Triton names the second",
    ),
    (
        r"expected number of inputs between",
        "an optional input (one with a default in the file) is not taken from requests (not built)",
    ),
    (
        r"ClientInferTimeoutTest.*not raised",
        "a client timeout not reached (the slow model ran faster than calibrated)",
    ),
    (r"UNIMPLEMENTED", "gRPC: method not implemented (item 5)"),
    (r"unknown model '(stats|…)'|/stats", "statistics extension missing (item 5)"),
    (
        r"tensor\(string\)|TYPE_STRING|BYTES|_object|simple_identity|string_identity",
        "BYTES tensors (item 3)",
    ),
    (r"test_class_|test_mix_|classification", "classification extension (item 4)"),
    (r"shared memory|shm", "shared memory (item 2)"),
    (r"Raw request|raw input|test_raw_binary", "raw binary requests (item 6)"),
    (
        r"the request has no rows|disagree on the number of rows",
        "first axis taken as rows (item 1)",
    ),
    (r"Request for unknown model|test_raw_version", "config.pbtxt version_policy"),
    (r"not found in|does not match|!= \d+ : Expected", "Triton's error wording or status asserted"),
    (r"Connection refused|failed to connect|UNAVAILABLE", "server not reachable"),
    (r"timed out after|no test ran", "the test file did not finish"),
]


def table(outcomes: list[Outcome]) -> str:
    lines = []
    by_suite: dict[str, list[Outcome]] = collections.defaultdict(list)
    for outcome in outcomes:
        by_suite[outcome.run.suite].append(outcome)
    grand = collections.Counter()
    for suite, items in by_suite.items():
        lines += [
            "",
            f"## {suite}",
            "",
            "| configuration | runs | passed | failed |",
            "|---|---:|---:|---:|",
        ]
        reasons: dict[str, list[str]] = collections.defaultdict(list)
        for outcome in items:
            counts = collections.Counter(status for status, _ in outcome.results.values())
            runs_ = counts["passed"] + counts["failed"]
            label = f"{outcome.run.script} ({outcome.run.label})"
            lines.append(f"| {label} | {runs_} | {counts['passed']} | {counts['failed']} |")
            grand.update(runs=runs_, passed=counts["passed"], failed=counts["failed"])
            grand[f"{suite}.runs"] += runs_
            for test, (status, message) in outcome.results.items():
                if status == "failed":
                    last = [line for line in message.splitlines() if line.strip()][-1:] or [""]
                    reasons[reason(test, message)].append(f"{test}: {last[0].strip()[:160]}")
            if outcome.note:
                lines.append(f"| ↳ {outcome.note[:600]} | | | |")
        if reasons:
            lines += ["", "failures by reason:"]
            for why, examples in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
                lines.append(f"- {len(examples)} × {why}  (e.g. {examples[0][:220]})")
    lines += [
        "",
        f"**all: {grand['runs']} runs, {grand['passed']} passed, {grand['failed']} failed**",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "repo", type=Path, help="a clone of triton-inference-server/server (bare is fine)"
    )
    parser.add_argument("--commit", default="HEAD", help="the commit of it to read (default HEAD)")
    parser.add_argument(
        "--suites", default=",".join(SUITES), help="comma-separated L0 directories (default: all)"
    )
    parser.add_argument(
        "--server-root",
        type=Path,
        default=ROOT,
        help="the checkout whose `python -m serving` runs (default: this one), e.g. another commit's",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the generated models (and logs) here between runs (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SUITES))
    if unknown:
        print(
            f"triton_qa: unknown suite(s) {unknown}; choose from {', '.join(SUITES)}",
            file=sys.stderr,
        )
        return 2
    if not (args.repo / "HEAD").exists() and not (args.repo / ".git").exists():
        print(f"triton_qa: {args.repo} is not a git repository", file=sys.stderr)
        return 2
    if not ports_free():
        print(
            f"triton_qa: ports {HTTP_PORT}, {GRPC_PORT} and {PROXY_PORT} (Triton's tests' own) must be "
            "free",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="triton-qa-") as temporary:
        base = args.workdir or Path(temporary)
        base.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="runs-", dir=base))
        qa = fetch_qa(args.repo, args.commit, scratch)
        models = base / "models"
        generate(qa, models)
        with open(qa / "common" / "test_util.py", "a") as test_util:
            test_util.write(ONNX_ONLY)
        outcomes = []
        for index, run in enumerate(r for r in runs() if r.suite in wanted):
            where = scratch / f"repository-{index}"
            repository = build_repository(run, models, where)
            started = time.monotonic()
            # a server (and a test process) per case where the test.sh starts one per case
            cases = [[test] for test in run.tests] if run.per_case else [run.tests]
            results, notes = {}, []
            for number, tests in enumerate(cases):
                tag = f"{index}" + (f"-{number}" if run.per_case else "")
                server = Server(
                    repository, run.flags, scratch / f"server-{tag}.log", args.server_root
                )
                proxy = None
                try:
                    server.start()
                    if run.proxy:
                        proxy = start_proxy(qa / run.proxy, scratch / f"nginx-{tag}")
                    report = scratch / f"report-{tag}.json"
                    log = scratch / f"client-{tag}.log"
                    one = replace(run, tests=tests)
                    results |= run_tests(one, qa, scratch / "tests", report, server.pid, log)
                except RuntimeError as exc:
                    results |= {" ".join(tests) or "(the whole file)": ("failed", str(exc))}
                finally:
                    if proxy is not None:
                        stop(proxy)
                    server.stop()
                note = server.note
                if server.unloadable:
                    note += f"; {len(server.unloadable)} not loaded: " + ", ".join(
                        sorted(server.unloadable)
                    )
                if note and note not in notes:
                    notes.append(note)
            outcomes.append(Outcome(run, results, "; ".join(notes)))
            passed = sum(1 for s, _ in results.values() if s == "passed")
            print(
                f"{run.suite} {run.script} ({run.label}): {passed}/{len(results)} passed "
                f"in {time.monotonic() - started:.0f} s",
                flush=True,
            )
        print(table(outcomes))
        print(f"\n(logs: {scratch})" if args.workdir else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
