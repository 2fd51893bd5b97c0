"""`python -m serving` and `pipeline serve`: flags and environment -> Settings -> a running server.

main(argv) -> exit code (also `add_arguments(parser)` + `cli(args)`, the pipeline stage interface):
0 after a clean shutdown (SIGTERM/SIGINT); 2, with one line `<command>: error: ...`, for bad flags,
a port already taken or a model that cannot be loaded; 1 if the server could not start otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from serving.config import (
    CPUS_PER_FRONT_END,
    DEFAULT_FRONT_ENDS_MAX,
    FRONT_END_CPUS,
    LARGE_ROW_BYTES,
    Settings,
)

log = logging.getLogger("serving")
ENV_PREFIX = "TRAINSERVE_"
# flags that may be given several times
REPEATABLE = {"model", "batching"}

# flag -> (type, help). Every flag can also come from TRAINSERVE_<FLAG> (dashes -> underscores).
FLAGS: dict[str, tuple[type, str]] = {
    "model": (
        str,
        "[NAME=]URI, repeatable: URI is path/to/model.onnx, models:/name@alias, models:/name/<version>, "
        "models:/<model id> or runs:/<run id>/<path>; a NAME given twice is one model with two versions",
    ),
    "model-name": (
        str,
        "name clients use in /v2/models/{name} for a single --model URI (default: registered "
        "name, the ONNX metadata's model name, or the file stem)",
    ),
    "repository": (str, "a model repository DIR/NAME/VERSION/model.onnx (Triton's layout)"),
    "load-model": (
        str,
        "repository models loaded at start, comma-separated (default: all); the others can be "
        "loaded with POST /v2/repository/models/NAME/load",
    ),
    "version-policy": (
        str,
        "versions of each repository model loaded: latest:N, all or specific:V[,V] "
        "(default latest:1)",
    ),
    "default-model": (str, "the model /invocations serves (default: the first --model)"),
    "http-threads": (
        int,
        "event loops taking HTTP requests in, each on a thread and a socket of its own on --port "
        "(default: one; one per CPU this process may use, at most 8, when a model loaded at start "
        "has input rows of 512 KiB or more: the loops share the GIL, and only large bodies gain)",
    ),
    "front-ends": (
        int,
        "front-end processes taking HTTP and gRPC requests in on the same ports, writing tensors "
        f"straight into the batch rows of this process, the engine (default: one per "
        f"{CPUS_PER_FRONT_END} CPUs this process may use, at most {DEFAULT_FRONT_ENDS_MAX}, from "
        f"{FRONT_END_CPUS} CPUs and when a model loaded at start has batch rows of "
        f"{LARGE_ROW_BYTES >> 10} KiB or more, unless --http-threads is given; else 0, one "
        "process)",
    ),
    "grpc-port": (int, "also serve KServe V2 over gRPC on this port (default: no gRPC)"),
    "grpc-engine": (
        str,
        "auto|native|aio: what serves --grpc-port, grpc's C++ server (native, built by scripts/setup "
        "where libgrpc++-dev is installed) or grpc.aio (default auto: native when built)",
    ),
    "model-control": (
        str,
        "explicit|none: whether clients may load and unload models with the V2 repository API "
        "(default: explicit with --repository, else none)",
    ),
    "host": (str, "interface to bind (default 127.0.0.1: private)"),
    "port": (int, "port (default 8080)"),
    "device": (
        str,
        "auto|cpu|cuda|tensorrt (default auto: CUDA when a GPU and the CUDA provider exist and it "
        "loads, else CPU with a warning; cuda and tensorrt refuse to start without it)",
    ),
    "device-id": (
        int,
        "CUDA device among the visible ones (default 0; prefer CUDA_VISIBLE_DEVICES)",
    ),
    "variant": (
        str,
        "fp32|fp16|int8|uint8|auto: the file of a model directory served, model.onnx, model.fp16.onnx, "
        "model.int8.onnx or model.uint8.onnx (image inputs as UINT8 pixel values: what its clients "
        "send); auto: the fastest the export measured for this provider among those that passed their "
        "gates, for a registered version (default fp32; fp16 only on a GPU)",
    ),
    "cudnn-conv-algo-search": (
        str,
        "HEURISTIC|EXHAUSTIVE|DEFAULT: how cuDNN picks convolution algorithms per "
        "input shape (default HEURISTIC: no benchmarking on the request path)",
    ),
    "allow-tf32": (
        bool,
        "let CUDA compute fp32 GEMMs and convolutions in TF32 (faster on Ampere+; not what the "
        "export gates certify)",
    ),
    "cuda-graphs": (
        bool,
        "run each batch bucket's session as a captured CUDA graph (CUDA provider, batch buckets; "
        "each checked against the plain run when the model loads, refused with the reason if it "
        "can't be captured)",
    ),
    "gpu-mem-limit-mb": (
        float,
        "cap on onnxruntime's CUDA memory arena of each session (each batch bucket's), MiB (default: none)",
    ),
    "trt-cache-dir": (
        str,
        "--device tensorrt: directory for built engines and timing caches "
        "(default ~/.cache/trainserve/tensorrt)",
    ),
    "threads": (int, "onnxruntime intra-op threads (default: CPUs this process may use)"),
    "max-batch-size": (
        int,
        "most rows per model run (default 32): a cap; which models batch at all is each one's own "
        "(its export's record of independent rows, its config.pbtxt's max_batch_size, --batching)",
    ),
    "batching": (
        str,
        "NAME=on|off, repeatable: whether requests to model NAME share model runs (on: its rows are "
        "independent along the first axis), over what its file and config.pbtxt say",
    ),
    "batch-buckets": (
        str,
        "auto|off|sizes like 1,8,32: batch sizes a run is padded up to, an onnxruntime session "
        "each (each a copy of the weights and its own memory arena); auto: powers of two up to "
        "--max-batch-size on the CUDA provider (default auto; why: serving/README.md, GPUs)",
    ),
    "max-delay-ms": (float, "how long a partial batch may wait for more rows (default 0: never)"),
    "arrival-wait-ms": (
        float,
        "how long a batch may wait for the requests whose bodies were already arriving when "
        "it could run; the requests behind a straggler in its batch buffer wait for it once "
        "more (default 5; 0: never)",
    ),
    "max-queue-rows": (int, "rows allowed to wait before 503 (default 1024)"),
    "max-body-bytes": (int, "largest request body (default 16 MiB)"),
    "grpc-memory-bytes": (
        int,
        "bytes grpc's C++ server (--grpc-engine native) may hold in all for messages not yet "
        "whole: past it grpc stops reading and closes the connections holding most (default "
        "4 x --max-body-bytes, at least 1 GiB)",
    ),
    "max-header-bytes": (
        int,
        "largest HTTP request head, request line and headers, counted as it arrives; beyond: "
        "431 (default 32 KiB)",
    ),
    "max-rows-per-request": (int, "most rows in one request (default 256)"),
    "shared-memory": (
        str,
        "on|off: the V2 system and CUDA shared-memory extensions, inputs and outputs by region "
        "for same-host clients (tritonclient.utils.shared_memory) (default on)",
    ),
    "max-shared-memory-mb": (
        float,
        "most MiB of shared memory one client (token) may register (default 4096)",
    ),
    "auth-token": (
        str,
        "require 'Authorization: Bearer <token>', or one of several comma-separated tokens, one per "
        "client (prefer TRAINSERVE_AUTH_TOKEN: flags show in ps)",
    ),
    "feedback-token": (
        str,
        "the bearer token POST /v2/models/NAME/feedback (labels) needs, one of its own: labels "
        "steer the shadow verdict (prefer TRAINSERVE_FEEDBACK_TOKEN; default none: labels are "
        "refused where --auth-token is set)",
    ),
    "reload-interval": (float, "seconds between polls of a models:/name@alias for a new version"),
    "graceful-timeout": (float, "seconds to finish in-flight requests after SIGTERM (default 30)"),
    "read-timeout": (
        float,
        "seconds a connection has to deliver a whole request; slower or idle ones are "
        "closed (default 30)",
    ),
    "request-timeout": (
        float,
        "seconds a request may wait for and run the model before 504 (default 60)",
    ),
    "run-timeout": (
        float,
        "seconds one model run may take before its requests get 504 and the server "
        "reports not ready until it returns (default 60)",
    ),
    "allowed-hosts": (
        str,
        "Host header patterns accepted besides loopback names (bound to loopback) or "
        "any (bound to all interfaces), comma-separated",
    ),
    "allowed-origins": (
        str,
        "browser Origins allowed, comma-separated (default none: cross-site requests get 403)",
    ),
    "allow-unauthenticated": (bool, "serve without a token on a non-loopback address"),
    "log-level": (str, "debug|info|warning|error (default info)"),
    "payload-log": (
        str,
        "directory for the payload log: sampled requests and answers as JSON Lines (default: none)",
    ),
    "payload-log-sample": (
        float,
        "fraction of requests logged, chosen by a hash of the request id (default 1)",
    ),
    "payload-log-max-mb": (
        float,
        "MiB all payload files may take together; the oldest go first (default 100)",
    ),
    "payload-log-file-mb": (
        float,
        "MiB per payload file before the next one is begun (default 10)",
    ),
    "payload-log-mlflow": (
        bool,
        "log each closed payload file to the model's training run, under payloads/",
    ),
    "drift-window": (
        int,
        "samples per model version compared with the training data's statistics (PSI in "
        "/metrics as trainserve_input_drift / trainserve_output_drift; 0: off; default 500)",
    ),
    "drift-threshold": (
        float,
        "PSI above which a log line says a version's input or output drifted (default 0.2)",
    ),
    "shadow": (
        float,
        "fraction of a models:/NAME@alias model's requests also run on the version behind "
        "--shadow-alias, off the request path, and compared (GET /v2/models/NAME/shadow; default 0)",
    ),
    "shadow-alias": (str, "the alias whose version is shadowed (default challenger)"),
    "shadow-min-pairs": (int, "pairs the shadow verdict needs before it decides (default 200)"),
    "shadow-min-agreement": (
        float,
        "top-1 agreement the challenger needs without labels (default 0.95)",
    ),
    "shadow-max-difference": (
        float,
        "largest mean |difference| per output, for outputs without a decision (default: no limit)",
    ),
    "shadow-min-labels": (
        int,
        "labelled pairs (POST /v2/models/NAME/feedback) before labels decide; only labels "
        "promote (default 100)",
    ),
    "shadow-tolerance": (
        float,
        "how much worse the challenger's live accuracy (points/100) or RMSE (relative) "
        "may be (default 0.01)",
    ),
    "shadow-max-latency-ratio": (
        float,
        "largest challenger/champion p50 latency ratio (default: no limit)",
    ),
    "shadow-max-source-share": (
        float,
        "largest share of the labelled pairs one client address may have sent for "
        "labels to promote (default 0.5; 1: no limit, for a server behind a proxy, "
        "where every client is one address)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags, for `python -m serving` and for `pipeline serve` to reuse."""
    for flag, (kind, help_text) in FLAGS.items():
        env = ENV_PREFIX + flag.upper().replace("-", "_")
        if kind is bool:
            parser.add_argument(
                f"--{flag}",
                action="store_const",
                const=True,
                default=None,
                help=f"{help_text} [env {env}=1]",
            )
        elif flag in REPEATABLE:
            parser.add_argument(
                f"--{flag}",
                type=kind,
                action="append",
                default=None,
                help=f"{help_text} [env {env}: one]",
            )
        else:
            parser.add_argument(
                f"--{flag}", type=kind, default=None, help=f"{help_text} [env {env}]"
            )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="let onnxruntime and MLflow speak for "
        "themselves, and show Python warnings [env TRAINSERVE_VERBOSE=1]",
    )
    # Refusals start with the command the user typed: `pipeline serve: error: ...` or
    # `python -m serving: ...`.
    parser.set_defaults(prog=parser.prog)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags > TRAINSERVE_* environment > defaults; ValueError names the bad value and the fix."""
    values = {}
    for flag, (kind, _) in FLAGS.items():
        key = flag.replace("-", "_")
        value = getattr(args, key, None)
        env = ENV_PREFIX + key.upper()
        if value is None and os.environ.get(env):
            raw = os.environ[env]
            if kind is bool:
                if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"{env}={raw!r}: use 1 or 0")
                value = raw.lower() in ("1", "true", "yes")
            else:
                try:
                    value = kind(raw)
                except ValueError:
                    raise ValueError(f"{env}={raw!r} is not a valid {kind.__name__}") from None
        if value is not None:
            values[key] = tuple(value) if isinstance(value, list) else value
    if "model" not in values and "repository" not in values:
        raise ValueError("--model [NAME=]URI or --repository DIR is required (or TRAINSERVE_MODEL)")
    settings = Settings(**values)
    settings.check()
    from serving.core import check_reload

    check_reload(settings)
    return settings


def cli(args: argparse.Namespace) -> int:
    """Run the server from parsed flags (the `pipeline` stage-module interface)."""
    from serving import console

    console.set_verbose(getattr(args, "verbose", False))
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        return refuse(args, exc)
    console.configure(level=settings.log_level)
    try:
        return serve(settings)
    except ServeError as exc:
        return refuse(args, exc)


class ServeError(Exception):
    """The server can't start with these settings (a model that can't be loaded, a payload log
    directory that can't be written): said in one line, exit 2, as every pipeline stage says a
    refusal."""


def refuse(args: argparse.Namespace, exc: Exception) -> int:
    one_line = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    print(f"{getattr(args, 'prog', 'python -m serving')}: error: {one_line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m serving` and `pipeline serve`; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m serving",
        allow_abbrev=False,
        description="Serve an ONNX model over HTTP (KServe V2, MLflow scoring, "
        "Prometheus metrics). Every flag can also be set as "
        "TRAINSERVE_<FLAG>, e.g. TRAINSERVE_PORT=9000.",
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # argparse exits on --help and on errors; hand back its code instead
        return int(exc.code or 0)
    return cli(args)


def check_ports_free(host: str, ports: list[int | None]) -> None:
    """ServeError for a port another process holds: found in a second, said in one line."""
    import socket

    for port in (p for p in ports if p):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ServeError(
                    f"port {port} on {host} is taken ({exc.strerror}); choose another with --port "
                    f"(or --grpc-port)"
                ) from None


def raise_open_files_limit() -> None:
    """Each client connection is a file descriptor: take the hard limit, not the soft 1024, so a
    burst of connections (each closed by the read deadline if idle) does not starve new ones."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard)
            )


