"""The KServe V2 gRPC protocol layer (serving/grpc/schema.py, serving/grpc/codec.py), no server.

Wire compatibility is proven against the real client library: our messages declare the fields of
tritonclient's (same names, numbers, types, labels), requests built by tritonclient's own code
decode to the arrays it was given, and our answers read back through its InferResult.as_numpy.
Strictness: every client mistake is a BadRequest naming it, and a fuzz of malformed messages
raises nothing else.
"""

from __future__ import annotations

import random
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from tritonclient.grpc import _utils as triton_utils
from tritonclient.grpc import service_pb2 as triton_pb2

from serving.codec import BadRequest, Limits
from serving.engine import TensorSpec
from serving.grpc import schema
from serving.grpc.codec import decode_infer, encode_infer


def spec(name: str, dtype, datatype: str, shape: tuple[int, ...]) -> TensorSpec:
    """A tensor of a batched model (its first axis the batch axis) when that axis is dynamic."""
    return TensorSpec(name, np.dtype(dtype), datatype, shape, batched=shape[:1] == (-1,))


INPUTS = [
    spec("x", np.float32, "FP32", (-1, 4)),
    spec("ids", np.int64, "INT64", (-1, 3)),
    spec("mask", np.bool_, "BOOL", (-1, 2)),
    spec("half", np.float16, "FP16", (-1, 2)),
]
OUTPUTS = [spec("probs", np.float32, "FP32", (-1, 3)), spec("label", np.int64, "INT64", (-1,))]
OUTPUT_NAMES = [s.name for s in OUTPUTS]
SMALL_INTS = [spec("i8", np.int8, "INT8", (-1, 2)), spec("u16", np.uint16, "UINT16", (-1, 2))]
ANY_SHAPE = [spec("t", np.float32, "FP32", (-1, -1, -1, -1, -1))]
LIMITS = Limits(max_rows=64, max_body_bytes=1 << 20)

# Triton's messages of the extensions this server answers over gRPC as over HTTP (its
# grpc_service.proto and model_config.proto).
TRITON_EXTENSION_MESSAGES = (
    "ModelConfigRequest",
    "ModelConfigResponse",
    "ModelConfig",
    "ModelInput",
    "ModelOutput",
    "RepositoryIndexRequest",
    "RepositoryIndexResponse",
    "RepositoryIndexResponse.ModelIndex",
    "ModelRepositoryParameter",
    "RepositoryModelLoadRequest",
    "RepositoryModelLoadResponse",
    "RepositoryModelUnloadRequest",
    "RepositoryModelUnloadResponse",
    "ModelStatisticsRequest",
    "ModelStatisticsResponse",
    "StatisticDuration",
    "ModelStatistics",
    "InferStatistics",
    "InferResponseStatistics",
    "InferBatchStatistics",
    "MemoryUsage",
)
# KServe's grpc_predict_v2.proto, the protocol itself: message -> {field: number}.
KSERVE_FIELDS = {
    "ServerLiveRequest": {},
    "ServerLiveResponse": {"live": 1},
    "ServerReadyRequest": {},
    "ServerReadyResponse": {"ready": 1},
    "ModelReadyRequest": {"name": 1, "version": 2},
    "ModelReadyResponse": {"ready": 1},
    "ServerMetadataRequest": {},
    "ServerMetadataResponse": {"name": 1, "version": 2, "extensions": 3},
    "ModelMetadataRequest": {"name": 1, "version": 2},
    "ModelMetadataResponse": {"name": 1, "versions": 2, "platform": 3, "inputs": 4, "outputs": 5},
    "ModelMetadataResponse.TensorMetadata": {"name": 1, "datatype": 2, "shape": 3},
    "ModelInferRequest": {
        "model_name": 1,
        "model_version": 2,
        "id": 3,
        "parameters": 4,
        "inputs": 5,
        "outputs": 6,
        "raw_input_contents": 7,
    },
    "ModelInferRequest.InferInputTensor": {
        "name": 1,
        "datatype": 2,
        "shape": 3,
        "parameters": 4,
        "contents": 5,
    },
    "ModelInferRequest.InferRequestedOutputTensor": {"name": 1, "parameters": 2},
    "ModelInferResponse": {
        "model_name": 1,
        "model_version": 2,
        "id": 3,
        "parameters": 4,
        "outputs": 5,
        "raw_output_contents": 6,
    },
    "ModelInferResponse.InferOutputTensor": {
        "name": 1,
        "datatype": 2,
        "shape": 3,
        "parameters": 4,
        "contents": 5,
    },
    "InferParameter": {"bool_param": 1, "int64_param": 2, "string_param": 3},
    "InferTensorContents": {
        "bool_contents": 1,
        "int_contents": 2,
        "int64_contents": 3,
        "uint_contents": 4,
        "uint64_contents": 5,
        "fp32_contents": 6,
        "fp64_contents": 7,
        "bytes_contents": 8,
    },
}


