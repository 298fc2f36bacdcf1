"""Where an MoE layer's time goes: GPU kernels (torch.profiler) and host functions (cProfile) of one path.

    python bench/profile_moe.py --model qwen3-30b-a3b --tokens 16384 --path fusion [--phase moe_training_step]

The layer, weights and inputs are bench_moe.py's (`run_config`'s setup); paths are its `fusion`,
`fusion_compiled` and `torch_compiled` (variant `parts`). Prints the kernels with the most GPU time per call,
then the Python functions with the most own time per call; first the host µs per call and the aten ops
one call dispatches. The MoE counterpart of bench/profile_step.py and
bench/profile_host.py.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_moe import ALL_CONFIGS, Options, make_paths, phase_fn  # noqa: E402
from profiling import print_host, print_kernels, print_ops  # noqa: E402


def setup(model: str, tokens: int, path_name: str, backend: str = "auto", torch_variant: str = "parts"):
    """bench_moe.run_config's layer, x and dy, and the named path (torch_compiled: variant `torch_variant`)."""
    import fusion

    cfg = next(c for c in ALL_CONFIGS if c.model == model)
    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(cfg.d, cfg.E, cfg.f, cfg.k, device="cuda", dtype=torch.bfloat16, backend=backend)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
    x = torch.randn(tokens, cfg.d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, cfg.d, device="cuda", dtype=torch.bfloat16)
    opts = Options(torch_variant=torch_variant)
    (_, path), = make_paths(path_name, moe, cfg, opts)
    return path, x, dy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--path", default="fusion")
    ap.add_argument("--phase", default="moe_training_step", choices=["moe_forward", "moe_training_step"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host-only", action="store_true", help="skip the kernel profile")
    ap.add_argument("--single-thread", action="store_true",
                    help="autograd runs the backward on the calling thread (torch.autograd.set_multithreading_"
                         "enabled(False)), so cProfile sees the backward's functions too")
    args = ap.parse_args(argv)
    if args.single_thread:
        torch.autograd.set_multithreading_enabled(False)
    path, x, dy = setup(args.model, args.tokens, args.path)
    call, clear = phase_fn(path, args.phase, x, dy)
    for _ in range(3):
        clear()
        call()
    torch.cuda.synchronize()
    title = f"{args.model} T={args.tokens} {args.path} {args.phase}"
    print_ops(call, clear, max(args.calls, 20), title)
    if not args.host_only:
        print_kernels(call, clear, args.calls, args.top, title)
    print_host(call, clear, args.calls, args.top, title)


if __name__ == "__main__":
    sys.exit(main())
