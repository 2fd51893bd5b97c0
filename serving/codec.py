"""Request bodies -> validated arrays, and arrays -> response bodies. Pure functions, no web
framework.

Two protocols:
- Open Inference Protocol (KServe V2) with Triton's binary tensor extension: a JSON header of
  `Inference-Header-Content-Length` bytes, then the raw little-endian bytes of every input whose
  parameters carry `binary_data_size`, in input order. Outputs come back the same way when asked
  (`binary_data` per output, or `binary_data_output` for all). A header length of 0 is a raw binary
  request: the body is a one-input model's input, its shape deduced from its size (`decode_raw`),
  every output binary.
- MLflow's scoring protocol: exactly one of `inputs` (a tensor, or name -> tensor), `instances` (a
  list of rows), `dataframe_split` / `dataframe_records` (one row per sample, either a column per
  model input holding a tensor, or the sample's values flattened into columns).

BYTES tensors (strings, onnxruntime's STRING) are numpy object arrays of `bytes`, one an element,
from every encoding: JSON strings (UTF-8), binary data of a 4-byte little-endian length then the
bytes per element (`bytes_elements` reads it, `serialized` writes it), gRPC's raw contents in the
same form or `bytes_contents`. Outputs of them (a model's, or classification's) go out the same
ways.

Every client mistake is a BadRequest (a 4xx) naming the field, never an exception of ours; as strict
as Triton: objects where objects belong (`parameters`), JSON numbers for numeric datatypes (no
strings, booleans or null coerced; whole numbers for integer types, in range), booleans for BOOL, an
integer `binary_data_size`, never both `data` and binary data, no repeated inputs or outputs, a
string `id`. Limits are checked before work: the declared rows and element count of every input
(Python ints: no overflow) before any data is converted. NaN/Inf policy: refused with a 400 (JSON
cannot carry them, but binary data can, and a too-large JSON number becomes Inf in FP32); checked by
the engine as it copies each batch (serving/staging.py), where a pass over the values costs least.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import orjson

from serving.console import clip
from serving.engine import TensorSpec

V2_DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
# the protocol's names; BF16 this server can't take
KNOWN_DATATYPES = (*V2_DTYPES, "BF16")
MLFLOW_KEYS = ("inputs", "instances", "dataframe_split", "dataframe_records")
# no model dimension is larger; numpy refuses some that are (a 500 once)
MAX_DIM = 2**31
# JSON data nested more deeply than this is refused: no tensor has that many axes (numpy stops at
# 64)
MAX_DATA_DEPTH = 100


# What a decoder raises on a request it did not foresee: still the client's malformed request, a
# 400, never a 500.
UNFORESEEN = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    MemoryError,
)


class BadRequest(Exception):
    """The client sent something we can't use. `status` is the 4xx to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, checked before its data is converted."""

    # rows (samples) per request
    max_rows: int
    # the body's own limit: no input can declare more elements than it could carry
    max_body_bytes: int


@dataclass
class V2Request:
    feeds: dict[str, np.ndarray]
    rows: int
    request_id: str | None
    # (output name, as binary), in the order to answer
    outputs: list[tuple[str, bool]]
    # output name -> shm.Ref: written to shared memory instead
    output_refs: dict = field(default_factory=dict)
    # every value was checked for NaN/Inf as it was copied in (needs no other pass)
    checked: bool = False
    # its inputs are rows of a batch buffer (serving/batcher.py)
    placed: bool = False
    # output name -> K: answered as its top K classes (the classification extension,
    # serving/classification.py)
    classification: dict[str, int] = field(default_factory=dict)


@dataclass
class MlflowRequest:
    feeds: dict[str, np.ndarray]
    rows: int
    # answer one object per row (dataframe inputs) instead of columns
    records: bool


def expected(specs: list[TensorSpec]) -> str:
    return ", ".join(
        f"'{s.name}' {s.describe()}" + (f" (in place of '{s.stands_for}')" if s.stands_for else "")
        for s in specs
    )


def given_inputs(inputs: list[TensorSpec], names) -> list[TensorSpec]:
    """The inputs a request that names `names` is to give: `inputs`, where one that stands for
    another (an image version's encoded images, for the tensor they become: serving/image_inputs.py)
    replaces it when named, and is left out when not. BadRequest for a request that names both."""
    if not any(s.stands_for for s in inputs):
        return inputs
    names, left_out = set(names), set()
    for s in inputs:
        if s.stands_for and s.name in names and s.stands_for in names:
            raise BadRequest(
                f"inputs '{s.name}' and '{s.stands_for}' are two forms of the same input; send one"
            )
        if s.stands_for:
            left_out.add(s.stands_for if s.name in names else s.name)
    return [s for s in inputs if s.name not in left_out]


def parse_json(data: bytes):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


