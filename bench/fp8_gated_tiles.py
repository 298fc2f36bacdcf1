"""The gated FP8 FC1 (GEMM + SwiGLU·scale) on its tiles, and what the FP8-block store costs: one GPU call.

For each FC1 shape (E experts, K = d, N = 2f, M routed rows, balanced groups), in interleaved rounds
(bench_fp8_gemm.interleaved_ms: the card is power-bound on FP8 launches), the FP8 kernel with the SwiGLU·scale
epilogue:

- ``policy``   the tile policy's gated tile before the n-waves (tile_policy.choose_fp8_config with FP8_GATED_WAVES
               off: 256 x 128 pairs where the 128-column n-tiles pair up, 128 x 192 pairs where only those do, else
               128 x 128), bf16 output (the first run of this script, session k, timed the policy of then; the
               second, after FP8_GATED_WAVES became the default, timed the n-waves twice: fixed since);
- ``n-waves``  the 128 x 256 tile walked as gate and up n-waves (tile_policy.fp8_block_output_tile), bf16 output;
- ``n-waves + store``  the same tile writing FC2's FP8-block input (codes, scales, amax) instead of bf16: what
               FC1 runs with QuantizeFP8Block(columnwise=False) after it;
- ``n-waves + store + saved``  the same store and the pre-activation (gate, up) saved in bf16 for the backward:
               what a training step's FC1 runs (the generated epilogue of patterns/fp8.fpat's fp8_gemm_act, train
               variant); against ``n-waves + store``, what writing the saved tensor costs in a kernel whose epilogue
               is not overlapped with the next tile's mainloop (added in session v);
- ``policy + quantize kernel``  that bf16 output then the FP8-block quantize kernel (rowwise): what ran before
               the store.

TFLOP/s on 2 M K N. The kernels compile on the GPU machine (in memory). One JSON document to stdout, a table to
stderr.

    python bench/fp8_gated_tiles.py --reps 20
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

#: (name, E, K = d, N = 2f, M): the FC1s of the FP8 block table (docs/benchmarks.md, session k)
SHAPES = [
    ("dsv3-ep8", 32, 7168, 4096, 32768), ("qwen3-30b", 128, 2048, 1536, 65536), ("gpt-oss-20b", 32, 2880, 5760, 32768),
    ("olmoe", 64, 2048, 2048, 65536), ("dsv2-lite", 64, 2048, 2816, 49152), ("qwen3-235b", 128, 4096, 3072, 32768),
    ("mixtral", 8, 4096, 28672, 16384),
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def tiles(N, Kd, E):
    """(the gated tile of the policy before the n-waves, the n-waves' tile) of FC1 with 2f = N: the first with
    FP8_GATED_WAVES off (the policy reads it per call), whatever the default."""
    import fusion.kernels as K
    from fusion.kernels import tile_policy

    saved, tile_policy.FP8_GATED_WAVES = tile_policy.FP8_GATED_WAVES, False
    try:
        policy = K.choose_fp8_config(N, Kd, E, True, wide_odd=True)
    finally:
        tile_policy.FP8_GATED_WAVES = saved
    return policy, K.fp8_block_output_tile(N)


def bench_shape(E, Kd, N, M, reps, gen):
    import fusion.kernels as K
    from bench_fp8_gemm import balanced_sizes, interleaved_ms
    from fusion.kernels.api import fp8_block_outputs
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device
    from fusion.quant.fp8_block import fp8_block_quantize_2d
    from fusion.quant.fp8_weight import quantize_weight_fp8_block

    class Store(K.SwiGLUScaleEpilogue):
        outputs = (K.FP8BlockOutput("out"),)

    class StoreSaved(K.SwiGLUScaleEpilogue):
        outputs = (K.FP8BlockOutput("out"), K.Output("saved", paired=True))

        def apply(self, gate, up, scale):
            from fusion.kernels import epi_math as em
            return em.silu(gate) * up * scale, gate, up

    sizes = balanced_sizes(E, M, gen).cuda()
    offs = K.offsets_from_group_sizes(sizes)
    x = torch.randn(M, Kd, device="cuda")
    a_data, a_scale = fp8_block_quantize_2d(x)
    del x
    wq = quantize_weight_fp8_block(torch.randn(E, N, Kd, device="cuda") / Kd ** 0.5)
    probs = torch.rand(M, device="cuda")
    args = (a_data, a_scale, wq.data, wq.scale, offs)
    policy, waves = tiles(N, Kd, E)
    hp = torch.empty(M, N // 2, dtype=torch.bfloat16, device="cuda")
    store = fp8_block_outputs(Store.outputs[0], M, N // 2, "cuda")
    kp = K.compile_fp8_grouped_gemm(policy, K.SwiGLUScaleEpilogue(), N, Kd, E)
    kw = K.compile_fp8_grouped_gemm(waves, K.SwiGLUScaleEpilogue(), N, Kd, E)
    ks = K.compile_fp8_grouped_gemm(waves, Store(), N, Kd, E)
    kt = K.compile_fp8_grouped_gemm(waves, StoreSaved(), N, Kd, E)
    saved = {**store, "saved": torch.empty(M, N, dtype=torch.bfloat16, device="cuda")}
    extras = {"scale": probs}
    fns = {
        "policy": lambda: K.run_fp8_grouped_gemm(kp, *args, {"out": hp}, extras=extras),
        "n-waves": lambda: K.run_fp8_grouped_gemm(kw, *args, {"out": hp}, extras=extras),
        "n-waves + store": lambda: K.run_fp8_grouped_gemm(ks, *args, store, extras=extras),
        "n-waves + store + saved": lambda: K.run_fp8_grouped_gemm(kt, *args, saved, extras=extras),
        "policy + quantize kernel": lambda: (K.run_fp8_grouped_gemm(kp, *args, {"out": hp}, extras=extras),
                                             quantize_fp8_block_device(hp, False, None)),
    }
    ms = interleaved_ms(list(fns.values()), reps=reps)
    flop = 2.0 * M * Kd * N
    names = {"policy": kp.name, "n-waves": kw.name}
    return {name: {"ms": t, "tflops": flop / t / 1e9} for name, t in zip(fns, ms)}, names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    args = ap.parse_args()
    from bench_common import run_header

    header = run_header()
    gen = torch.Generator().manual_seed(0)
    want = None if args.shapes is None else set(args.shapes.split(","))
    rows = []
    for name, E, Kd, N, M in SHAPES:
        if want is not None and name not in want:
            continue
        res, kernels = bench_shape(E, Kd, N, M, args.reps, gen)
        rows.append({"shape": name, "E": E, "K": Kd, "N": N, "M": M, "kernels": kernels, **res})
        log(f"{name:12s} " + "  ".join(f"{k} {v['tflops']:6.0f} ({v['ms']:.3f} ms)" for k, v in res.items()))
        torch.cuda.empty_cache()
    json.dump({**header, "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
