"""The KServe V2 gRPC protocol's messages (package `inference`), without generated code.

The messages are declared below as a table, turned into a FileDescriptorProto at import and added
to a descriptor pool of our own; the classes come from `message_factory.GetMessageClass`. Why not
protoc's `*_pb2.py`:
- generated modules are tied to the protobuf runtime that generated them (they refuse to import
  under an older one, and warn or break under much newer ones); a descriptor built at run time
  works with whatever protobuf is installed, and no grpcio-tools is needed to build or run;
- a private pool, never the default one: tritonclient (and KServe's own package) register the
  same full names (`inference.ModelInferRequest`, ...) in the default pool, and one pool can't
  hold two definitions of a name. Separate pools let them coexist in one process (the tests
  use tritonclient as the reference client). The wire format depends only on field numbers and
  types, so their messages and ours read each other's bytes.

Fields and numbers are KServe's `grpc_predict_v2.proto`, with what Triton's `grpc_service.proto`
adds that this server answers: `double_param`/`uint64_param` in InferParameter, the ModelStreamInfer
stream, the six shared-memory RPCs, ModelConfig (the part of its model_config.proto this server
fills in), the repository RPCs (RepositoryIndex, RepositoryModelLoad/Unload) and ModelStatistics, as
Triton numbers them. proto3: repeated scalars are packed, as both of theirs are.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
FILE_NAME = "trainserve/grpc_predict_v2.proto"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

# Every message's fields as "[repeated] <type> <name> = <number>". <type> is a scalar, an enum of
# _ENUMS, a message of this file by its name inside the package (nested: Outer.Inner), or
# map<string,Message>.
# A dotted key is a nested message: it is placed inside its outer one, listed before it.
_MESSAGES: dict[str, tuple[str, ...]] = {
    "ServerLiveRequest": (),
    "ServerLiveResponse": ("bool live = 1",),
    "ServerReadyRequest": (),
    "ServerReadyResponse": ("bool ready = 1",),
    "ModelReadyRequest": ("string name = 1", "string version = 2"),
    "ModelReadyResponse": ("bool ready = 1",),
    "ServerMetadataRequest": (),
    "ServerMetadataResponse": (
        "string name = 1",
        "string version = 2",
        "repeated string extensions = 3",
    ),
    "ModelMetadataRequest": ("string name = 1", "string version = 2"),
    "ModelMetadataResponse": (
        "string name = 1",
        "repeated string versions = 2",
        "string platform = 3",
        "repeated ModelMetadataResponse.TensorMetadata inputs = 4",
        "repeated ModelMetadataResponse.TensorMetadata outputs = 5",
    ),
    "ModelMetadataResponse.TensorMetadata": (
        "string name = 1",
        "string datatype = 2",
        "repeated int64 shape = 3",
    ),
    "ModelInferRequest": (
        "string model_name = 1",
        "string model_version = 2",
        "string id = 3",
        "map<string,InferParameter> parameters = 4",
        "repeated ModelInferRequest.InferInputTensor inputs = 5",
        "repeated ModelInferRequest.InferRequestedOutputTensor outputs = 6",
        "repeated bytes raw_input_contents = 7",
    ),
    "ModelInferRequest.InferInputTensor": (
        "string name = 1",
        "string datatype = 2",
        "repeated int64 shape = 3",
        "map<string,InferParameter> parameters = 4",
        "InferTensorContents contents = 5",
    ),
    "ModelInferRequest.InferRequestedOutputTensor": (
        "string name = 1",
        "map<string,InferParameter> parameters = 2",
    ),
    "ModelInferResponse": (
        "string model_name = 1",
        "string model_version = 2",
        "string id = 3",
        "map<string,InferParameter> parameters = 4",
        "repeated ModelInferResponse.InferOutputTensor outputs = 5",
        "repeated bytes raw_output_contents = 6",
    ),
    "ModelInferResponse.InferOutputTensor": (
        "string name = 1",
        "string datatype = 2",
        "repeated int64 shape = 3",
        "map<string,InferParameter> parameters = 4",
        "InferTensorContents contents = 5",
    ),
    # Triton's streaming answer (its grpc_service.proto; not in KServe's minimal proto): one per
    # request on a ModelStreamInfer stream, the answer or why there is none.
    "ModelStreamInferResponse": (
        "string error_message = 1",
        "ModelInferResponse infer_response = 2",
    ),
    "InferParameter": (
        "bool bool_param = 1",
        "int64 int64_param = 2",
        "string string_param = 3",
        "double double_param = 4",
        "uint64 uint64_param = 5",
    ),
    # Triton's shared-memory extension (its grpc_service.proto), as tritonclient.grpc calls it.
    "SystemSharedMemoryStatusRequest": ("string name = 1",),
    "SystemSharedMemoryStatusResponse": (
        "map<string,SystemSharedMemoryStatusResponse.RegionStatus> regions = 1",
    ),
    "SystemSharedMemoryStatusResponse.RegionStatus": (
        "string name = 1",
        "string key = 2",
        "uint64 offset = 3",
        "uint64 byte_size = 4",
    ),
    "SystemSharedMemoryRegisterRequest": (
        "string name = 1",
        "string key = 2",
        "uint64 offset = 3",
        "uint64 byte_size = 4",
    ),
    "SystemSharedMemoryRegisterResponse": (),
    "SystemSharedMemoryUnregisterRequest": ("string name = 1",),
    "SystemSharedMemoryUnregisterResponse": (),
    "CudaSharedMemoryStatusRequest": ("string name = 1",),
    "CudaSharedMemoryStatusResponse": (
        "map<string,CudaSharedMemoryStatusResponse.RegionStatus> regions = 1",
    ),
    "CudaSharedMemoryStatusResponse.RegionStatus": (
        "string name = 1",
        "uint64 device_id = 2",
        "uint64 byte_size = 3",
    ),
    "CudaSharedMemoryRegisterRequest": (
        "string name = 1",
        "bytes raw_handle = 2",
        "int64 device_id = 3",
        "uint64 byte_size = 4",
    ),
    "CudaSharedMemoryRegisterResponse": (),
    "CudaSharedMemoryUnregisterRequest": ("string name = 1",),
    "CudaSharedMemoryUnregisterResponse": (),
    # Triton's model configuration (its model_config.proto), the part this server fills in
    # (ModelConfig RPC).
    "ModelConfigRequest": ("string name = 1", "string version = 2"),
    "ModelConfigResponse": ("ModelConfig config = 1",),
    "ModelConfig": (
        "string name = 1",
        "string platform = 2",
        "int32 max_batch_size = 4",
        "repeated ModelInput input = 5",
        "repeated ModelOutput output = 6",
        "string backend = 17",
    ),
    "ModelInput": (
        "string name = 1",
        "DataType data_type = 2",
        "repeated int64 dims = 4",
        "bool is_shape_tensor = 6",
        "bool optional = 8",
    ),
    "ModelOutput": (
        "string name = 1",
        "DataType data_type = 2",
        "repeated int64 dims = 3",
        "string label_filename = 4",
        "bool is_shape_tensor = 6",
    ),
    # Triton's model repository extension (its grpc_service.proto).
    "RepositoryIndexRequest": ("string repository_name = 1", "bool ready = 2"),
    "RepositoryIndexResponse": ("repeated RepositoryIndexResponse.ModelIndex models = 1",),
    "RepositoryIndexResponse.ModelIndex": (
        "string name = 1",
        "string version = 2",
        "string state = 3",
        "string reason = 4",
    ),
    "ModelRepositoryParameter": (
        "bool bool_param = 1",
        "int64 int64_param = 2",
        "string string_param = 3",
        "bytes bytes_param = 4",
    ),
    "RepositoryModelLoadRequest": (
        "string repository_name = 1",
        "string model_name = 2",
        "map<string,ModelRepositoryParameter> parameters = 3",
    ),
    "RepositoryModelLoadResponse": (),
    "RepositoryModelUnloadRequest": (
        "string repository_name = 1",
        "string model_name = 2",
        "map<string,ModelRepositoryParameter> parameters = 3",
    ),
    "RepositoryModelUnloadResponse": (),
    # Triton's statistics extension (its grpc_service.proto).
    "ModelStatisticsRequest": ("string name = 1", "string version = 2"),
    "ModelStatisticsResponse": ("repeated ModelStatistics model_stats = 1",),
    "StatisticDuration": ("uint64 count = 1", "uint64 ns = 2"),
    "ModelStatistics": (
        "string name = 1",
        "string version = 2",
        "uint64 last_inference = 3",
        "uint64 inference_count = 4",
        "uint64 execution_count = 5",
        "InferStatistics inference_stats = 6",
        "repeated InferBatchStatistics batch_stats = 7",
        "repeated MemoryUsage memory_usage = 8",
        "map<string,InferResponseStatistics> response_stats = 9",
    ),
    "InferStatistics": (
        "StatisticDuration success = 1",
        "StatisticDuration fail = 2",
        "StatisticDuration queue = 3",
        "StatisticDuration compute_input = 4",
        "StatisticDuration compute_infer = 5",
        "StatisticDuration compute_output = 6",
        "StatisticDuration cache_hit = 7",
        "StatisticDuration cache_miss = 8",
    ),
    "InferResponseStatistics": (
        "StatisticDuration compute_infer = 1",
        "StatisticDuration compute_output = 2",
        "StatisticDuration success = 3",
        "StatisticDuration fail = 4",
        "StatisticDuration empty_response = 5",
        "StatisticDuration cancel = 6",
    ),
    "InferBatchStatistics": (
        "uint64 batch_size = 1",
        "StatisticDuration compute_input = 2",
        "StatisticDuration compute_infer = 3",
        "StatisticDuration compute_output = 4",
    ),
    "MemoryUsage": ("string type = 1", "int64 id = 2", "uint64 byte_size = 3"),
    "InferTensorContents": (
        "repeated bool bool_contents = 1",
        "repeated int32 int_contents = 2",
        "repeated int64 int64_contents = 3",
        "repeated uint32 uint_contents = 4",
        "repeated uint64 uint64_contents = 5",
        "repeated float fp32_contents = 6",
        "repeated double fp64_contents = 7",
        "repeated bytes bytes_contents = 8",
    ),
}
# Messages whose fields all belong to one oneof, by the oneof's name.
_ONEOFS = {"InferParameter": "parameter_choice", "ModelRepositoryParameter": "parameter_choice"}
# Enums, by name: their values, numbered from 0 in this order (Triton's model_config.proto).
_ENUMS = {
    "DataType": (
        "TYPE_INVALID",
        "TYPE_BOOL",
        "TYPE_UINT8",
        "TYPE_UINT16",
        "TYPE_UINT32",
        "TYPE_UINT64",
        "TYPE_INT8",
        "TYPE_INT16",
        "TYPE_INT32",
        "TYPE_INT64",
        "TYPE_FP16",
        "TYPE_FP32",
        "TYPE_FP64",
        "TYPE_STRING",
        "TYPE_BF16",
    ),
}
# The RPCs this server answers; each takes <name>Request and returns <name>Response.
_RPCS = (
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
)
# Triton's bidirectional stream, RPC -> (request message, response message): as in its
# grpc_service.proto.
_STREAMS = {"ModelStreamInfer": ("ModelInferRequest", "ModelStreamInferResponse")}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """The protocol's .proto file as a descriptor, built from the tables above."""
    file = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = file.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full_name in _MESSAGES:
        outer, _, name = full_name.rpartition(".")
        siblings = protos[outer].nested_type if outer else file.message_type
        protos[full_name] = siblings.add(name=name)
    for full_name, fields in _MESSAGES.items():
        for declaration in fields:
            _add_field(protos[full_name], full_name, declaration)
    for full_name, oneof in _ONEOFS.items():
        message = protos[full_name]
        message.oneof_decl.add(name=oneof)
        for field in message.field:
            field.oneof_index = 0
    service = file.service.add(name=SERVICE.rpartition(".")[2])
    for rpc in _RPCS:
        service.method.add(
            name=rpc, input_type=f".{PACKAGE}.{rpc}Request", output_type=f".{PACKAGE}.{rpc}Response"
        )
    for rpc, (request, response) in _STREAMS.items():
        service.method.add(
            name=rpc,
            input_type=f".{PACKAGE}.{request}",
            output_type=f".{PACKAGE}.{response}",
            client_streaming=True,
            server_streaming=True,
        )
    return file


