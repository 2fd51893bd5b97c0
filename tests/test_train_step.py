"""train_step's gradient math in one process: what the fp16 path does on CUDA (GradScaler), proven
on CPU with the CPU GradScaler, and clipping of the true (unscaled) gradients."""

import copy

import torch
import torch.nn.functional as F
from conftest import CPU1, mlp_spec

from pipeline.components import amp
from pipeline.components.build import instantiate_model
from pipeline.train import Learner, train_step

SPEC = mlp_spec(hidden=[32])


def one_step(scaler, clip: float, micro_batches):
    torch.manual_seed(0)
    model = instantiate_model(SPEC)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, norm = train_step(
        Learner(
            model=model,
            optimizer=opt,
            scaler=scaler,
            device=CPU1.device,
            precision="fp32",
            loss_fn=F.cross_entropy,
            clip_grad_norm=clip,
        ),
        micro_batches,
        want_norm=True,
    )
    return model, loss, norm


def batches(n=2, size=16):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.rand(size, 1, 8, 8, generator=g), torch.randint(0, 10, (size,), generator=g))
        for _ in range(n)
    ]


def test_loss_scaling_changes_nothing_but_the_scale():
    data = batches()
    plain, loss_a, norm_a = one_step(
        amp.grad_scaler("fp32", CPU1.device), clip=0.0, micro_batches=data
    )
    scaled, loss_b, norm_b = one_step(
        torch.amp.GradScaler("cpu", init_scale=2.0**12), clip=0.0, micro_batches=copy.deepcopy(data)
    )
    assert loss_a == loss_b
    # the reported norm is of unscaled gradients
    assert abs(norm_a - norm_b) < 1e-4 * norm_a
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_clipping_bounds_the_true_gradient_norm_under_loss_scaling():
    data = batches()
    torch.manual_seed(0)
    start = instantiate_model(SPEC)
    _, _, norm = one_step(
        torch.amp.GradScaler("cpu", init_scale=2.0**12), clip=0.0, micro_batches=data
    )
    clip = norm / 4
    clipped, _, reported = one_step(
        torch.amp.GradScaler("cpu", init_scale=2.0**12),
        clip=clip,
        micro_batches=copy.deepcopy(data),
    )
    # clip_grad_norm_ returns the norm before clipping
    assert abs(reported - norm) < 1e-4 * norm
    # SGD without momentum state on step 1: the update is lr x the clipped gradient.
    update = torch.cat(
        [(p0 - p1).flatten() for p0, p1 in zip(start.parameters(), clipped.parameters())]
    )
    assert abs(update.norm().item() / 0.5 - clip) < 1e-3 * clip
