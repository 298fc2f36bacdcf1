"""FP8 block-scaled grouped GEMM (fusion.kernels.fp8_gemm) against torch's grouped GEMMs, on MoE shapes.

Columns, all on the same routed rows (balanced random group sizes, multiples of 16):
  ours       fusion.kernels.run_fp8_grouped_gemm: E4M3 A (1x128 scales) x E4M3 B (128x128 scales) -> bf16
  scaled     torch._scaled_grouped_mm, rowwise scales (one per row of A, one per column of B), -> bf16
  bf16       torch._grouped_mm on bf16 operands
TFLOP/s counts 2*M*N*K. Timing: CUDA events around each call, median over the repetitions, the three columns in
interleaved rounds (`interleaved_ms`: the card is power-bound on these launches). Operands are
quantized once, outside the timed region. Progress goes to stderr, one JSON document to stdout.

Usage (from the repository root): python3 bench/bench_fp8_gemm.py [--shapes 0,2] [--rows M] [--reps 50]
(--precompile, no GPU: our kernels for those shapes and rows into FUSION_CACHE_DIR)

--profile: instead of timing, launch our kernel and torch._scaled_grouped_mm once each between cudaProfilerStart
and cudaProfilerStop (after a warm-up), for Nsight Compute, e.g. issue 9's target shape:
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section ComputeWorkloadAnalysis \
        python bench/bench_fp8_gemm.py --profile --shapes 2 --rows 262144
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import fusion.kernels as K  # noqa: E402
from fusion.quant.fp8_block import fp8_block_quantize_2d  # noqa: E402
from fusion.quant.fp8_weight import quantize_weight_fp8_block  # noqa: E402

SHAPES = [  # (experts E, K = hidden, N = output width, routed rows M)
    (64, 2048, 2048, 65536),
    (128, 2048, 1536, 65536),
    (32, 7168, 4096, 32768),
    (8, 4096, 28672, 16384),
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_ms(fn, warmup=10, reps=50):
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def interleaved_ms(fns, warmup=5, reps=20):
    """Median milliseconds of each of ``fns``, timed in rounds (one call of each per round, each between two CUDA
    events) rather than one after another: a long FP8 launch heats the card, and the SM clock it then runs at
    (power-bound) would otherwise favour whichever configuration ran first."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    for r in range(reps):
        for fn, evs in zip(fns, events):
            evs[r][0].record()
            fn()
            evs[r][1].record()
    torch.cuda.synchronize()
    out = []
    for evs in events:
        times = sorted(s.elapsed_time(e) for s, e in evs)
        out.append(times[len(times) // 2])
    return out


def balanced_sizes(E, M, gen, align=16):
    """Random sizes within +-20 % of M / E, multiples of ``align``, summing to M (M a multiple of align)."""
    w = 1.0 + 0.4 * (torch.rand(E, generator=gen) - 0.5)
    s = (torch.floor(w / w.sum() * (M // align)) * align).to(torch.int64)
    s[0] += M - int(s.sum())
    return s


def quantize_rows_chunked(a, chunk=32768):
    """fp8_block_quantize_2d(a) 32768 rows at a time (the reference quantizer's temporaries are several times
    its input: issue 9's 262144-row target shape runs out of memory whole): (data, scale (ceil(K/128), M))."""
    parts = [fp8_block_quantize_2d(a[r:r + chunk]) for r in range(0, a.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1).contiguous()


def _scaled_grouped_mm_call(a_data, b_data, offsets):
    """torch._scaled_grouped_mm of the E4M3 codes A (M, K) and B (E, N, K) with unit rowwise scales (one per row of
    A, one per column of B), bf16 out: the call, ready to time."""
    a8, b8 = a_data.view(torch.float8_e4m3fn), b_data.view(torch.float8_e4m3fn)   # B^T: column-major
    sa = torch.ones(a8.shape[0], dtype=torch.float32, device=a8.device)
    sb = torch.ones(b8.shape[0], b8.shape[1], dtype=torch.float32, device=a8.device)
    return lambda: torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), sa, sb, offs=offsets[1:],
                                            out_dtype=torch.bfloat16, use_fast_accum=True)


def bench_shape(E, Kd, N, M, reps, gen, profile=False):
    dev = "cuda"
    flop = 2.0 * M * N * Kd
    tf = (lambda ms: None if ms is None else round(flop / ms / 1e9, 1))
    sizes = balanced_sizes(E, M, gen).to(dev)
    offsets = K.offsets_from_group_sizes(sizes)
    x = torch.randn(M, Kd, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kd, device=dev, dtype=torch.bfloat16) / Kd ** 0.5
    a_data, a_scale = quantize_rows_chunked(x)
    wq = quantize_weight_fp8_block(w)
    row = dict(E=E, K=Kd, N=N, M=M)

    # the kernel the runtime launches for a lone FP8 GEMM over these rows (from FUSION_CACHE_DIR when precompiled)
    from fusion.runtime.compile import load_compiled
    from fusion.runtime.fp8_gemm import identity_job
    from fusion.runtime.kernel import for_rows

    comp = load_compiled(for_rows(identity_job(N, Kd, E, torch.bfloat16), M))
    cfg = comp.config
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)

    def ours():
        if cfg.dynamic:
            counter.zero_()
        K.run_fp8_grouped_gemm(comp, a_data, a_scale, wq.data, wq.scale, offsets, {"out": out},
                               counter_ptr=counter.data_ptr())

    # torch._scaled_grouped_mm, rowwise scales (per row of A, per column of B); None where torch lacks it
    scaled = _scaled_grouped_mm_call(a_data, wq.data, offsets) if hasattr(torch, "_scaled_grouped_mm") else None

    if profile:   # each kernel once, in the profiler's window: ours, then torch's FP8 grouped GEMM
        kernels = [("ours " + comp.name, ours)] + ([("torch._scaled_grouped_mm", scaled)] if scaled else [])
        for label, fn in kernels:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            log(f"  profiled: {label}")
        return dict(row, profiled=[label for label, _ in kernels])

    # torch._grouped_mm in bf16: B is (E, K, N), a transposed view of the (E, N, K) weight
    bf16 = (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:])) if hasattr(torch, "_grouped_mm") \
        else None
    # the three timed in interleaved rounds (the card is power-bound: timed one after another, the first ran faster)
    fns = {"ours": ours, "bf16": bf16, "scaled": scaled}
    errors = {name: (None if fn else "torch lacks it") for name, fn in fns.items()}
    for name, fn in fns.items():
        if fn is not None:
            try:
                fn()
            except Exception as e:  # an op missing or refusing this build / device: reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    timed = [name for name in fns if errors[name] is None]
    times = dict(zip(timed, interleaved_ms([fns[n] for n in timed], reps=reps)))
    for name in fns:
        row.update({f"{name}_ms": times.get(name), f"{name}_tflops": tf(times.get(name)), f"{name}_error": errors[name]})
    row.update(config=comp.name, registers=comp.registers, smem=comp.shared_memory_bytes)
    log(f"E={E} K={Kd} N={N} M={M}: ours {row['ours_ms']} ms ({row['ours_tflops']} TFLOP/s) {comp.name}; "
        f"torch._grouped_mm bf16 {row['bf16_ms']} ms ({row['bf16_tflops']}); torch._scaled_grouped_mm rowwise "
        f"{row['scaled_ms']} ms ({row['scaled_tflops']})" + "".join(f" [{n}: {e}]" for n, e in errors.items() if e))
    bf_out = bf16() if times.get("bf16") is not None else None

    if row["ours_ms"] is not None:
        for other in ("bf16", "scaled"):
            if row[f"{other}_ms"] is not None:
                row[f"speedup_vs_{other}"] = round(row[f"{other}_ms"] / row["ours_ms"], 3)
        if bf_out is not None:
            ours()
            # sanity only: the bf16 GEMM of the unquantized operands differs by the quantization error
            rel = ((out.float() - bf_out.float()).norm() / bf_out.float().norm()).item()
            row["rel_diff_vs_bf16"] = round(rel, 5)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="indices into SHAPES, e.g. 0,2")
    ap.add_argument("--rows", type=int, default=None, help="routed rows M for every shape")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true",
                    help="launch each kernel once inside cudaProfilerStart/Stop (run under ncu); no timing")
    ap.add_argument("--precompile", action="store_true", help="compile our kernels into FUSION_CACHE_DIR (no GPU)")
    args = ap.parse_args()
    idx = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(SHAPES))
    if args.precompile:
        from fusion.runtime.aot import compile_jobs
        from fusion.runtime.fp8_gemm import identity_job
        from fusion.runtime.kernel import for_rows

        compile_jobs([for_rows(identity_job(SHAPES[i][2], SHAPES[i][1], SHAPES[i][0], torch.bfloat16),
                               args.rows or SHAPES[i][3]) for i in idx])
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    gen = torch.Generator().manual_seed(0)
    results = []
    for i in idx:
        E, Kd, N, M = SHAPES[i]
        M = args.rows or M
        try:
            results.append(bench_shape(E, Kd, N, M, args.reps, gen, profile=args.profile))
        except Exception as e:
            results.append(dict(E=E, K=Kd, N=N, M=M, error=f"{type(e).__name__}: {e}"))
            log(f"E={E} K={Kd} N={N} M={M}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
