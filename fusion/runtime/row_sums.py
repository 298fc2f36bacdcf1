"""A row scale's gradient from the fused dgrad's float32 partial row sums (kernels.epilogue.RowSumOutput).

The fused dgrad's epilogue writes, per row, one float32 partial sum of the scale's gradient terms per 128 columns
(a tile adds its own columns only). The gradient is each row's partials added in a fixed order and rounded once to
the scale's dtype: on the GPU (backend "cute") one launch of kernels/row_sum.py, left to right; anywhere else
(backend "emulate", CPU, float64 partials) torch's sum over the row and a cast, whose own fixed order may differ from
the kernel's in a float32 rounding (the value is the same sum). In torch these are two launches, 35-40 us of host
time each on the lent H200 machine: most of the fused dgrad step's host time before (bench/probes/dgrad_host_lines.py).
"""
from __future__ import annotations

import torch

_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

#: Read per call: False keeps torch's sum on the GPU too (the A/B switch of bench/ab_switch.py; the kernel's host time
#: against torch's two launches).
KERNEL = True


def device_takes(partials: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel adds these partials up: float32, 2-D, contiguous, on a CUDA device, into a kernel dtype."""
    return (partials.is_cuda and partials.dtype == torch.float32 and partials.dim() == 2
            and partials.is_contiguous() and dtype in _OUT_DTYPES)


def row_sums(partials: torch.Tensor, dtype: torch.dtype, device_kernel: bool = True) -> torch.Tensor:
    """(M, P) partials -> (M,) in `dtype`: each row's partials added in a fixed order, rounded once. `device_kernel`
    False (backend "emulate") keeps torch's sum."""
    if not (KERNEL and device_kernel and device_takes(partials, dtype)):
        return partials.sum(-1).to(dtype)
    from fusion.kernels.row_sum import compile_row_sum

    M, parts = partials.shape
    out = torch.empty(M, dtype=dtype, device=partials.device)
    if M:
        kernel = compile_row_sum(parts, _OUT_DTYPES[dtype])
        kernel.launch(partials.data_ptr(), out.data_ptr(), M, torch._C._cuda_getCurrentRawStream(partials.device.index))
    return out


def kernel_launch(parts: int, partials_dtype: torch.dtype, dtype: torch.dtype):
    """The kernel's launch function (`launch(partials_ptr, out_ptr, M, stream)`) that :func:`row_sums` calls for
    (M, parts) partials of `partials_dtype` into `dtype`, or None where torch's sum runs instead: what the
    backward's replay repeats (fusion/runtime/backward_replay.py)."""
    if not KERNEL or partials_dtype != torch.float32 or dtype not in _OUT_DTYPES:
        return None
    from fusion.kernels.row_sum import compile_row_sum

    return compile_row_sum(parts, _OUT_DTYPES[dtype]).launch
