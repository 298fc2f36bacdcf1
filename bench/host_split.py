"""Where one call's host (CPU) time goes, split by the runtime's own pieces: each forward and backward step's
runner, the program's bookkeeping around them, autograd's engine (the time from `.backward()` to our backward
function and back), and the input checks.

    python bench/host_split.py --model small-batch [--calls 200]                   # the training-step block
    python bench/host_split.py --moe qwen3-30b-a3b --tokens 1024                   # the whole MoE layer

cProfile cannot split a training step: autograd runs our backward function on its device thread, and the
profile of the calling thread then charges that time to `run_backward`. Here every piece is wrapped with a
`time.perf_counter` timer (either thread), so the columns add up to the step's wall time per call. The GPU is
kept ahead by a small block, so these are host times. Complements bench/host_overhead.py (µs per call of whole
calls) and bench/profile_host.py (cProfile of the calling thread).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # run from a checkout

TIMES: "collections.Counter[str]" = collections.Counter()


def timed(label: str, fn):
    """`fn` with its wall time added to TIMES[label]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start
    return wrapper


def instrument_program(program, prefix: str = "") -> None:
    """Wrap each of the program's step runners, its forward and backward, and its bounds prologue."""
    for name, steps in (("F", program.forward_steps), ("B", program.backward_steps)):
        for n, runner in enumerate(steps, 1):
            runner.run = timed(f"{prefix}{name}{n} {type(runner).__name__}", runner.run)
    program.run_forward = timed(f"{prefix}program.forward (all)", program.run_forward)
    program.backward = timed(f"{prefix}program.backward (all)", program.backward)
    program._bounds = timed(f"{prefix}bounds", program._bounds)


def instrument_autograd() -> None:
    """The autograd function's forward and backward (the parts outside the program), and the replays that stand in
    for the program's forward and backward (fusion/runtime/replay.py, backward_replay.py)."""
    from fusion.runtime import autograd, backward_replay, replay

    fn = autograd._BlockFunction
    fn.forward = staticmethod(timed("_BlockFunction.forward (all)", fn.forward))
    fn.backward = staticmethod(timed("_BlockFunction.backward (all)", fn.backward))
    replay.ForwardReplay.train = timed("forward replay (training)", replay.ForwardReplay.train)
    replay.ForwardReplay.__call__ = timed("forward replay (no grad)", replay.ForwardReplay.__call__)
    backward_replay.BackwardReplay.__call__ = timed("backward replay", backward_replay.BackwardReplay.__call__)


def report(title: str, calls: int, total_s: float) -> None:
    print(f"== {title}: {total_s / calls * 1e6:.1f} µs of host per call ({calls} calls, {torch.cuda.get_device_name()})")
    for label, seconds in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<48} {seconds / calls * 1e6:8.1f} µs")


def measure(call, clear, calls: int, title: str) -> None:
    for _ in range(10):
        clear()
        call()
    torch.cuda.synchronize()
    TIMES.clear()
    outer = timed("step (all)", call)
    start = time.perf_counter()
    for _ in range(calls):
        clear()
        outer()
    total = time.perf_counter() - start
    torch.cuda.synchronize()
    report(title, calls, total)


def instrument_custom_ops() -> None:
    """The torch.compile custom ops' implementations (fusion/runtime/custom_ops.py): what runs inside them, and
    (by difference from the step) what torch's custom-op and compiled-graph wrappers cost around them."""
    from fusion.runtime import custom_ops

    for name in ("_context", "_as_promised", "_program"):
        setattr(custom_ops, name, timed(f"custom_ops.{name}", getattr(custom_ops, name)))
    # the registered kernel looks its implementation up per call, so a wrapped entry is what runs
    for name, fn in list(custom_ops.IMPLEMENTATIONS.items()):
        custom_ops.IMPLEMENTATIONS[name] = timed(f"custom op {name} (implementation)", fn)


