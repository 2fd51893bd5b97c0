"""ModelInferRequest -> validated arrays, and arrays -> ModelInferResponse. Pure, no gRPC server.

The gRPC twin of serving/codec.py's decode_v2/encode_v2, as strict and built on the same checks
(shape, size limits before data, NaN/Inf, rows). Every client mistake is a BadRequest naming the
field and what it should be; nothing else is raised, whatever the message holds.

An input's data comes one of two ways, never both:
- `raw_input_contents`: one blob per input, for every input or for none, in the order of `inputs`;
  little-endian, exactly count * itemsize bytes (BYTES: each element's 4-byte length, then its
  bytes). What tritonclient sends, and the only way for FP16 (the protocol has no typed field for
  it).
- the input's `contents`, in the one field of its datatype (FP32 -> fp32_contents, INT8/16/32 ->
  int_contents, BYTES -> bytes_contents, ...), as many values as the shape has elements, in range of
  the datatype.

The answer always carries outputs as `raw_output_contents`, in the order of `outputs`: what Triton
does, and what tritonclient's InferResult.as_numpy reads (it pairs the two lists by position); BYTES
ones serialized as their input is. Inputs and outputs may be placed in shared memory (parameters
shared_memory_region, _byte_size, _offset: the V2 shared-memory extensions, serving/shm.py);
raw_input_contents then carries the other inputs only, in order. An output's `classification`
parameter (int64_param K > 0) asks for its top-K classes (serving/classification.py); the other
client parameters (binary_data, request-level priority, timeout, ...) are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from serving.codec import (
    MAX_DIM,
    BadRequest,
    Limits,
    V2Request,
    _check_shape,
    _check_size,
    _rows,
    byte_size_mismatch,
    bytes_elements,
    check_all_given,
    check_datatype,
    classified,
    datatype_of,
    duplicate_output,
    expected,
    given_inputs,
    is_bytes,
    little_endian,
    shared_tensor,
    shm_ref,
)
from serving.engine import TensorSpec
from serving.grpc.schema import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from serving.staging import NonFinite

# as over HTTP
MAX_RANK = 32
# Fields a ModelInferRequest may hold at its top level and inside its inputs and outputs together: a
# real request has a handful per model input and output. Counted on the wire before any message is
# built, because an empty repeated entry costs far more in memory than on the wire
# (docs/benchmarks.md#servinggrpccodecpy).
MAX_FIELDS = 4096
# ModelInferRequest's fields worth counting inside: inputs (5) and outputs (6). Their own fields are
# counted but not descended into (contents' packed numbers are one field each).
_NESTED_COUNTED = (5, 6)

# V2 datatype -> the InferTensorContents field that carries it typed, and that field's own
# numpy type (narrower ints travel in the 32-bit fields and are range-checked). FP16 has no
# field in the protocol: raw only. BF16 never reaches here (no model input has it).
_CONTENTS: dict[str, tuple[str, type[np.generic]]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int32),
    "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint32),
    "UINT16": ("uint_contents", np.uint32),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", np.object_),
}


def check_field_count(data: bytes, limit: int = MAX_FIELDS) -> None:
    """Refuse a ModelInferRequest of more than `limit` fields (top level, inputs and outputs
    together) before it is parsed. Reads only tags and lengths, and stops at the limit: a few
    thousand steps at most, whatever the message holds. Malformed wire data is left for the parser
    to refuse."""
    count = 0
    stack = [(0, len(data), True)]
    while stack:
        pos, end, top = stack.pop()
        while pos < end:
            count += 1
            if count > limit:
                raise BadRequest(
                    f"the message holds more than {limit} fields (inputs, outputs, parameters, "
                    "raw_input_contents and their own fields together); a request needs a few "
                    "per model input and output"
                )
            tag, pos = _varint(data, pos, end)
            if tag is None:
                return
            kind = tag & 7
            if kind == 0:
                _, pos = _varint(data, pos, end)
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                length, pos = _varint(data, pos, end)
                if length is None:
                    return
                if top and tag >> 3 in _NESTED_COUNTED:
                    stack.append((pos, min(pos + length, end), False))
                pos += length
            else:
                # groups and invalid wire types: the parser's to refuse
                return
            if pos is None:
                return


def _varint(data: bytes, pos: int, end: int) -> tuple[int | None, int | None]:
    value = shift = 0
    while pos < end and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return None, None


def decode_infer(
    request: ModelInferRequest,
    inputs: list[TensorSpec],
    output_names: list[str],
    limits: Limits,
    shared=None,
    raw=None,
    place=None,
) -> V2Request:
    """The request's inputs as arrays of the model's dtypes, checked against `inputs` and `limits`;
    its requested outputs (all of the model's when none are named). `shared(ref, spec, count, into)`
    reads an input placed in shared memory (serving/shm.py). `raw`: the raw_input_contents when they
    came apart from the message (the native engine keeps them, and copies each once: `copy_into`,
    NaN/Inf checked on the way); then `place(rows)` may give the rows of a batch buffer to copy
    them, and inputs in shared memory, straight into (serving/batcher.py)."""
    given = request.inputs
    if not given:
        check_all_given(inputs, [], request.model_name)
    if len(given) > len(inputs):
        raise BadRequest(
            f"the request has {len(given)} inputs; this model takes {expected(inputs)}"
        )
    raw = request.raw_input_contents if raw is None else raw
    refs = [shm_ref(_plain(item.parameters), f"input '{item.name[:80]}'") for item in given]
    # inputs whose data is in the message
    carried = sum(ref is None for ref in refs)
    if raw and len(raw) != carried:
        raise BadRequest(
            f"the request has {len(raw)} raw_input_contents for {carried} "
            "inputs not in shared memory; send raw data for every such input, in the order of "
            "inputs, or for none (typed contents)"
        )
    by_name = {s.name: s for s in inputs}
    # name -> (spec, shape, count, ref, raw index or None, item)
    declared: dict[str, tuple] = {}
    index = 0
    for item, ref in zip(given, refs):
        spec = by_name.get(item.name)
        if spec is None:
            raise BadRequest(
                f"unknown input {_quote(item.name)}; this model takes {expected(inputs)}"
            )
        name = spec.name
        if name in declared:
            raise BadRequest(f"input '{name}' is given twice")
        shape = _checked_shape(item, spec)
        count = _check_size(name, shape, spec, limits)
        if ref is not None:
            if item.contents.ListFields():
                raise BadRequest(
                    f"input '{name}' is in shared memory and also has contents; send one"
                )
            if shared is None:
                raise BadRequest(
                    f"input '{name}' names a shared memory region, which this request can't use here"
                )
            declared[name] = (spec, shape, count, ref, None, item)
        elif raw:
            if item.contents.ListFields():
                raise BadRequest(
                    f"input '{name}' has both contents and raw_input_contents[{index}]; send one"
                )
            want = len(raw[index]) if is_bytes(spec) else count * spec.dtype.itemsize
            if len(raw[index]) != want:
                raise BadRequest(
                    byte_size_mismatch(name, request.model_name, want, len(raw[index]))
                    + f": raw_input_contents[{index}] must hold the {want} bytes shape {shape} "
                    f"{spec.datatype} takes"
                )
            declared[name] = (spec, shape, count, None, index, item)
            index += 1
        else:
            declared[name] = (spec, shape, count, None, None, item)
    check_all_given(inputs, list(declared), request.model_name)
    views = _placed(declared, inputs, raw, place)
    feeds: dict[str, np.ndarray] = {}
    for name, (spec, shape, count, ref, at, item) in declared.items():
        if ref is not None:
            into = None if views is None else views[name].reshape(-1)
            array = shared_tensor(shared, ref, spec, count, into)
        elif at is not None:
            array = _raw_tensor(
                raw[at], at, spec, count, None if views is None else views[name].reshape(-1)
            )
        else:
            array = _typed_tensor(item.contents, spec, shape, count)
        feeds[name] = _reshaped(array, shape, name)
    rows = _rows(feeds, inputs)
    outputs, output_refs, classes = _requested_outputs(request.outputs, output_names)
    native = raw is not None and len(raw) and not isinstance(raw[0], (bytes, bytearray, memoryview))
    return V2Request(
        feeds,
        rows,
        request.id or None,
        outputs,
        output_refs,
        checked=bool(native) and len(raw) == len(given_inputs(inputs, declared)),
        placed=views is not None,
        classification=classes,
    )


def _placed(declared: dict, inputs: list[TensorSpec], raw, place) -> dict | None:
    """The batch buffer rows every input can be copied straight into: only for raw contents the
    native engine kept (bytes the message parser made are copied once already) and inputs in shared
    memory (read into them), every model input one of those, all of one row count."""
    if place is None or len(declared) != len(given_inputs(inputs, declared)):
        return None
    # (BYTES elements have no fixed size: no rows of a buffer to go into)
    if any(is_bytes(spec) for spec, *_ in declared.values()):
        return None
    kept = bool(raw) and not isinstance(raw[0], (bytes, bytearray, memoryview))
    if any(ref is None and (at is None or not kept) for _, _, _, ref, at, _ in declared.values()):
        return None
    rows = {shape[0] if shape else -1 for _, shape, *_ in declared.values()}
    return place(rows.pop()) if len(rows) == 1 and min(rows) > 0 else None


def _plain(parameters: Mapping[str, InferParameter]) -> dict:
    """A parameters map as plain values (what shm_ref reads)."""
    if not parameters:
        return {}
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
        for key, value in parameters.items()
    }


def _checked_shape(item: ModelInferRequest.InferInputTensor, spec: TensorSpec) -> list[int]:
    """The input's shape, after the same checks and in the same order as over HTTP: a valid
    shape, a known datatype, the model's datatype, then a shape the model takes."""
    name, shape = spec.name, list(item.shape)
    if len(shape) > MAX_RANK or not all(0 <= d < MAX_DIM for d in shape):
        raise BadRequest(
            f"input '{name}': shape must be at most {MAX_RANK} non-negative "
            f"integers below {MAX_DIM}, got {shape!r:.100}; expected "
            f"{spec.describe()}"
        )
    check_datatype(item.datatype, spec)
    _check_shape(spec, shape)
    return shape


def _raw_tensor(
    blob, index: int, spec: TensorSpec, count: int, destination: np.ndarray | None = None
) -> np.ndarray:
    """raw_input_contents[index] as `spec`'s dtype: bytes the message parser made, read in place
    (read-only, like the HTTP path's binary data); or contents the native engine kept, copied once
    into `destination` (or an array of their own) with the NaN/Inf check on the way. BYTES: its
    serialized elements, read one by one."""
    if is_bytes(spec):
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            data = np.empty(len(blob), dtype=np.uint8)
            blob.copy_into(data, 0)
            blob = data
        return bytes_elements(blob, count, spec.name)
    if isinstance(blob, (bytes, bytearray, memoryview)):
        array = np.frombuffer(blob, dtype=spec.dtype.newbyteorder("<"), count=count)
    else:
        array = destination if destination is not None else np.empty(count, dtype=spec.dtype)
        if not blob.copy_into(array, spec.dtype.itemsize if spec.dtype.kind == "f" else 0):
            raise BadRequest(str(NonFinite(spec.name)))
    if spec.dtype == np.bool_ and array.view(np.uint8).max(initial=0) > 1:
        raise BadRequest(f"input '{spec.name}': BOOL raw data must be bytes 0 or 1")
    # a no-op on little-endian machines
    return array.astype(spec.dtype, copy=False)


def _typed_tensor(
    contents: InferTensorContents, spec: TensorSpec, shape: list[int], count: int
) -> np.ndarray:
    """The input's `contents` as `spec`'s dtype: only the datatype's own field set, one value
    per element, each in range of the datatype."""
    name = spec.name
    present = [field.name for field, _ in contents.ListFields()]
    if spec.datatype not in _CONTENTS:
        raise BadRequest(
            f"input '{name}': {spec.datatype} data can only come as "
            "raw_input_contents (little-endian), the protocol has no typed "
            f"contents field for it; got {_fields(present) or 'no data'}"
        )
    field, field_dtype = _CONTENTS[spec.datatype]
    strangers = [f for f in present if f != field]
    if strangers:
        raise BadRequest(
            f"input '{name}': {spec.datatype} data goes in contents.{field}, "
            f"got {_fields(strangers)}"
        )
    values = getattr(contents, field)
    if len(values) != count:
        if not values:
            raise BadRequest(
                f"input '{name}' has no data: send it as raw_input_contents or "
                f"contents.{field} ({count} values for shape {shape})"
            )
        raise BadRequest(
            f"input '{name}': shape {shape} needs {count} values, contents.{field} "
            f"has {len(values)}"
        )
    if is_bytes(spec):
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    array = np.asarray(list(values), dtype=field_dtype)
    if spec.dtype.kind in "iu" and spec.dtype != array.dtype and array.size:
        info = np.iinfo(spec.dtype)
        outside = array[(array < info.min) | (array > info.max)]
        if outside.size:
            raise BadRequest(
                f"input '{name}': value {outside[0]} in contents.{field} is out "
                f"of range for {spec.datatype} ({info.min}..{info.max})"
            )
    return array.astype(spec.dtype, copy=False)


def _reshaped(array: np.ndarray, shape: list[int], name: str) -> np.ndarray:
    """`array` in the declared shape. Its element count is right by now, but numpy still
    refuses a shape whose non-zero dimensions multiply past what it can index (an empty
    [1, 0, 2**31-1, 2**31-1, 2**31-1]), a shape no model computes on either."""
    try:
        return array.reshape(shape)
    except ValueError:
        raise BadRequest(
            f"input '{name}': shape {shape} is too large for an array, even empty"
        ) from None


def _requested_outputs(
    requested: Iterable[ModelInferRequest.InferRequestedOutputTensor], output_names: list[str]
) -> tuple[list[tuple[str, bool]], dict, dict[str, int]]:
    """(name, True) per requested output in the order asked, or every output when none are (the
    answer always carries raw data, so Triton's binary_data has nothing to choose); those to be
    written to shared memory instead, {name: Ref}; and those asked for as their top K classes,
    {name: K}."""
    if not requested:
        return [(name, True) for name in output_names], {}, {}
    outputs: list[tuple[str, bool]] = []
    refs, classes = {}, {}
    for out in requested:
        if out.name not in output_names:
            raise BadRequest(
                f"unknown output {_quote(out.name)}; this model has outputs {output_names}"
            )
        if any(out.name == known for known, _ in outputs):
            raise BadRequest(duplicate_output(out.name))
        parameters = _plain(out.parameters)
        ref = shm_ref(parameters, f"output '{out.name}'")
        if ref is not None:
            refs[out.name] = ref
        if "classification" in parameters:
            classes[out.name] = classified(parameters, out.name, ref)
        outputs.append((out.name, True))
    return outputs, refs, classes


def _fields(names: list[str]) -> str:
    return ", ".join(f"contents.{n}" for n in names)


def _quote(text: str, limit: int = 80) -> str:
    """A client's string in a message, cut short: gRPC carries the message in a trailer, and
    an oversized trailer loses the status for the client."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}..."


def encode_infer(
    model_name: str,
    model_version: str,
    request_id: str | None,
    results: dict[str, np.ndarray],
    outputs: list[tuple[str, bool]],
    specs: list[TensorSpec],
    placed: dict[str, dict] | None = None,
) -> ModelInferResponse:
    """The answer: each output in the order of `outputs` with the model's datatype and the
    result's shape, its data little-endian in raw_output_contents at the same position."""
    datatypes = {s.name: s.datatype for s in specs}
    response = ModelInferResponse(model_name=model_name, model_version=model_version)
    if request_id is not None:
        response.id = request_id
    blobs = []
    for name, _binary in outputs:
        array = np.ascontiguousarray(results[name])
        tensor = response.outputs.add(
            name=name, datatype=datatype_of(array, datatypes[name]), shape=list(array.shape)
        )
        # written to shared memory: where, and an empty place among the raw contents
        if placed and name in placed:
            for key, value in placed[name].items():
                if isinstance(value, str):
                    tensor.parameters[key].string_param = value
                else:
                    tensor.parameters[key].int64_param = value
            blobs.append(b"")
            continue
        blobs.append(little_endian(array))
    response.raw_output_contents.extend(blobs)
    return response
