"""How many back-to-back training steps a timing takes, and whether the fused / unfused ratio depends on it.

bench_training_step.py timed ten steps back to back (one sync) until session v. Session u found OLMoE's fused step 1.09x the static
unfused one back to back but 1.18x in the same process by the kernels' sums: ten steps of a few ms last a few tens
of ms, and the card's clocks (power-bound on these kernels) move over that time. A training loop runs thousands of
steps; this script times both paths at several counts in one process, the paths alternating within each round and
the order alternating between rounds, so that the ratio of record can be taken at the count a loop sees. It checks
no numerics (bench_training_step.py compares every path with the reference).

    python bench/b2b_calls.py --models olmoe-1b-7b,deepseek-v2-lite --counts 10,100 --rounds 3

With the card's clocks and power logged beside it (session v: both paths run at the 700 W cap, the fused step at
lower SM clocks):

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,nounits -lms 100 > smi.csv &
    python bench/b2b_calls.py --models qwen3-30b-a3b --counts 100,1000 --windows > b2b.log; kill %1
    python bench/b2b_calls.py --clocks b2b.log smi.csv

Prints, per block and count, each path's median ms per step and the ratio baseline / fused; --out writes the rows.
--fused fusion_fp8: the FP8 block against the same bf16 baseline (issue 9's ratio); --fused fusion,fusion_fp8: both
against it in one process (one baseline compile a block). --precompile (no GPU): compile
the fused kernels of the blocks into FUSION_CACHE_DIR (bench_training_step's; the FP8 twins' too).
--weights-change: each FP8 path also timed as its step runs after an optimizer step (bench_training_step's
<path>_after_step: fusion.quant.invalidate_weight_caches(), what the optimizer hook calls, before each step), so it
quantizes its weights again in every step, as a training loop without gradient accumulation does (session am's
records name it <path>@weights_change); the bf16 paths hold no quantized weights.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_training_step as B  # noqa: E402
from bench_common import run_header  # noqa: E402

#: (fused, baseline): the paths timed against each other (--fused replaces the first)
PATHS = ("fusion", "unfused_fullgraph")


def steps_ms(fn, clear, count: int) -> float:
    """Milliseconds per call of `count` calls back to back (one sync before, one after)."""
    clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / count * 1e3


def ratio_rows(model: str, times: dict, counts, paths=PATHS) -> list[dict]:
    """Per count and fused path: each path's median over the rounds and baseline / fused (the rows this script
    prints and writes). `times[(path, count)]` is the list of the rounds' ms; `paths` (fused, ..., baseline): one
    or more fused paths, each timed against the last."""
    *fused_paths, base = paths
    rows = []
    for count in counts:
        med = {p: statistics.median(times[(p, count)]) for p in paths}
        for fused in fused_paths:
            pair = (fused, base)
            rows.append({"model": model, "count": count, "fused": fused, "baseline": base,
                         **{f"{p}_ms": round(med[p], 4) for p in pair},
                         "rounds": {p: [round(t, 4) for t in times[(p, count)]] for p in pair},
                         "ratio": round(med[base] / med[fused], 4)})
    return rows


def with_after_step(paths) -> tuple:
    """`paths` (fused, ..., baseline) with each FP8 fused path followed by its <path>_after_step twin (the same
    block, each step as the first after an optimizer step), the baseline last."""
    *fused, base = paths
    return (*[q for p in fused for q in ((p, p + B.AFTER_STEP) if "fp8" in p else (p,))], base)


def run(block, counts, rounds, log, paths=PATHS, windows=False, weights_change=False) -> list[dict]:
    """One block's training steps on both paths, `rounds` rounds of every count in `counts` (see the module
    docstring); `windows`: log each window's wall-clock bounds; `weights_change`: each FP8 path also as
    <path>_after_step (bench_training_step.AfterStepPath; the next window of a path with fixed weights then
    quantizes once in its first step). Returns :func:`ratio_rows`' rows."""
    setup = B.setup_block(block)
    fns = {}
    if weights_change:
        paths = with_after_step(paths)
    for name in paths:
        fns[name] = B.phase_fn(setup.path(name), "training_step", setup.x, setup.dy)
        for _ in range(3):          # compile, warm up
            fns[name][0]()
    torch.cuda.synchronize()
    times = {(p, c): [] for p in paths for c in counts}
    for r in range(rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        for count in counts:
            for p in order:
                t0 = time.time()
                times[(p, count)].append(steps_ms(*fns[p], count))
                if windows:   # wall-clock bounds, to match a clock / power log (nvidia-smi) against the windows
                    log(f"window {block.model} {p} {count} {t0:.3f} {time.time():.3f} {times[(p, count)][-1]:.4f}")
    rows = ratio_rows(block.model, times, counts, paths)
    for row in rows:
        fused, base = row["fused"], row["baseline"]
        log(f"{block.model:18s} {row['count']:5d} steps  {fused} {row[fused + '_ms']:8.3f} ms  "
            f"{base} {row[base + '_ms']:8.3f} ms  ratio {row['ratio']:.3f}")
    del fns, setup
    torch.cuda.empty_cache()
    return rows


def clock_rows(log_lines, smi_rows, min_count: int = 100) -> list[dict]:
    """Per logged window (``--windows``) of at least `min_count` steps: the median SM clock and power draw and the
    hottest temperature of the nvidia-smi samples inside it. `smi_rows`: the rows of ``nvidia-smi
    --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,nounits -lms 100`` (header first)."""
    samples = []
    for r in smi_rows[1:]:
        try:
            t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, float(r[1]), float(r[2]), float(r[3])))
        except (ValueError, IndexError):
            continue                   # a torn last line, a "[N/A]"
    out = []
    for line in log_lines:
        if not line.startswith("window "):
            continue
        _, model, path, count, t0, t1, ms = line.split()
        inside = [x for x in samples if float(t0) <= x[0] <= float(t1)]
        if int(count) < min_count or not inside:
            continue
        out.append({"model": model, "path": path, "count": int(count), "ms": float(ms),
                    "sm_mhz": statistics.median(x[1] for x in inside),
                    "power_w": statistics.median(x[2] for x in inside),
                    "temp_c": max(x[3] for x in inside), "samples": len(inside),
                    "joules_per_step": round(statistics.median(x[2] for x in inside) * float(ms) / 1e3, 3)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="bench_training_step's block names (required unless --clocks)")
    ap.add_argument("--counts", default="10,100")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fused", default=PATHS[0], help="the fused path (fusion, fusion_fp8, ...), or several "
                    "comma-separated (each against the baseline, all alternating in one process)")
    ap.add_argument("--baseline", default=PATHS[1], help="the path it is timed against")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--windows", action="store_true", help="log every window's wall-clock start and end")
    ap.add_argument("--weights-change", action="store_true", help="each FP8 path also as after an optimizer step: "
                    "it quantizes its weights again in each step")
    ap.add_argument("--out", default=None)
    ap.add_argument("--clocks", nargs=2, metavar=("LOG", "SMI_CSV"),
                    help="no run: summarize a --windows log against an nvidia-smi log (clock, power, J per step)")
    args = ap.parse_args()
    if args.clocks:
        log_path, smi_path = args.clocks
        with open(smi_path) as f:
            smi = list(csv.reader(f))
        for r in clock_rows(open(log_path).readlines(), smi):
            print(f"{r['model']:18s} {r['path']:18s} {r['count']:5d} {r['ms']:8.3f} ms  sm {r['sm_mhz']:6.0f} MHz  "
                  f"power {r['power_w']:5.0f} W  {r['joules_per_step']:6.3f} J/step  temp {r['temp_c']:3.0f} C  "
                  f"({r['samples']} samples)")
        return
    if not args.models:
        ap.error("--models is required (unless --clocks)")
    blocks = B.select_blocks(args.models)
    if args.precompile:
        B.precompile(blocks, fp8="fp8" in args.fused)
        return
    counts = [int(c) for c in args.counts.split(",")]

    def log(msg):
        print(msg, flush=True)

    header = run_header()
    paths = (*args.fused.split(","), args.baseline)
    log(f"{header['gpu']}, commit {header['commit']}; {', '.join(paths[:-1])} against {paths[-1]}, counts {counts}, "
        f"{args.rounds} rounds" + ("; FP8 paths also with weights changing every step" if args.weights_change
                                   else ""))
    rows = [row for block in blocks
            for row in run(block, counts, args.rounds, log, paths, args.windows, args.weights_change)]
    if args.out:
        Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
