"""Command line: `python -m fusion demo` and `python -m fusion compile`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build MoE blocks, print their plans, compile and run them")
    demo.add_argument("--full", action="store_true", help="real model sizes on the CPU too (slow)")
    demo.add_argument("--no-compile", action="store_true", help="skip compiling the fused kernels")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    comp = sub.add_parser("compile", help="compile the fused kernels of the demo blocks (or --block) for a target")
    comp.add_argument("--target", default="sm_90a")
    comp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    comp.add_argument("--out", default=None, help="folder to write each kernel's .ptx and .cubin to")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fusion.demo import main as demo_main

        return demo_main(full=args.full, compile_kernels=not args.no_compile, device=args.device)
    from fusion.runtime.compile import cli_compile

    return cli_compile(target=args.target, dtype=args.dtype, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