def _object(value, where: str) -> dict:
    """`value` if it is a JSON object (absent counts as empty), else the field is named."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be a JSON object, got {_kind(value)}")
    return value


def _kind(value) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), "a number")


# ---- KServe V2 ---------------------------------------------------------------------------------


@dataclass
class V2Input:
    """One input of a V2 request as its JSON header declares it."""

    spec: TensorSpec
    shape: list[int]
    count: int
    # its binary data's byte count (binary_data_size), or None: JSON data, in `array`
    binary: int | None
    array: np.ndarray | None = None
    # a shm.Ref: its data is in a shared memory region
    ref: object = None


@dataclass
class V2Header:
    """A V2 request's JSON header, checked, before its binary data has arrived: what each input's
    bytes are (in the order they follow the header), the id and the outputs asked for."""

    inputs: list[V2Input]
    request_id: str | None
    outputs: list[tuple[str, bool]]
    # output name -> shm.Ref
    output_refs: dict = field(default_factory=dict)
    # output name -> K
    classification: dict[str, int] = field(default_factory=dict)

    @property
    def binary_inputs(self) -> list[V2Input]:
        return [i for i in self.inputs if i.binary is not None]


# checked V2 headers kept per model version (see parse_v2_header_once)
SEEN_HEADERS = 256


def parse_v2_header_once(
    seen: dict | None,
    data,
    header_length: int | None,
    body_length: int,
    inputs: list[TensorSpec],
    output_names: list[str],
    limits: Limits,
    model: str = "",
) -> V2Header:
    """parse_v2_header, checked once per distinct header: a client sends the same one request after
    request (the same shapes, regions, no id or the same), so `seen` (a model version's) keeps those
    without JSON data (small; nothing in them is per request)."""
    end = body_length if header_length is None else header_length
    key = (bytes(data[:end]) if len(data) != end else bytes(data), body_length)
    parsed = seen.get(key) if seen is not None else None
    if parsed is None:
        parsed = parse_v2_header(
            data, header_length, body_length, inputs, output_names, limits, model
        )
        if seen is not None and all(item.array is None for item in parsed.inputs):
            if len(seen) >= SEEN_HEADERS:
                seen.clear()
            seen[key] = parsed
    return parsed


def decode_v2(
    body: bytes,
    header_length: int | None,
    inputs: list[TensorSpec],
    output_names: list[str],
    limits: Limits,
    shared=None,
    seen: dict | None = None,
    place=None,
    model: str = "",
) -> V2Request:
    """A whole V2 request body (JSON, or JSON header + binary data): its arrays (binary ones are
    views of `body`, not copies). `shared(ref, spec, count, into)` reads an input placed in shared
    memory (serving/shm.py); `seen`: the model version's headers checked already
    (parse_v2_header_once); `place(rows)`: the rows of a batch buffer that inputs all in shared
    memory may be read straight into, or None."""
    if header_length == 0:
        return decode_raw(body, inputs, output_names, limits, model)
    header = parse_v2_header_once(
        seen, body, header_length, len(body), inputs, output_names, limits, model
    )
    offset, arrays = (len(body) if header_length is None else header_length), {}
    for item in header.binary_inputs:
        if is_bytes(item.spec):
            data = memoryview(body)[offset : offset + item.binary]
            arrays[item.spec.name] = bytes_elements(data, item.count, item.spec.name)
        else:
            arrays[item.spec.name] = np.frombuffer(
                body, dtype=item.spec.dtype.newbyteorder("<"), count=item.count, offset=offset
            )
        offset += item.binary
    views = None
    if place is not None and all(item.ref is not None for item in header.inputs):
        views = placed_rows(header, inputs, place)
    return finish_v2(header, arrays, inputs, shared, views)


def decode_raw(
    body, inputs: list[TensorSpec], output_names: list[str], limits: Limits, model: str = ""
) -> V2Request:
    """Triton's raw binary request (Inference-Header-Content-Length: 0): the whole body is the data
    of a model's one input, in the shape `raw_shape` deduces from its size; every output comes back
    as binary data."""
    if len(inputs) != 1:
        raise BadRequest(
            "a raw binary request (Inference-Header-Content-Length: 0) carries one input. Raw request "
            f"must only have 1 input (found 1) to be deduced but got {len(inputs)} inputs in "
            f"'{model}' model configuration ({expected(inputs)}): send a JSON header naming each"
        )
    spec = inputs[0]
    shape = raw_shape(spec, len(body))
    count = _check_size(spec.name, shape, spec, limits)
    if is_bytes(spec):
        array = np.empty(1, dtype=object)
        array[0] = bytes(body)
    else:
        array = np.frombuffer(body, dtype=spec.dtype.newbyteorder("<"), count=count)
        if array.dtype == np.bool_ and array.view(np.uint8).max(initial=0) > 1:
            raise BadRequest(f"input '{spec.name}': BOOL binary data must be bytes 0 or 1")
    feeds = {spec.name: array.reshape(shape).astype(spec.dtype, copy=False)}
    return V2Request(feeds, _rows(feeds, inputs), None, [(n, True) for n in output_names])


def raw_shape(spec: TensorSpec, size: int) -> list[int]:
    """The shape of a raw binary request's `size` bytes for input `spec`, as Triton deduces it: one
    row of a batched model; its one dynamic axis (besides the batch axis) from the byte count; a
    BYTES input of shape [1] is the body as its one element. An input of no rank takes the values as
    a list. BadRequest where it can't."""
    where = f"a raw binary request (Inference-Header-Content-Length: 0) for input '{spec.name}'"
    dims = list(spec.shape[1:]) if spec.batched else list(spec.shape) if spec.ranked else [-1]
    lead = [1] if spec.batched else []
    if is_bytes(spec):
        if dims != [1]:
            raise BadRequest(
                f"{where}: the body is one BYTES element. For BYTE datatype raw input "
                f"'{spec.name}', the model must have input shape [1]; this one is "
                f"{spec.describe()}: send a JSON header"
            )
        return lead + dims
    itemsize = spec.dtype.itemsize
    if size % itemsize:
        raise BadRequest(
            f"{where}: {size} bytes is not a whole number of {spec.datatype} values ({itemsize} "
            "bytes each)"
        )
    values, dynamic = size // itemsize, [i for i, d in enumerate(dims) if d == -1]
    fixed = math.prod(d for d in dims if d != -1)
    if len(dynamic) > 1:
        raise BadRequest(
            f"{where}: The shape of the raw input '{spec.name}' can not be deduced because there "
            f"are more than one variable-sized dimension in {spec.describe()}; send a JSON header "
            "with the shape"
        )
    if dynamic and (fixed == 0 or values % fixed):
        raise BadRequest(
            f"{where}: {values} {spec.datatype} values do not fill {spec.describe()} (rows of {fixed})"
        )
    if dynamic:
        dims[dynamic[0]] = values // fixed
    elif values != fixed:
        raise BadRequest(
            f"{where}: {size} bytes, but {spec.describe()} takes {fixed * itemsize} bytes"
            + (" (one row)" if spec.batched else "")
        )
    return lead + dims


def parse_v2_header(
    data,
    header_length: int | None,
    body_length: int,
    inputs: list[TensorSpec],
    output_names: list[str],
    limits: Limits,
    model: str = "",
) -> V2Header:
    """The JSON header (`data[:header_length]`, or all of `data` when the request has no binary
    data) of a body of `body_length` bytes: every field checked, each JSON input converted; the
    binary data's sizes checked against what follows the header."""
    if header_length is not None and not 0 <= header_length <= body_length:
        raise BadRequest(
            f"Inference-Header-Content-Length is {header_length}, but the body has "
            f"{body_length} bytes"
        )
    end = body_length if header_length is None else header_length
    request = parse_json(data[:end] if len(data) != end else data)
    if (
        not isinstance(request, dict)
        or not isinstance(request.get("inputs"), list)
        or (not request["inputs"] and inputs)
    ):
        raise BadRequest(
            'expected a JSON object with "inputs": [{"name", "shape", "datatype", "data"}, ...]; '
            f"this model takes {expected(inputs)}"
        )
    if len(request["inputs"]) > len(inputs):
        raise BadRequest(
            f"the request has {len(request['inputs'])} inputs; this model takes {expected(inputs)}"
        )
    parameters = _object(request.get("parameters"), '"parameters"')
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f'"id" must be a string, got {_kind(request_id)}')
    by_name = {s.name: s for s in inputs}
    declared: dict[str, V2Input] = {}
    offset = end
    for item in request["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest(
                'every input needs "name", "shape", "datatype" and "data" '
                "(or parameters.binary_data_size)"
            )
        name = item["name"]
        spec = by_name.get(name)
        if spec is None:
            raise BadRequest(f"unknown input '{name}'; this model takes {expected(inputs)}")
        if name in declared:
            raise BadRequest(f"input '{name}' is given twice")
        shape = item.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > 32
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape
            )
        ):
            raise BadRequest(bad_shape(name, shape, spec))
        check_datatype(item.get("datatype"), spec)
        _check_shape(spec, shape)
        count = _check_size(name, shape, spec, limits)
        item_parameters = _object(item.get("parameters"), f"input '{name}': parameters")
        binary_size = item_parameters.get("binary_data_size")
        ref = shm_ref(item_parameters, f"input '{name}'")
        if ref is not None:
            if "data" in item or binary_size is not None:
                raise BadRequest(
                    f"input '{name}' is in shared memory and also has data or binary_data_size; send one"
                )
            declared[name] = V2Input(spec, shape, count, None, ref=ref)
        elif binary_size is not None:
            if not isinstance(binary_size, int) or isinstance(binary_size, bool) or binary_size < 0:
                raise BadRequest(
                    f"input '{name}': binary_data_size must be an integer byte count, got "
                    f"{binary_size!r:.40}"
                )
            if "data" in item:
                raise BadRequest(
                    f"input '{name}' has both data and parameters.binary_data_size; send one"
                )
            if header_length is None:
                raise BadRequest(
                    f"input '{name}' has binary_data_size but the request has no "
                    "Inference-Header-Content-Length header"
                )
            want = binary_size if is_bytes(spec) else count * spec.dtype.itemsize
            if binary_size != want:
                raise BadRequest(
                    f"input '{name}': binary_data_size {binary_size}, but shape {shape} "
                    f"{spec.datatype} takes {want} bytes"
                )
            if offset + want > body_length:
                raise BadRequest(
                    f"input '{name}': the body ends before its {want} bytes of binary data"
                )
            declared[name] = V2Input(spec, shape, count, want)
            offset += want
        else:
            if "data" not in item:
                raise BadRequest(f"input '{name}' has neither data nor parameters.binary_data_size")
            array = _json_tensor(item["data"], spec, where=f"input '{name}'", count=count)
            if array.size != count:
                raise BadRequest(
                    f"input '{name}': shape {shape} needs {count} values, data has {array.size}"
                )
            declared[name] = V2Input(spec, shape, count, None, array)
    if offset != body_length:
        raise BadRequest(
            f"{body_length - offset} bytes of binary data follow the inputs that no input claims"
        )
    check_all_given(inputs, list(declared), model)

    binary_all = parameters.get("binary_data_output", False)
    if not isinstance(binary_all, bool):
        raise BadRequest(
            f"parameters.binary_data_output must be true or false, got {binary_all!r:.40}"
        )
    wanted = request.get("outputs")
    refs, classes = {}, {}
    if wanted is None:
        outputs = [(n, binary_all) for n in output_names]
    else:
        if not isinstance(wanted, list):
            raise BadRequest('"outputs" must be a list of {"name": ...}')
        outputs = []
        for out in wanted:
            if not isinstance(out, dict) or out.get("name") not in output_names:
                raise BadRequest(
                    f"unknown output {out!r:.100}; this model has outputs {output_names}"
                )
            if any(out["name"] == known for known, _ in outputs):
                raise BadRequest(duplicate_output(out["name"]))
            out_parameters = _object(out.get("parameters"), f"output '{out['name']}': parameters")
            binary = out_parameters.get("binary_data", binary_all)
            if not isinstance(binary, bool):
                raise BadRequest(
                    f"output '{out['name']}': parameters.binary_data must be true or false"
                )
            ref = shm_ref(out_parameters, f"output '{out['name']}'")
            if ref is not None:
                refs[out["name"]] = ref
            # Triton's: 0 (or none) is the tensor itself
            if out_parameters.get("classification", 0) != 0:
                classes[out["name"]] = classified(out_parameters, out["name"], ref)
            outputs.append((out["name"], binary))
    return V2Header(list(declared.values()), request_id, outputs, refs, classes)


