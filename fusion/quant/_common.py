"""Shared helpers: input validation, flattening to 2-D, finite amax."""

from __future__ import annotations

import torch

from .errors import QuantizationError

#: float64 is accepted for reference computations (gradcheck, float64 baselines): it is rounded to float32
#: first, and the QuantizedTensor dequantizes back to float64 (every quantized value is exact there).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_input(x: torch.Tensor, op_name: str, fmt_name: str, block: int, columnwise: bool):
    """Validate ``x`` and return ``(M, K)``, the 2-D view's sizes (leading dims flattened)."""
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"{op_name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise QuantizationError(
            f"{op_name}: input dtype {x.dtype} is not supported; {fmt_name} quantizes float32, "
            f"bfloat16, float16 (or float64, rounded to float32 first) tensors (cast the input first)")
    if x.dim() == 0:
        raise QuantizationError(
            f"{op_name}: cannot quantize a 0-dim tensor; {fmt_name} needs at least one dim whose "
            f"size is a multiple of the block size {block}")
    K = x.shape[-1]
    M = 1
    for s in x.shape[:-1]:
        M *= s
    if K % block:
        raise QuantizationError(
            f"{op_name}: last dim {K} is not divisible by the {fmt_name} block size {block}; pad the "
            f"features to a multiple of {block} or drop the quantize op")
    if columnwise and M % block:
        lead = f" (the product of the leading dims of shape {tuple(x.shape)})" if x.dim() != 2 else ""
        raise QuantizationError(
            f"{op_name}: row count {M}{lead} is not divisible by the {fmt_name} block size {block} "
            f"needed for the columnwise (transposed) copy; pad the rows to a multiple of {block} or "
            f"quantize with columnwise=False")
    return M, K


def to_2d_float32(x: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """``x`` as a contiguous float32 (M, K) tensor (exact for bf16/fp16; float64 is rounded)."""
    return x.detach().reshape(M, K).to(torch.float32).contiguous()


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Max of ``|x|`` over the finite elements, as a float32 0-dim tensor (0 if there are none)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x32 = x.to(torch.float32)
    mag = torch.where(torch.isfinite(x32), x32.abs(), torch.zeros_like(x32))
    return mag.amax()
