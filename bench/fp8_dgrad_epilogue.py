"""The FP8 dgrad with its generated d(SwiGLU·scale) epilogue (a training step's B1) alone, build variants interleaved;
``--step F1``: the training FC1 with its FP8-block store instead.

B1 of an FP8 block (`bench/fp8_paths.py`'s fusion_fp8: FC1 -> SwiGLU -> Scale -> QuantizeFP8Block -> FC2, fp8_block
weights) is FC2's dgrad dY @ W2 on the FP8 kernel, whose epilogue reads the saved pre-activation, writes d(gate, up),
the router scale's row-sum partials and FC2's input dequantized again: session y's Nsight Compute run found that
epilogue bound by its instructions' issue, not by memory or the tensor cores (docs/benchmarks.md). This times the
plan's own job (its generated epilogue and tile) on a bench block's shapes and group sizes, with random operands, in
builds that differ by a kernels.fp8_gemm.Fp8DebugKnobs field, interleaved (bench_fp8_gemm.interleaved_ms: the card
is power-bound), checks that every build writes the same bits as the first, and prints each build's static SASS
instruction count beside its time.

    python bench/fp8_dgrad_epilogue.py --models qwen3-30b-a3b,olmoe-1b-7b --reps 30
    python bench/fp8_dgrad_epilogue.py --step F1 --variants kernel,value-tests --models qwen3-30b-a3b
    python bench/fp8_dgrad_epilogue.py --step B1,fprop,dgrad --variants kernel,two-ctas --models olmoe-1b-7b
    python bench/fp8_dgrad_epilogue.py --step F1 --variants cooperative,kernel --models gpt-oss-20b,mixtral-8x7b

Variants (--variants): ``kernel`` (the defaults), ``cooperative`` (the job's tile as the policy chooses it with two
CTAs an SM off, tile_policy.FP8_TWO_CTAS: where the policy takes two CTAs, the cooperative kernel it replaced),
``two-ctas`` (the job on 128 x <= 128 tiles with one consumer warpgroup a CTA, two CTAs an SM: GemmConfig.ctas_per_sm
= 2, session ae; ``two-ctas-single`` without its CTA pairs, ``two-ctas-jit`` compiled here rather than loaded from the
kernel cache), ``int-decode`` (Fp8DebugKnobs(int_decode=True): the dequantized row's codes decoded by integer
instructions, as before session y), ``value-tests`` (Fp8DebugKnobs(value_tests=True): each bf16 value bound for an FP8
block tested for finiteness and folded into the block amax one at a time, as before session z, not a packed pair at a
time). F1 is the FP8 FC1 of a training step: SwiGLU·scale, FC2's input stored as
FP8 blocks (codes, scales, amax) and the pre-activation saved. The kernels compile on the GPU machine (in memory,
about 10 s each). --list (no GPU): the blocks' jobs and their tiles.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # run from a checkout
sys.path.insert(0, HERE)

#: build name -> Fp8DebugKnobs fields
VARIANTS = {"kernel": {}, "cooperative": {}, "int-decode": {"int_decode": True}, "value-tests": {"value_tests": True},
            "two-ctas": {}, "two-ctas-single": {}, "two-ctas-jit": {"reg_realloc": True}}


def _two_ctas(c, **over):
    """The job's tile as two CTAs an SM (tile_policy.two_cta_tile: 128 x 128, or the gated n-wave tile as 64 x 256
    CTA pairs along m; the job's own where the policy took two CTAs), with `over`."""
    from fusion.kernels.tile_policy import two_cta_tile

    return dataclasses.replace(c if c.ctas_per_sm == 2 else two_cta_tile(c), **over)


#: build name -> what it changes in the job's tile configuration (a function of it). ``two-ctas-jit`` is ``two-ctas``
#: compiled in this process rather than loaded from the kernel cache (a knob at its default makes it so): the same
#: kernel, unless loading from the cache lost a launch attribute (the shared-memory carveout two CTAs need)
CONFIGS = {"two-ctas": _two_ctas, "two-ctas-jit": _two_ctas,
           "two-ctas-single": lambda c: _two_ctas(c, cluster_n=1, cluster_m=1)}