def open_payload_log(settings: Settings):
    """The payload log the settings ask for (not started), or None; PayloadLogError if DIR can't be
    used."""
    if settings.payload_log is None:
        return None
    from serving.payload_log import PayloadLog

    mib = 1 << 20
    return PayloadLog(
        settings.payload_log,
        sample=settings.payload_log_sample,
        max_bytes=int(settings.payload_log_max_mb * mib),
        file_bytes=int(settings.payload_log_file_mb * mib),
        mlflow=settings.payload_log_mlflow,
    )


def serve(settings: Settings) -> int:
    from serving.core import Server, open_models

    # Registry calls (loading, following the alias) fail in seconds, not after MLflow's minutes of
    # retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from serving.engine import EngineError
    from serving.loader import SourceError, sweep_orphaned_downloads
    from serving.payload_log import PayloadLogError
    from serving.repository import RepositoryError

    # KServe V2 over gRPC on its own port, started and stopped with the server.
    front_ends = (grpc_start(settings),) if settings.grpc_port is not None else ()
    # Before a model download, not after.
    check_ports_free(settings.host, [settings.port, settings.grpc_port])
    # before the model: a directory we can't write is found in a second, not after a long load
    try:
        payload_log = open_payload_log(settings)
    except PayloadLogError as exc:
        raise ServeError(exc) from None
    if removed := sweep_orphaned_downloads():
        log.info("removed %d model download(s) left by servers no longer running", len(removed))
    try:
        models = open_models(settings)
    except (SourceError, EngineError, RepositoryError) as exc:
        raise ServeError(f"cannot serve: {exc}") from None
    rows = None
    # Only rows a front end receives straight into the batch rows count (arena.has_rows), and not
    # a model's that takes image files: those go to the engine whole.
    from serving import arena

    arena_rows = [
        model.engine.row_bytes
        for _, model in models
        if model.images is None and arena.has_rows(model)
    ]
    processes = front_end_processes(settings, max(arena_rows, default=0))
    if processes is not None:
        # the front ends take HTTP and gRPC in; this process is their engine
        front_ends, rows = (processes.start,), processes.placements_for
    try:
        server = Server(settings, models, payload_log, front_ends, rows)
    except (RepositoryError, SourceError) as exc:
        for _, model in models:
            model.discard()
        raise ServeError(f"cannot serve: {exc}") from None
    raise_open_files_limit()
    keep_freed_memory()
    return run(server)


