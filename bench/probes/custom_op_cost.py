"""What one call of a torch custom op costs on the host, by how it is registered: the reason fusion's torch.compile
ops (fusion/runtime/custom_ops.py) are registered with torch.library's low-level API.

    python bench/probes/custom_op_cost.py [--device cuda] [--calls 20000]

A trivial op (two torch.empty_like, the op's schema shaped like fusion::block_forward's) called directly: as the
Python function, as a `torch.library.custom_op` (its wrapper adds an output-aliasing check and a dynamo-disabling
layer), and defined with `torch.library.Library` (define + impl), with and without `register_autograd` (what an op
needs to be differentiated in a compiled graph). Prints µs per call, grad mode off and on.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

import torch


def _body(x, params, sizes, train):
    return [torch.empty_like(x), torch.empty_like(x)]


def _backward(ctx, grads):
    return grads[0], None, None, None


def _setup(ctx, inputs, output):
    pass


#: The probe's libraries, kept alive: an op's registration goes with its Library object.
_LIBS: list = []


def _register() -> dict:
    @torch.library.custom_op("probe_hi::op", mutates_args=())
    def wrapped(x: torch.Tensor, params: list[torch.Tensor], sizes: Optional[torch.Tensor],
                train: bool) -> list[torch.Tensor]:
        return _body(x, params, sizes, train)

    wrapped.register_fake(_body)
    wrapped.register_autograd(_backward, setup_context=_setup)
    ops = {"the Python function": _body, "torch.library.custom_op": torch.ops.probe_hi.op.default}
    for ns, autograd in (("probe_lo", False), ("probe_lo_ag", True)):
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define("op(Tensor x, Tensor[] params, Tensor? sizes, bool train) -> Tensor[]")
        lib.impl("op", _body, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{ns}::op", _body, lib=lib)
        if autograd:
            torch.library.register_autograd(f"{ns}::op", _backward, setup_context=_setup, lib=lib)
        ops["Library define + impl" + (" + register_autograd" if autograd else "")] = getattr(torch.ops, ns).op.default
        _LIBS.append(lib)
    return ops


def per_call(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    x = torch.randn(16, 16, device=args.device)
    params = [torch.randn(4, 4, device=args.device) for _ in range(2)]
    sizes = torch.ones(4, dtype=torch.int32, device=args.device)
    print(f"one call, µs ({args.device}; {args.calls} calls): grad off / on")
    for name, op in _register().items():
        with torch.no_grad():
            off = per_call(lambda: op(x, params, sizes, True), args.calls)
        on = per_call(lambda: op(x, params, sizes, True), args.calls)
        print(f"  {name:45s} {off:6.1f} / {on:6.1f}")


if __name__ == "__main__":
    main()
