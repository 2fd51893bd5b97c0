"""Server settings: one typed place, with defaults in code.

Precedence: command-line flag > environment variable TRAINSERVE_<FLAG> (e.g. TRAINSERVE_PORT,
TRAINSERVE_MAX_BATCH_SIZE) > default. The auth token is read from TRAINSERVE_AUTH_TOKEN rather than
a flag where possible, so that it does not show in `ps`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# --max-body-bytes at most: what grpc's channel arguments (C ints) hold
MAX_BODY_LIMIT = (1 << 31) - 1
# --front-ends at most (serving/placements.py counts arrivals for 64 processes, the engine's first)
MAX_FRONT_ENDS = 32
# models' input rows from this size get an HTTP event loop per CPU (Settings.http_loops), and on a
# host of FRONT_END_CPUS usable CPUs or more, a front-end process per CPUS_PER_FRONT_END CPUs, at
# most DEFAULT_FRONT_ENDS_MAX (Settings.front_end_processes)
LARGE_ROW_BYTES = 512 * 1024
FRONT_END_CPUS = 8
CPUS_PER_FRONT_END = 4
DEFAULT_FRONT_ENDS_MAX = 8


@dataclass(frozen=True)
class Settings:
    # The models: each `[NAME=]URI`, URI a path to an .onnx file, models:/name@alias,
    # models:/name/3, runs:/<id>/<path>. A NAME given more than once is one model with several
    # versions.
    model: str | tuple[str, ...] = ()
    # Name clients use in /v2/models/{name} for a single --model without NAME=; default: registered
    # name, ONNX metadata, file stem.
    model_name: str | None = None
    # A Triton-style model repository, DIR/NAME/VERSION/model.onnx.
    repository: str | None = None
    # Repository models loaded at start, comma-separated; None: all of them.
    load_model: str | None = None
    # Which versions of a repository model are loaded: latest:N, all, specific:V,V.
    version_policy: str = "latest:1"
    # The model /invocations serves; None: the first --model (or the repository's first model).
    default_model: str | None = None
    # Event loops taking HTTP requests in (the server's own and the rest in threads, one socket each
    # on the port); None: see http_loops.
    http_threads: int | None = None
    # Front-end processes taking HTTP and gRPC requests in, on the same ports (SO_REUSEPORT),
    # writing tensors straight into the batch rows of the process started, which becomes the engine
    # (serving/front_ends.py); 0: one process does everything; None: see front_end_processes.
    front_ends: int | None = None
    # Port of the KServe V2 gRPC endpoint; None: no gRPC.
    grpc_port: int | None = None
    # What serves that port: native (grpc's C++ server, serving/grpc/native.cc: a unary call costs
    # the event loop a third of grpc.aio's), aio (grpc.aio), auto: native when it was built
    # (scripts/setup), else aio.
    grpc_engine: str = "auto"
    # Whether clients may load and unload models (the V2 repository API): explicit, or none; None:
    # explicit with --repository, none without (a server of fixed --model flags keeps them).
    model_control: str | None = None
    # Interface to bind; 127.0.0.1 keeps the server private unless asked otherwise.
    host: str = "127.0.0.1"
    port: int = 8080
    # auto: CUDA when a GPU and onnxruntime's CUDA provider both exist and it loads, else CPU (with
    # a warning); cpu; cuda: CUDA or refuse to start; tensorrt: TensorRT (needs TensorRT 10) or
    # refuse.
    device: str = "auto"
    # CUDA device index among those visible; CUDA_VISIBLE_DEVICES=N makes GPU N device 0
    # (preferred).
    device_id: int = 0
    # Which file of a model directory is served: fp32 (model.onnx) or fp16 (model.fp16.onnx, GPU
    # only).
    variant: str = "fp32"
    # How cuDNN picks convolution algorithms for each new input shape: HEURISTIC (no benchmark on
    # the request path), EXHAUSTIVE (onnxruntime's default: benchmarks each new shape), DEFAULT.
    cudnn_conv_algo_search: str = "HEURISTIC"
    # Let CUDA run fp32 GEMMs and convolutions in TF32 (faster on Ampere+; the export gates certify
    # fp32).
    allow_tf32: bool = False
    # Run each batch bucket's session as a captured CUDA graph (CUDA provider, batch buckets; gated
    # at load).
    cuda_graphs: bool = False
    # Cap on onnxruntime's CUDA memory arena, in MiB; None: no cap.
    gpu_mem_limit_mb: float | None = None
    # --device tensorrt: directory of the TensorRT engine and timing caches; None:
    # ~/.cache/trainserve/tensorrt.
    trt_cache_dir: str | None = None
    # onnxruntime intra-op threads; default: the CPUs this process may use.
    threads: int | None = None
    # Most rows one model run gathers from concurrent requests: a cap, never a claim that a model's
    # rows are independent (only its export's record, its config.pbtxt or --batching says that).
    max_batch_size: int = 32
    # Per model, NAME=on|off: whether requests to NAME share model runs (its rows independent along
    # the first axis), over what its file records and its config.pbtxt says.
    batching: str | tuple[str, ...] = ()
    # Batch sizes a run is padded up to, an onnxruntime session each (serving.engine.Engine; why:
    # the GPU section of serving/README.md): auto (powers of two up to --max-batch-size, on the CUDA
    # provider only), off, or sizes like 1,8,32 (any provider but TensorRT; --max-batch-size is
    # always the largest).
    batch_buckets: str = "auto"
    # How long a partial batch may wait for more rows; 0: never wait, run what is queued.
    max_delay_ms: float = 0.0
    # How long a batch may wait for the requests already arriving when it could run (their head in,
    # their body on its way); 0: never.
    arrival_wait_ms: float = 5.0
    # Rows allowed to wait; beyond it requests get 503 with Retry-After. Bounds memory.
    max_queue_rows: int = 1024
    # Largest request body, in bytes (after decompression too); beyond it 413.
    max_body_bytes: int = 16 * 1024 * 1024
    # Largest HTTP request head (request line and headers), in bytes, counted as it arrives; beyond
    # it 431.
    max_header_bytes: int = 32 * 1024
    # What grpc's C++ server may hold in all (messages not yet whole, read buffers): its resource
    # quota. Past it grpc stops reading, then closes the connections holding the most. None: 4 x
    # --max-body-bytes, at least 1 GiB.
    grpc_memory_bytes: int | None = None
    # The V2 shared-memory extensions (system; CUDA on a GPU): on, or off (their routes and methods
    # refuse, 403).
    shared_memory: str = "on"
    # Most MiB of shared memory one client (token) may have registered at once.
    max_shared_memory_mb: float = 4096.0
    # Most rows (samples) in one request; beyond it 400.
    max_rows_per_request: int = 256
    # Bearer token required on every endpoint except health checks, or several, comma-separated, one
    # per client (a client's shared-memory regions belong to its token); None: no auth.
    auth_token: str | None = None
    # Bearer token POST /v2/models/NAME/feedback (labels, which steer the shadow verdict) needs, not
    # the inference token; None: labels are taken only where no --auth-token is set either.
    feedback_token: str | None = None
    # Seconds between polls of a models:/name@alias source for a new version; None: never.
    reload_interval: float | None = None
    # Seconds SIGTERM waits for in-flight requests before their connections are closed.
    graceful_timeout: float = 30.0
    # Seconds a connection has to deliver a whole request (headers and body) from its first byte or
    # from opening; a slower or idle one is closed (408 when a request had begun), so idle clients
    # can't hold the server's connections. Keep-alive connections between requests close after 5 s.
    read_timeout: float = 30.0
    # Seconds a request may wait in the queue and run; past it: 504.
    request_timeout: float = 60.0
    # Seconds one model run may take; past it its requests get 504 and the server reports not ready
    # until the run returns (a wedged GPU, a hung kernel).
    run_timeout: float = 60.0
    # Host header patterns accepted besides the defaults: loopback names when bound to a loopback
    # address (against DNS rebinding), anything when bound to all interfaces. Comma-separated.
    allowed_hosts: str | None = None
    # Browser Origins allowed to call the server, comma-separated; default none: a request that
    # carries another Origin header (a web page's cross-site request) gets 403. Clients other than
    # browsers send no Origin.
    allowed_origins: str | None = None
    # Serve without a token on a non-loopback address (refused otherwise: anyone who can reach it
    # could call it).
    allow_unauthenticated: bool = False
    log_level: str = "info"
    # Directory of the payload log (JSON Lines of sampled requests and answers); None: no payload
    # log.
    payload_log: str | None = None
    # Fraction of requests logged, chosen by a hash of the request id (so a reader can tell which
    # are in).
    payload_log_sample: float = 1.0
    # Most MiB all payload files in the directory may take together; the oldest are deleted first.
    payload_log_max_mb: float = 100.0
    # A new payload file is begun when the current one would pass this many MiB.
    payload_log_file_mb: float = 10.0
    # Log each closed payload file to the answering model's training run (its lineage run_id) in
    # MLflow.
    payload_log_mlflow: bool = False
    # Drift: samples per model version whose input and output features are compared with the
    # training data's (the reference export stored beside the model); 0: off. And the PSI above
    # which a log line says so.
    drift_window: int = 500
    drift_threshold: float = 0.2
    # Shadow: the fraction of a models:/NAME@alias model's requests mirrored to the version behind
    # --shadow-alias (loaded and followed as the alias moves), off the request path; 0: off.
    shadow: float = 0.0
    shadow_alias: str = "challenger"
    # The shadow verdict's rule: pairs needed, top-1 agreement needed (decision outputs), the
    # largest mean
    # |difference| per output (others), labels needed before they decide, how much worse a live metric may
    # be, the largest challenger/champion p50 ratio, and the largest share of the labelled pairs one
    # client address may have sent for labels to promote.
    shadow_min_pairs: int = 200
    shadow_min_agreement: float = 0.95
    shadow_max_difference: float = float("inf")
    shadow_min_labels: int = 100
    shadow_tolerance: float = 0.01
    shadow_max_latency_ratio: float = float("inf")
    shadow_max_source_share: float = 0.5

    def sources(self):
        """The --model flags as repository Sources (ValueError for a malformed one)."""
        from serving.repository import parse_model_flag

        specs = (self.model,) if isinstance(self.model, str) else tuple(self.model)
        return [parse_model_flag(spec) for spec in specs]

    def batching_flags(self) -> dict[str, bool]:
        """--batching NAME=on|off as {NAME: on}; ValueError for a malformed or repeated one."""
        from serving.repository import NAME

        found: dict[str, bool] = {}
        for flag in (self.batching,) if isinstance(self.batching, str) else self.batching:
            name, _, value = flag.partition("=")
            if not NAME.fullmatch(name) or value not in ("on", "off"):
                raise ValueError(f"--batching {flag!r}: expected NAME=on or NAME=off")
            if name in found:
                raise ValueError(f"--batching names {name} twice")
            found[name] = value == "on"
        return found

    def shadow_sources(self):
        """The --shadow-alias source of every --model that is a registry alias: the challengers to
        load."""
        from serving.repository import Source

        found = []
        for source in self.sources():
            if source.alias is not None and source.alias.rpartition("@")[2] != self.shadow_alias:
                registered = source.uri.split("@", 1)[0]
                name = source.name or self.model_name or registered.removeprefix("models:/")
                found.append(Source(f"{registered}@{self.shadow_alias}", name))
        return found

    def grpc_memory(self) -> int:
        """grpc's resource quota for the native engine, in bytes (see grpc_memory_bytes)."""
        return self.grpc_memory_bytes or max(1 << 30, 4 * self.max_body_bytes)

    def shadow_rule(self) -> dict:
        return {
            "min_pairs": self.shadow_min_pairs,
            "min_agreement": self.shadow_min_agreement,
            "max_difference": self.shadow_max_difference,
            "min_labels": self.shadow_min_labels,
            "tolerance": self.shadow_tolerance,
            "max_latency_ratio": self.shadow_max_latency_ratio,
            "max_source_share": self.shadow_max_source_share,
        }

    def policy(self):
        from serving.repository import parse_version_policy

        return parse_version_policy(self.version_policy)

    def check(self) -> None:
        """Cross-field rules; ValueError says how to fix."""
        self._check_models()
        if not 1024 <= self.max_header_bytes <= 1 << 20:
            raise ValueError(
                f"--max-header-bytes must be from 1024 to 1048576 (1 MiB), got {self.max_header_bytes}"
            )
        positive = {
            "--port": self.port,
            "--max-batch-size": self.max_batch_size,
            "--max-queue-rows": self.max_queue_rows,
            "--max-body-bytes": self.max_body_bytes,
            "--max-rows-per-request": self.max_rows_per_request,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.grpc_memory_bytes is not None and self.grpc_memory_bytes < 2 * self.max_body_bytes:
            raise ValueError(
                f"--grpc-memory-bytes must hold two messages of --max-body-bytes ({self.max_body_bytes}): "
                f"at least {2 * self.max_body_bytes}, got {self.grpc_memory_bytes}"
            )
        # grpc's message size limits are C ints (2 GiB - 1 at most)
        if self.max_body_bytes > MAX_BODY_LIMIT:
            raise ValueError(
                f"--max-body-bytes must be at most {MAX_BODY_LIMIT} (2 GiB - 1: gRPC's message size limit "
                f"is a 32-bit int), got {self.max_body_bytes}"
            )
        if self.device_id < 0:
            raise ValueError(f"--device-id must be >= 0, got {self.device_id}")
        if self.http_threads is not None and not 1 <= self.http_threads <= 64:
            raise ValueError(f"--http-threads must be from 1 to 64, got {self.http_threads}")
        if self.front_ends is not None and not 0 <= self.front_ends <= MAX_FRONT_ENDS:
            raise ValueError(
                f"--front-ends must be from 0 to {MAX_FRONT_ENDS}, got {self.front_ends}"
            )
        if self.front_ends and self.http_threads is not None and self.http_threads > 1:
            raise ValueError(
                "--http-threads with --front-ends: each front-end process takes HTTP in on one "
                "event loop; for more, ask for more front ends (--front-ends N), or drop "
                "--front-ends"
            )
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be positive, got {self.threads}")
        if self.max_delay_ms < 0:
            raise ValueError(f"--max-delay-ms must be >= 0, got {self.max_delay_ms}")
        if not 0 <= self.arrival_wait_ms <= 1000:
            raise ValueError(
                f"--arrival-wait-ms must be from 0 to 1000, got {self.arrival_wait_ms}"
            )
        if self.max_rows_per_request > self.max_queue_rows:
            raise ValueError(
                f"--max-rows-per-request ({self.max_rows_per_request}) exceeds --max-queue-rows "
                f"({self.max_queue_rows}): such a request could never be queued"
            )
        self._check_device()
        if self.shared_memory not in ("on", "off"):
            raise ValueError(f"--shared-memory must be on or off, got {self.shared_memory!r}")
        if not 0 < self.max_shared_memory_mb < float("inf"):
            raise ValueError(
                f"--max-shared-memory-mb must be a positive number of MiB, got {self.max_shared_memory_mb}"
            )
        if self.reload_interval is not None and self.reload_interval <= 0:
            raise ValueError(f"--reload-interval must be positive, got {self.reload_interval}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(
                f"--log-level must be debug, info, warning, error or critical, got {self.log_level!r}"
            )
        if self.auth_token is not None and (not self.auth_token.strip() or not all(self.tokens())):
            raise ValueError(
                "the auth token is empty (or one of several, comma-separated, is); unset it or give "
                "non-empty ones"
            )
        if self.auth_token is not None and not self.auth_token.isascii():
            raise ValueError(
                "the auth token must be ASCII (HTTP headers are latin-1: a non-ASCII one never matches)"
            )
        if self.feedback_token is not None:
            if not self.feedback_token.strip() or not self.feedback_token.isascii():
                raise ValueError("the feedback token must be non-empty ASCII")
            if self.feedback_token.strip().encode() in self.tokens():
                raise ValueError(
                    "the feedback token is one of the inference tokens: labels steer the shadow verdict, "
                    "so they need a credential of their own"
                )
        for flag, value in {
            "--read-timeout": self.read_timeout,
            "--request-timeout": self.request_timeout,
            "--run-timeout": self.run_timeout,
            "--graceful-timeout": self.graceful_timeout,
        }.items():
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        self._check_payload_log()
        self._check_drift_and_shadow()
        if not self.loopback and self.auth_token is None and not self.allow_unauthenticated:
            raise ValueError(
                f"--host {self.host} makes the server reachable from other machines, and no token is "
                "set: set TRAINSERVE_AUTH_TOKEN (clients send 'Authorization: Bearer <token>'), or "
                "pass --allow-unauthenticated if something in front of it authenticates"
            )

    def _check_models(self) -> None:
        from serving.loader import SourceError

        self.batching_flags()
        try:
            sources = self.sources()
        except SourceError as exc:
            raise ValueError(str(exc)) from None
        if not sources and self.repository is None:
            raise ValueError(
                "no model to serve: give --model [NAME=]URI (repeatable) or --repository DIR"
            )
        if self.model_name is not None and (len(sources) != 1 or sources[0].name is not None):
            raise ValueError(
                "--model-name names a single --model; with several, name each as --model NAME=URI"
            )
        self.policy()
        if self.repository is None:
            for flag, value in {
                "--load-model": self.load_model,
                "--version-policy": None
                if self.version_policy == "latest:1"
                else self.version_policy,
            }.items():
                if value is not None:
                    raise ValueError(
                        f"{flag} applies to --repository models: add --repository DIR or drop it"
                    )
        if self.model_control not in (None, "none", "explicit"):
            raise ValueError(
                f"--model-control must be none or explicit, got {self.model_control!r}"
            )
        if self.grpc_port is not None and not (
            0 < self.grpc_port < 65536 and self.grpc_port != self.port
        ):
            raise ValueError(
                f"--grpc-port must be a port (1-65535) other than --port {self.port}, got {self.grpc_port}"
            )
        # Whether the native engine was built is checked where gRPC is started (serving/cli.py).
        if self.grpc_engine not in ("auto", "native", "aio"):
            raise ValueError(f"--grpc-engine must be auto, native or aio, got {self.grpc_engine!r}")

    def _check_drift_and_shadow(self) -> None:
        if self.drift_window < 0:
            raise ValueError(
                f"--drift-window must be >= 0 samples (0: off), got {self.drift_window}"
            )
        if not self.drift_threshold > 0:
            raise ValueError(
                f"--drift-threshold must be a positive PSI (0.2: a shift), got {self.drift_threshold}"
            )
        if not 0 <= self.shadow <= 1:
            raise ValueError(
                f"--shadow must be a fraction of requests between 0 and 1, got {self.shadow}"
            )
        if self.shadow and not self.shadow_sources():
            raise ValueError(
                "--shadow mirrors a registry alias's traffic to the version behind --shadow-alias "
                f"(@{self.shadow_alias}): serve a --model models:/NAME@champion (an alias other than "
                f"@{self.shadow_alias})"
            )
        if self.shadow_min_pairs < 1 or self.shadow_min_labels < 1:
            raise ValueError("--shadow-min-pairs and --shadow-min-labels must be at least 1")
        if not 0 <= self.shadow_min_agreement <= 1:
            raise ValueError(
                f"--shadow-min-agreement must be between 0 and 1, got {self.shadow_min_agreement}"
            )
        if not 0 < self.shadow_max_source_share <= 1:
            raise ValueError(
                "--shadow-max-source-share must be a fraction of the labelled pairs above 0 and at most 1 (1: "
                f"no limit; 0.5: no client may send more than half), got {self.shadow_max_source_share}"
            )
        for flag, value in {
            "--shadow-max-difference": self.shadow_max_difference,
            "--shadow-tolerance": self.shadow_tolerance,
            "--shadow-max-latency-ratio": self.shadow_max_latency_ratio,
        }.items():
            if not value >= 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")

    def http_loops(self, row_bytes: int) -> int:
        """How many event loops take HTTP requests in: --http-threads, else one per usable CPU (at
        most 8) when the models loaded at start have input rows of LARGE_ROW_BYTES or more
        (`row_bytes`: the largest, 0 when no row is of one size), else one. By row, not by body: a
        request of many small rows still gets one loop.

        Why not always several: the loops share one GIL. What they do side by side is only the
        kernel's copy of a body off the socket (done without the GIL); everything else a request
        costs in Python, they take turns at, and each turn taken from the other loop costs a
        hand-off. A second loop pays only for rows large enough that the copy is most of a request
        (hence LARGE_ROW_BYTES; the measurements: docs/benchmarks.md#servingconfigpy)."""
        if self.http_threads is not None:
            return self.http_threads
        if row_bytes < LARGE_ROW_BYTES:
            return 1
        from serving.cpus import usable_cpus

        return max(1, min(8, usable_cpus()))

    def front_end_processes(self, row_bytes: int, why_not: str = "") -> tuple[int, str]:
        """How many front-end processes take requests in, and why, in words for the log:
        --front-ends; else, where the models loaded at start have batch rows of LARGE_ROW_BYTES or
        more that front ends receive (`row_bytes`: the largest) and this process may use
        FRONT_END_CPUS CPUs or more, one per CPUS_PER_FRONT_END of them (at most
        DEFAULT_FRONT_ENDS_MAX); else none (one process). A front end takes a request in for about
        what one process does, and the engine's process adds a record and an answer per request:
        that pays only where one interpreter is the limit, for large bodies with cores to spare
        beside the engine and its runs (docs/benchmarks.md#servingconfigpy). `why_not`: why this
        install can't run them (arena.WHY_NOT), which the default then says."""
        if self.front_ends is not None:
            return self.front_ends, "--front-ends"
        if self.http_threads is not None:
            return 0, "--http-threads asks for event loops in one process"
        from serving.cpus import usable_cpus

        cpus = usable_cpus()
        if row_bytes < LARGE_ROW_BYTES:
            return 0, (
                f"no model loaded at start has batch rows of {LARGE_ROW_BYTES >> 10} KiB or "
                "more for front ends to receive: for smaller ones a front end costs more than it "
                "saves; --front-ends N sets them"
            )
        if cpus < FRONT_END_CPUS:
            return 0, (
                f"{cpus} CPU{'s' if cpus > 1 else ''} usable: front ends pay from "
                f"{FRONT_END_CPUS}, with cores to spare beside the engine; --front-ends N sets them"
            )
        if why_not:
            return 0, f"{why_not}; the default would start front ends on {cpus} CPUs"
        count = min(DEFAULT_FRONT_ENDS_MAX, cpus // CPUS_PER_FRONT_END)
        return count, (
            f"{cpus} CPUs usable and model rows of {row_bytes >> 10} KiB: one per "
            f"{CPUS_PER_FRONT_END} CPUs, at most {DEFAULT_FRONT_ENDS_MAX}, so that one interpreter "
            "is not the limit; --front-ends 0 for one process"
        )

    def tokens(self) -> list[bytes]:
        """The bearer tokens clients may send (none: no auth)."""
        return [t.strip().encode() for t in self.auth_token.split(",")] if self.auth_token else []

    def control(self) -> str:
        """explicit (load/unload allowed) or none."""
        return self.model_control or ("explicit" if self.repository else "none")

    def load_model_names(self) -> list[str] | None:
        """--load-model as a list of names (None: every repository model)."""
        if self.load_model is None:
            return None
        return [n.strip() for n in self.load_model.split(",") if n.strip()]

    def _check_device(self) -> None:
        # onnxruntime: not for `--help`
        from serving.engine import (
            CONV_ALGO_SEARCH,
            DEVICES,
        )

        if self.device not in DEVICES:
            raise ValueError(f"--device must be {', '.join(DEVICES)}, got {self.device!r}")
        if self.variant not in ("fp32", "fp16", "int8", "uint8", "auto"):
            raise ValueError(
                f"--variant must be fp32, fp16, int8, uint8 or auto, got {self.variant!r}"
            )
        if self.variant == "fp16" and self.device == "cpu":
            raise ValueError(
                "--variant fp16 is for the CUDA provider: onnxruntime's CPU provider runs fp16 nodes "
                "through casts to fp32 (slower than the fp32 model, not faster): "
                "serve --variant fp32 on the CPU, or use --device cuda"
            )
        if self.cudnn_conv_algo_search not in CONV_ALGO_SEARCH:
            raise ValueError(
                f"--cudnn-conv-algo-search must be {', '.join(CONV_ALGO_SEARCH)}, "
                f"got {self.cudnn_conv_algo_search!r}"
            )
        if self.gpu_mem_limit_mb is not None and not 0 < self.gpu_mem_limit_mb < float("inf"):
            raise ValueError(
                f"--gpu-mem-limit-mb must be a positive number of MiB, got {self.gpu_mem_limit_mb}"
            )
        # its ValueError names what --batch-buckets takes
        self.bucket_sizes()
        if self.batch_buckets not in ("auto", "off"):
            if self.device == "tensorrt":
                raise ValueError(
                    "--batch-buckets sizes do not apply to --device tensorrt (it builds an engine per "
                    "session, and its profile spans every batch size): drop them or use --device cuda"
                )
        if self.cuda_graphs and (self.device == "tensorrt" or self.batch_buckets == "off"):
            raise ValueError(
                "--cuda-graphs runs each batch bucket as a CUDA graph on the CUDA provider: not with "
                "--device tensorrt or --batch-buckets off"
            )
        if self.trt_cache_dir is not None and self.device != "tensorrt":
            raise ValueError("--trt-cache-dir only applies to --device tensorrt")
        if self.device == "cpu":
            defaults = {f.name: f.default for f in fields(self)}
            given = [
                f"--{key.replace('_', '-')}"
                for key in (
                    "cudnn_conv_algo_search",
                    "allow_tf32",
                    "gpu_mem_limit_mb",
                    "cuda_graphs",
                )
                if getattr(self, key) != defaults[key]
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply to a GPU: use --device cuda (or auto) or drop them"
                )

    def bucket_sizes(self):
        """The batch buckets asked for (a serving.engine.BatchBuckets): auto's powers of two for the
        CUDA provider only, none for off, the sizes given for any provider; --max-batch-size always
        the largest. ValueError for sizes that are not whole numbers from 1 to --max-batch-size."""
        from serving.engine import BatchBuckets

        if self.batch_buckets == "off":
            return BatchBuckets()
        if self.batch_buckets == "auto":
            sizes = [
                1 << i
                for i in range(self.max_batch_size.bit_length())
                if 1 << i < self.max_batch_size
            ]
        else:
            try:
                sizes = [int(size) for size in self.batch_buckets.split(",")]
            except ValueError:
                sizes = [0]
            if not all(0 < size <= self.max_batch_size for size in sizes):
                example = ",".join(
                    map(str, sorted({1, max(1, self.max_batch_size // 4), self.max_batch_size}))
                )
                raise ValueError(
                    f"--batch-buckets must be auto, off, or batch sizes from 1 to --max-batch-size "
                    f"({self.max_batch_size}) like {example}, got {self.batch_buckets!r}"
                )
        return BatchBuckets(
            tuple(sorted({*sizes, self.max_batch_size})), cuda_only=self.batch_buckets == "auto"
        )

    def gpu_options(self):
        """The CUDA / TensorRT provider options these settings ask for (a
        serving.engine.GpuOptions)."""
        from serving.engine import GpuOptions

        return GpuOptions(
            conv_algo_search=self.cudnn_conv_algo_search,
            tf32=self.allow_tf32,
            gpu_mem_limit_mb=self.gpu_mem_limit_mb,
            trt_cache_dir=self.trt_cache_dir,
            cuda_graphs=self.cuda_graphs,
        )

    def _check_payload_log(self) -> None:
        if self.payload_log is None:
            defaults = {f.name: f.default for f in fields(self)}
            given = [
                f"--{key.replace('_', '-')}"
                for key in (
                    "payload_log_sample",
                    "payload_log_max_mb",
                    "payload_log_file_mb",
                    "payload_log_mlflow",
                )
                if getattr(self, key) != defaults[key]
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply to a payload log: add --payload-log DIR"
                )
            return
        if not self.payload_log.strip():
            raise ValueError("--payload-log is empty; give a directory")
        if not 0.0 <= self.payload_log_sample <= 1.0:
            raise ValueError(
                f"--payload-log-sample is the fraction of requests logged, between 0 and 1; got "
                f"{self.payload_log_sample}"
            )
        for flag, value in {
            "--payload-log-max-mb": self.payload_log_max_mb,
            "--payload-log-file-mb": self.payload_log_file_mb,
        }.items():
            # a file must hold a record: 1 KiB at the least
            if not 1 / 1024 <= value < float("inf"):
                raise ValueError(f"{flag} is a number of MiB, at least 1/1024 (1 KiB); got {value}")
        if self.payload_log_file_mb > self.payload_log_max_mb:
            raise ValueError(
                f"--payload-log-file-mb ({self.payload_log_file_mb:g}) exceeds --payload-log-max-mb "
                f"({self.payload_log_max_mb:g}), the cap on all payload files together: one file "
                "could not fit; make the file size at most the cap"
            )

    @property
    def loopback(self) -> bool:
        """Bound to this machine only (127.0.0.0/8, ::1, localhost)."""
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def host_patterns(self) -> list[str]:
        """Host header patterns (fnmatch, port stripped) the server answers."""
        extra = [h.strip() for h in (self.allowed_hosts or "").split(",") if h.strip()]
        if not self.loopback:
            return ["*"] if not extra else extra
        return ["localhost", "127.*", "[::1]", "::1", self.host, *extra]

    def origins(self) -> set[str]:
        return {o.strip().rstrip("/") for o in (self.allowed_origins or "").split(",") if o.strip()}
