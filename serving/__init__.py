"""trainserve's inference server: ONNX models on onnxruntime behind HTTP and gRPC (KServe V2).

    loader.py   where a model comes from (a file, the MLflow registry: lazy import) and its name
    repository.py  the models and versions served: sources, version policy, load/unload, alias following
    engine.py   the onnxruntime session: providers, threads, warm-up, `run(feeds)`; no HTTP
    batcher.py  dynamic batching of concurrent requests; knows neither HTTP nor onnxruntime
    codec.py    request bodies -> arrays and arrays -> response bodies (KServe V2, MLflow); pure
    metrics.py  Prometheus metrics of one server
    payload_log.py  the opt-in sampled log of requests and answers (JSONL, rotated, capped)
    core.py     the protocol-neutral core: the Server and its one inference path (version, receipt, decode,
                infer, payload log, shadow mirror), drift windows; every front end calls it
    app.py      the HTTP front end: Starlette routes, auth, limits, the repository API, shadow and feedback
    grpc/       KServe V2 over gRPC: schema.py (messages), codec.py (messages <-> arrays), service.py (front end)
    shadow.py   the challenger judged on live traffic: pairs, labels, the verdict
    drift.py    the drift reference format (written at export), PSI, the sliding window per version
    config.py   Settings, the typed knobs; cli.py: flags and environment -> Settings -> uvicorn

Entry points: `python -m serving ...`, and `serving.cli.main(argv)` for `pipeline serve`.
This package imports neither torch nor `pipeline`: a server needs the ONNX file, not the trainer.
"""

__version__ = "0.1.0"
