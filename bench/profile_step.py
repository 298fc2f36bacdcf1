"""Where one path's training step (or forward) spends its GPU time: torch.profiler's CUDA kernels, top first.

    python bench/profile_step.py --model qwen3-30b-a3b --path fusion_fp8 [--phase training_step] [--top 20]
    python bench/profile_step.py --model olmoe-1b-7b,llama-3-8b --path fusion,unfused_fullgraph --timeline

Comma-separated models and paths run one after another in one process (one process start per device call).

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
from bench_common import B2B_CALLS, measure  # noqa: E402
from profiling import export_trace, print_kernels, print_timeline  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a block of bench_training_step.py, or several, comma-separated")
    ap.add_argument("--path", default="fusion", help="a path, or several, comma-separated")
    ap.add_argument("--phase", default="training_step", choices=["forward", "training_step"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--timeline", action="store_true", help="also one call's kernels in launch order")
    ap.add_argument("--b2b-calls", type=int, default=B2B_CALLS,
                    help="calls of the unprofiled back-to-back window (100: the card's sustained clocks)")
    ap.add_argument("--trace", default=None,
                    help="directory: also a chrome trace (host and kernels) of three calls per block and path, to "
                         "see where the GPU waits for the host")
    args = ap.parse_args(argv)
    for block in B.select_blocks(args.model):
        setup = B.setup_block(block)
        for path in args.path.split(","):
            call, clear = B.phase_fn(setup.path(path), args.phase, setup.x, setup.dy)
            for _ in range(3):
                clear()
                call()
            torch.cuda.synchronize()
            m = measure(call, clear, b2b_calls=args.b2b_calls)
            print(f"== {block.model} {path} {args.phase}: b2b {m['b2b_ms']:.3f} ms, sync {m['sync_ms']:.3f} ms, "
                  f"host {m['host_us']:.0f} µs (unprofiled)")
            print_kernels(call, clear, args.steps, args.top, f"{block.model} {path} {args.phase}")
            if args.timeline:
                print_timeline(call, clear, f"{block.model} {path} {args.phase}")
            if args.trace:
                export_trace(call, clear, Path(args.trace) / f"{block.model}-{path}-{args.phase}.json")
            del call, clear
        del setup
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