def sample_arrays(rows: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {
        "x": rng.standard_normal((rows, 4)).astype(np.float32),
        "ids": rng.integers(-(2**40), 2**40, (rows, 3), dtype=np.int64),
        "mask": rng.integers(0, 2, (rows, 2)).astype(np.bool_),
        "half": rng.standard_normal((rows, 2)).astype(np.float16),
    }


def client_request(
    arrays: dict[str, np.ndarray], outputs: list[str] | None = None, request_id: str = ""
) -> bytes:
    """What tritonclient.grpc's infer() puts on the wire for these inputs, serialized."""
    infer_inputs = []
    for name, array in arrays.items():
        infer_input = triton.InferInput(
            name, list(array.shape), triton.np_to_triton_dtype(array.dtype)
        )
        infer_inputs.append(infer_input.set_data_from_numpy(array))
    requested = None if outputs is None else [triton.InferRequestedOutput(n) for n in outputs]
    request = triton_utils._get_inference_request(
        model_name="m",
        inputs=infer_inputs,
        model_version="",
        request_id=request_id,
        outputs=requested,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )
    return request.SerializeToString()


def ours(data: bytes) -> schema.ModelInferRequest:
    return schema.ModelInferRequest.FromString(data)


def raw_request(rows: int = 2) -> schema.ModelInferRequest:
    """A valid request with raw data for every input, built with our classes alone."""
    request = schema.ModelInferRequest(model_name="m")
    for s in INPUTS:
        array = sample_arrays(rows)[s.name]
        request.inputs.add(name=s.name, datatype=s.datatype, shape=list(array.shape))
        request.raw_input_contents.append(array.astype(s.dtype.newbyteorder("<")).tobytes())
    return request


def typed_request(rows: int = 2) -> schema.ModelInferRequest:
    """A valid request with typed contents (no FP16 input: it has no typed field)."""
    arrays = sample_arrays(rows)
    request = schema.ModelInferRequest(model_name="m")
    fields = {"x": "fp32_contents", "ids": "int64_contents", "mask": "bool_contents"}
    for s in INPUTS[:3]:
        item = request.inputs.add(
            name=s.name, datatype=s.datatype, shape=list(arrays[s.name].shape)
        )
        getattr(item.contents, fields[s.name]).extend(arrays[s.name].reshape(-1).tolist())
    return request


def small_ints_request(i8: list[int], u16: list[int]) -> schema.ModelInferRequest:
    request = schema.ModelInferRequest(model_name="m")
    request.inputs.add(name="i8", datatype="INT8", shape=[1, 2]).contents.int_contents.extend(i8)
    request.inputs.add(name="u16", datatype="UINT16", shape=[1, 2]).contents.uint_contents.extend(
        u16
    )
    return request


# ---- the schema against tritonclient's ----------------------------------------------------


def _messages(descriptor) -> list:
    """A message descriptor and all its nested ones."""
    found = [descriptor]
    for nested in descriptor.nested_types:
        found += _messages(nested)
    return found


def _field_rows(descriptor) -> dict[str, tuple]:
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    oneofs = [o.name for o in proto.oneof_decl]
    rows = {}
    for field, live in zip(proto.field, descriptor.fields):
        oneof = oneofs[field.oneof_index] if field.HasField("oneof_index") else None
        rows[field.name] = (
            field.number,
            field.type,
            field.label,
            field.type_name,
            oneof,
            live.is_packed,
        )
    return rows


OUR_MESSAGES = [m for top in schema.FILE.message_types_by_name.values() for m in _messages(top)]


@pytest.mark.parametrize("ours_descriptor", OUR_MESSAGES, ids=lambda d: d.full_name)
def test_every_message_matches_tritonclient(ours_descriptor):
    """Each of our fields is tritonclient's field of that name: number, type, label, message
    type, oneof, packing; map entries are map entries. Triton may declare more fields."""
    theirs_descriptor = triton_pb2.DESCRIPTOR.pool.FindMessageTypeByName(ours_descriptor.full_name)
    theirs = _field_rows(theirs_descriptor)
    for name, row in _field_rows(ours_descriptor).items():
        assert theirs.get(name) == row, f"{ours_descriptor.full_name}.{name}"
    assert ours_descriptor.GetOptions().map_entry == theirs_descriptor.GetOptions().map_entry


def test_schema_declares_kserve_messages_exactly():
    declared = {
        m.full_name.removeprefix("inference."): {f.name: f.number for f in m.fields}
        for m in OUR_MESSAGES
        if not m.GetOptions().map_entry
    }
    # KServe's messages exactly, plus Triton's answer on a stream, its two more InferParameter
    # kinds, its shared-memory messages and those of its extensions (model configuration,
    # repository, statistics) (checked field by field against tritonclient's by
    # test_every_message_matches_tritonclient).
    assert declared.pop("ModelStreamInferResponse") == {"error_message": 1, "infer_response": 2}
    triton_only = {name: fields for name, fields in declared.items() if "SharedMemory" in name}
    assert len(triton_only) == 14, sorted(triton_only)
    extensions = {
        name: fields for name, fields in declared.items() if name in TRITON_EXTENSION_MESSAGES
    }
    assert sorted(extensions) == sorted(TRITON_EXTENSION_MESSAGES)
    triton_only |= extensions
    declared = {name: fields for name, fields in declared.items() if name not in triton_only}
    kserve = dict(KSERVE_FIELDS)
    assert declared.pop("InferParameter") == {
        **kserve.pop("InferParameter"),
        "double_param": 4,
        "uint64_param": 5,
    }
    assert declared == kserve
    assert schema.InferParameter.DESCRIPTOR.oneofs_by_name["parameter_choice"].fields == list(
        schema.InferParameter.DESCRIPTOR.fields
    )


def test_service_methods_match_tritonclient():
    ours_service = schema.FILE.services_by_name["GRPCInferenceService"]
    theirs_service = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours_service.full_name == schema.SERVICE
    assert list(schema.METHODS) == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
    ]
    for method, (request_class, response_class) in schema.METHODS.items():
        theirs = theirs_service.methods_by_name[method]
        assert request_class.DESCRIPTOR.full_name == theirs.input_type.full_name
        assert response_class.DESCRIPTOR.full_name == theirs.output_type.full_name
        assert getattr(schema, request_class.DESCRIPTOR.name) is request_class
    # Triton's stream, beside KServe's six
    assert list(schema.STREAMS) == ["ModelStreamInfer"]
    for method, (request_class, response_class) in schema.STREAMS.items():
        ours, theirs = ours_service.methods_by_name[method], theirs_service.methods_by_name[method]
        assert (
            (ours.client_streaming, ours.server_streaming)
            == (theirs.client_streaming, theirs.server_streaming)
            == (True, True)
        )
        assert request_class.DESCRIPTOR.full_name == theirs.input_type.full_name
        assert response_class.DESCRIPTOR.full_name == theirs.output_type.full_name


