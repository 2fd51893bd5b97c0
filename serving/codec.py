"""Request bodies -> validated arrays, and arrays -> response bodies. Pure functions, no web framework.

Two protocols:
- Open Inference Protocol (KServe V2) with Triton's binary tensor extension: a JSON header of
  `Inference-Header-Content-Length` bytes, then the raw little-endian bytes of every input whose
  parameters carry `binary_data_size`, in input order. Outputs come back the same way when asked
  (`binary_data` per output, or `binary_data_output` for all).
- MLflow's scoring protocol: exactly one of `inputs` (a tensor, or name -> tensor),
  `instances` (a list of rows), `dataframe_split` / `dataframe_records` (one row per sample, either a
  column per model input holding a tensor, or the sample's values flattened into columns).

Every input is checked against the model: names, datatype, rank and fixed dimensions, the same
number of rows in every input, and finite values. NaN/Inf policy: refused with a 400. JSON cannot
carry them, but binary data can, and a too-large JSON number becomes Inf in FP32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import orjson

from serving.engine import TensorSpec

V2_DTYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}
MLFLOW_KEYS = ("inputs", "instances", "dataframe_split", "dataframe_records")


class BadRequest(Exception):
    """The client sent something we can't use. `status` is the 4xx to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class V2Request:
    feeds: dict[str, np.ndarray]
    rows: int
    request_id: str | None
    outputs: list[tuple[str, bool]]  # (output name, as binary), in the order to answer


@dataclass
class MlflowRequest:
    feeds: dict[str, np.ndarray]
    rows: int
    records: bool  # answer one object per row (dataframe inputs) instead of columns


def expected(specs: list[TensorSpec]) -> str:
    return ", ".join(f"'{s.name}' {s.describe()}" for s in specs)


def parse_json(data: bytes):
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


# ---- KServe V2 ---------------------------------------------------------------------------------

def decode_v2(body: bytes, header_length: int | None, inputs: list[TensorSpec],
              output_names: list[str]) -> V2Request:
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length is {header_length}, but the body has "
                         f"{len(body)} bytes")
    end = len(body) if header_length is None else header_length
    request = parse_json(body[:end])
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise BadRequest('expected a JSON object with "inputs": [{"name", "shape", "datatype", "data"}, ...]; '
                         f"this model takes {expected(inputs)}")
    by_name = {s.name: s for s in inputs}
    feeds: dict[str, np.ndarray] = {}
    offset = end
    for item in request["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest('every input needs "name", "shape", "datatype" and "data" '
                             '(or parameters.binary_data_size)')
        name = item["name"]
        spec = by_name.get(name)
        if spec is None:
            raise BadRequest(f"unknown input '{name}'; this model takes {expected(inputs)}")
        if name in feeds:
            raise BadRequest(f"input '{name}' is given twice")
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise BadRequest(f"input '{name}': shape must be a list of non-negative integers, "
                             f"got {shape!r}; expected {spec.describe()}")
        datatype = item.get("datatype")
        if datatype != spec.datatype:
            raise BadRequest(f"input '{name}': datatype {datatype!r}, expected {spec.describe()}")
        _check_shape(spec, shape)
        count = math.prod(shape)
        binary_size = (item.get("parameters") or {}).get("binary_data_size")
        if binary_size is not None:
            if header_length is None:
                raise BadRequest(f"input '{name}' has binary_data_size but the request has no "
                                 "Inference-Header-Content-Length header")
            want = count * spec.dtype.itemsize
            if binary_size != want:
                raise BadRequest(f"input '{name}': binary_data_size {binary_size}, but shape {shape} "
                                 f"{datatype} takes {want} bytes")
            if offset + want > len(body):
                raise BadRequest(f"input '{name}': the body ends before its {want} bytes of binary data")
            array = np.frombuffer(body, dtype=spec.dtype.newbyteorder("<"), count=count, offset=offset)
            offset += want
        else:
            if "data" not in item:
                raise BadRequest(f"input '{name}' has neither data nor parameters.binary_data_size")
            array = _json_tensor(item["data"], spec, where=f"input '{name}'")
            if array.size != count:
                raise BadRequest(f"input '{name}': shape {shape} needs {count} values, data has {array.size}")
        feeds[name] = _finite(array.reshape(shape).astype(spec.dtype, copy=False), name)
    if offset != len(body):
        raise BadRequest(f"{len(body) - offset} bytes of binary data follow the inputs that no input claims")
    rows = _rows(feeds, inputs)

    binary_all = bool((request.get("parameters") or {}).get("binary_data_output", False))
    wanted = request.get("outputs")
    if wanted is None:
        outputs = [(n, binary_all) for n in output_names]
    else:
        if not isinstance(wanted, list):
            raise BadRequest('"outputs" must be a list of {"name": ...}')
        outputs = []
        for out in wanted:
            if not isinstance(out, dict) or out.get("name") not in output_names:
                raise BadRequest(f"unknown output {out!r}; this model has outputs {output_names}")
            outputs.append((out["name"], bool((out.get("parameters") or {}).get("binary_data", binary_all))))
    request_id = request.get("id")
    return V2Request(feeds, rows, str(request_id) if request_id is not None else None, outputs)


