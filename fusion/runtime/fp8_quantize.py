"""QuantizeFP8Block on the GPU: the FP8-block quantize kernel (fusion/kernels/fp8_quantize.py) in place of the reference.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS, variant "quantize:fp8_block"): `takes(op,
x)` says whether the kernel runs it, `run(op, x, ctx)` returns the QuantizedTensor the reference
(fusion/ops/quantize.py -> fusion.quant.quantize) would, bit for bit: the kernel writes the rowwise and the
per-group columnwise buffers in one pass (tests/test_fp8_quantize_gpu.py checks them byte for byte), and the
tensor's amax (fusion.quant.finite_amax, as the reference's) in the same pass. No host sync: the group sizes
stay on the device.
"""
from __future__ import annotations

import torch

from fusion.op_table import device_method_refusal
from fusion.quant import QuantizedTensor
from fusion.run_context import RunContext

def takes(op, x) -> bool:
    """A plain CUDA 2-D tensor within the limits the plan states (fusion.op_table.DEVICE_METHOD_LIMITS: dtype,
    width); layout and the group count are run()'s to settle (it makes x contiguous, and takes the reference
    past the kernel's 1024 groups)."""
    return (type(x) is torch.Tensor and x.is_cuda and x.dim() == 2 and device_method_refusal(
        "quantize", "fp8_block", str(x.dtype).removeprefix("torch."), (x.shape[1],)) is None)


def run(op, x: torch.Tensor, ctx: RunContext) -> QuantizedTensor:
    from fusion.kernels.fp8_quantize_api import try_quantize_fp8_block_device

    x = x if x.is_contiguous() else x.contiguous()
    groups = getattr(ctx, "group_sizes", None) if op.columnwise else None  # as the reference reads them
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    buffers = try_quantize_fp8_block_device(x, op.columnwise, groups, amax_bits)
    if buffers is None:  # e.g. more groups than the kernel takes
        return op.reference(x, ctx)
    data, scale, cw_data, cw_scale = buffers
    return QuantizedTensor("fp8_block", data, scale, amax_bits.view(torch.float32), x.shape, x.dtype,
                           columnwise_data=cw_data, columnwise_scale=cw_scale, group_sizes=groups)
