"""Host (CPU) microseconds per call of the fused block, forward and training step, on a Hopper GPU.

    python bench/host_overhead.py
    FUSION_CACHE_DIR=/tmp/kc python bench/host_overhead.py --precompile   # no GPU: its kernels, for the device run

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


def breakdown(block, x, sizes, probs):
    """Host us of each piece of one fused call, and of the primitives it is made of."""
    from fusion.runtime import runner_for

    extra = {"group_sizes": sizes, "scale": probs}
    runner = runner_for(block, x)
    program = runner.program
    step = program.forward_steps[0]
    kernel = step.kernel(x.dtype, "inference")
    out = torch.empty(x.shape[0], block.features[-1], dtype=x.dtype, device=x.device)
    compiled = kernel.compiled
    ctx = runner.seq.inputs.context(x, extra, check_sum=False, device_checked=runner.device_checked)
    program.forward(x, ctx, train=False)
    w = block[0].weight
    buf = ctx.counters
    stream = torch._C._cuda_getCurrentRawStream(0)
    ptrs = (probs.data_ptr(), out.data_ptr())

    def raw_launch():
        compiled.launch(x.data_ptr(), w.data_ptr(), buf.data_ptr(), buf.data_ptr() + 4 * (sizes.numel() + 1),
                        buf.data_ptr(), ptrs, x.shape[0], x.shape[0], 132, stream)

    prologue = program.prologue._kernel(sizes)
    pieces = [
        ("torch.empty (M, n) bf16", lambda: torch.empty(x.shape[0], 1024, dtype=x.dtype, device=x.device)),
        ("tensor slice", lambda: buf[1:5]),
        ("current raw stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("prologue launch (raw ints)", lambda: prologue.launch(sizes.data_ptr(), buf.data_ptr(), x.shape[0], 4,
                                                               stream)),
        ("GEMM launch (raw ints)", raw_launch),
        ("runner_for", lambda: runner_for(block, x)),
        ("runner.check", lambda: runner.check(x)),
        ("inputs.context", lambda: runner.seq.inputs.context(x, extra, check_sum=False,
                                                              device_checked=runner.device_checked)),
        ("inputs.context + program.forward", lambda: program.forward(x, runner.seq.inputs.context(
            x, extra, check_sum=False, device_checked=runner.device_checked), train=False)),
        ("whole call (no_grad)", lambda: block(x, **extra)),
    ]
    print("--- host us per piece of a fused FC1 call ---")
    with torch.no_grad():
        for name, fn in pieces:
            print(f"{name:<44} {host_us(fn, calls=200)[0]:9.1f}")


E, d, f, M = 8, 2048, 2048, 4096


def blocks():
    """The measured block and its FC1 alone."""
    return (Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)),
            Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale()))


def main():
    if "--precompile" in sys.argv[1:]:
        for seq in blocks():
            seq.compile()
        return
    torch.manual_seed(0)
    block, fc1 = (seq.cuda().bfloat16() for seq in blocks())
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

    def train_forward():
        block(xg, group_sizes=sizes, scale=probs)

    w1 = block[0].weight.detach().transpose(-1, -2).requires_grad_()
    w2 = block[3].weight.detach().transpose(-1, -2).requires_grad_()
    pg = probs.clone().requires_grad_()

    def torch_train():  # the same block in eager torch with autograd: what a user's step costs the host
        h = torch._grouped_mm(xg, w1, offs=torch.cumsum(sizes, 0, dtype=torch.int32))
        g, u = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g) * u * pg[:, None]
        torch._grouped_mm(a, w2, offs=torch.cumsum(sizes, 0, dtype=torch.int32)).backward(dy)

    rows = [("fused FC1 (GEMM+SwiGLU+Scale) forward", fc1_fwd), ("fused block forward", fwd),
            ("fused block forward, recording for autograd", train_forward), ("fused block training step", train),
            ("eager torch block training step", torch_train), ("torch._grouped_mm (FC1 GEMM alone)", grouped_mm)]
    print(f"{'call':<44} {'host us':>9} {'wall us':>9}   ({torch.cuda.get_device_name()}, E={E}, d={d}, "
          f"2f={2 * f}, M={M})")
    for name, fn in rows:
        h, w_ = host_us(fn)
        print(f"{name:<44} {h:9.1f} {w_:9.1f}")
    breakdown(fc1, x, sizes, probs)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            train()
        torch.cuda.synchronize()
    print("--- torch.profiler, 20 training steps (CPU time) ---")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
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
