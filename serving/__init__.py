"""trainserve's inference server: ONNX models on onnxruntime behind HTTP and gRPC (KServe V2).

The core (one inference path for every front end):
    core.py     the Server: the models served, `answer(slot, request, exchange)` (receipt, infer,
                its observers told: payload log, shadow mirror, warm-up), start-up and shutdown
    envelope.py what every front end puts around a request, written once: auth, refusal -> status,
                receipt, metrics
    repository.py  the models and versions served: sources, version policy, load/unload, alias
                   following
    loader.py   where a model comes from (a file, the MLflow registry: lazy import) and its name
    batcher.py  dynamic batching: the queue, when a batch runs; knows neither HTTP nor onnxruntime
    placements.py  the batch buffers' rows: a request's place, a run's span, the pool's one owner
    runner.py   the engine thread: takes each batch when it is free to run it, the models' batchers
                in turn
    engine.py   the onnxruntime sessions (a batch bucket each): providers, threads, warm-up; no HTTP
    staging.py  the batch buffers (pinned on CUDA) and the NaN/Inf check where bytes are copied
                anyway
    codec.py    request bodies -> arrays and arrays -> response bodies (KServe V2, MLflow); pure
    image_inputs.py  encoded image files in (a BYTES input, a POSTed file), decoded as training
                     decoded its own
    images.py   an image model's preprocessing as data, and the one function that applies it
                (training's too)
    shm.py      the V2 system and CUDA shared-memory extensions (clients' regions, by token)
The front ends (each a thin adapter: its protocol in, the core's answer out):
    http/       HTTP/1.1 on uvloop + llhttp: a route table of plain handlers, bodies received in
                place
    grpc/       KServe V2 over gRPC: schema.py (messages), codec.py (messages <-> arrays),
                service.py (handlers), native.py + native.cc (grpc's C++ server, the default where
                built), or grpc.aio
And around them:
    metrics.py  Prometheus metrics of one server
    payload_log.py  the opt-in sampled log of requests and answers (JSONL, rotated, capped)
    shadow.py   the challenger judged on live traffic: the mirror (an observer of answers), pairs,
                labels, the verdict
    drift.py    the drift reference format (written at export), PSI, the sliding window per version
                (observed per batch: each batcher's `observe` hook)
    input_range.py  a warning for requests far outside the training data's range (from the drift
                reference)
    cuda.py     the CUDA runtime calls the server makes itself (pinning, IPC handles), through
                ctypes
    config.py   Settings, the typed knobs; cli.py: flags and environment -> Settings -> a running
                server
    cpus.py     how many CPUs this process may use (affinity, the cgroups' CPU quota): the
                server's threads and processes, and training's threads per rank

Entry points: `python -m serving ...`, and `serving.cli.main(argv)` for `pipeline serve`.
This package imports neither torch nor `pipeline`: a server needs the ONNX file, not the trainer.
"""

__version__ = "0.1.0"
