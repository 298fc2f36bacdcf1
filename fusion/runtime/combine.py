"""The MoE combine on the GPU: the aggregation kernel (fusion/kernels/combine.py) in place of the reference.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS): `takes(op, tensor)` says whether
the kernel runs it, `run(op, tensor, ctx)` computes.

Used by the fused runtime (backend "cute", CUDA tensors) for a block's Combine forward and its Gather's
backward, which are the same sum: each token's routed rows added in increasing row order, in float32, rounded
once. The reference (fusion/ops/routing.py: a gather, a float32 copy and torch.segment_reduce) adds in the same
order, so the two agree bit for bit; the kernel reads each routed row once instead of three times.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fusion.ops.routing import call_layout, combine_rows
from fusion.run_context import RunContext

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def takes(op, y: torch.Tensor) -> bool:
    """Whether the kernel runs these rows: a CUDA tensor of a kernel dtype whose rows are whole 16-byte chunks."""
    return (y.is_cuda and y.dtype in _KERNEL_DTYPES and y.dim() == 2 and (y.shape[1] * y.element_size()) % 16 == 0)


def run(op, y: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """Row t = the sum of y's rows routed from token t (ctx.index), padding rows skipped: (M, d) -> (T, d)."""
    rows, offsets = call_layout(ctx)
    if not takes(op, y):
        return combine_rows(y, ctx.index, ctx.tokens, (rows, offsets))
    from fusion.kernels.combine import compile_combine

    y = y if y.is_contiguous() else y.contiguous()
    M, d = y.shape
    out = torch.empty(ctx.tokens, d, dtype=y.dtype, device=y.device)
    if ctx.tokens:
        kernel = compile_combine(str(y.dtype).removeprefix("torch."), d)
        kernel.launch(y.data_ptr(), rows.data_ptr(), offsets.data_ptr(), out.data_ptr(), M, ctx.tokens,
                      torch._C._cuda_getCurrentRawStream(y.device.index))
    return out


class CombineLaunch(NamedTuple):
    """The Combine's launch as a call made it, for the forward's replay (fusion/runtime/replay.py): the compiled
    kernel's launch function (`launch(y_ptr, rows_ptr, offsets_ptr, out_ptr, M, T, stream)`), the value it reads
    (M routed rows of `width` columns) and the value it writes (T token rows)."""

    launch: object
    input: str
    output: str
    width: int
    M: int
    T: int


def replay_launch(op, y: torch.Tensor, ctx: RunContext, input: str, output: str) -> CombineLaunch | None:
    """What :func:`run` launched for rows `y` (the kernel, compiled once per dtype and width), or None where it
    launched nothing (no tokens)."""
    if type(y) is not torch.Tensor or not takes(op, y) or not ctx.tokens:
        return None
    from fusion.kernels.combine import compile_combine

    M, d = y.shape
    kernel = compile_combine(str(y.dtype).removeprefix("torch."), d)
    return CombineLaunch(kernel.launch, input, output, d, M, ctx.tokens)
