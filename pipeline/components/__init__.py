"""What the stages are built from; each stage imports what it needs, nothing is copied between them.

    amp.py                 precision choice, autocast, GradScaler
    checkpoint.py          sharded, atomic, self-describing DCP checkpoints
    checkpoint_uploads.py  checkpoints uploaded to MLflow in the background
    data.py                data sets -> loaders: sharding, exact resume, world-size changes
    gates.py               what an exported model must pass before it is registered
    onnx_export.py         PyTorch module -> ONNX graph
    optim.py               optimizer and learning-rate schedule
    plots.py               figures logged with a run
    safetensors_writer.py  a safetensors file written tensor by tensor
    tracking.py            every MLflow call the stages make
"""
