"""Tile configurations of the FP8 block-scaled grouped GEMM on MoE shapes: which one the tile policy should pick.

For each shape (the GEMMs of an expert MLP's forward and dgrads: FC1, FC2, FC2's dgrad, FC1's dgrad, of eight
MoE blocks, and issue 9's 32 x 8192-row target shape) and each candidate configuration (tiles 128 x 128 / 192 and
256 x 128, static or dynamic schedule, single CTAs or CTA pairs sharing the A tile, as many stages as fit;
``--tile-64`` adds 64-column tiles), the kernel with the identity epilogue, timed with CUDA events (median of
--reps calls, in rounds that interleave the configurations: bench_fp8_gemm `interleaved_ms`) on balanced random
group sizes, beside bf16 torch._grouped_mm on the same (unquantized) operands.
The kernels are KernelJobs (fusion/runtime/compile.py), so they compile here without a GPU into FUSION_CACHE_DIR
and load on the GPU machine:

    FUSION_CACHE_DIR=/tmp/kc python bench/fp8_tile_sweep.py --precompile     # no GPU needed
    FUSION_CACHE_DIR=/tmp/kc python bench/fp8_tile_sweep.py > sweep.json     # on the GPU

``--rows-per-group R1,R2,...`` runs each selected shape at E x R rows instead, with ``--pair-vs-single`` only the
256 x 128 dynamic tile as single CTAs and as CTA pairs (at each ``--bands`` value): where, by rows per group, a
pair stops paying for its lockstep (issue 9's target shape: the pair 1056 against single 1107 TFLOP/s at 8192
rows per group, 1136 against 1096 at DeepSeek-V3's 1024):

    python bench/fp8_tile_sweep.py --shapes "dsv3 fc1,olmoe fc1" --rows-per-group 1024,4096,8192 \
        --pair-vs-single --bands 4,8,16

``--two-ctas``: the lone GEMMs' two-CTA tile (128 x 128, two CTAs an SM) with each cluster shape and schedule:

    python bench/fp8_tile_sweep.py --shapes "dsv3 fc1 32x8192" --two-ctas --bands 4,8,16

One JSON document to stdout (per shape: TFLOP/s of each configuration), a table to stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                   # bench_fp8_gemm

from fusion.kernels.tile_policy import (FP8_SMEM, choose_fp8_config, cooperative_fp8_config,  # noqa: E402
                                        fp8_stage_bytes, n_tile_count, two_cta_tile)

#: (name, experts E, K, N, routed rows M): the expert GEMMs of MoE blocks at 16k (DeepSeek-V3: 4k) tokens of
#: the training-step benchmark (the identity epilogue: the GEMM alone), and issue 9's target shape
SHAPES = [
    ("qwen3 fc1", 128, 2048, 1536, 65536), ("qwen3 fc2", 128, 768, 2048, 65536),
    ("qwen3 fc2-dgrad", 128, 2048, 768, 65536), ("qwen3 fc1-dgrad", 128, 1536, 2048, 65536),
    ("olmoe fc1", 64, 2048, 2048, 65536), ("olmoe fc2", 64, 1024, 2048, 65536),
    ("dsv2-lite fc1", 64, 2048, 2816, 49152), ("dsv2-lite fc2", 64, 1408, 2048, 49152),
    ("qwen3-235b fc1", 128, 4096, 3072, 32768), ("qwen3-235b fc2", 128, 1536, 4096, 32768),
    ("gpt-oss-120b fc1", 128, 2880, 5760, 65536), ("gpt-oss-120b fc2", 128, 2880, 2880, 65536),
    ("dsv3 fc1", 32, 7168, 4096, 32768), ("dsv3 fc2", 32, 2048, 7168, 32768),
    ("dsv3 fc1 32x8192", 32, 7168, 4096, 262144),
    ("small fc1", 8, 2048, 2048, 4096),
]


#: --bands B1,B2,...: the policy's configuration with each band of the tile order (GemmConfig.band_m), instead of
#: the tile and schedule candidates.
BANDS: list = []
#: --pair-vs-single: only the 256 x 128 dynamic tile, single CTAs and (where the n-tiles pair) CTA pairs.
PAIR_VS_SINGLE: list = []
#: --two-ctas: only the plain epilogue's two-CTA tile (128 x 128, two CTAs an SM: tile_policy.two_cta_tile), as CTA
#: pairs along n (where the n-tiles pair), along m, and single CTAs, on the dynamic and static schedules (at each
#: --bands value).
TWO_CTAS: list = []


def candidates(N: int, K: int, G: int, tile_64: bool = False):
    """The tile policy's choice first, then tiles 128 x (64,) 128 / 192 and 256 x 128 (two 64-row waves per
    warpgroup) x static / dynamic x single / paired CTAs (pairs where the n-tile count is even; stages: as many
    as fit, <= 8); with BANDS, the policy's choice at each band instead; with TWO_CTAS the two-CTA tile's
    clusters and schedules (the policy's choice is then a lone GEMM's, plain_epilogue)."""
    out = [choose_fp8_config(N, K, G, plain_epilogue=bool(TWO_CTAS))]
    if TWO_CTAS:
        base = two_cta_tile(cooperative_fp8_config(N, K, G))
        clusters = [(1, 1), (2, 1)] + ([(1, 2)] if n_tile_count(N, 128) % 2 == 0 else [])
        for band in BANDS or [out[0].band_m]:
            for cluster_m, cluster_n in clusters:
                for dynamic in (True, False):
                    cfg = dataclasses.replace(base, cluster_m=cluster_m, cluster_n=cluster_n, dynamic=dynamic,
                                              band_m=band)
                    if cfg not in out:
                        out.append(cfg)
        return out
    if PAIR_VS_SINGLE:
        base = dataclasses.replace(out[0], tile_m=256, tile_n=128, dynamic=True,
                                   stages=min(8, FP8_SMEM // (fp8_stage_bytes(256, 128, 1) + 16)))
        pairs = (1, 2) if n_tile_count(N, 128) % 2 == 0 else (1,)
        for band in BANDS or [0]:
            for cluster_n in pairs:
                cfg = dataclasses.replace(base, cluster_n=cluster_n, band_m=band)
                if cfg not in out:
                    out.append(cfg)
        return out
    if BANDS:
        return out + [dataclasses.replace(out[0], band_m=b) for b in BANDS if b != out[0].band_m]
    tiles = [(128, n) for n in ((64,) if tile_64 else ()) + (128, 192)] + [(256, 128)]
    for tile_m, tile_n in tiles:
        stages = min(8, FP8_SMEM // (fp8_stage_bytes(tile_m, tile_n, 2 if tile_n % 128 else 1) + 16))
        for cluster_n in (1, 2):
            if cluster_n == 2 and n_tile_count(N, tile_n) % 2:
                continue
            for dynamic in (False, True):
                cfg = dataclasses.replace(out[0], tile_m=tile_m, tile_n=tile_n, stages=stages, dynamic=dynamic,
                                          cluster_n=cluster_n)
                if cfg not in out:
                    out.append(cfg)
    return out


def jobs(tile_64: bool = False):
    from fusion.runtime.kernel import IDENTITY_SOURCE
    from fusion.runtime.compile import KernelJob

    for name, E, K, N, M in SHAPES:
        for cfg in candidates(N, K, E, tile_64):
            yield (name, E, K, N, M, cfg), KernelJob(
                step="fp8_sweep", variant="identity", source=IDENTITY_SOURCE, config=dataclasses.astuple(cfg),
                dtype="bfloat16", N=N, K=K, G=E, target="sm_90a", mainloop="fp8_block")


def measure(reps: int, tile_64: bool = False, interleave: bool = True) -> dict:
    """Per shape, bf16 torch._grouped_mm and every candidate, timed in interleaved rounds (bench_fp8_gemm
    `interleaved_ms`; `interleave=False`: one configuration after another, the order before 2026-11-27j, which
    favoured the first-timed configuration, the policy's, on long launches)."""
    from bench_fp8_gemm import balanced_sizes, interleaved_ms, quantize_rows_chunked, time_ms
    from fusion.kernels import run_fp8_grouped_gemm
    from fusion.kernels.api import offsets_from_group_sizes
    from fusion.quant.fp8_weight import quantize_weight_fp8_block
    from fusion.runtime.compile import load_compiled

    by_shape: dict = {}
    for (name, E, K, N, M, cfg), job in jobs(tile_64):
        by_shape.setdefault((name, E, K, N, M), []).append((cfg, job))
    results: dict = {}
    gen = torch.Generator().manual_seed(0)
    for (name, E, K, N, M), candidates_ in by_shape.items():
        torch.cuda.empty_cache()
        sizes = balanced_sizes(E, M, gen)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        offsets = offsets_from_group_sizes(sizes.cuda())
        # bf16 torch._grouped_mm of the same operands: the ">= 1.6x bf16" baseline
        bf16_ms = time_ms(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets[1:]), warmup=5, reps=reps)
        row = results[name] = {"E": E, "K": K, "N": N, "M": M, "bf16_grouped_mm_ms": bf16_ms,
                               "bf16_grouped_mm_tflops": 2 * M * N * K / bf16_ms / 1e9, "interleaved": interleave,
                               "configs": []}
        print(f"{name:16s} bf16 torch._grouped_mm {bf16_ms:7.3f} ms {row['bf16_grouped_mm_tflops']:6.0f} TFLOP/s",
              file=sys.stderr, flush=True)
        a_data, a_scale = quantize_rows_chunked(a)
        wq = quantize_weight_fp8_block(b)
        a = b = None  # the bf16 operands are not needed past here
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

        def launch(compiled):
            return lambda: run_fp8_grouped_gemm(compiled, a_data, a_scale, wq.data, wq.scale, offsets, {"out": out})

        fns = [launch(load_compiled(job)) for _, job in candidates_]
        times = (interleaved_ms(fns, reps=reps) if interleave
                 else [time_ms(fn, warmup=5, reps=reps) for fn in fns])
        for i, ((cfg, _), ms) in enumerate(zip(candidates_, times)):
            tflops = 2 * M * N * K / ms / 1e9
            row["configs"].append({"tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "stages": cfg.stages,
                                   "dynamic": cfg.dynamic, "cluster_n": cfg.cluster_n, "cluster_m": cfg.cluster_m,
                                   "ctas_per_sm": cfg.ctas_per_sm, "band_m": cfg.band_m,
                                   "ms": ms, "tflops": tflops, "vs_bf16": bf16_ms / ms, "policy": i == 0})
            print(f"{name:16s} tile={cfg.tile_m}x{cfg.tile_n:<3d} stages={cfg.stages} dynamic={cfg.dynamic!s:5s} "
                  f"pair={cfg.cluster_n == 2!s:5s} m-pair={cfg.cluster_m == 2!s:5s} ctas/SM={cfg.ctas_per_sm} "
                  f"band={cfg.band_m:2d} {ms:7.3f} ms {tflops:6.0f} TFLOP/s "
                  f"{bf16_ms / ms:4.2f}x bf16" + ("  (policy)" if i == 0 else ""), file=sys.stderr, flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precompile", action="store_true", help="compile every kernel into FUSION_CACHE_DIR")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tile-64", action="store_true", help="also 64-column tiles (they lost by 11-33%% on an H100)")
    ap.add_argument("--shapes", help="comma-separated substrings of the shape names to run (default: all)")
    ap.add_argument("--bands", default="", help="comma-separated band_m values: the policy's tile at each band")
    ap.add_argument("--rows-per-group", default="",
                    help="comma-separated rows per group: each selected shape at E x R rows (balanced groups)")
    ap.add_argument("--sequential", action="store_true",
                    help="time the configurations one after another (the order before 2026-11-27j), not interleaved")
    ap.add_argument("--pair-vs-single", action="store_true",
                    help="only the 256 x 128 dynamic tile, single CTAs and CTA pairs (at each --bands value)")
    ap.add_argument("--two-ctas", action="store_true",
                    help="only the two-CTA 128 x 128 tile: pairs along n / m, single CTAs, dynamic and static "
                    "(at each --bands value)")
    args = ap.parse_args(argv)
    BANDS[:] = [int(b) for b in args.bands.split(",") if b]
    PAIR_VS_SINGLE[:] = [True] if args.pair_vs_single else []
    TWO_CTAS[:] = [True] if args.two_ctas else []
    if args.shapes:
        keep = args.shapes.split(",")
        SHAPES[:] = [s for s in SHAPES if any(k in s[0] for k in keep)]
    if args.rows_per_group:
        shapes = {(f"{name.split(' 32x')[0]} {E}x{r}", E, K, N, E * r): None  # issue 9's shape is dsv3 fc1's
                  for name, E, K, N, _ in SHAPES for r in (int(v) for v in args.rows_per_group.split(","))}
        SHAPES[:] = list(shapes)
    if args.precompile:
        from fusion.runtime.aot import compile_jobs

        todo = [job for _, job in jobs(args.tile_64)]
        compile_jobs(todo, parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "2")))
        return
    device = torch.cuda.get_device_name()
    print(json.dumps({"device": device, "torch": torch.__version__, "shapes": measure(args.reps, args.tile_64, not args.sequential)}, indent=1))


if __name__ == "__main__":
    main()