def encode_v2(model_name: str, model_version: str, request_id: str | None,
              results: dict[str, np.ndarray], outputs: list[tuple[str, bool]],
              specs: list[TensorSpec]) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows it (else None)."""
    datatypes = {s.name: s.datatype for s in specs}
    described, blobs = [], []
    for name, binary in outputs:
        array = np.ascontiguousarray(results[name])
        out = {"name": name, "datatype": datatypes[name], "shape": list(array.shape)}
        if binary:
            blob = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            out["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            out["data"] = array.reshape(-1)
        described.append(out)
    response = {"model_name": model_name, "model_version": model_version, "outputs": described}
    if request_id is not None:
        response["id"] = request_id
    header = dumps(response)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


# ---- MLflow scoring ----------------------------------------------------------------------------

def decode_mlflow(body: bytes, inputs: list[TensorSpec]) -> MlflowRequest:
    request = parse_json(body)
    keys = [k for k in MLFLOW_KEYS if isinstance(request, dict) and k in request]
    if len(keys) != 1:
        raise BadRequest(f"expected a JSON object with exactly one of {list(MLFLOW_KEYS)}, "
                         f"e.g. {{\"inputs\": <tensor {inputs[0].describe()}>}}; got "
                         f"{list(request) if isinstance(request, dict) else type(request).__name__}")
    if request.get("params"):
        raise BadRequest("this model takes no params")
    key = keys[0]
    value = request[key]
    if key == "inputs":
        feeds = _named_tensors(value, inputs, key)
    elif key == "instances":
        if not isinstance(value, list):
            raise BadRequest('"instances" must be a list with one entry per sample')
        if value and all(isinstance(v, dict) for v in value):
            feeds = _stack_records(value, inputs, key)
        else:
            feeds = _named_tensors(value, inputs, key)
    elif key == "dataframe_split":
        if not isinstance(value, dict) or not isinstance(value.get("data"), list):
            raise BadRequest('"dataframe_split" must be {"columns": [...], "data": [[...], ...]}')
        columns = value.get("columns")
        if isinstance(columns, list) and set(columns) == {s.name for s in inputs} and value["data"]:
            records = [dict(zip(columns, row)) if isinstance(row, list) else row for row in value["data"]]
            feeds = _stack_records(records, inputs, key)
        else:
            feeds = _flat_rows(value["data"], inputs, key)
    else:  # dataframe_records
        if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
            raise BadRequest('"dataframe_records" must be a list of {column: value} objects')
        names = {s.name for s in inputs}
        if value and set(value[0]) == names:
            feeds = _stack_records(value, inputs, key)
        else:
            feeds = _flat_rows([list(r.values()) for r in value], inputs, key)
    for spec in inputs:
        _check_shape(spec, list(feeds[spec.name].shape), f"\"{key}\" for input '{spec.name}'")
        _finite(feeds[spec.name], spec.name)
    return MlflowRequest(feeds, _rows(feeds, inputs), records=key.startswith("dataframe"))


def encode_mlflow(results: dict[str, np.ndarray], records: bool) -> bytes:
    """{"predictions": {output: tensor}} as MLflow's ONNX flavor answers tensors, or one object per
    row as it answers DataFrames."""
    if records:
        rows = next(iter(results.values())).shape[0]
        return dumps({"predictions": [{k: np.ascontiguousarray(v[i]) for k, v in results.items()}
                                      for i in range(rows)]})
    return dumps({"predictions": {k: np.ascontiguousarray(v) for k, v in results.items()}})


def _named_tensors(value, inputs: list[TensorSpec], key: str) -> dict[str, np.ndarray]:
    if isinstance(value, dict):
        unknown = set(value) - {s.name for s in inputs}
        missing = {s.name for s in inputs} - set(value)
        if unknown or missing:
            raise BadRequest(f'"{key}" names {sorted(value)}; this model takes {expected(inputs)}')
        return {s.name: _json_tensor(value[s.name], s, where=f"{key} '{s.name}'") for s in inputs}
    if len(inputs) != 1:
        raise BadRequest(f'this model has {len(inputs)} inputs; send "{key}" as {{name: tensor}} for '
                         f"{expected(inputs)}")
    return {inputs[0].name: _json_tensor(value, inputs[0], where=f'"{key}"')}


def _stack_records(records: list[dict], inputs: list[TensorSpec], key: str) -> dict[str, np.ndarray]:
    names = {s.name for s in inputs}
    for record in records:
        if set(record) != names:
            raise BadRequest(f'every row of "{key}" must name exactly the model inputs {sorted(names)}, '
                             f"got {sorted(record)}")
    return {s.name: _json_tensor([r[s.name] for r in records], s, where=f"{key} '{s.name}'")
            for s in inputs}


def _flat_rows(data: list, inputs: list[TensorSpec], key: str) -> dict[str, np.ndarray]:
    """Rows of a sample's values flattened, for a one-input model with a fixed sample shape."""
    spec = inputs[0]
    sample = spec.shape[1:]
    if len(inputs) != 1 or -1 in sample:
        raise BadRequest(f'"{key}" with plain value columns needs a model with one input of fixed sample '
                         f"shape; this model takes {expected(inputs)}: name a column after each input "
                         "and give a tensor per row")
    array = _json_tensor(data, spec, where=f'"{key}"')
    width = math.prod(sample)
    if array.ndim != 2 or array.shape[1] != width:
        raise BadRequest(f'"{key}": expected rows of {width} values (one sample {list(sample)} flattened) '
                         f"for input '{spec.name}' {spec.describe()}; got an array of shape {list(array.shape)}")
    return {spec.name: array.reshape(array.shape[0], *sample)}


# ---- shared checks -----------------------------------------------------------------------------

def _json_tensor(data, spec: TensorSpec, where: str) -> np.ndarray:
    if not isinstance(data, list):
        data = [data]
    try:
        return np.asarray(data, dtype=spec.dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"{where}: data is not a regular array of {spec.datatype} numbers ({exc}); "
                         f"expected {spec.describe()}") from None


def _check_shape(spec: TensorSpec, shape: list[int], where: str | None = None) -> None:
    ok = len(shape) == len(spec.shape) and all(w in (-1, g) for w, g in zip(spec.shape, shape))
    if not ok:
        where = where or f"input '{spec.name}'"
        raise BadRequest(f"{where}: shape {shape} does not fit; expected {spec.describe()} (-1: any size)")


def _finite(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise BadRequest(f"input '{name}' contains NaN or Inf; this server refuses non-finite values")
    return array


def _rows(feeds: dict[str, np.ndarray], inputs: list[TensorSpec]) -> int:
    missing = [s.name for s in inputs if s.name not in feeds]
    if missing:
        raise BadRequest(f"missing input(s) {missing}; this model takes {expected(inputs)}")
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
    """What orjson can't write natively (non-contiguous arrays, numpy scalars of some types)."""
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")