def front_end_processes(settings: Settings, row_bytes: int):
    """The front-end processes the settings ask for, or the default's for models of `row_bytes`
    (the largest batch row of the models loaded at start that front ends would receive;
    Settings.front_end_processes), said in the log with why; None for one process. ServeError
    where --front-ends asks for them and this install can't run them."""
    from serving.arena import WHY_NOT

    count, why = settings.front_end_processes(row_bytes, WHY_NOT)
    if count and WHY_NOT:
        raise ServeError(f"--front-ends {count}: {WHY_NOT}; or --front-ends 0")
    log.info(
        "front ends: %s (%s)",
        f"{count} process{'es' if count > 1 else ''}" if count else "none, one process",
        why,
    )
    if not count:
        return None
    from serving.front_ends import FrontEnds

    return FrontEnds(count, why)


def grpc_start(settings: Settings):
    """The gRPC front end's start function; ServeError for `--grpc-engine native` where grpc's C++
    server was not built (found before a model loads)."""
    from serving.grpc import native
    from serving.grpc.service import start_grpc

    if settings.grpc_engine == "native" and not native.available():
        raise ServeError(f"--grpc-engine native: {native.WHY_NOT}; or use --grpc-engine aio")
    return start_grpc


def largest_row_bytes(server) -> int:
    """The bytes of one row of the largest-rowed model loaded now (Engine.row_bytes; 0 when none is
    loaded or none has rows of one size): how large a request's body is, for how many loops take
    them in (Settings.http_loops)."""
    return max((slot.model.engine.row_bytes for _, slot in server.repository.slots()), default=0)


