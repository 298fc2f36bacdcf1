"""The MoE FC1 with its token gather fused: gather-A kernel against the gather written out first.

Per shape (experts E, hidden d, expert width f, tokens T, top-k): routed rows M = T*k, sorted by expert; the FC1 is
a gated GEMM (N = 2f, K = d) with the epilogue of the MoE layer plan's FC1 training job (SwiGLU*scale, also writing
the pre-activation H for the backward): the kernel a training step launches, at these tile configurations:

  gather-A kernel          the kernel reads A = x (T, d) through the index (one kernel), at the policy's
                           configuration, and the same tile as single CTAs or as CTA pairs on neighbouring m-tiles
                           sharing B (tile_policy.gather_pairs), whichever the policy is not; and the single CTA
                           loading A's rows by one TMA box each (GemmConfig.gather_tma), alone and as a CTA pair
                           along n sharing them (each CTA loads half the rows, multicast to both)
  pre-gathered, same tile  the same tile as single CTAs reading x[index] by TMA (kernel time only)
  pre-gathered, runtime    the configuration the runtime uses without gathering (CTA pairs where they fit)
  index_select + kernel    what a block does without the fusion: x.index_select, then the runtime's kernel
  torch                    x.index_select + torch._grouped_mm (the GEMM alone, no epilogue)

Every kernel's output is compared with the single gathering CTA's (max |diff|: the same sums in the same order).
TFLOP/s counts 2*M*d*2f for every row. The kernels load from the kernel cache, so they can be compiled elsewhere:

    FUSION_CACHE_DIR=/tmp/kc CUTE_DSL_ARCH=sm_90a python bench/bench_gather_gemm.py --precompile [--shapes ...]
    python bench/bench_gather_gemm.py [--shapes i,j] [--sweep] [--runtime-only] [--static] [--rounds 3] [--out f.json]

(--sweep: every gather-A tile configuration autotune mode would try, kernels/tile_policy.py candidates, and the
widths that leave a ragged last n-tile).

--profile: instead of timing, launch each row's kernel once between cudaProfilerStart and cudaProfilerStop, for
Nsight Compute (the lent machine needs --clock-control none):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python bench/bench_gather_gemm.py --profile --shapes qwen3-30b-a3b
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
from fusion.errors import KernelConfigError  # noqa: E402
from fusion.kernels.tile_policy import GemmConfig, candidates, n_tile_count, tile_config  # noqa: E402

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


def fc1_job(E, d, f, k):
    """The MoE layer plan's FC1 training job (fusion.MoE.swiglu's experts block)."""
    import fusion
    from fusion.runtime.aot import plan_jobs

    with torch.device("meta"):
        moe = fusion.MoE.swiglu(d, E, f, k, device="meta")
    return next(j for j in plan_jobs(moe.experts, torch.bfloat16) if j.step == "F1" and j.variant == "train")


def shape_jobs(E, d, f, k, sweep=False, runtime_only=False, static=False) -> dict:
    """The kernels timed for one shape, KernelJobs by name: "gather" (the policy's gathering configuration),
    "runtime" (the policy's configuration without gathering), and unless `runtime_only` the policy's gathering tile
    as "single" CTAs and as CTA "pairs" along m (each where it is not the policy's own and the template builds it),
    "tma_rows" (that tile as single CTAs loading A's rows by one TMA box each: GemmConfig.gather_tma) and "tma_pairs"
    (the same as a CTA pair along n, where the n-tiles pair up), and "same"
    (that tile as single CTAs reading pre-gathered rows by TMA); with `static` "static" (the policy's
    gathering configuration on the static tile order: quack's and SonicMoE's choice); with `sweep` the gathering
    candidates, keyed by GemmConfig."""
    N = 2 * f
    base = fc1_job(E, d, f, k)
    gather_cfg = GemmConfig(*tile_config(N, d, E, True, "K", False, gather=True))
    single = dataclasses.replace(gather_cfg, cluster_m=1)
    cfgs = {"gather": gather_cfg, "runtime": GemmConfig(*tile_config(N, d, E, True, "K", False))}
    if not runtime_only:
        pairs = dataclasses.replace(single, cluster_m=2)
        try:
            K.check_config(pairs, K.SwiGLUScaleEpilogue(), "bfloat16", N, d)
        except KernelConfigError:
            pairs = gather_cfg   # not buildable: left out below
        cfgs.update({name: cfg for name, cfg in (("single", single), ("pairs", pairs)) if cfg != gather_cfg})
        cfgs["tma_rows"] = dataclasses.replace(single, gather_tma=True)   # A's rows by one TMA box each
        if n_tile_count(N, single.tile_n) % 2 == 0:                         # ... as a pair along n sharing them
            cfgs["tma_pairs"] = dataclasses.replace(single, gather_tma=True, cluster_n=2)
        cfgs["same"] = dataclasses.replace(single, gather_a=False)
    if static:
        cfgs["static"] = dataclasses.replace(gather_cfg, dynamic=False)
    if sweep:  # autotune mode's gather-A candidates, and the widths that leave a ragged last n-tile
        ragged = [dataclasses.replace(single, tile_n=tn, stages=st, pingpong=pp)
                  for tn, st in ((128, 6), (192, 5), (256, 4)) for pp in (False, True) if N % tn]
        cfgs.update({c: c for c in candidates(single, N)[1:] + ragged if c not in (single, gather_cfg)})
    return {name: dataclasses.replace(base, config=dataclasses.astuple(cfg)) for name, cfg in cfgs.items()}


def _slot_tensor(spec, M, f, dev, gen):
    """A tensor for an epilogue slot: (M,) row vectors (the router scale: random, positive), else (M, f) or paired
    (M, 2f), in the slot's dtype."""
    dtype = getattr(torch, spec.dtype) if spec.dtype else torch.bfloat16
    if isinstance(spec, K.RowVector):
        return torch.rand(M, generator=gen).to(dev, dtype)
    return torch.empty(M, 2 * f if spec.paired else f, dtype=dtype, device=dev)


def run_shape(name, E, d, f, T, k, gen, dev="cuda", sweep=False, runtime_only=False, rounds=1, static=False,
              profile=False):
    from fusion.runtime.compile import load_compiled

    N, M = 2 * f, T * k
    x = torch.randn(T, d, generator=gen).to(dev, torch.bfloat16)
    W = (torch.randn(E, N, d, generator=gen) / d ** 0.5).to(dev, torch.bfloat16)
    sizes, index = routing(T, E, k, gen, dev)
    offs = K.offsets_from_group_sizes(sizes)
    kern = {}
    for key, job in shape_jobs(E, d, f, k, sweep, runtime_only, static).items():
        try:
            kern[key] = load_compiled(job)
        except Exception as exc:  # noqa: BLE001 - a sweep candidate that does not build is reported, not fatal
            if not isinstance(key, GemmConfig):
                raise
            print(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    epi = kern["gather"].epilogue
    ins = {s.name: _slot_tensor(s, M, f, dev, gen) for s in epi.inputs}
    outs = {s.name: _slot_tensor(s, M, f, dev, gen) for s in epi.outputs}
    out = outs[epi.outputs[0].name]
    xg = x.index_select(0, index)

    def run(key, a, idx=None):
        K.run_grouped_gemm(kern[key], a, W, offs, outs, ins, index=idx)

    rows = {f"gather-A kernel ({_label(kern['gather'].config)})": ("gather", x, index),
            f"pre-gathered, runtime ({_label(kern['runtime'].config)})": ("runtime", xg, None)}
    for key in ("single", "pairs"):
        if key in kern:
            rows[f"gather-A kernel ({_label(kern[key].config)})"] = (key, x, index)
    for key in ("tma_rows", "tma_pairs"):
        if key in kern:
            rows[f"gather-A by TMA rows ({_label(kern[key].config)})"] = (key, x, index)
    if "same" in kern:
        rows[f"pre-gathered, same tile ({_label(kern['same'].config)})"] = ("same", xg, None)
    if "static" in kern:
        rows[f"gather-A kernel ({_label(kern['static'].config)}, static)"] = ("static", x, index)
    for cfg in [key for key in kern if isinstance(key, GemmConfig)]:   # the sweep's, by the tile they were built at
        built = kern[cfg].config
        rows[f"gather-A {_label(built)} s{built.stages}{'' if built.dynamic else ' static'}"] = (cfg, x, index)
    ref_key = "single" if "single" in kern else "gather"
    run(ref_key, x, index)
    ref = out.clone()
    diffs = {}
    for label, (key, a, idx) in rows.items():
        out.fill_(float("nan"))
        run(key, a, idx)
        diffs[label] = (out.float() - ref.float()).abs().max().item()   # NaN where a row went unwritten
    diff = float("nan") if any(v != v for v in diffs.values()) else max(diffs.values())
    rows = {label: (lambda key=key, a=a, idx=idx: run(key, a, idx)) for label, (key, a, idx) in rows.items()}
    if profile:   # each kernel once, in the profiler's window, in the printed order
        for n, (label, call) in enumerate(rows.items()):
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"  profiled kernel {n}: {label}", flush=True)
        return {"shape": dict(E=E, d=d, f=f, T=T, k=k, M=M), "profiled": list(rows)}
    rows["index_select + runtime kernel"] = lambda: run("runtime", x.index_select(0, index))
    if hasattr(torch, "_grouped_mm"):
        rows["torch index_select + _grouped_mm"] = lambda: torch._grouped_mm(
            x.index_select(0, index), W.transpose(-2, -1), offs=offs[1:])
    flops = 2.0 * M * d * N
    result = {"shape": dict(E=E, d=d, f=f, T=T, k=k, M=M), "max_abs_diff_vs_single_gather": diff, "rows": {}}
    print(f"{name}: E={E} d={d} f={f} T={T} k={k} (M={M}); every kernel vs the single gathering CTA: max |diff| = "
          f"{diff:.3g} {'' if diff == diff else '(NaN: rows left unwritten!)'}", flush=True)
    times = {label: [] for label in rows}
    for r in range(rounds):   # every row once per round, the order reversed every other round (clock drift)
        for label in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
            times[label].append(median_ms(rows[label]))
    for label, ms_all in times.items():
        ms = sorted(ms_all)[len(ms_all) // 2]
        tf = flops / ms / 1e9
        result["rows"][label] = {"ms": ms, "tflops": tf, "rounds_ms": ms_all}
        each = f"  rounds {' '.join(f'{t:.3f}' for t in ms_all)}" if rounds > 1 else ""
        print(f"  {label:<42} {ms:8.3f} ms {tf:7.1f} TFLOP/s{each}", flush=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="comma-separated names of " + ",".join(SHAPES))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time every gather-A tile candidate")
    ap.add_argument("--static", action="store_true",
                    help="also the policy's gathering configuration on the static tile order")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every row this many times, in alternating order; report the median")
    ap.add_argument("--precompile", action="store_true",
                    help="only compile the kernels into FUSION_CACHE_DIR (no GPU needed)")
    ap.add_argument("--profile", action="store_true",
                    help="launch each kernel once inside cudaProfilerStart/Stop (run under ncu); no timing")
    ap.add_argument("--runtime-only", action="store_true",
                    help="only the runtime's gathering kernel and its kernel without the gather (three compiles)")
    args = ap.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    if args.precompile:
        from fusion.runtime.aot import compile_jobs

        jobs = [j for n in names for j in shape_jobs(*(SHAPES[n][i] for i in (0, 1, 2, 4)), args.sweep,
                                                     args.runtime_only, args.static).values()]
        compile_jobs(jobs, parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "1")))
        return
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "shapes": {}}
    print(results["device"], flush=True)
    for name in names:
        results["shapes"][name] = run_shape(name, *SHAPES[name], gen, sweep=args.sweep, runtime_only=args.runtime_only,
                                            rounds=args.rounds, static=args.static, profile=args.profile)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