def bad_shape(name: str, shape, spec: TensorSpec) -> str:
    """Why a declared shape is refused; where its sizes overflow, the overflow named as Triton names
    it."""
    rule = f"shape must be a list of non-negative integers below {MAX_DIM}"
    sizes = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    if sizes and math.prod(shape) > 2**63 - 1:
        return (
            f"input '{name}': shape {shape!r:.100} causes total element count to exceed maximum "
            f"size of {2**63 - 1} ({rule}); expected {spec.describe()}"
        )
    if sizes and not is_bytes(spec) and math.prod(shape) * spec.dtype.itemsize > 2**64 - 1:
        return (
            f"input '{name}': byte size overflow for input '{name}': shape {shape!r:.100} of "
            f"{spec.datatype} takes more than 2**64 bytes ({rule}); expected {spec.describe()}"
        )
    return f"input '{name}': {rule}, got {shape!r:.100}; expected {spec.describe()}"


def byte_size_mismatch(name: str, model: str, want: int, got: int) -> str:
    """An input whose bytes are not what its shape takes, in Triton's words (its clients look for
    them)."""
    return f"input byte size mismatch for input '{name}' for model '{model}'. Expected {want}, got {got}"


def check_all_given(inputs: list[TensorSpec], given: list[str], model: str = "") -> None:
    """BadRequest unless `given` names every input the model takes (one form of an input that has
    two: given_inputs), in Triton's words too (its clients look for them)."""
    wanted = given_inputs(inputs, given)
    if all(s.name in given for s in wanted):
        return
    missing = ",".join(f"'{s.name}'" for s in wanted if s.name not in given)
    sent = ",".join(f"'{name}'" for name in given)
    raise BadRequest(
        f"expected {len(wanted)} inputs but got {len(given)} inputs for model "
        f"'{model or '(this model)'}'. Got input(s) [{sent}], but missing required input(s) "
        f"[{missing}]. Please provide all required input(s). This model takes {expected(inputs)}"
    )


