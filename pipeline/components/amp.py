"""Mixed precision: which dtype, the autocast context, and the GradScaler (fp16 on CUDA only)."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls in hardware, where autocast can pay off."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cuda_has_native_bf16(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) or newer, or ROCm: bf16 tensor cores. Not
    `torch.cuda.is_bf16_supported()`, which by default also says yes on Volta and Turing (sm 7.x)
    because a bf16 tensor can be allocated there: bf16 is emulated, slowly, and cuDNN lacks bf16
    kernels for them; fp16 with loss scaling is what those GPUs run fast."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if cuda_has_native_bf16(device) else "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Enabled only for fp16, whose small range needs loss scaling; bf16 has fp32's range."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
