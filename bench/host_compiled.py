"""Host (CPU) µs per call of the fused block eager and inside torch.compile, in one process, and what the
compiled path adds: whether compiling leaves threads behind that slow the eager block, and what a trivial
torch.library custom op costs per call (the floor of the compiled path's two ops).

    python bench/host_compiled.py            # the small-batch block of bench_training_step.py, on a Hopper GPU

Host time is time.perf_counter over back-to-back calls (the best of three rounds of 200), the GPU synchronized only
between rounds: where the GPU keeps up, this is the time Python takes to issue a call. Complements
bench/host_split.py --path fusion_compiled (the same split by runtime piece) and bench/ab_switch.py --path
fusion_compiled (a switch of the compiled path, A/B in one process).
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # run from a checkout

from bench_training_step import BLOCKS, phase_fn, setup_block  # noqa: E402


def host(call, clear, n: int = 200) -> float:
    """The best of three rounds of `n` back-to-back calls: µs of host per call."""
    for _ in range(10):
        clear()
        call()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            clear()
            call()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return best


def custom_op_floor() -> tuple[float, float]:
    """(µs per call of a trivial custom op returning a new tensor, µs of torch.empty_like alone)."""
    @torch.library.custom_op("host_compiled::ident", mutates_args=())
    def ident(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @ident.register_fake
    def _(x):
        return torch.empty_like(x)

    x = torch.randn(16, device="cuda")
    for _ in range(100):
        ident(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2000):
        ident(x)
    op = (time.perf_counter() - start) / 2000 * 1e6
    start = time.perf_counter()
    for _ in range(2000):
        torch.empty_like(x)
    return op, (time.perf_counter() - start) / 2000 * 1e6


def main(model: str = "small-batch") -> None:
    block = next(b for b in BLOCKS if b.model == model)
    setup = setup_block(block)
    eager = setup.path("fusion")
    for phase in ("forward", "training_step"):
        call, clear = phase_fn(eager, phase, setup.x, setup.dy)
        print(f"eager {phase} before compile: {host(call, clear):.1f} us", flush=True)
    print("threads:", [t.name for t in threading.enumerate()], flush=True)
    compiled = setup.path("fusion_compiled")
    for phase in ("forward", "training_step"):
        call, clear = phase_fn(compiled, phase, setup.x, setup.dy)
        print(f"compiled {phase}: {host(call, clear):.1f} us", flush=True)
    print("threads:", [t.name for t in threading.enumerate()], flush=True)
    for phase in ("forward", "training_step"):
        call, clear = phase_fn(eager, phase, setup.x, setup.dy)
        print(f"eager {phase} after compile: {host(call, clear):.1f} us", flush=True)
    torch.autograd.set_multithreading_enabled(False)
    for name, path in (("eager", eager), ("compiled", compiled)):
        call, clear = phase_fn(path, "training_step", setup.x, setup.dy)
        print(f"{name} training_step, backward on the calling thread: {host(call, clear):.1f} us", flush=True)
    op, empty = custom_op_floor()
    print(f"trivial custom op call: {op:.1f} us", flush=True)
    print(f"torch.empty_like: {empty:.1f} us", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
