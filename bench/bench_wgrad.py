"""Weight gradients of MoE expert GEMMs: the varlen-K kernel (kernels/varlen_k_gemm.py) against torch._grouped_mm.

Per shape (experts E, hidden d, expert width f, tokens T, top-k; routed rows M = T*k sorted by expert):

  FC1 wgrad  dW1 (E, 2f, d) = dH_g.T @ x_g    x_g: token rows through the routing index
  FC2 wgrad  dW2 (E, d, f)  = dY_g.T @ h_g

Rows, TFLOP/s = 2*M*Ma*Nb / time:

  torch                    torch._grouped_mm(dy.t(), x, offs) on operands already in routed-row order
  torch index_select + mm  FC1 as a block without the fusion runs it: x.index_select, then torch._grouped_mm
  ours                     the varlen-K kernel at the tile policy's configuration for the shape's rows
                           (choose_wgrad_config(..., rows=M): what the runtime launches)
  ours, gathered x         FC1 reading x's rows through the index (no gathered copy)
  ours, gathered dY        FC2 reading the tokens' gradient dY's rows through the index (no Combine-backward copy)
  sweep <tile>             (--sweep) other tile configurations

Group distributions (--groups, GROUPS): "topk" (top-k of random logits: about balanced), "skewed" (expert weights
u^3: some experts get many rows, some none) and "lognormal" (the training-step bench's imbalance). Every row is
checked against torch's result (max relative error).

Usage (the kernels come from FUSION_CACHE_DIR; compile them first on any machine, no GPU needed):
    python bench/bench_wgrad.py --precompile [--sweep] [--no-gather] [--shapes ...]
    python bench/bench_wgrad.py [--sweep] [--no-gather] [--groups topk,lognormal] [--shapes ...] [--out results.json]
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fusion

from bench_common import median_ms  # noqa: E402
from held_out import HELD_OUT  # noqa: E402
from fusion.kernels.tile_policy import WgradConfig, choose_wgrad_config  # noqa: E402
from fusion.runtime.compile import KernelJob  # noqa: E402

SHAPES = {  # name: (E, d, f, T, k)
    "qwen3-30b-a3b": (128, 2048, 768, 16384, 8),
    "olmoe-1b-7b": (64, 2048, 1024, 16384, 8),
    "gpt-oss-120b": (128, 2880, 2880, 16384, 4),
    "deepseek-v3-ep8": (32, 7168, 2048, 16384, 8),
    "sonic-moe-cute": (128, 4096, 1024, 32768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 8192, 2),
    "deepseek-v2-lite": (64, 2048, 1408, 8192, 6),
    "qwen3-30b-a3b-T1024": (128, 2048, 768, 1024, 8),
    "qwen3-235b-a22b-T4096": (128, 4096, 1536, 4096, 8),   # the training-step bench's block: 256 rows per expert
    "qwen3-30b-a3b-T512": (128, 2048, 768, 512, 8),        # its small Qwen3 block: 32 rows per expert
    # rows per expert from 128 to 1024 on the same kernels (the --sweep's question: which tile at how many rows)
    "qwen3-30b-a3b-T2048": (128, 2048, 768, 2048, 8),      # 128 rows per expert
    "qwen3-30b-a3b-T4096": (128, 2048, 768, 4096, 8),      # 256
    "qwen3-235b-a22b-T2048": (128, 4096, 1536, 2048, 8),   # 128
    "qwen3-235b-a22b-T8192": (128, 4096, 1536, 8192, 8),   # 512
    "qwen3-235b-a22b-T16384": (128, 4096, 1536, 16384, 8),  # 1024
    "gpt-oss-120b-T8192": (128, 2880, 2880, 8192, 4),      # 256
    "deepseek-v3-ep8-T1024": (32, 7168, 2048, 1024, 8),    # 256
    "gpt-oss-120b-T1024": (128, 2880, 2880, 1024, 4),      # 32: one k-step a tile, the store is the kernel
    # shapes the rule by rows per group (kernels/tile_policy.py WGRAD_PINGPONG_ROWS) was not derived from
    "olmoe-1b-7b-T4096": (64, 2048, 1024, 4096, 8),        # 512
    "olmoe-1b-7b-T1024": (64, 2048, 1024, 1024, 8),        # 128
    "sonic-moe-cute-T4096": (128, 4096, 1024, 4096, 8),    # 256
    "mixtral-8x7b-T2048": (8, 4096, 14336, 2048, 2),       # 512
    # the training-step bench's blocks at its row counts (the lone-GEMM rule's measurements, fusion/runtime/lone_gemm.py)
    "small-batch-T2048": (8, 2048, 1024, 2048, 2),          # 512 rows per expert
    "qwen3-30b-a3b-T8192": (128, 2048, 768, 8192, 8),      # 512
    "olmoe-1b-7b-T8192": (64, 2048, 1024, 8192, 8),        # 1024
    "deepseek-v3-ep8-T8192": (32, 7168, 2048, 8192, 4),    # 1024
    # dense blocks (one group of T rows: the tile order's bands matter there, kernels/scheduler.py)
    "llama-3-8b": (1, 4096, 14336, 16384, 1),
    "llama-3-70b": (1, 8192, 28672, 8192, 1),
    "llama-3-8b-T4096": (1, 4096, 14336, 4096, 1),
    "llama-3-70b-T2048": (1, 8192, 28672, 2048, 1),
    "qwen2.5-7b-dense": (1, 3584, 18944, 8192, 1),
    "llama-3-8b-T1024": (1, 4096, 14336, 1024, 1),
    "qwen2.5-7b-dense-T512": (1, 3584, 18944, 512, 1),
}
# bench/held_out.py's MoE configurations (no rule was tuned on them), at the block benchmark's token counts
SHAPES.update({h.model: (h.E, h.d, h.f, h.tokens, h.top_k) for h in HELD_OUT if h.moe})
SWEEP = tuple(dataclasses.replace(c, cluster_m=m) for m in (2, 1) for c in (
    WgradConfig(tile_n=256, stages=4), WgradConfig(tile_n=192, stages=5, pingpong=True),
    WgradConfig(tile_n=128, stages=6, pingpong=True), WgradConfig(tile_n=128, stages=6)))


def job(cfg: WgradConfig, Ma: int, Nb: int, G: int) -> KernelJob:
    return KernelJob(step="bench", variant="wgrad", source="", config=dataclasses.astuple(cfg), dtype="bfloat16",
                     N=Nb, K=Ma, G=G, target="sm_90a", mainloop="varlen_k")


def gemms(E, d, f, T, k):
    """(label, Ma, Nb, the operand an MoE block may read through the index) of the shape's two weight gradients:
    FC1's B (x), FC2's A (dY)."""
    return (("fc1", 2 * f, d, "b"), ("fc2", d, f, "a"))


def configs(Ma, Nb, G, rows, gathered, sweep, gather=True):
    """(plain, gathered) configuration pairs: the tile policy's at `rows` routed rows first (the runtime's choice),
    then (sweep) the others; gathered (the `gathered` operand, "a" or "b", read through the index, cp.async: no
    cluster) once per tile."""
    base = choose_wgrad_config(Ma, Nb, G, rows=rows)
    # the policy's tile with its schedule walking n fastest, and with 16-byte stores (the store-bound question)
    store = [dataclasses.replace(base, n_fastest=True), dataclasses.replace(base, store_bytes=16),
             dataclasses.replace(base, n_fastest=True, store_bytes=16)]
    out = [base] + ([c for c in SWEEP + tuple(store) if c != base] if sweep else [])
    pairs, seen = [], set()
    for c in out:
        # (a gathered A keeps the tile's CTA pair: B multicast; a gathered B has none)
        gath = (dataclasses.replace(c, **{f"gather_{gathered}": True}, cluster_m=c.cluster_m if gathered == "a" else 1)
                if gathered and gather else None)
        pairs.append((c, gath if gath not in seen else None))
        seen.add(gath)
    return pairs


def all_jobs(names, sweep, gather=True):
    jobs = []
    for name in names:
        E, d, f, T, k = SHAPES[name]
        for _, Ma, Nb, gathered in gemms(E, d, f, T, k):
            for plain, gath in configs(Ma, Nb, E, T * k, gathered, sweep, gather):
                jobs.append(job(plain, Ma, Nb, E))
                if gath is not None:
                    jobs.append(job(gath, Ma, Nb, E))
    return jobs


#: The group distributions: "topk" (top-k of random logits: about balanced), "skewed" (logits biased by expert
#: weights u^3: a few experts take most rows, some none) and "lognormal" (bench/bench_training_step.py's: rows split
#: by weights exp(0.6 z), as the training-step and MoE benches route them).
GROUPS = ("topk", "skewed", "lognormal")


def routing(T, E, k, groups, gen, dev):
    """(group sizes (E,), index int32 (T*k,) of each routed row's token, rows sorted by expert) under `groups` (one
    of GROUPS)."""
    if groups == "lognormal":
        weights = torch.exp(0.6 * torch.randn(E, generator=gen))
        sizes = torch.distributions.Multinomial(T * k, probs=weights / weights.sum()).sample().long()
        return sizes.to(dev), torch.randint(0, T, (T * k,), generator=gen).to(torch.int32).to(dev)
    logits = torch.rand(T, E, generator=gen)
    if groups == "skewed":
        logits = logits + 4 * torch.rand(E, generator=gen) ** 3
    experts = logits.topk(k, dim=1).indices.flatten()
    order = torch.argsort(experts, stable=True)
    return torch.bincount(experts, minlength=E).to(dev), (order // k).to(torch.int32).to(dev)


def routed_shape(name, E, d, f, T, k, groups, gen, dev):
    """One shape's routing and the start of its result record (printed): (M, data generator, index, ends (o_1..o_G),
    offsets (o_0..o_G), result). Shared with bench/bench_pair_gemm.py."""
    M = T * k
    dgen = torch.Generator(device=dev).manual_seed(1)
    sizes, index = routing(T, E, k, groups, gen, dev)
    ends = torch.cumsum(sizes, 0).to(torch.int32)
    offs = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), ends])
    result = {"shape": dict(E=E, d=d, f=f, T=T, k=k, M=M), "groups": groups,
              "max_rows": int(sizes.max()), "empty_groups": int((sizes == 0).sum()), "gemms": {}}
    print(f"{name} [{result['groups']}]: E={E} d={d} f={f} T={T} k={k} M={M}, largest group {result['max_rows']}, "
          f"{result['empty_groups']} empty", flush=True)
    return M, dgen, index, ends, offs, result


def run_shape(name, E, d, f, T, k, groups, gen, sweep, gather=True, dev="cuda"):
    from fusion.kernels.wgrad_api import run_varlen_k_gemm
    from fusion.runtime.compile import load_compiled

    M, dgen, index, ends, offs, result = routed_shape(name, E, d, f, T, k, groups, gen, dev)
    for label, Ma, Nb, gathered in gemms(E, d, f, T, k):
        # the operand read through the index as (T, .) tokens, the other as (M, .) routed rows
        a_tok = torch.randn(T if gathered == "a" else M, Ma, generator=dgen, device=dev, dtype=torch.bfloat16)
        b_tok = torch.randn(T if gathered == "b" else M, Nb, generator=dgen, device=dev, dtype=torch.bfloat16)
        dy = a_tok.index_select(0, index) if gathered == "a" else a_tok
        xg = b_tok.index_select(0, index) if gathered == "b" else b_tok
        out = torch.empty(E, Ma, Nb, dtype=torch.bfloat16, device=dev)
        want = torch._grouped_mm(dy.t(), xg, offs=ends).float()
        scale = want.abs().max().item()
        # the output's bytes written and nothing read: the ceiling of a kernel whose time is its store
        rows = {"torch _grouped_mm": lambda: torch._grouped_mm(dy.t(), xg, offs=ends),
                "torch fill_ (D's bytes alone)": lambda: out.fill_(0.0)}
        if gathered == "b":
            rows["torch index_select + _grouped_mm"] = lambda: torch._grouped_mm(
                dy.t(), b_tok.index_select(0, index), offs=ends)
        errors = {}
        suffix_g = ", gathered x" if gathered == "b" else ", gathered dY"
        for i, (plain, gath) in enumerate(configs(Ma, Nb, E, M, gathered, sweep, gather)):
            tag = "ours" if i == 0 else "sweep"
            gathered_in = (a_tok if gathered == "a" else dy, b_tok if gathered == "b" else xg)
            for cfg, a_in, b_in, idx, suffix in ((plain, dy, xg, None, ""), (gath, *gathered_in, index, suffix_g)):
                if cfg is None:
                    continue
                comp = load_compiled(job(cfg, Ma, Nb, E))
                key = (f"{tag}{suffix} ({cfg.tile_m}x{cfg.tile_n} {'pp' if cfg.pingpong else 'coop'} s{cfg.stages}"
                       f"{' c2' if cfg.cluster_m > 1 else ''}{' nf' if cfg.n_fastest else ''}"
                       f"{' st16' if cfg.store_bytes == 16 else ''})")
                fn = (lambda c, a, b, ix: lambda: run_varlen_k_gemm(c, a, b, offs, out, index=ix))(comp, a_in, b_in,
                                                                                                    idx)
                out.fill_(float("nan"))
                fn()
                errors[key] = (out.float() - want).abs().max().item() / scale
                rows[key] = fn
        flops = 2.0 * M * Ma * Nb
        res = {}
        print(f"  {label}: Ma={Ma} Nb={Nb}", flush=True)
        for key, fn in rows.items():
            ms = median_ms(fn)
            # D's bytes per second: where a few rows per group leave the kernel its store
            write_tbs = out.numel() * out.element_size() / ms / 1e9
            res[key] = {"ms": ms, "tflops": flops / ms / 1e9, "d_write_tbs": write_tbs,
                        "max_rel_err": errors.get(key)}
            err = f"  err {errors[key]:.1e}" if key in errors else ""
            print(f"    {key:<52} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  D {write_tbs:5.2f} TB/s{err}",
                  flush=True)
        result["gemms"][label] = {"Ma": Ma, "Nb": Nb, "rows": res}
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="comma-separated names of " + ",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time the other tile configurations")
    ap.add_argument("--skewed", action="store_true", help="also the skewed group distribution")
    ap.add_argument("--groups", default="topk", help="comma-separated group distributions of " + ",".join(GROUPS))
    ap.add_argument("--no-gather", action="store_true",
                    help="leave out the kernels that gather an operand (FC1's x, FC2's dY)")
    ap.add_argument("--precompile", action="store_true", help="compile the kernels into FUSION_CACHE_DIR and exit")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    if args.precompile:
        from fusion.runtime.aot import compile_jobs
        compile_jobs(all_jobs(names, args.sweep, not args.no_gather),
                     parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "0")) or None)
        return
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "commit": os.environ.get("FUSION_COMMIT"), "shapes": []}
    print(results["device"], flush=True)
    for name in names:
        for groups in args.groups.split(",") + (["skewed"] if args.skewed else []):
            results["shapes"].append({"name": name, **run_shape(name, *SHAPES[name], groups, gen, args.sweep,
                                                                      not args.no_gather)})
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