def test_private_pool_coexists_with_tritonclient():
    default = descriptor_pool.Default().FindMessageTypeByName("inference.ModelInferRequest")
    assert default is triton_pb2.ModelInferRequest.DESCRIPTOR
    assert schema.ModelInferRequest.DESCRIPTOR is not default
    assert schema.POOL is not descriptor_pool.Default()
    declared = descriptor_pb2.FileDescriptorProto()
    schema.FILE.CopyToProto(declared)
    assert (declared.syntax, declared.package) == ("proto3", "inference")


def test_metadata_messages_cross_the_wire():
    response = schema.ModelMetadataResponse(
        name="m", versions=["1", "2"], platform="onnxruntime_onnx"
    )
    response.inputs.add(name="x", datatype="FP32", shape=[-1, 4])
    theirs = triton_pb2.ModelMetadataResponse.FromString(response.SerializeToString())
    assert (theirs.name, list(theirs.versions), list(theirs.inputs[0].shape)) == (
        "m",
        ["1", "2"],
        [-1, 4],
    )
    ready = triton_pb2.ModelReadyRequest(name="m", version="3").SerializeToString()
    assert schema.ModelReadyRequest.FromString(ready).version == "3"


# ---- round trips through tritonclient ----------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5])
def test_tritonclient_request_decodes_to_its_arrays(rows):
    arrays = sample_arrays(rows)
    decoded = decode_infer(ours(client_request(arrays)), INPUTS, OUTPUT_NAMES, LIMITS)
    assert decoded.rows == rows
    assert decoded.request_id is None
    assert decoded.outputs == [("probs", True), ("label", True)]
    for name, array in arrays.items():
        assert decoded.feeds[name].dtype == array.dtype
        np.testing.assert_array_equal(decoded.feeds[name], array)


