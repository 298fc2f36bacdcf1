"""One training step of a bench block inside cudaProfilerStart/Stop, for Nsight Compute: which kernel bounds what.

    ncu --profile-from-start off --clock-control none -k regex:Fp8GroupedGemm --launch-count 4 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        python bench/probes/ncu_step.py --model qwen3-30b-a3b --path fusion_fp8

Runs --warmup steps of the path (compiling and binding everything), then one step in the profiler's range, so
`--launch-skip` / `--launch-count` count that step's launches only (in launch order: forward, then backward).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from bench_training_step import BLOCKS, phase_fn, setup_block  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--path", default="fusion_fp8")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    block = next(b for b in BLOCKS if b.model == args.model)
    s = setup_block(block)
    path = s.path(args.path)
    step, _ = phase_fn(path, "training_step", s.x, s.dy)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{args.model} {args.path}: one step profiled")


if __name__ == "__main__":
    main()
