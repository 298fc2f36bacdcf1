"""The varlen-M grouped GEMM on the four routed-row GEMMs of an MoE block: single CTAs against CTA pairs that share
the A tile by TMA multicast (GemmConfig.cluster_n = 2), and against torch._grouped_mm where torch can run the same
GEMM.

Per shape (experts E, hidden d, expert width f, tokens T, top-k; routed rows M = T*k sorted by expert):

  fc1_fwd    (M, d) x W1 (E, 2f, d)  -> SwiGLU * scale, and the pre-activation (the plan's F1 training kernel)
  fc1_fwd_inference                   the same without the pre-activation (the plan's F1 inference kernel)
  fc2_fwd    (M, f) x W2 (E, d, f)   -> (M, d)            identity epilogue, B K-major
  fc2_dgrad  (M, d) x W2 (E, d, f)   -> d(SwiGLU * scale) (the plan's B1 kernel: dH's epilogue reads H)
  fc1_dgrad  (M, 2f) x W1 (E, 2f, d) -> (M, d)            identity epilogue, B MN-major (the weight as stored)

Configurations: the tile policy's (what the runtime launches), then the same tile with either schedule (static, or
dynamic: tile ids from an atomic counter), single CTAs or CTA pairs ("c2", where the n-tile count is even), and
CTA pairs on neighbouring m-tiles multicasting B ("m2", dynamic; B not gated); with --short-ab only the policy's
configuration with and without short tiles (GemmConfig.short_tiles: a group's last m-tile of at most 64 rows issues
only their wgmma);
with --tile-m-64 also 64-row pingpong tiles (64x128 s8, 64x192 s6, 64x256 s5, dynamic schedule), which waste less
of a group's last m-tile at few rows per group. TFLOP/s = 2*M*N*K / time (gated: N = 2f). Every kernel's output is
checked against the policy kernel's (max relative difference; 0 where they are bitwise equal). Each row is timed in
two rounds (the second in reverse order) after the GPU has run them all for half a second, and reports the lower
median.

Usage (compiles on first use; FUSION_CACHE_DIR keeps the kernels between runs):
    python bench/bench_pair_gemm.py --precompile [--shapes ...] [--tile-m-64]
    python bench/bench_pair_gemm.py [--shapes ...] [--skewed] [--tile-m-64] [--out results.json]
    python bench/bench_pair_gemm.py --bands 1,8,16 --shapes llama-3-8b,...   (the tile order's bands instead)
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fusion

from bench_common import median_ms, warm_gpu  # noqa: E402
from bench_wgrad import SHAPES, routed_shape  # noqa: E402
from fusion.runtime.compile import KernelJob  # noqa: E402

#: Also time 64-row tiles (--tile-m-64): (tile_n, stages) of the pingpong 64-row tiles that fit shared memory.
TILE_M_64 = {"on": False, "tiles": ((128, 8), (192, 6), (256, 5))}
#: --bands B1,B2,...: time the policy's configuration with each band of the tile order (GemmConfig.band_m) instead
#: of the schedule variants.
BANDS = {"values": ()}
#: --short-ab: time the policy's configuration with and without short tiles instead of the schedule variants.
SHORT_AB = {"on": False}
#: --no-schedules: time the policy's configuration and the --tiles ones only, not its tile on the other schedules
#: (static/dynamic x single/pairs, m-pairs): a sweep over many shapes that fits one device call.
SCHEDULES = {"on": True}
#: --gemms: time only these of plan_kernels' GEMMs.
GEMMS = {"only": ()}
#: --tiles N:S:pp|coop,...: also time the policy's configuration at these tile widths, stages and consumer schedules
#: (dynamic schedule, single CTAs), e.g. 192:5:pp for a width that divides N where 128 leaves a ragged n-tile.
TILES = {"extra": (), "pairs": False, "m_pairs": False}


def plan_kernels(E, d, f):
    """{gemm: KernelJob at the tile policy's configuration} of the block's four routed-row GEMMs."""
    import fusion
    from fusion import GroupLinear, Scale, SwiGLU
    from fusion.runtime.aot import plan_jobs
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job
    from fusion.runtime.lone_gemm import with_lone_tile   # the lone GEMMs run the wide tile where the rule says

    with torch.device("meta"):
        seq = fusion.Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d))
    jobs = {(j.step, j.variant): j for j in plan_jobs(seq, torch.bfloat16)}
    return {
        "fc1_fwd": jobs[("F1", "train")],
        "fc1_fwd_inference": jobs[("F1", "inference")],
        "fc2_fwd": with_lone_tile(make_job(IDENTITY_SOURCE, torch.bfloat16, d, f, E, False, "K", False, "fc2",
                                            "identity")),
        "fc2_dgrad": jobs[("B1", "backward")],
        "fc1_dgrad": with_lone_tile(make_job(IDENTITY_SOURCE, torch.bfloat16, d, 2 * f, E, False, "MN", False,
                                              "fc1dgrad", "identity")),
    }


def variants(job: KernelJob):
    """(label, job) of the policy's configuration and its twins (see the module docstring)."""
    from fusion.kernels.tile_policy import GemmConfig, n_tile_count

    base = GemmConfig(*job.config)
    pairs = n_tile_count(job.N, base.tile_n) % 2 == 0 and not base.gather_a
    out = [("policy", base)]
    if SHORT_AB["on"]:
        # the policy's configuration with every tile issuing all of its rows' wgmma (GemmConfig.short_tiles)
        return _as_jobs(job, out + [("no short tiles", dataclasses.replace(base, short_tiles=False))])
    if BANDS["values"]:
        out += [(f"band {b}", dataclasses.replace(base, band_m=b)) for b in BANDS["values"] if b != base.band_m]
        return _as_jobs(job, out)
    for dynamic in ((False, True) if SCHEDULES["on"] else ()):
        for cn in ((1, 2) if pairs else (1,)):
            cfg = dataclasses.replace(base, dynamic=dynamic, cluster_n=cn, cluster_m=1)
            if cfg != base:
                out.append((("dyn" if dynamic else "static") + (" c2" if cn > 1 else ""), cfg))
    if SCHEDULES["on"] and not base.gather_a and job.step != "F1":   # F1: the gated FC1 (two B boxes per stage)
        # CTA pairs on neighbouring m-tiles multicasting B (cluster_m = 2), dynamic: what an odd n-tile count allows
        m2 = dataclasses.replace(base, dynamic=True, cluster_n=1, cluster_m=2)
        if m2 != base:
            out.append(("dyn m2", m2))
    for tile_n, stages, pingpong in TILES["extra"]:
        cfg = dataclasses.replace(base, tile_n=tile_n, stages=stages, pingpong=pingpong, dynamic=True, cluster_n=1,
                                  cluster_m=1)
        label = f"128x{tile_n} {'pp' if pingpong else 'coop'} s{stages}"
        if cfg != base:
            out.append((f"{label} dyn", cfg))
        if TILES["pairs"] and n_tile_count(job.N, tile_n) % 2 == 0 and not base.gather_a:
            # the same tile as CTA pairs sharing A (cluster_n = 2), on either schedule
            out += [(f"{label} static c2", dataclasses.replace(cfg, dynamic=False, cluster_n=2)),
                    (f"{label} dyn c2", dataclasses.replace(cfg, cluster_n=2))]
        if TILES["m_pairs"] and not base.gather_a and job.step != "F1":
            # pairs on neighbouring m-tiles multicasting B (cluster_m = 2), dynamic: torch._grouped_mm's sm90 kernel
            # for large groups is 128x256 cooperative with a 2x1 cluster (aten/src/ATen/native/cuda/GroupMM.cu)
            out.append((f"{label} dyn m2", dataclasses.replace(cfg, cluster_m=2)))
    if TILE_M_64["on"]:
        for tile_n, stages in TILE_M_64["tiles"]:
            cfg = dataclasses.replace(base, tile_m=64, tile_n=tile_n, stages=stages, pingpong=True, dynamic=True,
                                      cluster_n=1)
            if cfg != base:
                out.append((f"64x{tile_n} dyn", cfg))
    return _as_jobs(job, out)


def _as_jobs(job: KernelJob, configs) -> list:
    """(label, `job` at that configuration) for each (label, GemmConfig) of `configs`."""
    return [(label, dataclasses.replace(job, config=dataclasses.astuple(cfg))) for label, cfg in configs]


def all_jobs(names):
    jobs = []
    for name in names:
        E, d, f, _, _ = SHAPES[name]
        for gemm, job in plan_kernels(E, d, f).items():
            if not GEMMS["only"] or gemm in GEMMS["only"]:
                jobs += [j for _, j in variants(job)]
    return jobs


def slot_tensors(epi, M, N, G, dtype, gen, dev):
    """Random inputs and empty outputs for every slot the epilogue of a GEMM N wide declares (kernels/epilogue.py;
    a gated epilogue's logical width is N/2)."""
    from fusion.kernels.epilogue import AuxInput, GroupVector, RowVector
    from fusion.kernels.api import allocate_outputs

    n_log = N // 2 if epi.gated else N
    extras = {}
    for s in epi.inputs:
        dt = getattr(torch, s.dtype) if getattr(s, "dtype", None) else dtype
        width = n_log * (2 if getattr(s, "paired", False) else 1)
        shape = {RowVector: (M,), AuxInput: (M, width), GroupVector: (G, width)}[type(s)]
        extras[s.name] = torch.randn(*shape, generator=gen, device=dev).to(dt)
    return allocate_outputs(epi, M, N, str(dtype).removeprefix("torch."), dev), extras


def run_shape(name, skewed, gen, dev="cuda"):
    from fusion.kernels import run_grouped_gemm
    from fusion.runtime.compile import load_compiled

    E, d, f, T, k = SHAPES[name]
    M, dgen, _, ends, offs, result = routed_shape(name, E, d, f, T, k, "skewed" if skewed else "topk", gen, dev)
    bf = torch.bfloat16
    w1 = torch.randn(E, 2 * f, d, generator=dgen, device=dev, dtype=bf) / d ** 0.5
    w2 = torch.randn(E, d, f, generator=dgen, device=dev, dtype=bf) / f ** 0.5
    operands = {  # gemm: (A, B as the kernel reads it, torch's equivalent or None)
        "fc1_fwd": (torch.randn(M, d, generator=dgen, device=dev, dtype=bf), w1, None),
        "fc1_fwd_inference": (torch.randn(M, d, generator=dgen, device=dev, dtype=bf), w1, None),
        "fc2_fwd": (torch.randn(M, f, generator=dgen, device=dev, dtype=bf), w2,
                    lambda a: torch._grouped_mm(a, w2.transpose(-2, -1), offs=ends)),
        "fc2_dgrad": (torch.randn(M, d, generator=dgen, device=dev, dtype=bf), w2, None),
        "fc1_dgrad": (torch.randn(M, 2 * f, generator=dgen, device=dev, dtype=bf), w1,
                      lambda a: torch._grouped_mm(a, w1, offs=ends)),
    }
    for gemm, job in plan_kernels(E, d, f).items():
        if GEMMS["only"] and gemm not in GEMMS["only"]:
            continue
        A, B, torch_fn = operands[gemm]
        flops = 2.0 * M * job.N * job.K
        rows, ref = {}, None
        print(f"  {gemm}: N={job.N} K={job.K}", flush=True)
        if torch_fn is not None:
            rows["torch _grouped_mm"] = (lambda fn, a: lambda: fn(a))(torch_fn, A)
            ref = torch_fn(A).float()
        errors, slots = {}, None
        for label, vjob in variants(job):
            comp = load_compiled(vjob)
            cfg = comp.config
            if slots is None:   # the same inputs for every configuration, so their outputs compare
                slots = slot_tensors(comp.epilogue, M, job.N, E, bf, dgen, dev)
            outs, extras = {k: v.clone() for k, v in slots[0].items()}, slots[1]
            fn = (lambda c, a, o, x: lambda: run_grouped_gemm(c, a, B, offs, o, x))(comp, A, outs, extras)
            fn()
            first = next(iter(outs.values())).float()
            if ref is None:
                ref = first
            scale = ref.abs().max().clamp_min(1e-30)
            key = (f"{label} ({cfg.tile_m}x{cfg.tile_n} {'pp' if cfg.pingpong else 'coop'} s{cfg.stages}"
                   f"{' dyn' if cfg.dynamic else ''}{' c2' if cfg.cluster_n > 1 else ''}{' m2' if cfg.cluster_m > 1 else ''}"
                   f" bm{cfg.band_m}{'' if cfg.short_tiles else ' full'})")
            errors[key] = ((first - ref).abs().max() / scale).item()
            rows[key] = fn
        # two rounds, the second in reverse order, and each row's lower median: the first row timed after a GEMM
        # change read high (up to 24%: Llama-3-70B's FC2 forward, bench/results/H100-2026-11-26i-tiles.log); the
        # GPU is kept busy for a while first, or the first row reads low (bench_common.warm_gpu)
        warm_gpu(rows.values())
        first = {key: median_ms(fn) for key, fn in rows.items()}
        second = {key: median_ms(rows[key]) for key in reversed(list(rows))}
        res = {}
        for key in rows:
            ms = min(first[key], second[key])
            res[key] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_diff": errors.get(key),
                        "rounds_ms": [first[key], second[key]]}
            err = f"  diff {errors[key]:.1e}" if key in errors else ""
            print(f"    {key:<44} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s{err}", flush=True)
        result["gemms"][gemm] = {"N": job.N, "K": job.K, "rows": res}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--skewed", action="store_true", help="also the skewed group distribution")
    ap.add_argument("--precompile", action="store_true", help="compile every kernel into FUSION_CACHE_DIR (no GPU)")
    ap.add_argument("--tile-m-64", action="store_true", help="also 64-row pingpong tiles")
    ap.add_argument("--bands", default="", help="comma-separated band_m values: time those instead of the schedules")
    ap.add_argument("--gemms", default="", help="comma-separated GEMMs (fc1_fwd, fc2_fwd, ...): only those")
    ap.add_argument("--tiles", default="", help="comma-separated N:STAGES:pp|coop tiles to time as well "
                                                "(dynamic schedule), e.g. 192:5:pp,256:4:coop")
    ap.add_argument("--tile-m-pairs", action="store_true", help="with --tiles: also each tile as CTA pairs on "
                    "neighbouring m-tiles (m2, B multicast), not for the gated FC1")
    ap.add_argument("--tile-pairs", action="store_true", help="with --tiles: also each tile as CTA pairs (c2), "
                                                               "static and dynamic, where its n-tiles pair up")
    ap.add_argument("--short-ab", action="store_true", help="time the policy's configuration with and without "
                                                             "short tiles (GemmConfig.short_tiles) only")
    ap.add_argument("--no-schedules", action="store_true", help="only the policy's configuration and --tiles")
    ap.add_argument("--out", default=None, help="JSON path, rewritten after every shape (a cut run keeps them)")
    args = ap.parse_args()
    SHORT_AB["on"] = args.short_ab
    TILE_M_64["on"] = args.tile_m_64
    BANDS["values"] = tuple(int(b) for b in args.bands.split(",") if b)
    GEMMS["only"] = tuple(g for g in args.gemms.split(",") if g)
    TILES["pairs"] = args.tile_pairs
    TILES["m_pairs"] = args.tile_m_pairs
    SCHEDULES["on"] = not args.no_schedules
    TILES["extra"] = tuple((int(n), int(st), sched == "pp") for n, st, sched in
                           (t.split(":") for t in args.tiles.split(",") if t))
    names = args.shapes.split(",")
    if args.precompile:
        from fusion.runtime.aot import compile_jobs
        jobs = all_jobs(names)
        print(f"{len(jobs)} kernels ({len({j.key for j in jobs})} distinct)", flush=True)
        compile_jobs(jobs, parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "1")))
        return
    from bench_common import run_header
    gen = torch.Generator().manual_seed(0)
    out = run_header() | {"results": []}
    for name in names:
        for skewed in ((False, True) if args.skewed else (False,)):
            out["results"].append({"name": name} | run_shape(name, skewed, gen))
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
