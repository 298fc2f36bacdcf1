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
- ``n-waves + store + saved``  the same store and the pre-activation (gate, up) saved in bf16 for the backward, stored
               2 columns per lane (GemmConfig.quad_beside_fp8 off, the kernel before session w):
               what a training step's FC1 runs (the generated epilogue of patterns/fp8.fpat's fp8_gemm_act, train
               variant); against ``n-waves + store``, what writing the saved tensor costs in a kernel whose epilogue
               is not overlapped with the next tile's mainloop (added in session v);
- ``n-waves + store + saved (quad)``  the same, the saved pre-activation stored 4 columns per lane (whole 32-byte
               sectors, GemmConfig.quad_beside_fp8: the policy's since session w) instead of 2;
- ``policy + quantize kernel``  that bf16 output then the FP8-block quantize kernel (rowwise): what ran before
               the store.

--variants picks some of them (comma-separated; each compiles on the GPU machine, about 10 s a kernel).

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


def bench_shape(E, Kd, N, M, reps, gen, variants=None):
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
    saved = {**store, "saved": torch.empty(M, N, dtype=torch.bfloat16, device="cuda")}
    extras = {"scale": probs}

    def run(config, epilogue, outs, quad=None):
        if quad is not None:
            config = dataclasses.replace(config, quad_beside_fp8=quad)
        k = K.compile_fp8_grouped_gemm(config, epilogue, N, Kd, E)
        return lambda: K.run_fp8_grouped_gemm(k, *args, outs, extras=extras)

    def quantized():
        k = K.compile_fp8_grouped_gemm(policy, K.SwiGLUScaleEpilogue(), N, Kd, E)
        return lambda: (K.run_fp8_grouped_gemm(k, *args, {"out": hp}, extras=extras),
                        quantize_fp8_block_device(hp, False, None))

    makers = {
        "policy": lambda: run(policy, K.SwiGLUScaleEpilogue(), {"out": hp}),
        "n-waves": lambda: run(waves, K.SwiGLUScaleEpilogue(), {"out": hp}),
        "n-waves + store": lambda: run(waves, Store(), store),
        "n-waves + store + saved": lambda: run(waves, StoreSaved(), saved, quad=False),
        "n-waves + store + saved (quad)": lambda: run(waves, StoreSaved(), saved, quad=True),
        "policy + quantize kernel": quantized,
    }
    fns = {name: make() for name, make in makers.items() if variants is None or name in variants}
    ms = interleaved_ms(list(fns.values()), reps=reps)
    flop = 2.0 * M * Kd * N
    names = {"policy": str(policy), "n-waves": str(waves)}   # the tiles (configs)
    return {name: {"ms": t, "tflops": flop / t / 1e9} for name, t in zip(fns, ms)}, names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    from bench_common import run_header

    header = run_header()
    gen = torch.Generator().manual_seed(0)
    want = None if args.shapes is None else set(args.shapes.split(","))
    rows = []
    for name, E, Kd, N, M in SHAPES:
        if want is not None and name not in want:
            continue
        res, kernels = bench_shape(E, Kd, N, M, args.reps, gen,
                                   None if args.variants is None else set(args.variants.split(",")))
        rows.append({"shape": name, "E": E, "K": Kd, "N": N, "M": M, "kernels": kernels, **res})
        log(f"{name:12s} " + "  ".join(f"{k} {v['tflops']:6.0f} ({v['ms']:.3f} ms)" for k, v in res.items()))
        torch.cuda.empty_cache()
    json.dump({**header, "rows": rows}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
