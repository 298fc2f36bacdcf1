"""The README block's fused FC1 (GroupLinear -> SwiGLU -> Scale -> QuantizeMXFP8, bf16 kernel) in three builds, timed
interleaved on the bench blocks' shapes: ``sectors`` (the kernel since session z: bf16 values quantized a packed pair
at a time, kernels/pow2_quant.py finite_abs2_bf16, and each 32-column block's codes stored as one 32-byte sector),
``pairs`` (the pairs, 2-byte stores a lane and chunk), ``values`` (a value at a time and 2-byte stores, as before; the
training variant then spilled at the policy's 192-wide CTA pair and was rebuilt at the 128 x 128 fallback tile,
which is what ran). Prints each build's tile, SASS instruction count and median ms, and whether all wrote the same
bytes.

    python bench/probes/mxfp8_store_ab.py --models qwen3-30b-a3b,olmoe-1b-7b --reps 30
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))


def f1_jobs(block):
    from fusion import GroupLinear, QuantizeMXFP8, Scale, Sequential, SwiGLU
    from fusion.runtime.aot import plan_jobs

    seq = Sequential(GroupLinear(block.E, block.d, 2 * block.f), SwiGLU(), Scale(), QuantizeMXFP8(),
                     GroupLinear(block.E, block.f, block.d)).to("meta")
    return [j for j in plan_jobs(seq, torch.bfloat16) if j.step == "F1"]


#: build name -> TileEpilogue attributes set after its constructor
BUILDS = {"sectors": {}, "pairs": {"mxfp8_sectors": False}, "values": {"clean_fp8_words": False}}


def build(job, attrs: dict):
    """The job's kernel, every TileEpilogue built with ``attrs`` set (the A/B builds)."""
    import fusion.kernels.api as api
    import fusion.kernels.tile_epilogue as TE
    from fusion.runtime.compile import _compile

    api._CACHE.clear()   # the in-memory kernels: the key does not name the build
    init = TE.TileEpilogue.__init__
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name, value in attrs.items():
            setattr(self, name, value)
    TE.TileEpilogue.__init__ = patched
    try:
        return _compile(job)
    finally:
        TE.TileEpilogue.__init__ = init


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,olmoe-1b-7b")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    import fusion.kernels as K
    from bench_fp8_gemm import interleaved_ms
    from bench_training_step import BLOCKS, group_sizes
    from fusion.kernels.api import allocate_outputs
    from fusion.runtime.compile import _epilogue
    from fp8_dgrad_epilogue import same_bits, sass_count

    rows = []
    for model in args.models.split(","):
        block = next(b for b in BLOCKS if b.model == model)
        for job in f1_jobs(block):
            kernels = {name: build(job, attrs) for name, attrs in BUILDS.items()}
            torch.manual_seed(0)
            M = block.rows
            x = torch.randn(M, block.d, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(block.E, job.N, block.d, device="cuda", dtype=torch.bfloat16) / block.d ** 0.5
            offsets = K.offsets_from_group_sizes(group_sizes(block).cuda())
            extras = {"scale_scale": torch.rand(M, device="cuda", dtype=torch.bfloat16)}
            outs = {n: allocate_outputs(_epilogue(job), M, job.N, "bfloat16", "cuda") for n in kernels}
            counters = {n: torch.zeros(1, dtype=torch.int32, device="cuda") for n in kernels}

            def launch(n):
                def fn():
                    counters[n].zero_()
                    K.run_grouped_gemm(kernels[n], x, w, offsets, outs[n], extras=extras,
                                       counter_ptr=counters[n].data_ptr())
                return fn
            times = interleaved_ms([launch(n) for n in kernels], reps=args.reps)
            torch.cuda.synchronize()
            same = all(same_bits(outs[n][k], outs["values"][k]) for n in kernels for k in outs["values"])
            for n, ms in zip(kernels, times):
                cfg = kernels[n].config
                row = {"model": model, "variant": job.variant, "build": n, "ms": ms,
                       "tile": [cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n],
                       "sass": sass_count(kernels[n].cubin), "same_bytes": same}
                rows.append(row)
                print(f"{model:16s} {job.variant:9s} {n:6s} tile {row['tile']} {row['sass']:5d} SASS {ms:8.4f} ms"
                      f"  same bytes: {same}", file=sys.stderr, flush=True)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
