"""FP8 weight gradients of MoE expert GEMMs: the FP8 varlen-K kernel (kernels/fp8_wgrad.py) with its two slot-layout
quantizations, against the bf16 weight gradient the FP8 recipe runs by default (our bf16 varlen-K kernel) and
torch._grouped_mm, on bench/bench_wgrad.py's shapes (FC1: dW1 (E, 2f, d) = dH_g.T @ x_g; FC2: dW2 (E, d, f) =
dY_g.T @ a_g; M = T*k routed rows, lognormal groups by default).

Rows per GEMM (ms, TFLOP/s = 2*M*Ma*Nb / time):

  torch _grouped_mm bf16        torch._grouped_mm(dy.t(), x, offs)
  bf16 ours                     the bf16 varlen-K kernel at the tile policy's configuration (the default recipe's)
  fp8 gemm <tile>               the FP8 varlen-K kernel alone on operands already quantized, by tile (fp8_configs)
  fp8 quantize dY + X           the two columnwise slot-layout quantizations (kernels/fp8_quantize.py, slots=True)
  fp8 total                     both quantizations + the kernel at the policy's tile: what the runtime runs

The FP8 result is checked against a float64 GEMM of the dequantized operands (issue 9: relative error <= 1e-3).

    python bench/bench_fp8_wgrad.py --precompile [--shapes ...]      # no GPU: the GEMM kernels into FUSION_CACHE_DIR
    python bench/bench_fp8_wgrad.py [--shapes ...] [--groups lognormal] [--out results.json]
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fusion

from bench_common import median_ms, run_header  # noqa: E402
from bench_wgrad import SHAPES, gemms, job as bf16_job, routing  # noqa: E402
from fusion.kernels.tile_policy import (choose_fp8_wgrad_config, choose_wgrad_config, fp8_wgrad_stages,  # noqa: E402
                                       fp8_wgrad_two_ctas)
from fusion.runtime.compile import KernelJob  # noqa: E402

DEFAULT_SHAPES = ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "deepseek-v3-ep8", "mixtral-8x7b",
                  "gpt-oss-120b", "qwen3-235b-a22b-T4096", "qwen3-30b-a3b-T1024")


def fp8_configs(Ma, Nb, G, tiles="all"):
    """The policy's tile first, then the cooperative 256 x 128 and 128 x 128 tiles as single CTAs and pairs, the
    two-CTA 128 x 128 tile (two CTAs an SM), and the 256 x 128 (single and pairs) and two-CTA tiles storing 16 bytes
    a lane: each once. ``tiles="ordered"``: the policy's tile with and without ordered waves
    (WgradConfig.ordered_waves) and the 256 x 128 single CTA with them, only."""
    coop = dataclasses.replace(fp8_wgrad_two_ctas(), ctas_per_sm=1, tile_m=256, stages=fp8_wgrad_stages(256, 128))
    short = dataclasses.replace(coop, tile_m=128, stages=fp8_wgrad_stages(128, 128))
    out = [choose_fp8_wgrad_config(Ma, Nb, G)]
    if tiles == "ordered":
        for cfg in (dataclasses.replace(out[0], ordered_waves=not out[0].ordered_waves),
                    dataclasses.replace(coop, ordered_waves=True)):
            if cfg not in out:
                out.append(cfg)
        return out
    for cfg in (coop, short, dataclasses.replace(coop, cluster_n=2), dataclasses.replace(short, cluster_n=2),
                fp8_wgrad_two_ctas(), dataclasses.replace(coop, store_bytes=16),
                dataclasses.replace(fp8_wgrad_two_ctas(), store_bytes=16),
                dataclasses.replace(coop, cluster_n=2, store_bytes=16)):
        if cfg not in out:
            out.append(cfg)
    return out


def config_label(cfg) -> str:
    return (f"{cfg.tile_m}x{cfg.tile_n} s{cfg.stages}{' c2' if cfg.cluster_n > 1 else ''}"
            f"{' 2cta' if cfg.ctas_per_sm == 2 else ''}{' st16' if cfg.store_bytes == 16 else ''}"
            f"{' ord' if cfg.ordered_waves else ''}")


def fp8_job(cfg, Ma, Nb, G) -> KernelJob:
    return KernelJob(step="bench", variant="wgrad", source="", config=dataclasses.astuple(cfg), dtype="bfloat16",
                     N=Nb, K=Ma, G=G, target="sm_90a", mainloop="fp8_varlen_k")


def all_jobs(names, tiles="all"):
    jobs = []
    for name in names:
        E, d, f, T, k = SHAPES[name]
        for _, Ma, Nb, _ in gemms(E, d, f, T, k):
            jobs.append(bf16_job(choose_wgrad_config(Ma, Nb, E, rows=T * k), Ma, Nb, E))
            jobs += [fp8_job(c, Ma, Nb, E) for c in fp8_configs(Ma, Nb, E, tiles)]
    return jobs


def dequantized_groups(data, scale, sizes):
    """Per group, the float64 (width, rows) values of a slot-layout operand (its slots' columns)."""
    out, slot = [], 0
    for n in sizes:
        blocks = -(-n // 128)
        codes = data[:, 128 * slot: 128 * (slot + blocks)].view(torch.float8_e4m3fn).double()
        out.append(codes * scale[slot: slot + blocks].double().t().repeat_interleave(128, dim=1))
        slot += blocks
    return out


def run_shape(name, groups, gen, dev="cuda", tiles="all"):
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_slots
    from fusion.kernels.fp8_wgrad_api import run_fp8_varlen_k_gemm
    from fusion.kernels.wgrad_api import run_varlen_k_gemm
    from fusion.runtime.compile import load_compiled

    E, d, f, T, k = SHAPES[name]
    M = T * k
    sizes, _ = routing(T, E, k, groups, gen, dev)
    ends = torch.cumsum(sizes, 0).to(torch.int32)
    offs = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), ends])
    sizes32 = sizes.to(torch.int32)
    host_sizes = sizes.tolist()
    dgen = torch.Generator(device=dev).manual_seed(1)
    result = {"shape": dict(E=E, d=d, f=f, T=T, k=k, M=M), "groups": groups, "max_rows": max(host_sizes),
              "empty_groups": host_sizes.count(0), "gemms": {}}
    print(f"{name} [{groups}]: E={E} d={d} f={f} T={T} k={k} M={M}, largest group {result['max_rows']}, "
          f"{result['empty_groups']} empty", flush=True)
    for label, Ma, Nb, _ in gemms(E, d, f, T, k):
        dy = torch.randn(M, Ma, generator=dgen, device=dev, dtype=torch.bfloat16)
        x = torch.randn(M, Nb, generator=dgen, device=dev, dtype=torch.bfloat16)
        out = torch.empty(E, Ma, Nb, dtype=torch.bfloat16, device=dev)
        a = quantize_fp8_block_slots(dy, sizes32)
        b = quantize_fp8_block_slots(x, sizes32)
        bf16 = load_compiled(bf16_job(choose_wgrad_config(Ma, Nb, E, rows=M), Ma, Nb, E))
        rows = {"torch _grouped_mm bf16": lambda: torch._grouped_mm(dy.t(), x, offs=ends),
                "bf16 ours": lambda: run_varlen_k_gemm(bf16, dy, x, offs, out)}
        errors = {}
        want = None
        for i, cfg in enumerate(fp8_configs(Ma, Nb, E, tiles)):
            comp = load_compiled(fp8_job(cfg, Ma, Nb, E))
            key = f"fp8 gemm {config_label(cfg)}" + (" (policy)" if i == 0 else "")
            fn = (lambda c: lambda: run_fp8_varlen_k_gemm(c, *a, *b, offs, out))(comp)
            out.fill_(float("nan"))
            fn()
            if want is None:   # float64 of the dequantized operands, group by group
                want = [ga @ gb.t() for ga, gb in zip(dequantized_groups(*a, host_sizes),
                                                      dequantized_groups(*b, host_sizes))]
            num = sum(((out[g].double() - w) ** 2).sum().item() for g, w in enumerate(want))
            den = sum((w ** 2).sum().item() for w in want)
            errors[key] = (num / max(den, 1e-300)) ** 0.5
            rows[key] = fn
            if i == 0:
                policy = comp
        rows["fp8 quantize dY + X"] = lambda: (quantize_fp8_block_slots(dy, sizes32),
                                               quantize_fp8_block_slots(x, sizes32))

        def total():
            qa = quantize_fp8_block_slots(dy, sizes32)
            qb = quantize_fp8_block_slots(x, sizes32)
            run_fp8_varlen_k_gemm(policy, *qa, *qb, offs, out)
        rows["fp8 total"] = total
        flops = 2.0 * M * Ma * Nb
        res = {}
        print(f"  {label}: Ma={Ma} Nb={Nb}", flush=True)
        for key, fn in rows.items():
            ms = median_ms(fn)
            res[key] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_float64": errors.get(key)}
            err = f"  rel err {errors[key]:.1e}" if key in errors else ""
            print(f"    {key:34s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s{err}", flush=True)
        bf16_ms = res["bf16 ours"]["ms"]
        print(f"    fp8 total / bf16 ours: {res['fp8 total']['ms'] / bf16_ms:.3f}x the time", flush=True)
        result["gemms"][label] = {"Ma": Ma, "Nb": Nb, "rows": res}
        del dy, x, out, a, b, want
        torch.cuda.empty_cache()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--groups", default="lognormal")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--tiles", default="all", choices=["all", "ordered"],
                    help="ordered: the policy's tile with and without ordered waves, and the 256 x 128 single CTA")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shapes {unknown}; known: {sorted(SHAPES)}")
    if args.precompile:
        from fusion.runtime.aot import compile_jobs
        compile_jobs(all_jobs(names, args.tiles), parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "1")))
        return None
    gen = torch.Generator().manual_seed(0)
    header = run_header()
    print(f"{header['gpu']}, torch {torch.__version__}, commit {header['commit']}", flush=True)
    results = [run_shape(n, g, gen, tiles=args.tiles) for n in names for g in args.groups.split(",")]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({**header, "results": results}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
