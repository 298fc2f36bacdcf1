"""A call's group row bounds and tile counters, in one buffer made on the device.

    buffer = [0, o_1, ..., o_G | counters of the forward kernels | counters of the backward kernels]   (int32)

The kernels read the bounds (G+1 values) and torch._grouped_mm reads o_1..o_G as its `offs`; every fused
launch of the call takes its own zeroed int32 tile counter from the tail, so nothing is allocated outside the
call (CUDA-graph pools stay clean) and no extra memset runs.

Two makers of the buffer:
  * `DevicePrologue` (fused plans on a GPU): the one-warp prologue kernel of fusion.kernels.bounds validates
    group_sizes, writes the bounds and zeroes the counters in one launch (a dozen torch ops otherwise, 10-20 us
    of host time each);
  * `torch_bounds` (emulate, CPU, and calls whose offsets the caller's context already holds): torch ops.
"""
from __future__ import annotations

import torch

_SIZE_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def torch_bounds(ctx, rows: int, device, counters: int) -> torch.Tensor:
    """The buffer from ctx.offsets (or one group of `rows` rows) with torch ops."""
    if ctx.offsets is None:
        buffer = torch.zeros(2 + counters, dtype=torch.int32, device=device)
        buffer.narrow(0, 1, 1).fill_(rows)
        return buffer
    return torch.nn.functional.pad(ctx.offsets.to(torch.int32), (1, counters))


class DevicePrologue:
    """The prologue kernel for a block with `groups` groups (1 and no group_sizes for a dense block). Blocks that
    start with a Gather (sizes may sum to fewer than the routed rows, the rest padding) take `torch_bounds`."""

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

    def __call__(self, sizes: torch.Tensor | None, rows: int, device: torch.device, counters: int) -> torch.Tensor:
        """The call's buffer (G + 1 + counters int32), validated sizes or a device error (no host sync)."""
        compiled = self._kernel(sizes if self.grouped else None)
        buffer = torch.empty(self.groups + 1 + counters, dtype=torch.int32, device=device)
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        compiled.launch(sizes.data_ptr() if self.grouped else buffer.data_ptr(), buffer.data_ptr(), rows, counters,
                        stream)
        return buffer