#: step -> the plan job's (step, variant)
STEPS = {"B1": ("B1", "backward"), "F1": ("F1", "train"), "fprop": ("fp8_fprop", "identity"),
         "dgrad": ("fp8_dgrad", "identity")}


def plan_job(block, step="B1"):
    """The fusion_fp8 block's B1 job (generated epilogue, tile policy's configuration) for a bench block; ``step``
    "F1": its training FC1's."""
    from fusion import GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU
    from fusion.runtime.aot import plan_jobs

    seq = Sequential(GroupLinear(block.E, block.d, 2 * block.f, weight_format="fp8_block"), SwiGLU(), Scale(),
                     QuantizeFP8Block(columnwise=False),
                     GroupLinear(block.E, block.f, block.d, weight_format="fp8_block")).to("meta")
    # the job at its own configuration: plan_jobs lists a job's variants by rows (tile_policy.fp8_for_rows: single
    # CTAs at many rows per group) after it, under the same name
    jobs = [j for j in plan_jobs(seq, torch.bfloat16) if (j.step, j.variant) == STEPS[step]]
    if len({j.name for j in jobs}) != 1 or jobs[0].mainloop != "fp8_block":
        raise SystemExit(f"{block.model}: expected one FP8 {step} job, got {[j.name for j in jobs]}")
    return jobs[0]


def problem(block, job, epilogue, device="cuda"):
    """(operands, epilogue inputs, outputs by build) of the job (B1 or F1) at the block's rows and group sizes:
    B1's A is dY (M, d) and its B the weight's transposed blocks (G, N = f, K = d); F1's A is x (M, d) and its B
    FC1's weight (G, N = 2f, K = d)."""
    import fusion.kernels as K
    from bench_training_step import group_sizes
    from fusion.kernels.api import allocate_outputs
    from fusion.quant.fp8_block import fp8_block_quantize_2d
    from fusion.quant.fp8_weight import quantize_weight_fp8_block

    torch.manual_seed(0)
    sizes = group_sizes(block).to(device)
    M, k, G = block.rows, job.K, block.E
    a_data, a_scale = fp8_block_quantize_2d(torch.randn(M, k, device=device, dtype=torch.bfloat16))
    wq = quantize_weight_fp8_block(torch.randn(G, job.N, k, device=device, dtype=torch.bfloat16) / k ** 0.5)
    args = (a_data, a_scale, wq.data, wq.scale, K.offsets_from_group_sizes(sizes))
    extras = {"scale_scale": torch.rand(M, device=device, dtype=torch.bfloat16)}
    if any(s.name == "saved" for s in epilogue.inputs):
        extras["saved"] = torch.randn(M, 2 * block.f, device=device, dtype=torch.bfloat16)

    def outputs():
        outs = allocate_outputs(epilogue, M, job.N, "bfloat16", device)
        for name, t in outs.items():
            if t.dim() and t.is_floating_point():
                t.view(torch.uint8).fill_(0x7F if t.element_size() == 1 else 0xFF)   # NaN: what was not written
        return outs
    return args, extras, outputs


def cooperative_config(block, step):
    """The job's tile configuration as the policy chooses it with two CTAs an SM off (tile_policy.FP8_TWO_CTAS)."""
    from fusion.kernels import tile_policy
    from fusion.runtime.compile import _config

    saved, tile_policy.FP8_TWO_CTAS = tile_policy.FP8_TWO_CTAS, False
    try:
        return _config(plan_job(block, step))
    finally:
        tile_policy.FP8_TWO_CTAS = saved


def variant_config(config, name, cooperative):
    """Build `name`'s tile configuration: CONFIGS's change of the job's `config`, or `cooperative`'s."""
    return cooperative if name == "cooperative" else CONFIGS.get(name, lambda c: c)(config)