def duplicate_output(name: str) -> str:
    return f"output '{name}' already exists in request (requested twice); ask for each output once"


def classified(parameters: dict, name: str, ref) -> int:
    """An output's classification count K (its top K classes come back as strings:
    serving/classification.py), checked: a whole number, at least 1, and not with shared memory
    (Triton's rule too)."""
    value = parameters["classification"]
    if ref is not None:
        raise BadRequest(
            f"output '{name}': classification and shared memory can't be asked together (the classes "
            "come back as strings in the response); ask for one"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            f"output '{name}': parameters.classification must be a whole number of classes, at least "
            f"1; got {value!r:.40}"
        )
    return value


def placed_rows(header: V2Header, inputs: list[TensorSpec], place) -> dict | None:
    """The rows of a batch buffer a request's inputs can go straight into (`place(rows)`,
    serving/batcher.py), when it can have them: every model input in the request and none of them
    JSON data, all with the same rows."""
    items = header.inputs
    given = given_inputs(inputs, [i.spec.name for i in items])
    # (BYTES elements have no fixed size: no rows of a buffer to go into)
    if (
        len(items) != len(given)
        or any(i.array is not None for i in items)
        or any(is_bytes(i.spec) for i in items)
    ):
        return None
    rows = {item.shape[0] if item.shape else -1 for item in items}
    if len(rows) != 1 or min(rows) <= 0:
        return None
    return place(rows.pop())


