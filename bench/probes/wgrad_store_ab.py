"""The varlen-K kernel's store-bound variants against the tile policy's configuration, interleaved.

bench/bench_wgrad.py --sweep times each configuration once, in order, the policy's first: on a power-bound card the
first row timed after a shape's setup runs at higher clocks, so a sweep flatters it by a few percent. Here every
configuration of a weight gradient is timed in each of --rounds rounds, the order rotated each round, the GPU kept
busy before each (bench_common.warm_gpu), and the median over rounds reported with its ratio to the policy's:

  policy       choose_wgrad_config at the shape's rows (what the runtime launches)
  st16         the same tile storing 16 bytes a lane (a quad's 4x4 transpose) instead of 8
  nf           the same tile, the schedule walking a group's n-tiles fastest (running CTAs write whole rows of D)
  nf st16      both
  pp128 [st16] 128x128 pingpong CTA pairs (a store-bound tile at few rows per group), and with 16-byte stores

Also torch._grouped_mm, D's bytes over time (TB/s) and torch fill_ of D: the write ceiling. Every variant must give
the policy's bits (the same rows reduced in the same order; checked).

    FUSION_CACHE_DIR=$PWD/.kcache CUTE_DSL_ARCH=sm_90a python bench/probes/wgrad_store_ab.py --precompile
    python bench/probes/wgrad_store_ab.py [--shapes gpt-oss-120b-T1024,...] [--rounds 5] [--out results.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

from bench_common import median_ms, warm_gpu  # noqa: E402
from bench_wgrad import SHAPES, gemms, job, routed_shape  # noqa: E402
from fusion.kernels.tile_policy import WgradConfig, choose_wgrad_config  # noqa: E402

DEFAULT_SHAPES = ("gpt-oss-120b-T1024", "qwen3-30b-a3b-T1024", "olmoe-1b-7b-T1024", "qwen3-30b-a3b-T2048",
                  "qwen3-30b-a3b-T4096", "deepseek-v3-ep8-T1024", "qwen3-30b-a3b", "olmoe-1b-7b")


def variants(Ma: int, Nb: int, G: int, rows: int) -> dict[str, WgradConfig]:
    base = choose_wgrad_config(Ma, Nb, G, rows=rows)
    pp128 = WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2)
    out = {"policy": base, "st16": dataclasses.replace(base, store_bytes=16),
           "nf": dataclasses.replace(base, n_fastest=True),
           "nf st16": dataclasses.replace(base, n_fastest=True, store_bytes=16),
           "pp128": pp128, "pp128 st16": dataclasses.replace(pp128, store_bytes=16)}
    return {k: v for k, v in out.items() if k == "policy" or v != base}


def all_jobs(names):
    return [job(cfg, Ma, Nb, SHAPES[n][0]) for n in names for _, Ma, Nb, _ in gemms(*SHAPES[n])
            for cfg in variants(Ma, Nb, SHAPES[n][0], SHAPES[n][3] * SHAPES[n][4]).values()]


def run_shape(name: str, rounds: int, gen) -> dict:
    from fusion.kernels.wgrad_api import run_varlen_k_gemm
    from fusion.runtime.compile import load_compiled

    E, d, f, T, k = SHAPES[name]
    M, dgen, _, ends, offs, result = routed_shape(name, E, d, f, T, k, "topk", gen, "cuda")
    for label, Ma, Nb, _ in gemms(E, d, f, T, k):
        a = torch.randn(M, Ma, generator=dgen, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, Nb, generator=dgen, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(E, Ma, Nb, dtype=torch.bfloat16, device="cuda")
        want = None   # the policy's bits: every variant reduces the same rows in the same order
        fns = {"torch _grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=ends),
               "torch fill_ (D alone)": lambda: out.fill_(0.0)}
        same = {}
        for key, cfg in variants(Ma, Nb, E, M).items():
            fn = (lambda c: lambda: run_varlen_k_gemm(c, a, b, offs, out))(load_compiled(job(cfg, Ma, Nb, E)))
            out.fill_(float("nan"))
            fn()
            want = out.clone() if want is None else want
            same[key] = bool(torch.equal(out, want))
            fns[key] = fn
        keys = list(fns)
        times = {key: [] for key in keys}
        for r in range(rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            warm_gpu([fns[key] for key in order], 0.3)
            for key in order:
                times[key].append(median_ms(fns[key]))
        med = {key: statistics.median(v) for key, v in times.items()}
        d_bytes = out.numel() * out.element_size()
        print(f"  {label}: Ma={Ma} Nb={Nb}, {M / E:.0f} rows per group", flush=True)
        rows = {}
        for key in keys:
            ratio = med[key] / med["policy"]
            tb = d_bytes / med[key] / 1e9
            tag = "" if key not in same else ("  same bits" if same[key] else "  BITS DIFFER FROM THE POLICY'S")
            print(f"    {key:<24} {med[key]:8.3f} ms  x{ratio:5.3f}  D {tb:5.2f} TB/s  rounds "
                  f"{min(times[key]):.3f}-{max(times[key]):.3f}{tag}", flush=True)
            rows[key] = {"ms": med[key], "rounds_ms": times[key], "ratio_to_policy": ratio, "d_write_tbs": tb,
                         "same_bits_as_policy": same.get(key)}
        result["gemms"][label] = {"Ma": Ma, "Nb": Nb, "rows": rows}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.shapes.split(",")
    if args.precompile:
        from fusion.runtime.aot import compile_jobs
        compile_jobs(all_jobs(names), parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "0")) or None)
        return
    print(torch.cuda.get_device_name(), flush=True)
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "rounds": args.rounds,
               "shapes": [{"name": n, **run_shape(n, args.rounds, gen)} for n in names]}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