def layout(server, http_loops: int) -> str:
    """How the server is laid out over threads and cores, in one line for its log."""
    from serving.cpus import usable_cpus

    slots = [slot for _, slot in server.repository.slots()]
    loops = f"HTTP on {http_loops} event loop{'s' if http_loops > 1 else ''}"
    if http_loops > 1:
        loops += " (threads, a socket each: SO_REUSEPORT)"
    elif server.settings.http_threads is None and usable_cpus() > 1:
        loops += (
            f" (no model loaded at start has rows of {LARGE_ROW_BYTES >> 10} KiB or more: more "
            "loops would share the GIL for little; --http-threads N sets them)"
        )
    parts = [loops] if http_loops else []
    parts += [getattr(f, "layout", "gRPC") for f in server.listening]
    threads = sorted({slot.model.engine.threads for slot in slots})
    parts.append(
        f"1 engine thread running every model's batches in turn (onnxruntime "
        f"{'/'.join(map(str, threads)) or '-'} intra-op threads)"
    )
    buffers = [slot.batcher.buffers for slot in slots if slot.batcher.buffers is not None]
    if buffers:
        b = buffers[0]
        parts.append(
            f"batch buffers of {b.capacity} rows, up to {b.count} a model version"
            + (", pinned" if b.pin else "")
        )
    return f"{'; '.join(parts)}; {usable_cpus()} CPUs usable"