def finish_v2(
    header: V2Header,
    binary: dict[str, np.ndarray],
    inputs: list[TensorSpec],
    shared=None,
    views: dict | None = None,
) -> V2Request:
    """The request, once its binary inputs' data has arrived (`binary`: name -> flat array of the
    input's dtype; `shared(ref, spec, count, into)` reads one placed in shared memory, into its rows
    of a batch buffer when `views` gives them): BOOL bytes checked, every array in its shape, the
    rows counted. (NaN and Inf are refused by the engine, where each batch is copied anyway.)"""
    feeds: dict[str, np.ndarray] = {}
    for item in header.inputs:
        name, spec = item.spec.name, item.spec
        array = item.array
        if item.ref is not None:
            if shared is None:
                raise BadRequest(
                    f"input '{name}' names a shared memory region, which this request can't use here"
                )
            into = None if views is None else views[name].reshape(-1)
            array = shared_tensor(shared, item.ref, spec, item.count, into)
        elif item.binary is not None:
            array = binary[name]
        if (
            array.dtype == np.bool_
            and item.array is None
            and array.view(np.uint8).max(initial=0) > 1
        ):
            raise BadRequest(f"input '{name}': BOOL binary data must be bytes 0 or 1")
        feeds[name] = array.reshape(item.shape).astype(spec.dtype, copy=False)
    return V2Request(
        feeds,
        _rows(feeds, inputs),
        header.request_id,
        header.outputs,
        header.output_refs,
        classification=header.classification,
    )


def shared_tensor(shared, ref, spec: TensorSpec, count: int, into=None) -> np.ndarray:
    """An input placed in shared memory, read by `shared(ref, spec, count, into)` (into its batch
    rows where `into` gives them): a BYTES one as the region's bytes (its serialized elements,
    shared_memory_byte_size of them), then its elements."""
    if not is_bytes(spec):
        return shared(ref, spec, count, into)
    raw = shared(ref, replace(spec, dtype=np.dtype(np.uint8), datatype="UINT8"), ref.byte_size)
    return bytes_elements(memoryview(np.ascontiguousarray(raw)), count, spec.name)


def is_bytes(spec: TensorSpec) -> bool:
    return spec.dtype == object


def bytes_elements(data, count: int, name: str) -> np.ndarray:
    """`count` BYTES elements from their binary form (each a 4-byte little-endian length, then that
    many bytes): an object array of bytes. BadRequest naming the element for a length past the data,
    and for data left over."""
    view = memoryview(data).cast("B")
    out = np.empty(count, dtype=object)
    at = 0
    for i in range(count):
        if at + 4 > len(view):
            raise BadRequest(
                f"BYTES element {i} of input '{name}': the data ends inside its 4-byte length "
                f"({len(view)} bytes for {count} elements)"
            )
        length = int.from_bytes(view[at : at + 4], "little")
        at += 4
        if at + length > len(view):
            raise BadRequest(
                f"BYTES element {i} of input '{name}' declares {length} bytes, but only "
                f"{len(view) - at} remain"
            )
        out[i] = bytes(view[at : at + length])
        at += length
    if at != len(view):
        raise BadRequest(
            f"{len(view) - at} bytes follow the {count} BYTES elements of input '{name}' that its "
            "shape declares; each element is a 4-byte little-endian length, then its bytes"
        )
    return out


def serialized(array: np.ndarray) -> bytes:
    """A BYTES tensor in its binary form: each element (bytes, or str as UTF-8) as a 4-byte
    little-endian length, then its bytes."""
    parts = []
    for element in array.reshape(-1):
        data = element.encode("utf-8") if isinstance(element, str) else bytes(element)
        parts += [len(data).to_bytes(4, "little"), data]
    return b"".join(parts)


def json_strings(name: str, array: np.ndarray) -> list[str]:
    """A BYTES output's elements as JSON strings; BadRequest for one that is not UTF-8 (binary data
    carries it)."""
    try:
        return [e if isinstance(e, str) else bytes(e).decode("utf-8") for e in array.reshape(-1)]
    except UnicodeDecodeError:
        raise BadRequest(
            f"output '{name}' holds bytes that are not UTF-8 text, which JSON cannot carry; ask for it as "
            'binary data ("parameters": {"binary_data": true})'
        ) from None


def datatype_of(array: np.ndarray, spec_datatype: str) -> str:
    """An output's datatype as answered: BYTES for strings (a model's, or classification's), else
    the model's."""
    return "BYTES" if array.dtype == object else spec_datatype


@dataclass(frozen=True)
class Ref:
    """Where a request keeps one tensor in shared memory (serving/shm.py): a registered region's
    name, and the byte size and offset inside it."""

    region: str
    byte_size: int
    offset: int = 0


