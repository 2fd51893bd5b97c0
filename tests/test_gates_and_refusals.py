"""Small, fast guards: gates that must not pass NaN, casts that must not hide overflow, resumes
that must not silently start over."""

import numpy as np
import pytest
import torch
from conftest import CPU1, checkpoint_meta, mlp_spec

from pipeline import checkpoint, consolidate
from pipeline.artifact import gates
from pipeline.checkpoint import CheckpointError
from pipeline.checkpoint import store as checkpoint_store
from pipeline.components.build import instantiate_model


def test_parity_fails_on_nan_outputs_even_where_argmax_agrees():
    ref_logits = np.zeros((4, 10), np.float32)
    # class 0 everywhere: argmax of a NaN row is 0 too
    ref_logits[:, 0] = 5.0
    logits = ref_logits.copy()
    logits[2] = np.nan
    probs = np.full((4, 10), 0.1, np.float32)
    result = gates.compare(
        {"logits": logits, "probabilities": probs},
        {"logits": ref_logits, "probabilities": probs},
        atol=1e-4,
        rtol=1e-3,
    )
    assert not result["passed"]
    assert "1 samples with NaN/Inf outputs" in result["message"]
    ok = gates.compare(
        {"logits": ref_logits, "probabilities": probs},
        {"logits": ref_logits, "probabilities": probs},
        atol=1e-4,
        rtol=1e-3,
    )
    assert ok["passed"], ok["message"]


def test_fp16_consolidation_refuses_values_that_overflow(tmp_path):
    spec = mlp_spec()
    model = instantiate_model(spec)
    with torch.no_grad():
        # fine in fp32 and bf16, Inf in fp16
        model.head.weight[0, 0] = 1e5
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = checkpoint.save(
        tmp_path / "run/checkpoints", 1, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=1
    )
    with pytest.raises(
        consolidate.ConsolidateError, match="head.weight.*Inf.*float16.*--dtype bf16"
    ):
        consolidate.main(ckpt, dtype="fp16", log_to_mlflow=False)
    assert not (tmp_path / "run/consolidated/model.safetensors").exists()
    consolidate.main(ckpt, dtype="bf16", log_to_mlflow=False)


def test_resume_latest_with_nothing_to_resume_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint under .*train.run_name"):
        checkpoint_store.resolve_resume("latest", tmp_path / "outputs/new-run/checkpoints", CPU1)
    assert (
        checkpoint_store.resolve_resume("auto", tmp_path / "outputs/new-run/checkpoints", CPU1)
        is None
    )


class Rows(torch.utils.data.Dataset):
    """(inputs, target) pairs from two tensors, for the gates' own checks."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_declared_dynamic_axis_the_model_cannot_vary_is_a_failed_gate():
    """A weight of fixed length 16 along the 'dynamic' axis: the exporter may still mark it dynamic,
    but no other length can run, so the gate must fail instead of there being no gate at all."""
    from pipeline.artifact.onnx_export import ExportHead
    from pipeline.tasks.regression import Regression

    class FixedLength(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return (x * self.w).sum(1)

    class AnyLength(torch.nn.Module):
        def forward(self, x):
            return x.mean(1)

    val = Rows(torch.rand(10, 16), torch.rand(10))
    for model, failed_gate in ((FixedLength(), True), (AnyLength(), False)):
        head = ExportHead(model, Regression(), ["input"], True)
        batches, failed = gates.parity_batches(val, {"input": [1]}, head)
        lengths = sorted(k for k in batches if k.startswith("input_1.len"))
        if failed_gate:
            assert lengths == [] and not failed["parity.input_1"]["passed"]
            assert (
                "declares input axis 1 dynamic (length 16 in the data), but the PyTorch model itself runs it at 0"
                in failed["parity.input_1"]["message"]
            )
        else:
            assert failed == {} and lengths == ["input_1.len25", "input_1.len8"]
            assert batches["input_1.len25"]["input"].shape == (7, 25)


def test_the_metric_gate_has_an_absolute_floor_for_a_metric_near_zero():
    from pipeline.tasks.custom import Custom

    task = Custom(lambda o, t: (o - t).abs().mean(), lambda o, t: {"mae": 0.0}, "min", "mae")
    assert task.metric_gate({"mae": 1e-7}, {"mae": 0.0}, tolerance=1e-3, atol=1e-6)["passed"]
    assert not task.metric_gate({"mae": 1e-7}, {"mae": 0.0}, tolerance=1e-3, atol=0.0)["passed"]
    assert not task.metric_gate({"mae": 2.0}, {"mae": 1.0}, tolerance=1e-3, atol=1e-6)["passed"]


def test_the_baseline_gate_can_be_passed_on_imbalanced_classes_and_knows_no_baseline_for_constant_targets():
    """98% of one class: 'majority + 5 points' would ask for 103%; half the headroom left is asked
    instead, and a perfect model passes. Targets that never vary: nothing beats their mean, so there
    is no baseline (rather than a square root of a rounding error's negative)."""
    from types import SimpleNamespace

    from pipeline.artifact import baseline
    from pipeline.tasks.classification import Classification
    from pipeline.tasks.regression import Regression

    cfg = SimpleNamespace(baseline_margin=0.05, allow_below_baseline=False)
    task = Classification(["common", "rare"], top_k=1)
    state = task.new_state(torch.device("cpu"))
    # perfect
    state["confusion"] += torch.tensor([[98.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    state["n"] += 100
    found = baseline.gate(task, state, cfg, torch.nn.Identity(), None)
    assert (
        found["passed"]
        and found["baseline"] == pytest.approx(0.98)
        and found["needed"] == pytest.approx(0.99)
    )

    regression = Regression(columns=1)
    state = regression.new_state(torch.device("cpu"))
    regression.update(state, {"prediction": torch.full((100, 1), 0.7)}, torch.full((100, 1), 0.7))
    assert regression.baseline(state) is None
