"""Small, fast guards: gates that must not pass NaN, casts that must not hide overflow, resumes
that must not silently start over."""

import numpy as np
import pytest
import torch

from pipeline import consolidate
from pipeline.components import checkpoint, gates
from pipeline.components.build import instantiate_model
from pipeline.components.checkpoint import CheckpointError

from conftest import CPU1, checkpoint_meta, mlp_spec


def test_parity_fails_on_nan_outputs_even_where_argmax_agrees():
    ref_logits = np.zeros((4, 10), np.float32)
    ref_logits[:, 0] = 5.0  # class 0 everywhere: argmax of a NaN row is 0 too
    logits = ref_logits.copy()
    logits[2] = np.nan
    probs = np.full((4, 10), 0.1, np.float32)
    result = gates.compare({"logits": logits, "probabilities": probs},
                           {"logits": ref_logits, "probabilities": probs}, atol=1e-4, rtol=1e-3)
    assert not result["passed"]
    assert "1 samples with NaN/Inf outputs" in result["message"]
    ok = gates.compare({"logits": ref_logits, "probabilities": probs},
                       {"logits": ref_logits, "probabilities": probs}, atol=1e-4, rtol=1e-3)
    assert ok["passed"], ok["message"]


def test_fp16_consolidation_refuses_values_that_overflow(tmp_path):
    spec = mlp_spec()
    model = instantiate_model(spec)
    with torch.no_grad():
        model.head.weight[0, 0] = 1e5  # fine in fp32 and bf16, Inf in fp16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = checkpoint.save(tmp_path / "run/checkpoints", 1, model, opt, checkpoint_meta(model, spec), CPU1,
                           keep_last=1)
    with pytest.raises(consolidate.ConsolidateError, match="head.weight.*Inf.*float16.*--dtype bf16"):
        consolidate.main(ckpt, dtype="fp16", log_to_mlflow=False)
    assert not (tmp_path / "run/consolidated/model.safetensors").exists()
    consolidate.main(ckpt, dtype="bf16", log_to_mlflow=False)


def test_resume_latest_with_nothing_to_resume_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint under .*train.run_name"):
        checkpoint.resolve_resume("latest", tmp_path / "outputs/new-run/checkpoints", CPU1)
    assert checkpoint.resolve_resume("auto", tmp_path / "outputs/new-run/checkpoints", CPU1) is None
