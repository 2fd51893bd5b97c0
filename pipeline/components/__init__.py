"""What builds a run from the user's components; each stage imports what it needs, nothing is copied
between them.

    amp.py                 precision choice, autocast, GradScaler
    build.py               data, model and task built from their components and checked on real
                           samples
    code_capture.py        the user's component code, logged with the run
    data.py                data sets -> loaders: sharding, exact resume, world-size changes
    monitor.py             the best checkpoint so far, and early stopping
    optim.py               optimizer and learning-rate schedule
    reference.py           'module:attribute' references, resolved and trusted

The other rooms: pipeline/checkpoint/ (the checkpoint: layout, formats, saving, stores),
pipeline/artifact/ (the exported artifact: ONNX, variants, gates, promotion, the weights bundle),
pipeline/tasks/ (one module a task, and a registry), pipeline/tracking.py (every MLflow call the
stages make), serving/lineage.py (the lineage contract).
"""
