"""The MoE FC1 with its token gather fused: gather-A kernel against the gather written out first.

Per shape (experts E, hidden d, expert width f, tokens T, top-k): routed rows M = T*k, sorted by expert; the FC1 is
a gated GEMM (N = 2f, K = d) with the SwiGLU*scale epilogue.

  gather-A kernel          run_grouped_gemm(..., index=): A = x (T, d), rows read through the index (one kernel),
                           at the runtime's schedule and at the other one (static / dynamic tile order)
  pre-gathered, same tile  the same tile configuration reading x[index] by TMA (kernel time only), both schedules
  pre-gathered, runtime    the configuration the runtime uses without gathering (may be dynamic), kernel only
  index_select + kernel    what a block does without the fusion: x.index_select, then the runtime's kernel
  torch                    x.index_select + torch._grouped_mm (the GEMM alone, no epilogue)

TFLOP/s counts 2*M*d*2f for every row. Usage: python bench/bench_gather_gemm.py [--shapes i,j] [--sweep] [--out file.json]
(--sweep: every gather-A tile configuration autotune mode would try, kernels/tile_policy.py candidates, and the
widths that leave a ragged last n-tile).
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fusion

import fusion.kernels as K  # noqa: E402
from bench_common import median_ms  # noqa: E402
from held_out import HELD_OUT  # noqa: E402
from fusion.kernels.tile_policy import GemmConfig, candidates, tile_config  # noqa: E402

SHAPES = {  # name: (E, d, f, T, k)
    "qwen3-30b-a3b": (128, 2048, 768, 16384, 8),
    "olmoe": (64, 2048, 1024, 16384, 8),
    "mixtral-8x7b": (8, 4096, 14336, 8192, 2),
    "gpt-oss-120b": (128, 2880, 2880, 16384, 4),
    "qwen3-235b-a22b": (128, 4096, 1536, 16384, 8),
    "deepseek-v3-ep8": (32, 7168, 2048, 8192, 8),
    # bench/held_out.py's MoE configurations at bench_moe.py's 16384 tokens (no rule was tuned on them)
    **{h.model: (h.E, h.d, h.f, 16384, h.top_k) for h in HELD_OUT if h.moe},
}


def routing(T, E, k, gen, dev):
    """Top-k of random logits per token (about balanced): (group sizes, index int32 (T*k,) sorted by expert)."""
    experts = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.flatten()
    order = torch.argsort(experts, stable=True)
    return torch.bincount(experts, minlength=E).to(dev), (order // k).to(torch.int32).to(dev)


def _label(cfg) -> str:
    """A tile configuration in a few words: 128x192 pp dyn c2."""
    return (f"{cfg.tile_m}x{cfg.tile_n} {'pp' if cfg.pingpong else 'coop'}{' dyn' if cfg.dynamic else ''}"
            f"{' c2' if cfg.cluster_n > 1 else ''}{' m2' if cfg.cluster_m > 1 else ''}")


def run_shape(name, E, d, f, T, k, gen, dev="cuda", sweep=False, runtime_only=False):
    N, M = 2 * f, T * k
    x = torch.randn(T, d, generator=gen).to(dev, torch.bfloat16)
    W = (torch.randn(E, N, d, generator=gen) / d ** 0.5).to(dev, torch.bfloat16)
    sizes, index = routing(T, E, k, gen, dev)
    offs = K.offsets_from_group_sizes(sizes)
    scale = torch.rand(M, generator=gen).to(dev)
    epi = K.SwiGLUScaleEpilogue()
    gather_cfg = GemmConfig(*tile_config(N, d, E, True, "K", False, gather=True))
    runtime_cfg = GemmConfig(*tile_config(N, d, E, True, "K", False))
    other_cfg = dataclasses.replace(gather_cfg, dynamic=not gather_cfg.dynamic)   # the other schedule
    kern = {
        "gather": K.compile_grouped_gemm(gather_cfg, epi, "bfloat16", N, d, E),
        "same": K.compile_grouped_gemm(dataclasses.replace(gather_cfg, gather_a=False), epi, "bfloat16", N, d, E),
        "runtime": K.compile_grouped_gemm(runtime_cfg, epi, "bfloat16", N, d, E),
    }
    if not runtime_only:
        kern["gather-other"] = K.compile_grouped_gemm(other_cfg, epi, "bfloat16", N, d, E)
        kern["same-other"] = K.compile_grouped_gemm(dataclasses.replace(other_cfg, gather_a=False), epi, "bfloat16",
                                                    N, d, E)
    sched = {True: "dynamic", False: "static"}
    out = torch.empty(M, f, dtype=torch.bfloat16, device=dev)
    xg = x.index_select(0, index)

    def run(key, a, idx=None):
        K.run_grouped_gemm(kern[key], a, W, offs, {"out": out}, {"scale": scale}, index=idx)

    run("gather", x, index)
    fused = out.clone()
    run("same", xg)
    diff = (fused.float() - out.float()).abs().max().item()
    rows = {
        f"gather-A kernel ({kern['gather'].config.tile_n} wide, {sched[gather_cfg.dynamic]})":
            lambda: run("gather", x, index),
        f"pre-gathered, same tile, {sched[gather_cfg.dynamic]}": lambda: run("same", xg),
        f"pre-gathered, runtime ({_label(kern['runtime'].config)})": lambda: run("runtime", xg),
        "index_select + runtime kernel": lambda: run("runtime", x.index_select(0, index)),
    }
    if not runtime_only:
        rows[f"gather-A kernel ({kern['gather-other'].config.tile_n} wide, {sched[other_cfg.dynamic]})"] = \
            lambda: run("gather-other", x, index)
        rows[f"pre-gathered, same tile, {sched[other_cfg.dynamic]}"] = lambda: run("same-other", xg)
    if sweep:  # autotune mode's gather-A candidates, and the widths that leave a ragged last n-tile
        ragged = [dataclasses.replace(gather_cfg, tile_n=tn, stages=st, pingpong=pp)
                  for tn, st in ((128, 6), (192, 5), (256, 4)) for pp in (False, True) if N % tn]
        for cfg in [c for c in candidates(gather_cfg, N)[1:] + ragged if c != gather_cfg]:
            try:
                kern[cfg] = K.compile_grouped_gemm(cfg, epi, "bfloat16", N, d, E)
            except Exception as exc:  # noqa: BLE001 - a candidate that does not build is reported, not fatal
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            label = (f"gather-A {cfg.tile_m}x{cfg.tile_n} {'pingpong' if cfg.pingpong else 'cooperative'} "
                     f"s{cfg.stages} {sched[cfg.dynamic]}")
            rows[label] = (lambda c: lambda: run(c, x, index))(cfg)
    if hasattr(torch, "_grouped_mm"):
        rows["torch index_select + _grouped_mm"] = lambda: torch._grouped_mm(
            x.index_select(0, index), W.transpose(-2, -1), offs=offs[1:])
    flops = 2.0 * M * d * N
    result = {"shape": dict(E=E, d=d, f=f, T=T, k=k, M=M), "max_abs_diff_vs_pregathered": diff, "rows": {}}
    print(f"{name}: E={E} d={d} f={f} T={T} k={k} (M={M}); gather vs pre-gathered max |diff| = {diff:.3g}",
          flush=True)
    for label, fn in rows.items():
        ms = median_ms(fn)
        tf = flops / ms / 1e9
        result["rows"][label] = {"ms": ms, "tflops": tf}
        print(f"  {label:<42} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="comma-separated names of " + ",".join(SHAPES))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time every gather-A tile candidate")
    ap.add_argument("--runtime-only", action="store_true",
                    help="only the runtime's gathering kernel and its kernel without the gather (three compiles)")
    args = ap.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "shapes": {}}
    print(results["device"], flush=True)
    for name in names:
        results["shapes"][name] = run_shape(name, *SHAPES[name], gen, sweep=args.sweep, runtime_only=args.runtime_only)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