def _add_field(message: descriptor_pb2.DescriptorProto, full_name: str, declaration: str) -> None:
    """One "[repeated] <type> <name> = <number>" line as a field of `message`."""
    words, _, number = declaration.partition(" = ")
    *qualifiers, kind, name = words.split()
    label = _F.LABEL_REPEATED if qualifiers == ["repeated"] else _F.LABEL_OPTIONAL
    if kind.startswith("map<string,"):
        # A map is a repeated nested <Name>Entry{key = 1; value = 2} marked map_entry: what
        # protoc generates for it, and what makes the runtime give a dict-like field.
        entry = message.nested_type.add(name=_camel(name) + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
        value = kind.removeprefix("map<string,").removesuffix(">")
        entry.field.add(
            name="value",
            number=2,
            label=_F.LABEL_OPTIONAL,
            type=_F.TYPE_MESSAGE,
            type_name=f".{PACKAGE}.{value}",
        )
        message.field.add(
            name=name,
            number=int(number),
            label=_F.LABEL_REPEATED,
            type=_F.TYPE_MESSAGE,
            type_name=f".{PACKAGE}.{full_name}.{entry.name}",
        )
    elif kind in _SCALARS:
        message.field.add(name=name, number=int(number), label=label, type=_SCALARS[kind])
    elif kind in _ENUMS:
        message.field.add(
            name=name,
            number=int(number),
            label=label,
            type=_F.TYPE_ENUM,
            type_name=f".{PACKAGE}.{kind}",
        )
    else:
        message.field.add(
            name=name,
            number=int(number),
            label=label,
            type=_F.TYPE_MESSAGE,
            type_name=f".{PACKAGE}.{kind}",
        )


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


# ours alone: see the module docstring
POOL = descriptor_pool.DescriptorPool()
FILE = POOL.AddSerializedFile(file_descriptor_proto().SerializeToString())


def _message(name: str) -> type:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveRequest = _message("ServerLiveRequest")
ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyRequest = _message("ServerReadyRequest")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyRequest = _message("ModelReadyRequest")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataRequest = _message("ServerMetadataRequest")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataRequest = _message("ModelMetadataRequest")
ModelMetadataResponse = _message("ModelMetadataResponse")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")
ModelStreamInferResponse = _message("ModelStreamInferResponse")
InferParameter = _message("InferParameter")
SystemSharedMemoryStatusRequest = _message("SystemSharedMemoryStatusRequest")
SystemSharedMemoryStatusResponse = _message("SystemSharedMemoryStatusResponse")
SystemSharedMemoryRegisterRequest = _message("SystemSharedMemoryRegisterRequest")
SystemSharedMemoryRegisterResponse = _message("SystemSharedMemoryRegisterResponse")
SystemSharedMemoryUnregisterRequest = _message("SystemSharedMemoryUnregisterRequest")
SystemSharedMemoryUnregisterResponse = _message("SystemSharedMemoryUnregisterResponse")
CudaSharedMemoryStatusRequest = _message("CudaSharedMemoryStatusRequest")
CudaSharedMemoryStatusResponse = _message("CudaSharedMemoryStatusResponse")
CudaSharedMemoryRegisterRequest = _message("CudaSharedMemoryRegisterRequest")
CudaSharedMemoryRegisterResponse = _message("CudaSharedMemoryRegisterResponse")
CudaSharedMemoryUnregisterRequest = _message("CudaSharedMemoryUnregisterRequest")
CudaSharedMemoryUnregisterResponse = _message("CudaSharedMemoryUnregisterResponse")
InferTensorContents = _message("InferTensorContents")
ModelConfigRequest = _message("ModelConfigRequest")
ModelConfigResponse = _message("ModelConfigResponse")
RepositoryIndexRequest = _message("RepositoryIndexRequest")
RepositoryIndexResponse = _message("RepositoryIndexResponse")
RepositoryModelLoadRequest = _message("RepositoryModelLoadRequest")
RepositoryModelLoadResponse = _message("RepositoryModelLoadResponse")
RepositoryModelUnloadRequest = _message("RepositoryModelUnloadRequest")
RepositoryModelUnloadResponse = _message("RepositoryModelUnloadResponse")
ModelStatisticsRequest = _message("ModelStatisticsRequest")
ModelStatisticsResponse = _message("ModelStatisticsResponse")

# RPC name -> (request class, response class), for the server's method handlers.
METHODS: dict[str, tuple[type, type]] = {
    rpc: (_message(f"{rpc}Request"), _message(f"{rpc}Response")) for rpc in _RPCS
}
# Streaming RPC name -> (request class, response class).
STREAMS: dict[str, tuple[type, type]] = {
    rpc: (_message(request), _message(response)) for rpc, (request, response) in _STREAMS.items()
}