def test_tritonclient_outputs_and_id():
    data = client_request(sample_arrays(), outputs=["label"], request_id="req-7")
    decoded = decode_infer(ours(data), INPUTS, OUTPUT_NAMES, LIMITS)
    assert decoded.outputs == [("label", True)]
    assert decoded.request_id == "req-7"


def test_tritonclient_dict_inputs_in_any_order():
    arrays = dict(reversed(sample_arrays(3).items()))
    decoded = decode_infer(ours(client_request(arrays)), INPUTS, OUTPUT_NAMES, LIMITS)
    for name, array in arrays.items():
        np.testing.assert_array_equal(decoded.feeds[name], array)


def test_answer_reads_back_through_tritonclient():
    results = {
        "probs": np.arange(12, dtype=np.float32).reshape(4, 3) / 7,
        "label": np.array([3, -1, 2**40, 0], dtype=np.int64),
    }
    response = encode_infer("m", "2", "req-7", results, [("label", True), ("probs", True)], OUTPUTS)
    theirs = triton_pb2.ModelInferResponse.FromString(response.SerializeToString())
    assert [o.name for o in theirs.outputs] == ["label", "probs"]
    assert [o.datatype for o in theirs.outputs] == ["INT64", "FP32"]
    assert (theirs.model_name, theirs.model_version, theirs.id) == ("m", "2", "req-7")
    result = triton.InferResult(theirs)
    for name, array in results.items():
        got = result.as_numpy(name)
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)


def test_answer_is_contiguous_little_endian_and_id_optional():
    # big-endian, not contiguous
    probs = np.arange(6, dtype=">f4").reshape(3, 2).T
    response = encode_infer("m", "1", None, {"probs": probs}, [("probs", True)], OUTPUTS)
    assert not response.id
    assert list(response.outputs[0].shape) == [2, 3]
    assert response.raw_output_contents[0] == probs.astype("<f4").tobytes()
    got = triton.InferResult(
        triton_pb2.ModelInferResponse.FromString(response.SerializeToString())
    ).as_numpy("probs")
    np.testing.assert_array_equal(got, probs)


def test_typed_contents_decode():
    request = typed_request(3)
    decoded = decode_infer(request, INPUTS[:3], OUTPUT_NAMES, LIMITS)
    for name, array in sample_arrays(3).items():
        if name != "half":
            assert decoded.feeds[name].dtype == array.dtype
            np.testing.assert_array_equal(decoded.feeds[name], array)
    narrow = decode_infer(
        small_ints_request([-128, 127], [0, 65535]), SMALL_INTS, OUTPUT_NAMES, LIMITS
    )
    np.testing.assert_array_equal(narrow.feeds["i8"], np.array([[-128, 127]], np.int8))
    assert narrow.feeds["u16"].dtype == np.uint16