def keep_freed_memory() -> None:
    """glibc gives large blocks (above 128 KiB at first) their own pages from the kernel and returns
    them when freed, and trims the heap's free top back to the kernel: a server taking 602 KB
    tensors in had every message's memory faulted in and zeroed again (clear_page: half of a gRPC
    request's CPU). Kept in the heap instead, reused; an unload still hands memory back
    (malloc_trim, serving/repository.py)."""
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        # glibc's largest: blocks up to 32 MiB come from the heap
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 512 << 20)


def run(server) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully: 0; 1 if the HTTP port could not be
    bound."""
    try:
        import uvloop
    except ImportError:
        # the standard loop serves too, a little slower
        return asyncio.run(_serve(server))
    return uvloop.run(_serve(server))


async def _serve(server) -> int:
    from serving.http.front_end import HttpFrontEnd

    settings = server.settings
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.rows is not None:
        return await _serve_front_ends(server, stop)
    http = HttpFrontEnd(server)
    async with server.lifespan():
        try:
            bound = await http.listen(
                settings.host, settings.port, settings.http_loops(largest_row_bytes(server))
            )
        except OSError as exc:
            log.error(
                "cannot listen on %s:%d: %s; the server did not start",
                settings.host,
                settings.port,
                exc.strerror or exc,
            )
            return 1
        log.info("listening on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in bound))
        log.info("laid out as: %s", layout(server, len(http.listeners)))
        await stop.wait()
        # Not ready at once (load balancers stop sending), queued requests run without waiting out
        # --max-delay-ms, gRPC drains alongside; connections still uploading close, the others after
        # their answer.
        server.begin_shutdown()
        http.stop_accepting()
        await http.drain(settings.graceful_timeout)
    return 0


async def _serve_front_ends(server, stop: asyncio.Event) -> int:
    """The engine of front-end processes (serving/front_ends.py): they listen, it serves them until
    SIGTERM or SIGINT, then they drain (the server's lifespan stops them) and it stops."""
    try:
        async with server.lifespan():
            log.info(
                "listening on http://%s:%d (front ends)", server.settings.host, server.settings.port
            )
            log.info("laid out as: %s", layout(server, 0))
            await stop.wait()
            # Not ready at once; queued requests run without waiting out --max-delay-ms; the front
            # ends stop accepting and answer what is in flight.
            server.begin_shutdown()
    except RuntimeError as exc:
        log.error("%s; the server did not start", exc)
        return 1
    return 0
