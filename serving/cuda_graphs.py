"""Batch buckets run as CUDA graphs (--cuda-graphs): each bucket's session captures its whole run
once and replays it, one launch instead of one per kernel (ResNet-50 has ~160; at batch 1 their
launches are a large part of its ~2.6 ms on an H100).

onnxruntime's CUDA provider captures a graph (`enable_cuda_graph`) only for a session whose inputs
and outputs stay at the same device addresses run after run and whose every node runs on the CUDA
provider: so each bucket has a session of its own, made with that option, and device memory of its
own for its inputs and outputs, bound once (IOBinding). A run copies the batch from its (pinned)
batch buffer into the bucket's device inputs, replays, and copies the outputs back. Batch buckets
give each session one shape already (serving/engine.py), which is what a graph needs; Triton has no
CUDA graphs for onnxruntime models (onnxruntime_backend #168).

Gated when the model loads: every bucket's graph runs a probe batch and must answer what the plain
session answers, within GRAPH_RTOL/GRAPH_ATOL, or the model is refused with the numbers; a graph
onnxruntime cannot capture (a node on the CPU, an output shape it cannot know) is refused with
onnxruntime's reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

# onnxruntime is imported where it is used: the front-end processes import this module's
# names (serving/front_end_process.py) and never run a model.
if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger("serving.cuda_graphs")
# a replay runs the captured kernels: it should match the plain run to rounding
GRAPH_RTOL, GRAPH_ATOL = (
    1e-4,
    1e-5,
)


class GraphError(Exception):
    """A bucket's session cannot run as a CUDA graph, or its graph answers differently from the
    plain run."""


class BucketGraph:
    """One bucket size's session, its device inputs and outputs bound at fixed addresses."""

    def __init__(self, session: ort.InferenceSession, inputs, outputs, size: int, device_id: int):
        import onnxruntime as ort

        self.session, self.size = session, size
        self.binding = session.io_binding()
        self.inputs: dict[str, ort.OrtValue] = {}
        self.outputs: dict[str, ort.OrtValue] = {}
        for spec in inputs:
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                (size, *spec.shape[1:]), spec.dtype, "cuda", device_id
            )
            self.binding.bind_ortvalue_input(spec.name, value)
            self.inputs[spec.name] = value
        for spec in outputs:
            if -1 in spec.shape[1:]:
                raise GraphError(
                    f"output '{spec.name}' {list(spec.shape)} has a dynamic axis besides the batch axis: "
                    "its device memory can't be set aside before the run"
                )
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                (size, *spec.shape[1:]), spec.dtype, "cuda", device_id
            )
            self.binding.bind_ortvalue_output(spec.name, value)
            self.outputs[spec.name] = value

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch (exactly `size` rows, contiguous: a batch buffer's rows) through the graph."""
        for name, value in self.inputs.items():
            # host -> device, into the address the graph was captured with
            value.update_inplace(feeds[name])
        self.session.run_with_iobinding(self.binding)
        return {name: value.numpy() for name, value in self.outputs.items()}


def open_graphs(
    path: str,
    options: ort.SessionOptions,
    cuda_options: dict[str, str],
    sizes: tuple[int, ...],
    inputs,
    outputs,
    device_id: int,
    plain: ort.InferenceSession,
    open_session,
) -> dict[int, BucketGraph]:
    """A captured graph per bucket size, each checked against `plain` (the model's session without
    graphs) on a probe batch. GraphError says which bucket and why."""
    providers = [("CUDAExecutionProvider", {**cuda_options, "enable_cuda_graph": "1"})]
    names = [spec.name for spec in outputs]
    graphs: dict[int, BucketGraph] = {}
    for size in sizes:
        probe = _probe(inputs, size)
        try:
            session = open_session(path, options, providers)
            graph = BucketGraph(session, inputs, outputs, size, device_id)
            # the first run captures
            graph.run(probe)
            # this one replays
            got = graph.run(probe)
        except GraphError:
            raise
        except Exception as exc:
            # onnxruntime's own reasons (a node outside the CUDA provider, ...)
            raise GraphError(
                f"batch bucket {size}: onnxruntime could not run it as a CUDA graph: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
            ) from exc
        want = dict(zip(names, plain.run(names, probe)))
        for name in names:
            if not np.allclose(
                got[name], want[name], rtol=GRAPH_RTOL, atol=GRAPH_ATOL, equal_nan=True
            ):
                worst = float(
                    np.max(np.abs(got[name].astype(np.float64) - want[name].astype(np.float64)))
                )
                raise GraphError(
                    f"batch bucket {size}: the CUDA graph's '{name}' differs from the plain run's by up to "
                    f"{worst:.3g} (allowed: rtol {GRAPH_RTOL}, atol {GRAPH_ATOL})"
                )
        graphs[size] = graph
    log.info(
        "CUDA graphs captured for batch buckets %s, each answering as the plain run",
        ",".join(map(str, sizes)),
    )
    return graphs


def _probe(inputs, size: int) -> dict[str, np.ndarray]:
    """A batch the model certainly takes: values in [0, 1) for floating-point inputs, zeros for the
    others."""
    rng = np.random.default_rng(0)
    return {
        spec.name: (
            rng.random((size, *spec.shape[1:])).astype(spec.dtype)
            if spec.dtype.kind == "f"
            else np.zeros((size, *spec.shape[1:]), spec.dtype)
        )
        for spec in inputs
    }
