"""What quantizing an FP8-block weight costs: the step after every optimizer step pays it once per weight.

An fp8_block GroupLinear quantizes its weight in 128x128 blocks (codes, scales, and the transposed copy the dgrad
reads) once per parameter version (fusion/quant/fp8_weight.py); a training loop changes the weights every optimizer
step, so each step's first forward quantizes both weights of every block again. The training-step benchmark keeps
the weights fixed and never saw it. This times, per block, each weight's quantization (synchronous, median of
`--reps`), against `w.clone()` of the same weight (the same 4 bytes an element a near-bandwidth quantization moves:
2 read, 1 + 1 written), with the weight-quantize kernel (kernels/fp8_weight_quantize.py) and torch's reference.

    python bench/probes/weight_quantize_cost.py --models olmoe-1b-7b,mixtral-8x7b
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_training_step as B  # noqa: E402


def ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from fusion.quant import fp8_weight
    from fusion.runtime.fp8_gemm import quantize_weight_device

    impls = {"kernel": quantize_weight_device, "reference": fp8_weight.quantize_weight_fp8_block_reference}
    print(f"{torch.cuda.get_device_name()}; ms per weight (median of {args.reps}), share of clone's bandwidth")
    for block in B.select_blocks(args.models):
        torch.manual_seed(0)
        seq = B.fusion_block(block, "cuda", torch.bfloat16)
        for name, op in (("fc1", seq[0]), ("fc2", seq[len(seq) - 1])):
            w = op.weight.detach()
            torch.nn.init.normal_(w, std=0.02)
            clone = ms(lambda: w.clone(), args.reps)
            row = f"{block.model:20s} {name} {tuple(w.shape)!s:22s} clone {clone:7.3f}"
            for label, fn in impls.items():
                fn(w)   # compile, warm up
                t = ms(lambda: fn(w), args.reps if label != "reference" else 2)
                row += f"  {label} {t:8.3f} ({clone / t:.2f})"
            print(row, flush=True)
            del w
        del seq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