def block_step(model: str, calls: int, path_name: str = "fusion") -> None:
    from bench_training_step import BLOCKS, phase_fn, setup_block
    from fusion.runtime import runner_for

    block = next(b for b in BLOCKS if b.model == model)
    setup = setup_block(block)
    path = setup.path(path_name)
    for phase in ("forward", "training_step"):
        call, clear = phase_fn(path, phase, setup.x, setup.dy)
        call()
        if phase == "forward":
            runner = runner_for(path.seq, setup.x)
            instrument_program(runner.program)
            instrument_autograd()
            if path_name == "fusion_compiled":
                instrument_custom_ops()
            type(runner).check = timed("runner.check", type(runner).check)
        measure(call, clear, calls, f"{model} {path_name} {phase}")


def moe_step(model: str, tokens: int, calls: int) -> None:
    from profile_moe import setup
    from bench_moe import phase_fn
    from fusion.runtime import runner_for

    path, x, dy = setup(model, tokens, "fusion")
    for phase in ("moe_forward", "moe_training_step"):
        call, clear = phase_fn(path, phase, x, dy)
        call()
        if phase == "moe_forward":
            moe = path.call
            from fusion.moe import layer
            layer.route = timed("route", layer.route)
            from fusion.runtime import route as route_kernels
            fn = route_kernels._KernelRoute
            fn.backward = staticmethod(timed("route backward", fn.backward))
            moe.router.forward = timed("router Linear", moe.router.forward)
            moe.forward = timed("MoE.forward (all)", moe.forward)
            torch.autograd.backward = timed("torch.autograd.backward (engine and nodes)", torch.autograd.backward)
            for name, child in moe.named_modules():
                if hasattr(child, "inputs") and hasattr(child, "ops"):
                    runner = runner_for(child, x)
                    if runner.program is not None:
                        instrument_program(runner.program, prefix=f"{name}.")
            instrument_autograd()
            instrument_moe_node()
        measure(call, clear, calls, f"{model} T={tokens} fusion {phase}")


def instrument_moe_node() -> None:
    """The merged MoE node's pieces (fusion/runtime/moe_node.py: route and the experts block in one autograd
    node, the default for a training step): its forward and backward whole, route's kernels' host path in each,
    the input checks, and the block's node parts around its replays."""
    from fusion.runtime import autograd, moe_node, route

    fn = moe_node._RoutedBlockFunction
    fn.forward = staticmethod(timed("moe node forward (all)", fn.forward))
    fn.backward = staticmethod(timed("moe node backward (all)", fn.backward))
    route.forward = timed("  route kernels forward", route.forward)
    route.backward = timed("  route kernels backward", route.backward)
    autograd.forward_node = timed("  block forward_node (replay incl.)", autograd.forward_node)
    autograd.backward_node = timed("  block backward_node (replay incl.)", autograd.backward_node)
    moe_node.takes = timed("moe_node.takes", moe_node.takes)
    moe_node.run = timed("moe_node.run (apply incl.)", moe_node.run)
    from fusion.inputs import BlockInputs

    BlockInputs.context = timed("  input checks (BlockInputs.context)", BlockInputs.context)
    BlockInputs.routed_context = timed("  input checks (BlockInputs.routed_context)", BlockInputs.routed_context)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a block of bench_training_step.py")
    ap.add_argument("--moe", default=None, help="an MoE config of bench_moe.py")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--path", default="fusion", choices=["fusion", "fusion_fp8", "fusion_compiled"],
                    help="--model's path: eager (bf16 or FP8), or inside torch.compile (the custom ops)")
    ap.add_argument("--no-replay", action="store_true",
                    help="run every forward interpretively (fusion/runtime/replay.py off), so that its steps show; "
                         "a replayed forward shows as one piece, outside the program")
    ap.add_argument("--no-backward-replay", action="store_true",
                    help="run every backward interpretively (fusion/runtime/backward_replay.py off), so that its "
                         "steps show")
    args = ap.parse_args(argv)
    if args.no_replay:
        from fusion.runtime import replay

        replay.ENABLED = False
    if args.no_backward_replay:
        from fusion.runtime import backward_replay

        backward_replay.ENABLED = False
    if args.model:
        block_step(args.model, args.calls, args.path)
    if args.moe:
        moe_step(args.moe, args.tokens, args.calls)


if __name__ == "__main__":
    main()
