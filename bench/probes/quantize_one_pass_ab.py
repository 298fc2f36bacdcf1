"""A GEMM output gradient's two FP8 copies for the backward (fusion.runtime.fp8_gemm.quantize_for_backward): the
dgrad's 1x128 rowwise copy and the weight gradient's columnwise copy in the slot layout, made by two launches of
the quantize kernel (rowwise-only, then slots-only: the default) or by one launch of its rowwise + slots build,
which reads dY once: as its no-spill rule builds it (one CTA an SM: it needs 138 registers) and forced to two CTAs an
SM (spilling 16 bytes). Interleaved rounds, medians; every output compared byte for byte with the two launches'.

    python bench/probes/quantize_one_pass_ab.py [--shapes mixtral-fc1,...] [--rounds 7] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench_quantize import _sizes, _time_ms  # noqa: E402

#: name: (rows M, width K = the GEMM's output width, groups): FC1's dY (2f wide) and FC2's (d wide) of the FP8 blocks
#: whose weight gradients the recipe runs in FP8 (fusion.quant.fp8_linear.wgrad_in_bf16), and a fine-grained one
SHAPES = {"mixtral-fc1": (16384, 28672, 8), "mixtral-fc2": (16384, 4096, 8), "llama-3-8b-fc1": (16384, 28672, 1),
          "llama-3-70b-fc1": (8192, 57344, 1), "olmoe-fc1": (65536, 2048, 64)}


def paths(x, sizes):
    """name: a callable returning the four buffers (data, scale, cw_data, cw_scale)."""
    from fusion.kernels.fp8_quantize_api import (quantize_fp8_block_device, quantize_fp8_block_rowwise_slots,
                                                 quantize_fp8_block_slots)

    def two_launches():
        data, scale, _, _ = quantize_fp8_block_device(x, False, None)
        return (data, scale, *quantize_fp8_block_slots(x, sizes))

    return {"two launches": two_launches,
            "one pass (1 CTA an SM)": lambda: quantize_fp8_block_rowwise_slots(x, sizes, 0),
            "one pass (2 CTAs an SM)": lambda: quantize_fp8_block_rowwise_slots(x, sizes, 2)}


def run(name, rounds, iters, device):
    M, K, G = SHAPES[name]
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    x.view(-1)[::997] = float("inf")
    sizes = _sizes(M, G, device).to(torch.int32)
    fns = paths(x, sizes)
    want = fns["two launches"]()
    same = {k: all(torch.equal(a, b) for a, b in zip(fn(), want)) for k, fn in fns.items()}
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 else list(fns)[::-1]):
            times[k].append(_time_ms(fns[k], iters, device))
    nbytes = M * K * 2 + 2 * M * K   # read once, both copies written (scales aside)
    out = {}
    for k, t in times.items():
        ms = statistics.median(t)
        out[k] = dict(ms=round(ms, 4), TBps_one_read=round(nbytes / ms / 1e9, 2), same_bytes=same[k])
        print(f"  {name:16s} {k:26s} {ms:8.4f} ms  {nbytes / ms / 1e9:5.2f} TB/s (dY read once)  same bytes: "
              f"{same[k]}", flush=True)
    return dict(shape=dict(M=M, K=K, G=G), paths=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    results = {n: run(n, args.rounds, args.iters, device) for n in args.shapes.split(",")}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
