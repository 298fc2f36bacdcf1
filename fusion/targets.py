"""GPU targets: the one parser every entry point uses (planner, explain, compile, the CLI), and the target of
a device.

A target names an NVIDIA architecture the way nvcc does: "sm_" + the compute capability (major and minor
digits) + an optional feature suffix ("a": arch-specific features such as Hopper's wgmma and TMA; "f": the
architecture family). Spelling is forgiving ("SM_90A", " sm90a " -> "sm_90a"), content is not: "sm_9x",
"sm_9" or "hopper" are errors, never a target that silently matches no pattern.
"""
from __future__ import annotations

import functools
import re

import torch

from fusion.errors import CompileError, TargetError

_TARGET_RE = re.compile(r"^sm_?(\d{2,3})([af]?)$")

#: The architecture the kernel templates are written for, and the code target they compile to.
KERNEL_ARCH = 90
KERNEL_TARGET = "sm_90a"

ACCEPTED = "'sm_90a', 'sm_90' or another 'sm_<major><minor>[a|f]' such as 'sm_80' or 'sm_100a'"


def parse_target(target) -> str:
    """`target` in canonical form ("sm_90a", "sm_90", "sm_100a"); raises TargetError for anything else."""
    if not isinstance(target, str):
        raise TargetError(f"target must be a string such as 'sm_90a', got {target!r} ({type(target).__name__})")
    m = _TARGET_RE.match(target.strip().lower())
    if not m:
        raise TargetError(f"unknown target {target!r}: use {ACCEPTED}")
    return f"sm_{m.group(1)}{m.group(2)}"


def plan_target(target) -> str | None:
    """A planning target: None or "cpu" (nothing fused) -> None, else parse_target(target)."""
    if target is None or (isinstance(target, str) and target.strip().lower() == "cpu"):
        return None
    return parse_target(target)


def arch(target: str | None) -> int | None:
    """"sm_90a" -> 90; None or "cpu" -> None."""
    target = plan_target(target)
    return None if target is None else int(_TARGET_RE.match(target).group(1))


def kernel_target(target) -> str:
    """The code target to compile fused kernels for: "sm_90" and "sm_90a" (the same GPUs) both give "sm_90a",
    the only target the kernel templates are written for; any other architecture is a CompileError."""
    canonical = parse_target(target)
    if arch(canonical) != KERNEL_ARCH or canonical.endswith("f"):
        raise CompileError(f"cannot compile for target {canonical!r}: the kernel templates are written for "
                           f"Hopper's {KERNEL_TARGET} (wgmma, TMA); use target='{KERNEL_TARGET}'")
    return KERNEL_TARGET


def device_target(device: torch.device) -> str | None:
    """The fused-kernel target of a device ("sm_90" on Hopper), or None where no fused kernel can run."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def cuda_major(device) -> int:
    """The compute capability's major number of a CUDA device (a torch.device or an index; None or an index-less
    device: the current one), asked once per device: the query costs microseconds, and device methods' `takes`
    runs every call."""
    index = device if isinstance(device, int) else getattr(device, "index", None)
    return _cuda_major(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
