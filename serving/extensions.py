"""The V2 protocol extensions beside inference, written once for both protocols: each operation
takes plain values and returns plain data (or raises Refused / RepositoryError with the HTTP status
that says why), and the front ends only carry them (serving/http/routes.py as JSON,
serving/grpc/service.py as Triton's messages, the same field names).

    extensions(server)                 what GET /v2 and gRPC ServerMetadata list
    model_config(server, name, v)      the model configuration extension (Triton's config.pbtxt, as JSON)
    repository_index(server, ready)    the model repository extension: the index ...
    repository_load(server, name, p)   ... loading a model (`parameters` refused: see below) ...
    repository_unload(server, name)    ... and unloading one
    statistics(server, name, v)        the statistics extension (serving/statistics.py has the figures)

The repository operations change what is loaded: they run on the server's main event loop (HTTP's
routes marked `main`; gRPC's handlers run there).
"""

from __future__ import annotations

import logging
from functools import partial

from serving import image_inputs
from serving.core import batch_cap
from serving.envelope import Refused
from serving.loader import SourceError
from serving.repository import READY, RepositoryError, off_loop, version_key

log = logging.getLogger("serving.extensions")
# In the order Triton lists them; each offered where this server has it on (see `extensions`).
EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "model_repository",
    "statistics",
    "system_shared_memory",
    "cuda_shared_memory",
    "grpc",
)
# the index reuses a directory scan this recent; a load always scans afresh
INDEX_MAX_AGE_S = 1.0


def extensions(server) -> list[str]:
    shared = server.shared_memory
    offered = {
        "grpc": server.settings.grpc_port is not None,
        "system_shared_memory": shared.enabled,
        "cuda_shared_memory": shared.enabled and shared.cuda_device is not None,
    }
    return [e for e in EXTENSIONS if offered.get(e, True)]


def model_config(server, name: str, version: str | None) -> dict:
    """The version's configuration as Triton's config.pbtxt would give it (JSON field names of its
    model_config.proto), as this server runs the version now: max_batch_size 0 unless its requests
    share runs (then dims leave the batch axis out, as Triton's do)."""
    slot = server.model_slot(name, version)
    engine = slot.model.engine
    batched = engine.batchable

    # an image input and the input it stands for: a request gives one of the two, so each is
    # optional as Triton's config marks an input a request may leave out
    inputs = image_inputs.request_inputs(slot.model)
    either = {s.name for s in inputs if s.stands_for} | {s.stands_for for s in inputs}

    def tensors(specs) -> list[dict]:
        return [
            {
                "name": s.name,
                "data_type": config_type(s),
                "dims": list(s.shape[1:] if batched else s.shape),
                **({"optional": True} if s.name in either else {}),
            }
            for s in specs
        ]

    return {
        "name": slot.model.info.name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": batch_cap(slot.model, server.settings.max_batch_size) if batched else 0,
        "input": tensors(inputs),
        "output": tensors(engine.outputs),
    }


def config_type(spec) -> str:
    """A tensor's data_type as Triton's model configuration names it (BYTES is TYPE_STRING
    there)."""
    return "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}"


def check_repository(name: str) -> None:
    """A repository a client named (Triton's multi-repository API): this server has one, unnamed."""
    if name:
        raise Refused(
            400,
            f"repository '{name[:60]}': this server has one model repository, which has no name; "
            "leave the repository name out",
        )


def check_control(server) -> None:
    if server.settings.control() != "explicit":
        raise Refused(
            403,
            "loading and unloading models is off on this server; start it with "
            "--model-control explicit to allow it",
        )


async def repository_index(server, only_ready: bool) -> list[dict]:
    """A row per loaded version ({name, version, state, reason}) and one per model with none loaded;
    models added to the --repository directory since are listed (not loaded)."""
    if server.settings.repository:
        try:
            await off_loop(
                partial(server.repository.add_repository_models, max_age=INDEX_MAX_AGE_S)
            )
        except SourceError as exc:
            # a directory gone unreadable: the index of what is known
            log.warning("reading --repository: %s", exc)
    rows = server.repository.index()
    return [r for r in rows if r["state"] == READY] if only_ready else rows


async def repository_load(server, name: str, parameters: dict) -> None:
    """Loads (or reloads) `name` from where this server was told models are. Triton's load
    parameters (`config`, `file:<path>`) are refused: answering success while ignoring them would
    mislead."""
    check_control(server)
    if parameters:
        raise Refused(
            400,
            f"load parameters {sorted(parameters)[:10]} are not taken: this server takes none; it "
            "loads a model only from its --model flags or --repository directory (with "
            "--version-policy), never from files, a config or options a client sends",
        )
    try:
        await server.repository.load(name)
    except RepositoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        # a model that cannot be loaded: the client named it
        raise Refused(400, f"failed to load '{name}': {exc}") from None


async def repository_unload(server, name: str) -> None:
    check_control(server)
    await server.repository.unload(name)


def statistics(server, name: str | None, version: str | None) -> dict:
    """`{"model_stats": [...]}` for every loaded version (no name), one model's loaded versions, or
    one version (serving/statistics.py). A model or version that is not loaded: 404, as for
    inference."""
    repository = server.repository
    if not name:
        if version:
            raise Refused(400, "a version was given without a model name; name the model too")
        slots = sorted(repository.slots(), key=lambda pair: (pair[0], version_key(pair[1].version)))
    elif version:
        slots = [(name, server.model_slot(name, version))]
    else:
        # the 404 of a model not loaded, worded as for inference
        server.model_slot(name, None)
        slots = sorted(
            ((n, slot) for n, slot in repository.slots() if n == name),
            key=lambda pair: version_key(pair[1].version),
        )
    return {
        "model_stats": [
            slot.batcher.statistics.snapshot(model, slot.version) for model, slot in slots
        ]
    }