def shm_ref(parameters, where: str) -> Ref | None:
    """An input's or output's shared-memory placement from its V2 parameters (a dict: HTTP JSON, or
    gRPC's parameters as plain values), or None."""
    region = parameters.get("shared_memory_region")
    if region is None:
        return None
    size, offset = (
        parameters.get("shared_memory_byte_size"),
        parameters.get("shared_memory_offset", 0),
    )
    if not isinstance(region, str) or not region:
        raise BadRequest(f"{where}: parameters.shared_memory_region must be a region's name")
    for name, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(
                f"{where}: parameters.{name} must be a non-negative integer, got {value!r:.40}"
            )
    return Ref(region, size, offset)


def check_datatype(datatype, spec: TensorSpec) -> None:
    """An input's declared datatype: one of the protocol's, and the model's (HTTP and gRPC
    alike)."""
    if datatype not in KNOWN_DATATYPES:
        raise BadRequest(
            f"input '{spec.name}': datatype {datatype!r:.40} is not a KServe V2 datatype "
            f"({', '.join(KNOWN_DATATYPES)}); expected {spec.describe()}"
        )
    if datatype != spec.datatype:
        raise BadRequest(f"input '{spec.name}': datatype {datatype!r}, expected {spec.describe()}")


def _check_size(name: str, shape: list[int], spec: TensorSpec, limits: Limits) -> int:
    """The declared element count, refused before any data is touched when it can't be right: more
    rows than a request may have, or more values than the body could carry."""
    if spec.batched and shape and shape[0] > limits.max_rows:
        raise BadRequest(
            f"input '{name}': {shape[0]} rows; this server takes at most {limits.max_rows} per request "
            "(--max-rows-per-request): split it"
        )
    count = math.prod(shape)
    # JSON takes 2 bytes a value at the least
    ceiling = limits.max_body_bytes // min(spec.dtype.itemsize, 2)
    if count > ceiling:
        raise BadRequest(
            f"input '{name}': shape {shape} declares {count} values, more than a body of at most "
            f"{limits.max_body_bytes} bytes can carry"
        )
    return count


