"""A training step's host time by where autograd runs the backward, and on how many CPU cores.

    python bench/host_threads.py --moe qwen3-30b-a3b --tokens 1024 --paths fusion,torch_compiled
    python bench/host_threads.py --model small-batch --paths fusion,unfused_compiled

By default autograd hands a CUDA backward to its device thread: the forward's Python runs on the calling thread,
the backward's on another, usually on another core. A cProfile of the same step ran about 1.7x slower in every
function, forward ones included, with that default than with the backward on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`): the step's objects move between the two cores' caches every
step. Four modes, in rounds (each a fresh sample of the machine):

  device-thread          autograd's default
  calling-thread         torch.autograd.set_multithreading_enabled(False)
  one-core               the default, with every thread of the process pinned to one core (the highest the
                         process may use; the runs of 2026-11-27 pinned to the lowest)
  one-core+calling       both

Host µs per step: the time to issue `--calls` steps while the GPU works through a long sleep queued first (the
host never waits for the GPU), as bench_common.measure times `host_us`; b2b ms: `--calls` steps, one sync.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # run from a checkout

MODES = ("device-thread", "calling-thread", "one-core", "one-core+calling")


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


class Placement:
    """Sets a mode: autograd's threading and the CPU affinity of every thread of the process (restored after)."""

    def __init__(self):
        self.all_cpus = os.sched_getaffinity(0)
        self.core = max(self.all_cpus)   # the highest: core 0 usually takes the interrupts

    def __call__(self, mode: str) -> None:
        torch.autograd.set_multithreading_enabled("calling" not in mode)
        cpus = {self.core} if mode.startswith("one-core") else self.all_cpus
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # a thread that exited meanwhile
                pass


def host_us(call, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # a few hundred ms of GPU work ahead: the host never waits below
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def b2b_ms(call, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def paths_for(args):
    """[(name, call)] of training steps."""
    out = []
    if args.moe:
        from bench_moe import phase_fn
        from profile_moe import setup

        for name in args.paths.split(","):
            # torch_compiled's whole-layer variant (bench_moe.py's "whole": the one its runs reported; "parts" syncs)
            path, x, dy = setup(args.moe, args.tokens, name, torch_variant="whole")
            call, _ = phase_fn(path, "moe_training_step", x, dy)
            out.append((name, call))
    else:
        from bench_training_step import BLOCKS, phase_fn, setup_block

        setup = setup_block(next(b for b in BLOCKS if b.model == args.model))
        for name in args.paths.split(","):
            call, _ = phase_fn(setup.path(name), "training_step", setup.x, setup.dy)
            out.append((name, call))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-batch", help="a block of bench_training_step.py (without --moe)")
    ap.add_argument("--moe", default=None, help="an MoE config of bench_moe.py")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--paths", default="fusion")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    place = Placement()
    paths = paths_for(args)
    for _, call in paths:
        for mode in modes:  # warm up every path in every mode (the device thread starts at the first backward)
            place(mode)
            for _ in range(3):
                call()
    torch.cuda.synchronize()
    what = args.moe and f"{args.moe} T={args.tokens}" or args.model
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs; {what} training step")
    results = {(name, mode): ([], []) for name, _ in paths for mode in modes}
    for _ in range(args.rounds):
        for name, call in paths:
            for mode in modes:
                place(mode)
                host, b2b = results[(name, mode)]
                host.append(host_us(call, args.calls))
                b2b.append(b2b_ms(call, args.calls))
    place("device-thread")
    print(f"  {'path':<18} {'mode':<18} {'host µs/step (median; rounds)':<44} b2b ms (median)")
    for (name, mode), (host, b2b) in results.items():
        rounds = " ".join(f"{h:.0f}" for h in host)
        print(f"  {name:<18} {mode:<18} {statistics.median(host):7.0f}  ({rounds}){'':<{max(0, 33 - len(rounds))}} "
              f"{statistics.median(b2b):8.3f}")


if __name__ == "__main__":
    main()
