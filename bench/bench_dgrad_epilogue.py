"""FC2's dgrad with the generated d(SwiGLU*scale) epilogue (aux input `pre`), timed alone per kernel variant.

Usage: python bench/bench_dgrad_epilogue.py [--shape i,j,...] [--precompile]
  --precompile: only compile the variants into the fusion kernel cache (no GPU needed), so that a device
  run can load them (copy the cache folder to FUSION_CACHE_DIR there).
Variants: the config the plan's job picks (kernels/tile_policy.py aux_tile: 128x128 pingpong dynamic pairs where
the n-tiles pair up, else dynamic pairs along m, at 128x192 where 192 divides N), single 128x128 CTAs dynamic (the
policy before aux_tile) and static, CTA pairs multicasting dY's tile (static, dynamic; where the n-tile count is
even), 128x192 dynamic and in static pairs, 128x192 and 128x128 as CTA pairs on neighbouring m-tiles multicasting
the weight's tile ("mpairs", cluster_m = 2: for n-tile counts that do not pair up, GPT-OSS's 2880), 128x256
cooperative (each warpgroup 64x256: the pingpong tile's registers) dynamic and in static pairs; a 192-column
variant that spills is built at 128 columns (the label shows the tile built);
outputs compared with the first variant's. "gather ..." variants read dY's rows through a routing index (an MoE
FC2 before a Combine: the tokens' gradient (M/8, d), each token's row read by 8 routed rows; no copy of dY per
routed row): the runtime's tile for them (tile_policy.tile_config with gather: gather_tile), the same as CTA pairs
on neighbouring m-tiles sharing the weight's tile ("gather m-pairs": tile_policy.gather_pairs, which only FC1
takes), and others. The kernel is bound by L2 throughput (ncu, GPT-OSS-120B's shape on an
H100: L2 87%, DRAM 56-65%): every n-tile reads dY's rows again and every m-tile the expert's weight, so wider
tiles and pairs cut the bytes.
Anchor: torch._grouped_mm of the same dgrad.
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's fusion

# (E, routed rows M, d, 2f): Llama-like dense-ish, GPT-OSS-20B, DeepSeek-V3-like, ..., then GPT-OSS-120B,
# Qwen3-30B-A3B and OLMoE at 16384 tokens
SHAPES = [(8, 32768, 4096, 28672), (32, 65536, 2880, 5760), (128, 196608, 1536, 512), (32, 49152, 1536, 2048),
          (32, 32768, 7168, 4096), (128, 65536, 2880, 5760), (128, 131072, 2048, 1536), (64, 131072, 2048, 2048),
          (128, 262144, 4096, 3072),   # SonicMoE's Qwen3-235B configuration (T = 32768, top-8)
          (64, 49152, 2048, 2816),     # DeepSeek-V2-Lite (f = 1408: 11 128-column n-tiles, 192 does not divide)
          (32, 131072, 7168, 4096),    # DeepSeek-V3 EP8 at 16384 tokens (bench/bench_moe.py's)
          (128, 262144, 4096, 2048),   # SonicMoE's moe-cute default (T = 32768, top-8, f = 1024)
          # held-out blocks (bench/held_out.py) at 8192 tokens: Hunyuan-A13B, Qwen2-57B-A14B, GLM-4.5-Air, ERNIE-4.5
          (64, 65536, 4096, 6144), (64, 65536, 3584, 5120), (128, 65536, 4096, 2816), (64, 49152, 2560, 3072)]


def jobs(shape, only=None):
    from fusion import GroupLinear, Scale, Sequential, SwiGLU
    from fusion.kernels.tile_policy import GemmConfig, n_tile_count, tile_config
    from fusion.runtime.aot import plan_jobs

    E, M, d, f2 = shape
    block = Sequential(GroupLinear(E, d, f2), SwiGLU(), Scale(), GroupLinear(E, f2 // 2, d)).to("meta")
    base = [j for j in plan_jobs(block, torch.bfloat16) if j.variant == "backward"][0]
    out = {"job()": base}
    f = f2 // 2
    for name, kw in (("pp128 dyn", dict(tile_n=128, stages=6, dynamic=True, cluster_n=1)),
                     ("pp128 static", dict(tile_n=128, stages=6, dynamic=False, cluster_n=1)),
                     ("pp128 pairs static", dict(tile_n=128, stages=6, dynamic=False, cluster_n=2)),
                     ("pp128 pairs dyn", dict(tile_n=128, stages=6, dynamic=True, cluster_n=2)),
                     ("pp192 dyn", dict(tile_n=192, stages=5, dynamic=True, cluster_n=1)),
                     ("pp192 pairs static", dict(tile_n=192, stages=5, dynamic=False, cluster_n=2)),
                     ("pp192 mpairs dyn", dict(tile_n=192, stages=5, dynamic=True, cluster_m=2)),
                     ("pp128 mpairs dyn", dict(tile_n=128, stages=6, dynamic=True, cluster_m=2)),
                     ("pp192 mpairs static", dict(tile_n=192, stages=5, dynamic=False, cluster_m=2)),
                     ("co256 dyn", dict(tile_n=256, stages=4, dynamic=True, cluster_n=1, pingpong=False)),
                     ("co256 pairs static", dict(tile_n=256, stages=4, dynamic=False, cluster_n=2, pingpong=False))):
        if kw.get("cluster_n", 1) == 2 and n_tile_count(f, kw["tile_n"]) % 2:
            continue    # a CTA pair takes two neighbouring n-tiles
        if only is not None and name not in only:
            continue
        cfg = dataclasses.replace(GemmConfig(*base.config), **{"pingpong": True, "cluster_n": 1, "cluster_m": 1, **kw})
        out[name] = dataclasses.replace(base, config=dataclasses.astuple(cfg))
    gathered = GemmConfig(*tile_config(f, d, E, False, "MN", True, gather=True))
    for name, kw in (("gather job()", {}),
                     ("gather m-pairs", dict(cluster_m=2)),
                     ("gather pp128 dyn", dict(tile_n=128, stages=6, pingpong=True)),
                     ("gather pp192 dyn", dict(tile_n=192, stages=5, pingpong=True)),
                     ("gather co256 dyn", dict(tile_n=256, stages=4, pingpong=False))):
        if only is not None and name not in only and name != "gather job()":
            continue
        cfg = dataclasses.replace(gathered, **kw)
        if name != "gather job()" and cfg == gathered:
            continue
        out[name] = dataclasses.replace(base, variant="backward_gather", config=dataclasses.astuple(cfg))
    return out


def _tensor(spec, M, f, make):
    """A CUDA tensor for an epilogue input or output spec: (M,) for a row vector, (M, f / block) for row sums, else
    (M, f) or paired (M, 2f)."""
    from fusion.kernels import RowSumOutput, RowVector

    dtype = getattr(torch, spec.dtype) if spec.dtype else torch.bfloat16
    if isinstance(spec, RowSumOutput):   # float32 partial row sums, one per 32 columns
        return make(M, spec.parts(f), device="cuda", dtype=dtype)
    if isinstance(spec, RowVector):
        return make(M, device="cuda", dtype=dtype).abs() if make is torch.randn else make(M, device="cuda", dtype=dtype)
    return make(M, 2 * f if spec.paired else f, device="cuda", dtype=dtype)


def _gather(tokens, index):
    """The Combine backward's copy of dY to every routed row, by the runtime's gather kernel."""
    from fusion.kernels.gather_rows import compile_gather_rows

    out = torch.empty(index.numel(), tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
    compile_gather_rows("bfloat16", tokens.shape[1], "int32").launch(
        tokens.data_ptr(), index.data_ptr(), out.data_ptr(), tokens.shape[0], index.numel(),
        torch.cuda.current_stream().cuda_stream)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0", help="indices into SHAPES, comma-separated")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--only", default=None, help="variant names to time besides job()'s, comma-separated")
    args = ap.parse_args()
    only = None if args.only is None else set(args.only.split(","))
    for i in [int(x) for x in args.shape.split(",")]:
        run_shape(SHAPES[i], args.precompile, only)


def run_shape(shape, precompile: bool, only=None):
    from fusion.runtime import compile as aot

    js = jobs(shape, only)
    if precompile:
        for j in js.values():
            aot.compile_to_disk(j)
        return

    import triton
    from fusion.kernels import offsets_from_group_sizes, run_grouped_gemm

    E, M, d, f2 = shape
    f = f2 // 2
    torch.manual_seed(0)
    w = torch.rand(E) + 0.5
    sizes = torch.floor(w / w.sum() * M).long()
    sizes[0] += M - int(sizes.sum())
    offs = offsets_from_group_sizes(sizes.cuda())
    dy_tokens = torch.randn(M // 8, d, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, M // 8, (M,), device="cuda", dtype=torch.int32)
    dy = dy_tokens.index_select(0, index)     # the Combine backward's copy: what the TMA variants read
    W2 = torch.randn(E, d, f, device="cuda", dtype=torch.bfloat16) * 0.02     # FC2 weight (E, out=d, in=f)
    B = W2    # the dgrad reads the weight as stored: MN-major B (G, K=d, N=f)
    ref = None
    rows = []
    rows.append(("gmm dgrad alone", triton.testing.do_bench(
        lambda: torch._grouped_mm(dy, W2, offs=offs[1:]), warmup=5, rep=50, return_mode="median"), ""))
    ext = None
    for name, job in js.items():
        comp = aot.load_compiled(job)
        if ext is None:   # the epilogue's inputs by its declared names (the saved pre-activation, the row scale)
            ext = {spec.name: _tensor(spec, M, f, torch.randn) for spec in comp.epilogue.inputs}
        outs = {spec.name: _tensor(spec, M, f, lambda *a, **k: torch.full(a, float("nan"), **k))
                for spec in comp.epilogue.outputs}
        a, idx = (dy_tokens, index) if comp.config.gather_a else (dy, None)
        run_grouped_gemm(comp, a, B, offs, outs, ext, index=idx)
        torch.cuda.synchronize()
        if ref is None:
            ref = {k: v.float() for k, v in outs.items()}
            err = "ref"
        else:
            err = max(float((outs[k].float() - ref[k]).norm() / ref[k].norm()) for k in ref)
            err = f"rel diff vs first {err:.1e}"
        nan = any(bool(v.isnan().any()) for v in outs.values())
        ms = triton.testing.do_bench(lambda: run_grouped_gemm(comp, a, B, offs, outs, ext, index=idx), warmup=5,
                                     rep=50, return_mode="median")
        c = comp.config
        rows.append((f"{name} {c.tile_m}x{c.tile_n} s{c.stages}{' pp' if c.pingpong else ''}"
                     f"{' dyn' if c.dynamic else ''}{' c2' if c.cluster_n > 1 else ''}{' m2' if c.cluster_m > 1 else ''}",
                     ms, f"{err}{' NaN!' if nan else ''}{' gather' if c.gather_a else ''}"))
    rows.append(("the copy itself (gather kernel, M x d)", triton.testing.do_bench(
        lambda: _gather(dy_tokens, index), warmup=5, rep=50, return_mode="median"), ""))
    tflop = 2 * M * d * f / 1e12
    print(f"\ndgrad FC2 + dSwiGLU*s kernel alone, E,M,d,2f = {shape}")
    for n, ms, e in rows:
        print(f"  {n:<40} {ms:8.3f} ms {tflop / ms * 1e3:6.0f} TFLOP/s  {e}")


if __name__ == "__main__":
    main()