def encode_v2(
    model_name: str,
    model_version: str,
    request_id: str | None,
    results: dict[str, np.ndarray],
    outputs: list[tuple[str, bool]],
    specs: list[TensorSpec],
    placed: dict[str, dict] | None = None,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it (else None).
    `placed`: the outputs written to shared memory, with the parameters that say where (no data of
    theirs in the body)."""
    datatypes = {s.name: s.datatype for s in specs}
    described, blobs = [], []
    for name, binary in outputs:
        array = np.ascontiguousarray(results[name])
        out = {
            "name": name,
            "datatype": datatype_of(array, datatypes[name]),
            "shape": list(array.shape),
        }
        if placed and name in placed:
            out["parameters"] = placed[name]
        elif binary:
            blob = little_endian(array)
            out["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            out["data"] = json_strings(name, array) if array.dtype == object else array.reshape(-1)
        described.append(out)
    response = {"model_name": model_name, "model_version": model_version, "outputs": described}
    if request_id is not None:
        response["id"] = request_id
    header = dumps(response)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def little_endian(array: np.ndarray) -> bytes:
    """An output's binary form: its values little-endian, row-major; a BYTES one serialized."""
    if array.dtype == object:
        return serialized(array)
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


# ---- MLflow scoring ----------------------------------------------------------------------------


def decode_mlflow(body: bytes, inputs: list[TensorSpec], limits: Limits) -> MlflowRequest:
    request = parse_json(body)
    keys = [k for k in MLFLOW_KEYS if isinstance(request, dict) and k in request]
    if len(keys) != 1:
        raise BadRequest(
            f"expected a JSON object with exactly one of {list(MLFLOW_KEYS)}, "
            f'e.g. {{"inputs": <tensor {inputs[0].describe()}>}}; got '
            f"{list(request)[:10] if isinstance(request, dict) else _kind(request)}"
        )
    if request.get("params"):
        raise BadRequest("this model takes no params")
    key = keys[0]
    value = request[key]
    if key == "inputs":
        feeds = _named_tensors(value, inputs, key, limits)
    elif key == "instances":
        if not isinstance(value, list):
            raise BadRequest('"instances" must be a list with one entry per sample')
        _check_rows(len(value), key, limits)
        if value and all(isinstance(v, dict) for v in value):
            feeds = _stack_records(value, inputs, key)
        else:
            feeds = _named_tensors(value, inputs, key, limits)
    elif key == "dataframe_split":
        if not isinstance(value, dict) or not isinstance(value.get("data"), list):
            raise BadRequest('"dataframe_split" must be {"columns": [...], "data": [[...], ...]}')
        columns, data = value.get("columns"), value["data"]
        if columns is not None and not (
            isinstance(columns, list) and all(isinstance(c, str) for c in columns)
        ):
            raise BadRequest('"dataframe_split": columns must be a list of column names (strings)')
        if not all(isinstance(row, list) for row in data):
            raise BadRequest(
                '"dataframe_split": every entry of data must be a row (a list of values)'
            )
        _check_rows(len(data), key, limits)
        if columns is not None and set(columns) == {s.name for s in inputs} and data:
            if not all(len(row) == len(columns) for row in data):
                raise BadRequest(
                    f'"dataframe_split": every row must have {len(columns)} values, one per column'
                )
            feeds = _stack_records([dict(zip(columns, row)) for row in data], inputs, key)
        else:
            feeds = _flat_rows(data, inputs, key)
    else:
        # dataframe_records
        if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
            raise BadRequest('"dataframe_records" must be a list of {column: value} objects')
        _check_rows(len(value), key, limits)
        names = {s.name for s in inputs}
        if value and set(value[0]) == names:
            feeds = _stack_records(value, inputs, key)
        else:
            feeds = _flat_rows([list(r.values()) for r in value], inputs, key)
    for spec in inputs:
        _check_shape(spec, list(feeds[spec.name].shape), f"\"{key}\" for input '{spec.name}'")
    return MlflowRequest(feeds, _rows(feeds, inputs), records=key.startswith("dataframe"))


def encode_mlflow(results: dict[str, np.ndarray], records: bool) -> bytes:
    """{"predictions": {output: tensor}} as MLflow's ONNX flavor answers tensors, or one object per
    row as it answers DataFrames."""
    if records:
        rows = next(iter(results.values())).shape[0]
        return dumps(
            {
                "predictions": [
                    {k: np.ascontiguousarray(v[i]) for k, v in results.items()} for i in range(rows)
                ]
            }
        )
    return dumps({"predictions": {k: np.ascontiguousarray(v) for k, v in results.items()}})


def _check_rows(rows: int, key: str, limits: Limits) -> None:
    if rows > limits.max_rows:
        raise BadRequest(
            f'"{key}" has {rows} rows; this server takes at most {limits.max_rows} per request '
            "(--max-rows-per-request): split it"
        )


def _named_tensors(
    value, inputs: list[TensorSpec], key: str, limits: Limits
) -> dict[str, np.ndarray]:
    if isinstance(value, dict):
        unknown = set(value) - {s.name for s in inputs}
        missing = {s.name for s in inputs} - set(value)
        if unknown or missing:
            raise BadRequest(
                f'"{key}" names {sorted(value)[:10]}; this model takes {expected(inputs)}'
            )
        for s in inputs:
            if isinstance(value[s.name], list):
                _check_rows(len(value[s.name]), f"{key}.{s.name}", limits)
        return {s.name: _json_tensor(value[s.name], s, where=f"{key} '{s.name}'") for s in inputs}
    if len(inputs) != 1:
        raise BadRequest(
            f'this model has {len(inputs)} inputs; send "{key}" as {{name: tensor}} for '
            f"{expected(inputs)}"
        )
    if isinstance(value, list):
        _check_rows(len(value), key, limits)
    return {inputs[0].name: _json_tensor(value, inputs[0], where=f'"{key}"')}


def _stack_records(
    records: list[dict], inputs: list[TensorSpec], key: str
) -> dict[str, np.ndarray]:
    names = {s.name for s in inputs}
    for record in records:
        if not isinstance(record, dict) or set(record) != names:
            got = sorted(record)[:10] if isinstance(record, dict) else _kind(record)
            raise BadRequest(
                f'every row of "{key}" must name exactly the model inputs {sorted(names)}, got {got}'
            )
    return {
        s.name: _json_tensor([r[s.name] for r in records], s, where=f"{key} '{s.name}'")
        for s in inputs
    }


def _flat_rows(data: list, inputs: list[TensorSpec], key: str) -> dict[str, np.ndarray]:
    """Rows of a sample's values flattened, for a one-input model with a fixed sample shape."""
    spec = inputs[0]
    sample = spec.shape[1:]
    if len(inputs) != 1 or -1 in sample:
        raise BadRequest(
            f'"{key}" with plain value columns needs a model with one input of fixed sample '
            f"shape; this model takes {expected(inputs)}: name a column after each input "
            "and give a tensor per row"
        )
    array = _json_tensor(data, spec, where=f'"{key}"')
    width = math.prod(sample)
    if array.ndim != 2 or array.shape[1] != width:
        raise BadRequest(
            f'"{key}": expected rows of {width} values (one sample {list(sample)} flattened) '
            f"for input '{spec.name}' {spec.describe()}; got an array of shape {list(array.shape)}"
        )
    return {spec.name: array.reshape(array.shape[0], *sample)}


# ---- shared checks -----------------------------------------------------------------------------


def _json_tensor(data, spec: TensorSpec, where: str, count: int | None = None) -> np.ndarray:
    """A JSON array (nested or flat) as `spec`'s dtype; its elements must be of the datatype's JSON
    kind. `count`: the values the declared shape needs (V2), checked before any array is built.
    BYTES: strings, each an element as its UTF-8 bytes."""
    values = _leaves(
        data if isinstance(data, list) else [data], f"{where}: {spec.datatype} data", spec
    )
    if is_bytes(spec):
        return _json_bytes(data, values, spec, where, count)
    if count is not None and len(values) != count:
        raise BadRequest(
            f"{where}: the declared shape needs {count} values, data has {len(values)}"
        )
    kind = spec.dtype.kind
    if kind == "b":
        bad = next((v for v in values if not isinstance(v, bool)), _NONE)
        want = "true or false"
    elif kind in "iu":
        bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), _NONE)
        want = "whole numbers"
    else:
        bad = next(
            (v for v in values if not isinstance(v, (int, float)) or isinstance(v, bool)), _NONE
        )
        want = "numbers"
    if bad is not _NONE:
        raise BadRequest(
            f"{where}: {spec.datatype} data must be {want}, got {bad!r:.40}; expected {spec.describe()}"
        )
    # Nested past any tensor's rank (numpy refuses more than 64 axes): the values, flat.
    nested = data if isinstance(data, list) and _depth(data) <= 32 else values
    try:
        return np.asarray(nested, dtype=spec.dtype)
    except OverflowError as exc:
        raise BadRequest(f"{where}: a value is out of range for {spec.datatype} ({exc})") from None
    except (ValueError, TypeError) as exc:
        raise BadRequest(
            f"{where}: data is not a regular array ({clip(str(exc).splitlines()[0], 120)}); "
            f"expected {spec.describe()}"
        ) from None


