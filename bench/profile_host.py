"""Where one path's host (CPU) time goes: cProfile over back-to-back calls of bench_training_step's paths.

    python bench/profile_host.py --model small-batch --path fusion_fp8_direct [--phase training_step] [--top 30]
    python bench/profile_host.py --model small-batch --single-thread      # the backward in the profile too

Runs --warmup calls, then profiles --calls calls (the GPU keeps up or not: only Python's time is attributed),
and prints the functions with the most own time (tottime) and the most cumulative time. Complements
bench/profile_step.py (GPU kernels) and bench/host_overhead.py (host microseconds per call).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # run from a checkout

from bench_training_step import phase_fn, select_blocks, setup_block  # noqa: E402
from profiling import print_host, print_ops  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--path", default="fusion")
    ap.add_argument("--phase", default="training_step", choices=["forward", "training_step"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--single-thread", action="store_true",
                    help="autograd runs the backward on the calling thread, so cProfile sees it too")
    ap.add_argument("--ops", action="store_true", help="also count the aten ops one call dispatches")
    ap.add_argument("--torch-profiler", action="store_true",
                    help="also torch.profiler's CPU table over 20 calls (what a compiled graph launches, with counts)")
    args = ap.parse_args(argv)
    if args.single_thread:
        torch.autograd.set_multithreading_enabled(False)
    block, = select_blocks(args.model)   # a block of BLOCKS or of the held-out table
    setup = setup_block(block)
    call, clear = phase_fn(setup.path(args.path), args.phase, setup.x, setup.dy)
    for _ in range(args.warmup):
        clear()
        call()
    torch.cuda.synchronize()
    print_host(call, clear, args.calls, args.top, f"{args.model} {args.path} {args.phase}")
    if args.ops:
        print_ops(call, clear, args.calls, f"{args.model} {args.path} {args.phase}")
    if args.torch_profiler:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                clear()
                call()
            torch.cuda.synchronize()
        print(f"== {args.model} {args.path} {args.phase}: torch.profiler, 20 calls, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
