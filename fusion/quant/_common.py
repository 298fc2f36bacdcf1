"""Shared helpers: input validation, flattening to 2-D, finite amax."""

from __future__ import annotations

import torch

from .errors import QuantizationError

#: float64 is accepted for reference computations (gradcheck, float64 baselines): it is rounded to float32
#: first, and the QuantizedTensor dequantizes back to float64 (every quantized value is exact there).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_input(x: torch.Tensor, op_name: str, fmt_name: str, block: int, whole_blocks: bool = True):
    """Validate ``x`` and return ``(M, K)``, the 2-D view's sizes (leading dims flattened).

    ``whole_blocks``: the last dim must be a multiple of ``block`` (MXFP8, NVFP4); FP8-block rows may end
    with a partial block. The row count is free: columnwise blocks run per group and may end partial.
    """
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"{op_name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise QuantizationError(
            f"{op_name}: input dtype {x.dtype} is not supported; {fmt_name} quantizes float32, "
            f"bfloat16, float16 (or float64, rounded to float32 first) tensors (cast the input first)")
    if x.dim() == 0:
        raise QuantizationError(
            f"{op_name}: cannot quantize a 0-dim tensor; {fmt_name} quantizes the rows of the last dim "
            f"(reshape it to (1, n))")
    K = x.shape[-1]
    M = 1
    for s in x.shape[:-1]:
        M *= s
    if whole_blocks and K % block:
        raise QuantizationError(
            f"{op_name}: last dim {K} is not divisible by the {fmt_name} block size {block}; pad the "
            f"features to a multiple of {block} or drop the quantize op")
    return M, K


def check_group_sizes(group_sizes, x: torch.Tensor, op_name: str):
    """Validate ``group_sizes`` (shape, dtype, device) without reading its values: no host sync.

    The values must be non-negative and sum to the row count of the 2-D view; that is the caller's
    contract (``Sequential`` checks it), since checking here would copy the sizes to the host.
    """
    if group_sizes is None:
        return None
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dim() != 1 or \
            group_sizes.dtype not in (torch.int32, torch.int64):
        what = (f"shape {tuple(group_sizes.shape)} dtype {group_sizes.dtype}"
                if isinstance(group_sizes, torch.Tensor) else type(group_sizes).__name__)
        raise QuantizationError(
            f"{op_name}: group_sizes must be a 1-D int32/int64 tensor (one row count per group), got {what}")
    if group_sizes.device != x.device:
        raise QuantizationError(
            f"{op_name}: group_sizes is on {group_sizes.device} but the input is on {x.device}; keep the "
            f"counts on the input's device (no host copy is needed)")
    return group_sizes


def to_2d_float32(x: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """``x`` as a contiguous float32 (M, K) tensor (exact for bf16/fp16; float64 is rounded)."""
    return x.detach().reshape(M, K).to(torch.float32).contiguous()


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Max of ``|x|`` over the finite elements, as a float32 0-dim tensor (0 if there are none)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # in the input's own dtype (|x| and the max are exact there, and every bf16/fp16 value is a float32); float64
    # is rounded to float32 first, so a value past float32's range counts as the Inf it becomes
    x = x if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else x.to(torch.float32)
    return torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).amax().to(torch.float32)
