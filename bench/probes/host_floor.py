"""The floor of a fused forward's host time on this machine: the block's no-grad forward as the runtime runs it
(replayed, fusion/runtime/replay.py; and interpretive, the replay off), against the very launches it makes (the
bounds prologue, F1, F2) replayed with every argument pre-bound, with and without allocating their outputs. What a
launch path with pre-bound arguments could reach at best.

    python bench/probes/host_floor.py [--model small-batch] [--calls 100]

Prints µs per call of each, and of the primitives (torch.empty on the GPU, the raw stream query, one TVM-FFI
launch, torch._grouped_mm). The GPU is kept ahead by a small block, so these are host times.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from bench_training_step import BLOCKS, setup_block  # noqa: E402


def per_call(fn, calls: int) -> float:
    """Median of fifteen rounds of µs per call, back to back from a synchronized GPU: a round of `calls` calls
    must launch fewer kernels than the launch queue holds (about a thousand), or the host waits for the GPU and
    this times the GPU."""
    rounds = []
    for _ in range(15):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[7]


def launchers(program) -> list:
    """Every compiled kernel object the program's forward may launch (objects with a raw `.launch`)."""
    from fusion.runtime import lone_gemm

    found = list(getattr(program.prologue, "_compiled", {}).values())
    for runner in program.forward_steps:
        for k in getattr(runner, "_kernels", {}).values():
            found.append(k.compiled)
    found += list(lone_gemm._COMPILED.values())
    return [c for c in found if c is not None and hasattr(c, "launch")]


def forget_bindings(program) -> None:
    """Drop the launches bound per call shape (kernels.api.BoundGemm), so the next call binds them again."""
    from fusion.runtime import lone_gemm

    lone_gemm._BOUND.clear()
    for runner in program.forward_steps:
        for k in getattr(runner, "_kernels", {}).values():
            getattr(k, "_bound", {}).clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-batch")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args(argv)
    from fusion.runtime import replay, runner_for

    block = next(b for b in BLOCKS if b.model == args.model)
    s = setup_block(block)
    names = s.seq.inputs.names
    kwargs = {"group_sizes": s.sizes} if "group_sizes" in names else {}
    kwargs |= {name: s.probs.detach() for name in s.seq.inputs.floats}
    x = s.x

    def forward():
        with torch.no_grad():
            return s.seq(x, **kwargs)

    for _ in range(20):
        forward()
    program = runner_for(s.seq, x).program
    record, originals = [], []
    for c in launchers(program):
        raw = c.launch
        originals.append((c, raw))

        def spy(*a, _raw=raw):
            record.append((_raw, a))
            return _raw(*a)

        c.launch = spy
    forget_bindings(program)   # the bound launches hold the raw function: bind again, through the spies
    replay.ENABLED = False     # the interpretive path, whose launches go through the spies (a replay's do not)
    forward()
    torch.cuda.synchronize()
    for c, raw in originals:   # back to the raw functions
        c.launch = raw
    forget_bindings(program)
    print(f"{args.model}: {len(record)} launches per no-grad forward ({torch.cuda.get_device_name()})")
    outputs = forward()   # the recorded pointers stay valid while the caching allocator holds them

    def replay_record():
        for fn, a in record:
            fn(*a)

    rows, d = x.shape
    dev = x.device

    def replay_alloc():
        # the outputs a forward allocates: the bounds buffer, F1's output, F2's output (no grad: nothing saved)
        torch.empty(64, dtype=torch.int32, device=dev)
        torch.empty(rows, block.f, dtype=x.dtype, device=dev)
        torch.empty(rows, d, dtype=x.dtype, device=dev)
        for fn, a in record:
            fn(*a)

    class Replayed(torch.autograd.Function):
        """The replay as an autograd node: the floor of a forward that records for autograd."""

        @staticmethod
        def forward(fctx, x):
            replay_alloc()
            return torch.empty(rows, d, dtype=x.dtype, device=dev)

        @staticmethod
        def backward(fctx, dy):
            return dy

    xg = x.detach().requires_grad_()

    def forward_grad():
        return s.seq(xg, **kwargs)

    w = s.seq[0].weight.detach()
    offs = s.offsets
    interpretive = {"forward, interpretive (replay off)": per_call(forward, args.calls),
                    "forward recording for autograd, interpretive": per_call(forward_grad, args.calls)}
    replay.ENABLED = True
    rows_out = {
        "forward (the runtime: replayed)": per_call(forward, args.calls),
        "forward recording for autograd (replayed)": per_call(forward_grad, args.calls),
        **interpretive,
        "the replay with allocations in an autograd.Function": per_call(lambda: Replayed.apply(xg), args.calls),
        f"replay of its {len(record)} launches, pre-bound": per_call(replay_record, args.calls),
        "the same plus its three torch.empty": per_call(replay_alloc, args.calls),
        "torch.empty (rows, d) bf16": per_call(lambda: torch.empty(rows, d, dtype=x.dtype, device=dev), args.calls),
        "torch._C._cuda_getCurrentRawStream": per_call(lambda: torch._C._cuda_getCurrentRawStream(0), args.calls),
        "torch.cuda.current_stream()": per_call(lambda: torch.cuda.current_stream(), args.calls),
        "one TVM-FFI launch (F1's)": per_call(lambda: record[1][0](*record[1][1]), args.calls),
        "x.data_ptr()": per_call(lambda: x.data_ptr(), args.calls),
        "torch._grouped_mm FC1": per_call(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), args.calls),
    }
    for label, us in rows_out.items():
        print(f"  {label:<48} {us:8.1f} µs")
    del outputs


if __name__ == "__main__":
    main()