def test_typed_contents_from_tritonclient_message():
    """Typed contents set on tritonclient's own message (its client never sends them)."""
    request = triton_pb2.ModelInferRequest(model_name="m")
    item = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    item.contents.fp32_contents.extend([0.5, -1.0, 2.0, 3.25])
    only_x = INPUTS[:1]
    decoded = decode_infer(ours(request.SerializeToString()), only_x, OUTPUT_NAMES, LIMITS)
    np.testing.assert_array_equal(decoded.feeds["x"], [[0.5, -1.0, 2.0, 3.25]])


def test_request_parameters_and_binary_data_are_ignored():
    request = raw_request()
    request.parameters["priority"].int64_param = 3
    request.outputs.add(name="probs").parameters["binary_data"].bool_param = False
    decoded = decode_infer(request, INPUTS, OUTPUT_NAMES, LIMITS)
    assert decoded.outputs == [("probs", True)]


# ---- refusals ------------------------------------------------------------------------------


def _set(message, **fields):
    for key, value in fields.items():
        if isinstance(value, list):
            message.ClearField(key)
            getattr(message, key).extend(value)
        else:
            setattr(message, key, value)
    return message


def _without_last_input(request):
    del request.inputs[-1]
    del request.raw_input_contents[-1]


def _huge_rows(request):
    # 16 GB of FP32 declared, 32 bytes sent
    request.inputs[0].shape[0] = 10**9


def _huge_values(request):
    request.inputs[0].shape[:] = [1, 2**30, 2**30, 1, 1]


def _too_big_even_empty(request):
    request.inputs[0].shape[:] = [1, 0, 2**31 - 1, 2**31 - 1, 2**31 - 1]
    request.raw_input_contents[0] = b""


def _any_shape_request() -> schema.ModelInferRequest:
    request = schema.ModelInferRequest()
    request.inputs.add(name="t", datatype="FP32", shape=[1, 1, 1, 1, 1])
    request.raw_input_contents.append(b"\0" * 4)
    return request