_NONE = object()


def _depth(data: list) -> int:
    """How deep the first element of a JSON array is nested (a regular array's rank)."""
    depth = 0
    while isinstance(data, list):
        depth += 1
        data = data[0] if data else None
    return depth


def _json_bytes(data, values: list, spec: TensorSpec, where: str, count: int | None) -> np.ndarray:
    """A BYTES input's JSON strings as an object array of their UTF-8 bytes: flat for V2 (`count`:
    its shape declares it), else in the nesting's shape."""
    if count is not None and len(values) != count:
        raise BadRequest(
            f"{where}: the declared shape needs {count} values, data has {len(values)}"
        )
    bad = next((v for v in values if not isinstance(v, str)), _NONE)
    if bad is not _NONE:
        raise BadRequest(
            f"{where}: BYTES data must be strings, got {bad!r:.40}; expected {spec.describe()}"
        )
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode("utf-8") for v in values]
    if count is not None:
        return out
    try:
        shape = np.shape(data) if isinstance(data, list) else (1,)
    except ValueError:
        shape = ()
    if int(np.prod(shape)) != len(values):
        raise BadRequest(f"{where}: data is not a regular array; expected {spec.describe()}")
    return out.reshape(shape)


def _leaves(data: list, where: str, spec: TensorSpec) -> list:
    """Every value of a nested JSON array, in order (objects, nulls, and strings but for BYTES, are
    refused on the way; so is nesting deeper than MAX_DATA_DEPTH)."""
    text = is_bytes(spec)
    out: list = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) >= MAX_DATA_DEPTH:
                    raise BadRequest(
                        f"{where}: JSON nesting depth exceeds maximum allowed limit "
                        f"({MAX_DATA_DEPTH}); send the values flat in row-major order, or nested as "
                        f"the shape is; expected {spec.describe()}"
                    )
                stack.append(iter(value))
                break
            if isinstance(value, dict) or value is None or (isinstance(value, str) and not text):
                raise BadRequest(
                    f"{where} holds {_kind(value)} ({value!r:.40}), not a value; expected {spec.describe()}"
                )
            out.append(value)
        else:
            stack.pop()
    return out


def shape_fits(spec: TensorSpec, shape) -> bool:
    """`shape` has the input's rank and every fixed axis's size (-1 in the spec: any size); any
    shape for an input the graph gives no rank (onnxruntime judges it)."""
    if not spec.ranked:
        return True
    return len(shape) == len(spec.shape) and all(w in (-1, g) for w, g in zip(spec.shape, shape))


def _check_shape(spec: TensorSpec, shape: list[int], where: str | None = None) -> None:
    if not shape_fits(spec, shape):
        where = where or f"input '{spec.name}'"
        raise BadRequest(
            f"{where}: shape {shape} does not fit; expected {spec.describe()} (-1: any size)"
        )


def _rows(feeds: dict[str, np.ndarray], inputs: list[TensorSpec]) -> int:
    """The rows of a batched version's request (every input's first axis, one count); 1 for a
    version that runs each request alone, whatever its tensors' shapes (empty ones too: the model
    judges them)."""
    inputs = given_inputs(inputs, feeds)
    missing = [s.name for s in inputs if s.name not in feeds]
    if missing:
        raise BadRequest(f"missing input(s) {missing}; this model takes {expected(inputs)}")
    # (a model of no inputs, or whose inputs all have defaults in its file, runs on none)
    if not inputs or not all(s.batched for s in inputs):
        return 1
    counts = {name: (a.shape[0] if a.ndim else 1) for name, a in feeds.items()}
    if len(set(counts.values())) > 1:
        raise BadRequest(f"inputs disagree on the number of rows (first axis): {counts}")
    rows = next(iter(counts.values()))
    if rows == 0:
        raise BadRequest("the request has no rows")
    return rows


def dumps(obj) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=_plain)


def _plain(obj):
    """What orjson can't write natively (non-contiguous arrays, numpy scalars of some types, BYTES
    elements)."""
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
