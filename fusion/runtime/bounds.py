"""A call's group row bounds and tile counters, in one buffer made on the device.

    buffer = [0, o_1, ..., o_G | counters of the forward kernels | counters of the backward kernels]   (int32)

The kernels read the bounds (G+1 values) and torch._grouped_mm reads o_1..o_G as its `offs`; every fused
launch of the call takes its own zeroed int32 tile counter from the tail, so nothing is allocated outside the
call (CUDA-graph pools stay clean) and no extra memset runs.

Three makers of the buffer:
  * `DevicePrologue` (fused plans on a GPU): the one-warp prologue kernel of fusion.kernels.bounds validates
    group_sizes, writes the bounds and zeroes the counters in one launch (a dozen torch ops otherwise, 10-20 us
    of host time each);
  * `RoutedPrologue` (the same, for an MoE experts block: a Gather first): it also checks the routing index,
    absorbs the padding rows into the last group and writes the gathering kernels' int32 index, in one launch
    (about twenty torch ops otherwise);
  * `torch_bounds` (emulate, CPU, and calls whose offsets the caller's context already holds): torch ops.
"""
from __future__ import annotations

import torch

_SIZE_DTYPES = {torch.int32: "int32", torch.int64: "int64"}

#: Read per call: False makes an MoE call's absorbed group sizes with torch.diff of the routed prologue's bounds, as
#: before the kernel wrote them (the A/B switch of bench/ab_switch.py --moe: about 50 us of host a call).
SIZES_FROM_KERNEL = True


def torch_bounds(ctx, rows: int, device, counters: int) -> torch.Tensor:
    """The buffer from ctx.offsets (or one group of `rows` rows) with torch ops."""
    if ctx.offsets is None:
        buffer = torch.zeros(2 + counters, dtype=torch.int32, device=device)
        buffer.narrow(0, 1, 1).fill_(rows)
        return buffer
    return torch.nn.functional.pad(ctx.offsets.to(torch.int32), (1, counters))


class DevicePrologue:
    """The prologue kernel for a block with `groups` groups (1 and no group_sizes for a dense block). Blocks that
    start with a Gather (sizes may sum to fewer than the routed rows, the rest padding) take `RoutedPrologue`."""

    def __init__(self, groups: int, grouped: bool):
        self.groups, self.grouped = groups, grouped
        self._compiled: dict = {}

    def _kernel(self, sizes: torch.Tensor | None):
        dtype = None if sizes is None else sizes.dtype
        compiled = self._compiled.get(dtype)
        if compiled is None:
            from fusion.kernels.bounds import compile_group_bounds

            name = None if sizes is None else _SIZE_DTYPES[dtype]
            compiled = self._compiled[dtype] = compile_group_bounds(self.groups, name)
        return compiled

    def __call__(self, ctx, rows: int, device: torch.device, counters: int) -> torch.Tensor:
        """The call's buffer (G + 1 + counters int32), validated sizes or a device error (no host sync)."""
        sizes = ctx.group_sizes
        compiled = self._kernel(sizes if self.grouped else None)
        buffer = torch.empty(self.groups + 1 + counters, dtype=torch.int32, device=device)
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        compiled.launch(sizes.data_ptr() if self.grouped else buffer.data_ptr(), buffer.data_ptr(), rows, counters,
                        stream)
        return buffer


class RoutedPrologue:
    """The prologue kernel of a block that starts with a Gather (fusion.kernels.bounds.RoutedBoundsKernel): the
    call's buffer as DevicePrologue makes it, with the padding rows past sum(group_sizes) in the last group; the
    routing index checked; and ctx's derived "gather_index" (the gathering kernels' int32 index, -1 at padding
    rows) and ctx.group_sizes (the sizes with the padding absorbed, for the ops that read sizes: int32, written by
    the kernel after the counters) set from what it wrote."""

    def __init__(self, groups: int):
        self.groups = groups
        self._compiled: dict = {}   # per (sizes dtype, index dtype): the kernel, looked up once, not per call

    def __call__(self, ctx, rows: int, device: torch.device, counters: int) -> torch.Tensor:
        sizes, index = ctx.routed_group_sizes, ctx.index   # rows >= 1: BlockInputs.context checks an empty call
        head = self.groups + 1 + counters
        buffer = torch.empty(head + self.groups, dtype=torch.int32, device=device)   # + the absorbed sizes
        index32 = torch.empty(rows, dtype=torch.int32, device=device)
        key = (sizes.dtype, index.dtype)
        compiled = self._compiled.get(key)
        if compiled is None:
            from fusion.kernels.bounds import compile_routed_bounds

            compiled = self._compiled[key] = compile_routed_bounds(self.groups, _SIZE_DTYPES[sizes.dtype],
                                                                   _SIZE_DTYPES[index.dtype])
        compiled.launch(sizes.data_ptr(), index.data_ptr(), buffer.data_ptr(), index32.data_ptr(), rows, ctx.tokens,
                        counters, torch._C._cuda_getCurrentRawStream(device.index))
        ctx.derived["gather_index"] = index32
        bounds = buffer.narrow(0, 0, head)
        ctx.group_sizes = (buffer.narrow(0, head, self.groups) if SIZES_FROM_KERNEL else
                           torch.diff(bounds.narrow(0, 0, self.groups + 1)))
        return bounds


def row_bounds(op, rows: int, ctx, device) -> torch.Tensor:
    """The (G+1,) int32 row bounds a lone GEMM kernel of `op` reads (a device method's: fusion/runtime/fp8_gemm.py,
    wgrad_gemm.py): the head of the call's bounds buffer (G+1 bounds, then tile counters the kernel does not
    read), where it describes this GEMM's rows; else made once per call for a grouped block, [0, rows] for a
    Linear."""
    weight = op._parameters["weight"]   # (an nn.Module attribute lookup costs a microsecond)
    dense = weight.dim() == 2 or ctx.group_sizes is None   # a Linear (op.spec costs µs per call)
    if ctx.counters is not None and (ctx.groups == 1 if dense else ctx.groups == weight.shape[0]):
        return ctx.counters
    if dense:
        bounds = torch.zeros(2, dtype=torch.int32, device=device)
        bounds[1] = rows
        return bounds

    def make():
        from fusion.kernels.api import offsets_from_group_sizes

        return offsets_from_group_sizes(ctx.group_sizes)

    return ctx.derive("row_bounds", make)