def variant_job(job, config, name, cooperative=None):
    """The plan job at build `name`'s tile configuration (`variant_config`)."""
    return dataclasses.replace(job, config=dataclasses.astuple(variant_config(config, name, cooperative)))


def build(job, config, epilogue, name, cooperative):
    """Build `name` of the job: from the runtime's kernel cache (FUSION_CACHE_DIR) where it has no debug knobs,
    else compiled here."""
    if not VARIANTS[name]:
        from fusion.runtime.compile import load_compiled
        return load_compiled(variant_job(job, config, name, cooperative))
    import fusion.kernels as K
    from fusion.kernels.fp8_gemm import Fp8DebugKnobs
    return K.compile_fp8_grouped_gemm(variant_config(config, name, cooperative), epilogue, job.N, job.K, job.G,
                                      debug=Fp8DebugKnobs(**VARIANTS[name]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where the other has NaN (a NaN's payload aside); E4M3 codes and int32s compared whole."""
    if a.dtype == torch.float8_e4m3fn or not a.is_floating_point():
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def sass_count(cubin: bytes) -> int:
    from fusion.kernels import sass_opcodes, sass_text
    return len(sass_opcodes(sass_text(cubin)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,olmoe-1b-7b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--step", default="B1", help="B1, F1, fprop (FC2's forward), dgrad (FC1's): one or several, "
                    "comma-separated")
    ap.add_argument("--list", action="store_true", help="print the jobs (no GPU)")
    ap.add_argument("--precompile", action="store_true", help="compile the builds without debug knobs into "
                    "FUSION_CACHE_DIR (no GPU); on the GPU they load from there")
    args = ap.parse_args(argv)
    from bench_training_step import BLOCKS
    from fusion.runtime.compile import _config, _epilogue

    blocks = [next(b for b in BLOCKS if b.model == m) for m in args.models.split(",")]
    names = args.variants.split(",")
    rows = []
    for block, step in [(b, st) for b in blocks for st in args.step.split(",")]:
        job = plan_job(block, step)
        print(f"{block.model} {step}: {job.name} tile {job.config[:4]}", file=sys.stderr, flush=True)
        if args.list:
            continue
        config, epilogue = _config(job), _epilogue(job)
        cooperative = cooperative_config(block, step)
        if args.precompile:
            from fusion.runtime.compile import compile_to_disk
            for n in names:
                if not VARIANTS[n]:
                    compile_to_disk(variant_job(job, config, n, cooperative))
            continue
        import fusion.kernels as K
        from bench_fp8_gemm import interleaved_ms

        compiled = {n: build(job, config, epilogue, n, cooperative) for n in names}
        operands, extras, outputs = problem(block, job, epilogue)
        outs = {n: outputs() for n in names}
        counters = {n: torch.zeros(1, dtype=torch.int32, device="cuda") for n in names}

        def launch(n):
            amax = [t for t in outs[n].values() if t.dim() == 0]   # an FP8-block output's atomic max

            def fn():
                counters[n].zero_()
                for t in amax:
                    t.zero_()
                K.run_fp8_grouped_gemm(compiled[n], *operands, outs[n], extras=extras,
                                       counter_ptr=counters[n].data_ptr())
            return fn
        times = interleaved_ms([launch(n) for n in names], reps=args.reps)
        torch.cuda.synchronize()
        first = names[0]
        for n, ms in zip(names, times):
            same = all(same_bits(outs[n][k], outs[first][k]) for k in outs[first])
            row = {"model": block.model, "step": step, "variant": n, "ms": ms, "tile": compiled[n].name,
                   "sass": sass_count(compiled[n].cubin), "same_bits_as_" + first: same}
            rows.append(row)
            print(f"  {n:12s} {ms:8.4f} ms  {row['sass']:5d} SASS instructions  same bits as {first}: {same}",
                  file=sys.stderr, flush=True)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
