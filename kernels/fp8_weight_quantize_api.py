"""Host side of the FP8-block weight quantize kernel (kernels/fp8_weight_quantize.py): checks, buffers, the launch.

:func:`try_quantize_weight_fp8_block_device` returns the four buffers of ``fusion.quant.quantize_weight_fp8_block``
(``data``, ``scale``, ``data_t``, ``scale_t``), bit for bit, from one launch on torch's current stream; or None where
the kernel does not take the weight (the caller then runs the reference): a contiguous 16-byte-aligned CUDA tensor
of bfloat16 or float16, ``(G, N, K)`` or ``(N, K)``, with ``N % 8 == 0``, ``K % 16 == 0`` and at most 65535 groups.
"""
from __future__ import annotations

import torch

__all__ = ["weight_unsupported_reason", "try_quantize_weight_fp8_block_device"]

BLOCK = 128
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def weight_unsupported_reason(weight) -> str | None:
    """Why the kernel would not take `weight` (a message), or None. Reads shapes, dtypes and devices only (and
    imports cutlass only for a CUDA weight)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        return "expected a (G, N, K) or (N, K) tensor"
    if weight.dtype not in _DTYPES:
        return f"weight dtype {weight.dtype}; the kernel reads bfloat16 or float16"
    if not weight.is_cuda:
        return f"the weight is on {weight.device}; the kernel runs on CUDA tensors"
    from .fp8_weight_quantize import COLS, MAX_GROUPS, ROWS

    N, K = weight.shape[-2:]
    if N % ROWS or K % COLS or N == 0 or K == 0:
        return f"a ({N}, {K}) weight; the kernel takes N % {ROWS} == 0 and K % {COLS} == 0"
    if weight.dim() == 3 and not 1 <= weight.shape[0] <= MAX_GROUPS:
        return f"{weight.shape[0]} groups; the kernel takes 1..{MAX_GROUPS}"
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return "the weight is not contiguous and 16-byte aligned"
    return None


def try_quantize_weight_fp8_block_device(weight: torch.Tensor, out=None):
    """``(data, scale, data_t, scale_t)`` of `weight` from the kernel (see the module docstring), or None. `out`:
    four buffers of those shapes and dtypes on the weight's device, contiguous, to write (and return) instead of
    new ones; buffers that do not fit are not used (new ones are)."""
    if weight_unsupported_reason(weight) is not None:
        return None
    from .fp8_weight_quantize import compile_fp8_weight_quantize

    w = weight.detach()
    lead = w.shape[:-2]
    G = w.shape[0] if w.dim() == 3 else 1
    N, K = w.shape[-2:]
    nnb, nkb = -(-N // BLOCK), -(-K // BLOCK)
    dev = w.device
    shapes = (((*lead, N, K), torch.uint8), ((*lead, nnb, nkb), torch.float32), ((*lead, K, N), torch.uint8),
              ((*lead, nkb, nnb), torch.float32))
    if out is None or len(out) != 4 or not all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype and t.device == dev
            and t.is_contiguous() for t, (shape, dtype) in zip(out, shapes)):
        out = tuple(torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in shapes)
    data, scale, data_t, scale_t = out
    kernel = compile_fp8_weight_quantize(_DTYPES[w.dtype], N, K)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    kernel.launch(w.data_ptr(), data.data_ptr(), scale.data_ptr(), data_t.data_ptr(), scale_t.data_ptr(), G,
                  torch._C._cuda_getCurrentRawStream(index))
    return data, scale, data_t, scale_t
