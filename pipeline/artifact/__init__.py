"""The exported artifact: what consolidation writes and export turns into a registered, gated model.

weights.py             the weights bundle (model.safetensors + model.json): read, checked, the model
                       rebuilt
safetensors_writer.py  a safetensors file written tensor by tensor
rebuild.py             the PyTorch reference of a weights bundle, and the gate runner export and
                       verify share
onnx_export.py         PyTorch module -> ONNX graph
gates.py               what an exported model must pass before it is registered
baseline.py            the baseline gate: clearly better than the task's trivial predictor
length_limits.py       the longest token inputs a graph was exported for
int8.py                the int8 variant (quantized, gated, measured)
uint8_inputs.py        the UINT8-pixel variant
promotion.py           champion vs challenger: whether the registry alias moves
plots.py               figures logged with a run
"""
