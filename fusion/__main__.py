"""Command line: `python -m fusion demo` and `python -m fusion compile` (also installed as the `fusion` script).

A mistake on the command line is one line on stderr and exit code 2, found before any work starts; a
FusionError while working is one line and exit code 1. Never a traceback. The top of the layers: it imports
what it runs, nothing imports it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fusion.demo import DEEPSEEK_LIKE, GPT_OSS_LIKE, build_block
from fusion.demo import main as demo_main
from fusion.errors import CompileError, FusionError
from fusion.runtime.aot import compile_plan
from fusion.targets import kernel_target

PROG = "python -m fusion"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage text is what --help is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _target(text: str) -> str:
    try:
        return kernel_target(text)
    except FusionError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _out_folder(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("the folder is empty: pass a folder to write .ptx and .cubin files to")
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder: pass a folder (it is created if "
                                         f"missing)")
    return folder


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r}: the demo runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda is not available here (torch.cuda.is_available() is False): "
                                         "use --device cpu")
    return text


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = root.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="build MoE blocks, print their plans, compile and run them")
    demo.add_argument("--full", action="store_true", help="real model sizes on the CPU too (slow)")
    demo.add_argument("--no-compile", action="store_true", help="skip compiling the fused kernels")
    demo.add_argument("--device", default=None, type=_device, help="cpu or cuda (default: cuda if available)")
    comp = sub.add_parser("compile", help="compile the fused kernels of the demo blocks for a target")
    comp.add_argument("--target", default="sm_90a", type=_target, help="sm_90a (default) or sm_90: the same code")
    comp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    comp.add_argument("--out", default=None, type=_out_folder,
                      help="folder to write each kernel's .ptx and .cubin to (created if missing)")
    return root


def cli_compile(target: str = "sm_90a", dtype: str = "bfloat16", out: str | Path | None = None) -> int:
    """`python -m fusion compile`: compile the demo blocks' kernels and print what was built (and with `out`,
    write each kernel's .ptx and .cubin there)."""
    folder = Path(out) if out is not None else None
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CompileError(f"cannot create the --out folder {str(folder)!r} ({err.strerror or err}): pass a "
                               f"writable folder") from None
    dt = getattr(torch, dtype)
    print(f"{'kernel':<64} {'regs':>5} {'smem B':>8} {'cubin B':>8}")
    for shape in (GPT_OSS_LIKE, DEEPSEEK_LIKE):
        block = build_block(shape, dt, "meta")
        for k in compile_plan(block, dtype=dt, target=target):
            print(f"{k.name:<64} {k.registers or '?':>5} {k.shared_memory_bytes or '?':>8} {len(k.cubin):>8}")
            if folder is not None:
                (folder / f"{k.name}.ptx").write_text(k.ptx)
                (folder / f"{k.name}.cubin").write_bytes(k.cubin)
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "demo":
            return demo_main(full=args.full, compile_kernels=not args.no_compile, device=args.device)
        return cli_compile(target=args.target, dtype=args.dtype, out=args.out)
    except FusionError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
