"""What the stages are built from; each stage imports what it needs, nothing is copied between them.

    amp.py                 precision choice, autocast, GradScaler
    build.py               data, model and task built from their components and checked on real samples
    checkpoint.py          sharded, atomic, self-describing DCP checkpoints
    checkpoint_uploads.py  checkpoints uploaded to MLflow in the background
    code_capture.py        the user's component code, logged with the run
    data.py                data sets -> loaders: sharding, exact resume, world-size changes
    gates.py               what an exported model must pass before it is registered
    monitor.py             the best checkpoint so far, and early stopping
    object_store.py        a run directory on an object store (train.output_dir=s3://...)
    onnx_export.py         PyTorch module -> ONNX graph
    optim.py               optimizer and learning-rate schedule
    plots.py               figures logged with a run
    promotion.py           champion vs challenger: whether the registry alias moves
    reference.py           'module:attribute' references, resolved and trusted
    run_dir.py             one owner per run directory
    safetensors_writer.py  a safetensors file written tensor by tensor
    checkpoint_store.py    checkpoints to and from the tracking server; --resume resolved
    rebuild.py             the PyTorch reference of a weights bundle, and the gate runner export and verify share
    weights.py             the weights bundle (model.safetensors + model.json): read, checked, the model rebuilt
(the tasks live in pipeline/tasks/: one module each and a registry)
    tracking.py            every MLflow call the stages make
"""
