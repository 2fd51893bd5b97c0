"""The two heads' loss and metrics: they receive the model's dict and the data's dict as they
are."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def joint_loss(outputs: dict, target: dict, alcohol_weight: float = 1.0) -> torch.Tensor:
    return F.cross_entropy(
        outputs["cultivar_logits"], target["cultivar"]
    ) + alcohol_weight * F.mse_loss(outputs["alcohol"].float(), target["alcohol"].float())


def both(outputs: dict, target: dict) -> dict[str, float]:
    """Accuracy of the cultivar (first: the primary, gated and monitored by default) and RMSE of
    alcohol."""
    accuracy = (outputs["cultivar_logits"].argmax(1) == target["cultivar"]).float().mean().item()
    rmse = (outputs["alcohol"].float() - target["alcohol"].float()).pow(2).mean().sqrt().item()
    return {"cultivar_accuracy": accuracy, "alcohol_rmse": rmse}
