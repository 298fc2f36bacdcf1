"""Host (CPU) microseconds per call of the fused block, forward and training step, on a Hopper GPU.

    python bench/host_overhead.py

Host time is measured with time.perf_counter over back-to-back calls that the GPU cannot keep up with
(a large enough block), one sync at the end of each batch; the GPU time per call is reported beside it, so a
host time near the GPU time means the GPU waited for Python. Also prints torch._grouped_mm's own host cost.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from fusion import GroupLinear, Scale, Sequential, SwiGLU


def host_us(fn, calls: int = 30, repeats: int = 5) -> tuple[float, float]:
    """(host us per call, wall us per call) over back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    best_host, best_wall = float("inf"), float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        best_host = min(best_host, (t1 - t0) / calls * 1e6)
        best_wall = min(best_wall, (t2 - t0) / calls * 1e6)
    return best_host, best_wall


def main():
    torch.manual_seed(0)
    E, d, f, M = 8, 2048, 2048, 4096
    block = Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)).cuda().bfloat16()
    fc1 = Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale()).cuda().bfloat16()
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    sizes = torch.full((E,), M // E, device="cuda", dtype=torch.int32)
    probs = torch.rand(M, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    w = block[0].weight.detach().transpose(-1, -2)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)

    def fwd():
        with torch.no_grad():
            block(x, group_sizes=sizes, scale=probs)

    def fc1_fwd():
        with torch.no_grad():
            fc1(x, group_sizes=sizes, scale=probs)

    def train():
        block(xg, group_sizes=sizes, scale=probs).backward(dy)

    def grouped_mm():
        torch._grouped_mm(x, w, offs=offs)

    rows = [("fused FC1 (GEMM+SwiGLU+Scale) forward", fc1_fwd), ("fused block forward", fwd),
            ("fused block training step", train), ("torch._grouped_mm (FC1 GEMM alone)", grouped_mm)]
    print(f"{'call':<44} {'host us':>9} {'wall us':>9}   ({torch.cuda.get_device_name()}, E={E}, d={d}, "
          f"2f={2 * f}, M={M})")
    for name, fn in rows:
        h, w_ = host_us(fn)
        print(f"{name:<44} {h:9.1f} {w_:9.1f}")
    import cProfile
    import pstats

    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        """The aten ops one call dispatches: each costs host time (a CUDA launch or an allocation)."""

        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func).removeprefix("aten."))
            return func(*args, **(kwargs or {}))

    for name, fn in (("forward", fwd), ("training step", train)):
        with OpLog() as log:
            fn()
        print(f"--- {len(log.ops)} ops per {name}: {' '.join(log.ops)}")

    for name, fn in (("forward", fwd), ("training step", train)):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile, 50 x {name} (tottime) ---")
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
