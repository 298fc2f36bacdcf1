"""Host microseconds per line of the generated replays (fusion/runtime/launch_code.py): each top-level line of every
forward and backward replay a block builds, timed over back-to-back training steps.

    python bench/probes/replay_lines.py --model small-batch --path fusion_fp8 [--calls 200] [--phase forward]
    python bench/probes/replay_lines.py --moe qwen3-30b-a3b --tokens 1024      # a whole MoE layer (bench_moe.py)

cProfile charges a launch (a TVM-FFI call, not a Python function) to the generated function's own time and
multiplies the cost of small Python calls several times over; bench/host_split.py times whole replays. This probe
compiles every replay with a `perf_counter_ns` mark before each top-level statement (LaunchCode.compile patched
before the block builds its replays: no copy of the runtime's code to keep in step) and prints each line with its
mean, median and 90th-percentile cost per call (a mean far above its median is an occasional spike, such as an
allocation that reaches cudaMalloc, not a steady cost). The GPU is kept ahead by a small block, so these are host
times; the marks add about 0.1 µs a line.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from fusion.runtime import launch_code  # noqa: E402

MARKS: dict = {}   # function name -> list of (line number, ns) marks of the calls timed
SOURCES: dict = {}  # function name -> its source lines


def _marked_source(lines: list[str]) -> list[str]:
    """`lines` with `_mark(i)` before each top-level statement i (and at the function's end, before a return)."""
    out = [lines[0], "    _mark(0)"]
    for i, text in enumerate(lines[1:], 1):
        if text.startswith("    ") and not text.startswith("     "):
            out.append(f"    _mark({i})")
        out.append(text)
    return out


def _patched_compile(self):
    name = f"{self.name} #{len(SOURCES)}"
    marks = MARKS.setdefault(name, [])
    SOURCES[name] = self.lines
    ns = time.perf_counter_ns
    self.namespace["_mark"] = lambda i: marks.append((i, ns()))
    self.lines = _marked_source(self.lines)
    fn = _ORIGINAL(self)
    self.lines = SOURCES[name]
    return fn


_ORIGINAL = launch_code.LaunchCode.compile


def report(calls: int) -> None:
    for name, marks in MARKS.items():
        lines = SOURCES[name]
        samples: "collections.defaultdict[int, list]" = collections.defaultdict(list)
        runs = 0
        for (i, t0), (following, t1) in zip(marks, marks[1:]):
            runs += i == 0
            if following != 0:   # (a mark 0 starts the next run)
                samples[i].append(t1 - t0)
        if not runs:
            continue
        total = sum(sum(s) for s in samples.values()) / runs / 1e3
        print(f"== {name}: {runs} runs timed, {total:.1f} µs per run between the first mark and the last "
              f"(columns: mean, median, 90th percentile µs)")
        for i, text in enumerate(lines):
            if i in samples:
                ordered = sorted(samples[i])
                median, p90 = ordered[len(ordered) // 2], ordered[(len(ordered) * 9) // 10]
                print(f"{sum(ordered) / runs / 1e3:8.2f} {median / 1e3:7.2f} {p90 / 1e3:7.2f}  {text.strip()[:140]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-batch")
    ap.add_argument("--path", default="fusion_fp8")
    ap.add_argument("--phase", default="training_step", choices=["forward", "training_step"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--moe", default=None, help="an MoE config of bench_moe.py: its layer's step (or forward), "
                                                "path fusion; --model and --path are then not read")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    launch_code.LaunchCode.compile = _patched_compile
    if args.moe:
        from bench_moe import phase_fn as moe_phase_fn
        from profile_moe import setup as moe_setup

        path, x, dy = moe_setup(args.moe, args.tokens, "fusion")
        phase = "moe_forward" if args.phase == "forward" else "moe_training_step"
        call, clear = moe_phase_fn(path, phase, x, dy)
        args.model, args.path = f"{args.moe} T={args.tokens}", "fusion"
    else:
        from bench_training_step import phase_fn, select_blocks, setup_block

        block, = select_blocks(args.model)
        setup = setup_block(block)
        call, clear = phase_fn(setup.path(args.path), args.phase, setup.x, setup.dy)
    for _ in range(10):
        clear()
        call()
    torch.cuda.synchronize()
    for marks in MARKS.values():
        marks.clear()
    start = time.perf_counter()
    for _ in range(args.calls):
        clear()
        call()
    host = (time.perf_counter() - start) / args.calls * 1e6
    torch.cuda.synchronize()
    print(f"== {args.model} {args.path} {args.phase}: {host:.1f} µs of host per call with the marks "
          f"({args.calls} calls, {torch.cuda.get_device_name()})")
    report(args.calls)


if __name__ == "__main__":
    main()
