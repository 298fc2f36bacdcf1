"""The MoE gather on the GPU: the gather kernel (fusion/kernels/gather_rows.py) in place of the reference, and
the int32 index the gathering GEMM kernels read.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS): `takes(op, tensor)` says whether the
kernel runs it, `run(op, tensor, ctx)` computes. Used by the fused runtime (backend "cute", CUDA tensors) for an
MoE block's Combine backward (each routed row takes its token's gradient) and its Gather forward where that runs
alone (recomputed before FC1's weight gradient where that kernel does not read x through the index itself:
fusion/runtime/wgrad_gemm.py `gathers`; the gathering FC1 kernel keeps no gathered copy). Both are the
same copy: routed row r = token row index[r], a padding row (index -1) zeros, exactly the reference's values
(fusion/ops/routing.py `_gather`, which appends a zero row to a copy of the tokens and index_selects from it:
one more pass over the tokens and five small ops, twice per training step).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fusion.ops.routing import gather_rows
from fusion.run_context import RunContext
# the same rows as the combine kernel's: a CUDA tensor of a kernel dtype whose rows are whole 16-byte chunks
from fusion.runtime.combine import takes  # noqa: F401 (this module's `takes`)

_INDEX_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def gather_index(ctx: RunContext) -> torch.Tensor:
    """The index a gathering GEMM kernel loads its rows through (FC1's forward and weight gradient: x's; FC2's
    dgrad and weight gradient: the tokens' gradient dY's): int32, -1 at padding rows, made once per call
    (RunContext.derived; on the GPU the routed prologue writes it, fusion/runtime/bounds.py).

    Padding rows (token rounding) lie in the last group (RunContext.group_sizes absorbs them), so the kernels
    compute them; their gather producers zero-fill a row whose index is -1, so they read exactly what the
    reference's gathered copy holds there (zeros)."""
    return ctx.derive("gather_index", lambda: ctx.index.to(torch.int32))


def run(op, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """(T, d) token rows -> (M, d) routed rows: row r = x[ctx.index[r]], zeros where ctx.index[r] == -1."""
    index = ctx.index
    if not takes(op, x) or index.dtype not in _INDEX_DTYPES or not index.is_cuda:
        return gather_rows(x, index)
    from fusion.kernels.gather_rows import compile_gather_rows

    x = x if x.is_contiguous() else x.contiguous()
    index = index if index.is_contiguous() else index.contiguous()
    T, d = x.shape
    M = index.numel()
    out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    if M:
        kernel = compile_gather_rows(str(x.dtype).removeprefix("torch."), d, _INDEX_DTYPES[index.dtype])
        kernel.launch(x.data_ptr(), index.data_ptr(), out.data_ptr(), T, M,
                      torch._C._cuda_getCurrentRawStream(x.device.index))
    return out


class GatherLaunch(NamedTuple):
    """What :func:`run` launches for (T, width) token rows into M routed rows, for the backward's replay
    (fusion/runtime/backward_replay.py): the compiled kernel's `launch(x_ptr, index_ptr, out_ptr, T, M, stream)`."""

    launch: object
    width: int
    M: int
    T: int


def replay_launch(x: torch.Tensor, ctx: RunContext) -> GatherLaunch | None:
    """The kernel :func:`run` launched for rows `x` of the call `ctx` (compiled once per dtype, width and index
    dtype), or None where it launched none (the reference, no routed rows, a strided index)."""
    index = ctx.index
    if (not takes(None, x) or index.dtype not in _INDEX_DTYPES or not index.is_cuda or not index.is_contiguous()
            or not index.numel()):
        return None
    from fusion.kernels.gather_rows import compile_gather_rows

    T, d = x.shape
    kernel = compile_gather_rows(str(x.dtype).removeprefix("torch."), d, _INDEX_DTYPES[index.dtype])
    return GatherLaunch(kernel.launch, d, index.numel(), T)