RAW, TYPED, NARROW, HALF, ANY = "raw", "typed", "narrow", "half", "any"
# (case id, base request, how it is spoiled, words the message must hold)
REFUSALS = [
    ("unknown input", RAW, lambda r: _set(r.inputs[0], name="nope"), "unknown input 'nope'"),
    ("duplicate input", RAW, lambda r: _set(r.inputs[1], name="x"), "input 'x' is given twice"),
    (
        "wrong datatype",
        RAW,
        lambda r: _set(r.inputs[0], datatype="FP64"),
        "datatype 'FP64', expected [-1,4] FP32",
    ),
    (
        "unknown datatype",
        RAW,
        lambda r: _set(r.inputs[0], datatype="FLOAT"),
        "'FLOAT' is not a KServe V2 datatype",
    ),
    (
        "BYTES datatype",
        RAW,
        lambda r: _set(r.inputs[0], datatype="BYTES"),
        "datatype 'BYTES', expected [-1,4] FP32",
    ),
    (
        "wrong rank",
        RAW,
        lambda r: _set(r.inputs[0], shape=[8]),
        "shape [8] does not fit; expected [-1,4] FP32",
    ),
    (
        "wrong dimension",
        RAW,
        lambda r: _set(r.inputs[0], shape=[4, 2]),
        "shape [4, 2] does not fit",
    ),
    (
        "negative dimension",
        RAW,
        lambda r: _set(r.inputs[0], shape=[-2, 4]),
        "shape must be at most 32 non-negative integers",
    ),
    (
        "rank over 32",
        RAW,
        lambda r: _set(r.inputs[0], shape=[1] * 33),
        "shape must be at most 32 non-negative integers",
    ),
    (
        "raw size mismatch",
        RAW,
        lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 31),
        "Expected 32, got 31: raw_input_contents[0] must hold the 32 bytes shape [2, 4] FP32 takes",
    ),
    (
        "raw count mismatch",
        RAW,
        lambda r: r.raw_input_contents.pop(),
        "3 raw_input_contents for 4 inputs",
    ),
    (
        "raw and contents",
        RAW,
        lambda r: r.inputs[0].contents.fp32_contents.extend([0.0] * 8),
        "input 'x' has both contents and raw_input_contents[0]",
    ),
    (
        "wrong typed field",
        TYPED,
        lambda r: _set(r.inputs[0].contents, fp32_contents=[], int_contents=[1] * 8),
        "FP32 data goes in contents.fp32_contents, got contents.int_contents",
    ),
    (
        "extra typed field",
        TYPED,
        lambda r: r.inputs[0].contents.fp64_contents.append(1.0),
        "FP32 data goes in contents.fp32_contents, got contents.fp64_contents",
    ),
    (
        "typed count mismatch",
        TYPED,
        lambda r: r.inputs[0].contents.fp32_contents.pop(),
        "shape [2, 4] needs 8 values, contents.fp32_contents has 7",
    ),
    (
        "typed no data",
        TYPED,
        lambda r: r.inputs[0].ClearField("contents"),
        "input 'x' has no data: send it as raw_input_contents or contents.fp32_contents",
    ),
    (
        "typed FP16",
        HALF,
        lambda r: (
            r.ClearField("raw_input_contents"),
            r.inputs[0].contents.fp32_contents.extend([0.0] * 4),
        ),
        "FP16 data can only come as raw_input_contents",
    ),
    (
        "INT8 out of range",
        NARROW,
        lambda r: _set(r.inputs[0].contents, int_contents=[1, 300]),
        "value 300 in contents.int_contents is out of range for INT8 (-128..127)",
    ),
    (
        "UINT16 out of range",
        NARROW,
        lambda r: _set(r.inputs[1].contents, uint_contents=[65536, 0]),
        "out of range for UINT16",
    ),
    ("rows over limit", RAW, _huge_rows, "1000000000 rows; this server takes at most 64"),
    ("values over body", ANY, _huge_values, "declares 1152921504606846976 values"),
    ("too big even empty", ANY, _too_big_even_empty, "is too large for an array"),
    (
        "missing input",
        RAW,
        _without_last_input,
        "expected 4 inputs but got 3 inputs for model 'm'. Got input(s) ['x','ids','mask'], but "
        "missing required input(s) ['half']. Please provide all required input(s). This model takes",
    ),
    (
        "rows disagree",
        RAW,
        lambda r: (
            _set(r.inputs[0], shape=[1, 4]),
            r.raw_input_contents.__setitem__(0, b"\0" * 16),
        ),
        "inputs disagree on the number of rows",
    ),
    (
        "no rows",
        TYPED,
        lambda r: [(_set(i, shape=[0, *i.shape[1:]]), i.ClearField("contents")) for i in r.inputs],
        "the request has no rows",
    ),
    (
        "no inputs",
        RAW,
        lambda r: (r.ClearField("inputs"), r.ClearField("raw_input_contents")),
        "expected 4 inputs but got 0 inputs for model 'm'. Got input(s) [], but missing "
        "required input(s) ['x','ids','mask','half']",
    ),
    (
        "too many inputs",
        RAW,
        lambda r: (r.inputs.add(name="x"), r.raw_input_contents.append(b"")),
        "the request has 5 inputs; this model takes 'x' [-1,4] FP32",
    ),
    ("unknown output", RAW, lambda r: r.outputs.add(name="nope"), "unknown output 'nope'"),
    (
        "repeated output",
        RAW,
        lambda r: (r.outputs.add(name="probs"), r.outputs.add(name="probs")),
        "output 'probs' already exists in request (requested twice)",
    ),
    (
        "BOOL raw byte 2",
        RAW,
        lambda r: r.raw_input_contents.__setitem__(2, b"\0\1\2\0"),
        "BOOL raw data must be bytes 0 or 1",
    ),
    (
        "shared memory without a size",
        RAW,
        lambda r: _set(r.inputs[0].parameters["shared_memory_region"], string_param="region"),
        "input 'x': parameters.shared_memory_byte_size must be a non-negative integer",
    ),
    (
        "shared memory with no reader",
        RAW,
        lambda r: (
            _set(r.inputs[0].parameters["shared_memory_region"], string_param="region"),
            _set(r.inputs[0].parameters["shared_memory_byte_size"], int64_param=32),
            r.raw_input_contents.pop(0),
        ),
        "input 'x' names a shared memory region, which this request can't use here",
    ),
    (
        "output classification of no classes",
        RAW,
        lambda r: _set(r.outputs.add(name="probs").parameters["classification"], string_param="2"),
        "output 'probs': parameters.classification must be a whole number of classes, at least 1",
    ),
    ("long name cut short", RAW, lambda r: _set(r.inputs[0], name="n" * 5000), "nnn'..."),
]


