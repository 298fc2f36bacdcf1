"""What autograd's structure of an MoE layer costs on the host, with no kernel of ours: the layer's training step as
fusion.MoE records it (router Linear, then route's node, then the experts block's node, then the loss) against the
same allocations and router GEMMs in one node, each with autograd's device thread and with the backward on the
calling thread. The stubs allocate what the real nodes allocate (route 9 tensors forward and 1 backward, the block 5
forward and 8 backward) and launch nothing, so the difference between the two structures is what merging the
layer's nodes could save, and the step's host time minus either is what our own code costs.

    python bench/probes/autograd_floor.py [--tokens 1024 --d 2048 --f 1024 --experts 64 --k 8] [--calls 200]

Also times the real fusion.MoE layer at that shape in the same process (where it runs: a Hopper GPU).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from bench_common import loss_of  # noqa: E402


def empties(n: int, like: torch.Tensor, numel: int) -> list:
    return [torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(n)]


class RouteStub(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, k: int):
        S = logits.shape[0] * k
        made = empties(9, logits, S)
        fctx.save_for_backward(logits, made[0], made[1])
        index, sizes, probs, expert = made[2], made[3], made[4], made[5]
        fctx.mark_non_differentiable(index, sizes, expert)
        return index, sizes, probs, expert

    @staticmethod
    def backward(fctx, _i, _s, dprobs, _e):
        logits, _, _ = fctx.saved_tensors
        return torch.empty_like(logits), None


class BlockStub(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, probs, w1, w2):
        made = empties(4, x, x.shape[0] * 8)
        y = torch.empty_like(x)
        fctx.save_for_backward(x, made[0])
        fctx.held = made[1:]
        return y

    @staticmethod
    def backward(fctx, dy):
        x, _ = fctx.saved_tensors
        fctx.held = None
        scratch = empties(4, x, x.shape[0] * 8)
        del scratch
        return (torch.empty_like(x), torch.empty(x.shape[0] * 8, dtype=x.dtype, device=x.device),
                torch.empty_like(_W[0]), torch.empty_like(_W[1]))


class LayerStub(torch.autograd.Function):
    """The router GEMM, route's and the block's allocations, in one node."""

    @staticmethod
    def forward(fctx, x, wr, w1, w2, k: int):
        logits = x @ wr.t()
        S = x.shape[0] * k
        made = empties(9, logits, S)
        bmade = empties(4, x, x.shape[0] * 8)
        y = torch.empty_like(x)
        fctx.save_for_backward(x, wr, logits, made[0], made[1], bmade[0])
        fctx.held = bmade[1:]
        return y

    @staticmethod
    def backward(fctx, dy):
        x, wr, logits, _, _, _ = fctx.saved_tensors
        fctx.held = None
        scratch = empties(4, x, x.shape[0] * 8)
        del scratch
        dx = torch.empty_like(x)
        dprobs = torch.empty(x.shape[0] * 8, dtype=x.dtype, device=x.device)
        dw1, dw2 = torch.empty_like(_W[0]), torch.empty_like(_W[1])
        dlogits = torch.empty_like(logits)
        del dprobs
        dx.addmm_(dlogits, wr)
        return dx, dlogits.t() @ x, dw1, dw2, None


_W: list = []


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_step(step, clear, calls: int) -> float:
    """Median of seven rounds of µs per back-to-back step (the GPU work is a few tiny GEMMs: host time)."""
    for _ in range(10):
        clear()
        step()
    rounds = []
    for _ in range(7):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            clear()
            step()
        sync()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(rounds)[3]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--model", default="olmoe-1b-7b", help="the real layer timed alongside (bench_moe.py's config)")
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    T, d, f, E, k = args.tokens, args.d, args.f, args.experts, args.k
    x = torch.randn(T, d, device=dev, dtype=dt).requires_grad_()
    wr = torch.randn(E, d, device=dev, dtype=dt).requires_grad_()
    _W[:] = [torch.randn(E, 2 * f, d, device=dev, dtype=dt).requires_grad_(),
             torch.randn(E, d, f, device=dev, dtype=dt).requires_grad_()]
    w1, w2 = _W
    dy = torch.randn(T, d, device=dev, dtype=dt)

    def clear():
        for t in (x, wr, w1, w2):
            t.grad = None

    def layered():
        logits = F.linear(x, wr)
        _, _, probs, _ = RouteStub.apply(logits, k)
        loss_of(BlockStub.apply(x, probs, w1, w2), dy).backward()

    def one_node():
        loss_of(LayerStub.apply(x, wr, w1, w2, k), dy).backward()

    steps = {"layered (router Linear, route node, block node)": layered, "one node": one_node}
    real = None
    try:
        from profile_moe import setup
        from bench_moe import phase_fn

        path, rx, rdy = setup(args.model, T, "fusion")
        real, real_clear = phase_fn(path, "moe_training_step", rx, rdy)
        real()
    except Exception as exc:   # (no Hopper GPU, or no kernels: the stubs alone)
        print(f"the real layer does not run here: {type(exc).__name__}: {exc}")
    if real is not None:
        steps[f"fusion.MoE {args.model} T={T}"] = real
    for mode in ("device thread", "calling thread"):
        torch.autograd.set_multithreading_enabled(mode == "device thread")
        for name, step in steps.items():
            c = real_clear if step is real else clear
            print(f"{mode:<15} {name:<52} {per_step(step, c, args.calls):8.1f} µs per step")
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
