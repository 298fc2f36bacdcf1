"""Where one path's training step (or forward) spends its GPU time: torch.profiler's CUDA kernels, top first.

    python bench/profile_step.py --model qwen3-30b-a3b --path fusion_fp8 [--phase training_step] [--top 20]

Paths and blocks are bench/bench_training_step.py's (same weights, inputs and group sizes). The step runs a few
times first (compiles, caches); the profiled region is `--steps` steps back to back. Replaces profile_block.py,
which timed pieces through a runtime module that no longer exists.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_training_step as B  # noqa: E402
from profiling import print_kernels, print_timeline  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--path", default="fusion")
    ap.add_argument("--phase", default="training_step", choices=["forward", "training_step"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--timeline", action="store_true", help="also one call's kernels in launch order")
    args = ap.parse_args(argv)
    (block,) = [b for b in B.BLOCKS + B.HELD_OUT_BLOCKS if b.model == args.model]
    setup = B.setup_block(block)
    call, clear = B.phase_fn(setup.path(args.path), args.phase, setup.x, setup.dy)
    for _ in range(3):
        clear()
        call()
    torch.cuda.synchronize()
    print_kernels(call, clear, args.steps, args.top, f"{block.model} {args.path} {args.phase}")
    if args.timeline:
        print_timeline(call, clear, f"{block.model} {args.path} {args.phase}")


if __name__ == "__main__":
    sys.exit(main())