def _base(kind: str) -> tuple[schema.ModelInferRequest, list[TensorSpec]]:
    if kind == RAW:
        return raw_request(), INPUTS
    if kind == TYPED:
        return typed_request(), INPUTS[:3]
    if kind == NARROW:
        return small_ints_request([1, 2], [3, 4]), SMALL_INTS
    if kind == HALF:
        request = raw_request()
        del request.inputs[:3]
        del request.raw_input_contents[:3]
        return request, INPUTS[3:]
    return _any_shape_request(), ANY_SHAPE


@pytest.mark.parametrize(
    ("kind", "spoil", "words"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
def test_refusal(kind, spoil, words):
    request, inputs = _base(kind)
    # valid before it is spoiled
    decode_infer(request, inputs, OUTPUT_NAMES, LIMITS)
    spoil(request)
    with pytest.raises(BadRequest) as refused:
        decode_infer(request, inputs, OUTPUT_NAMES, LIMITS)
    assert words in str(refused.value)
    assert refused.value.status == 400
    # gRPC carries it in a trailer
    assert len(str(refused.value)) < 1000


def test_declared_size_is_refused_before_any_allocation():
    """A shape declaring gigabytes with a few bytes of data costs nothing to refuse."""
    request = raw_request()
    _huge_rows(request)
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest):
            decode_infer(request, INPUTS, OUTPUT_NAMES, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ---- fuzz ------------------------------------------------------------------------------------


def _byte_mutation(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        where = rng.randrange(len(data) + 1)
        choice = rng.randrange(4)
        # flip a byte
        if choice == 0 and data:
            data[min(where, len(data) - 1)] = rng.randrange(256)
        elif choice == 1:
            # cut
            del data[where : where + rng.randint(1, 16)]
        elif choice == 2:
            # insert noise
            data[where:where] = rng.randbytes(rng.randint(1, 8))
        else:
            # repeat a slice: fields given twice, shapes longer
            data[where:where] = data[rng.randrange(len(data) + 1) :][: rng.randint(1, 24)]
    return bytes(data)


_NAMES = ["x", "ids", "mask", "half", "i8", "u16", "t", "probs", "label", "", "nope"]
_DATATYPES = ["FP32", "FP64", "FP16", "INT8", "INT64", "UINT16", "BOOL", "BYTES", "BF16", "", "?"]
_DIMS = [0, 1, 2, 3, 4, 5, 8, 64, 65, -1, 2**31 - 1, 2**31, 2**62]
# Values each InferTensorContents field can hold, edges of the narrower datatypes among them.
_CONTENT_VALUES = {
    "bool_contents": [True, False],
    "int_contents": [0, 1, -1, 127, 128, -129, 32768, 65535, 2**31 - 1, -(2**31)],
    "int64_contents": [0, -1, 2**63 - 1, -(2**63)],
    "uint_contents": [0, 1, 255, 256, 65536, 2**32 - 1],
    "uint64_contents": [0, 2**64 - 1],
    "fp32_contents": [0.0, -1.5, float("nan"), float("inf"), 1e39],
    "fp64_contents": [0.0, 1e300, float("nan"), float("-inf")],
    "bytes_contents": [b"", b"ab"],
}


def _field_mutation(rng: random.Random, seed: bytes) -> bytes:
    """A message that parses, with one to three of its fields set to something plausible but
    maybe wrong: names, datatypes, shapes, raw blobs, typed contents, requested outputs."""
    request = schema.ModelInferRequest.FromString(seed)
    for _ in range(rng.randint(1, 3)):
        item = request.inputs[rng.randrange(len(request.inputs))] if request.inputs else None
        choice = rng.randrange(7)
        if choice == 0 and item is not None:
            item.name = rng.choice(_NAMES)
        elif choice == 1 and item is not None:
            item.datatype = rng.choice(_DATATYPES)
        elif choice == 2 and item is not None:
            item.shape[:] = [rng.choice(_DIMS) for _ in range(rng.choice([0, 1, 2, 2, 3, 5, 33]))]
        elif choice == 3 and request.raw_input_contents:
            index = rng.randrange(len(request.raw_input_contents))
            blob = request.raw_input_contents[index]
            request.raw_input_contents[index] = rng.choice(
                [blob[:-1], blob + b"\1", rng.randbytes(len(blob)), b""]
            )
        elif choice == 4 and item is not None:
            field, values = rng.choice(list(_CONTENT_VALUES.items()))
            getattr(item.contents, field).extend(rng.choices(values, k=rng.randint(1, 9)))
        elif choice == 5:
            request.outputs.add(name=rng.choice(_NAMES))
        elif request.raw_input_contents:
            request.raw_input_contents.append(b"\0" * 8)
    return request.SerializeToString()


def test_fuzz_only_bad_request_or_decode_error():
    """Random bytes, bytes of a valid request spoiled, and valid messages with fields set to
    wrong values: protobuf refuses to parse the first kinds (DecodeError, which the server
    answers with INVALID_ARGUMENT), and whatever parses is decoded or refused, never more."""
    assert set(_CONTENT_VALUES) == {f.name for f in schema.InferTensorContents.DESCRIPTOR.fields}
    rng = random.Random(20240601)
    seeds = [
        (raw_request().SerializeToString(), INPUTS),
        (typed_request().SerializeToString(), INPUTS[:3]),
        (small_ints_request([1, 2], [3, 4]).SerializeToString(), SMALL_INTS),
        (_any_shape_request().SerializeToString(), ANY_SHAPE),
    ]
    outcomes = {"parse error": 0, "refused": 0, "accepted": 0}
    for i in range(1200):
        seed, inputs = rng.choice(seeds)
        if i % 4 == 3:
            data = rng.randbytes(rng.randint(0, 200))
        elif i % 4 == 2:
            data = _byte_mutation(rng, seed)
        else:
            data = _field_mutation(rng, seed)
        try:
            request = schema.ModelInferRequest.FromString(data)
        except DecodeError:
            outcomes["parse error"] += 1
            continue
        try:
            decoded = decode_infer(request, inputs, OUTPUT_NAMES, LIMITS)
        except BadRequest:
            outcomes["refused"] += 1
            continue
        outcomes["accepted"] += 1
        assert 0 < decoded.rows <= LIMITS.max_rows
        # what is accepted is what the model takes
        for s in inputs:
            assert decoded.feeds[s.name].dtype == s.dtype
            assert len(decoded.feeds[s.name].shape) == len(s.shape)
    # every path was taken, often
    assert min(outcomes.values()) >= 30, outcomes


def test_a_missing_input_of_an_image_version_names_the_tensor_not_both_forms():
    """An image version takes the tensor or the file that stands for it (codec.given_inputs): a
    request with neither is missing one input, the tensor, in Triton's words too."""
    inputs = [
        spec("x", "float32", "FP32", (-1, 4)),
        replace(spec("image", "object", "BYTES", (-1,)), stands_for="x"),
    ]
    request = schema.ModelInferRequest(model_name="m")
    with pytest.raises(BadRequest) as refused:
        decode_infer(request, inputs, OUTPUT_NAMES, LIMITS)
    assert str(refused.value).startswith(
        "expected 1 inputs but got 0 inputs for model 'm'. Got input(s) [], but missing required "
        "input(s) ['x']. Please provide all required input(s)."
    ), refused.value
