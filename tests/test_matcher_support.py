"""Helpers shared by the matcher / planner / explain tests: FusionPatterns built directly (no parser), a
predicate stub evaluated by a Python lambda, and the demo block. (No tests here.)"""
from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

import fusion
from fusion import GroupLinear, QuantizeMXFP8, Scale, SwiGLU

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_ast():
    try:
        from fusion.patterns import ast as mod  # once fusion.patterns is importable
        return mod
    except ImportError:
        spec = importlib.util.spec_from_file_location("_fpat_ast_for_tests", ROOT / "patterns" / "ast.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


ast = _load_ast()
SourceLoc, ChainElement, FusionPattern = ast.SourceLoc, ast.ChainElement, ast.FusionPattern


@dataclass(frozen=True)
class Pred:
    """Stands in for ast.Predicate: `.holds(attrs)`, `.text`, `.loc`."""

    text: str
    fn: Callable[[dict], Any]
    loc: Any = SourceLoc("patterns/test.fpat", 99, 5)

    def holds(self, attrs: dict) -> bool:
        return bool(self.fn(attrs))


def el(label, *ops, optional=False, where=(), line=1):
    return ChainElement(label=label, ops=tuple(ops), optional=optional, where=tuple(where),
                        loc=SourceLoc("patterns/test.fpat", line, 5))


def pat(name, *chain, kernel="grouped_gemm", direction="forward", line=1, file="patterns/test.fpat", **kw):
    """A FusionPattern as the loader makes one; its epilogue is derived from the chain, as for a loaded one."""
    return FusionPattern(name=name, kernel=kernel, direction=direction, chain=tuple(chain),
                         loc=SourceLoc(file, line, 1), **kw)


def align64(line=3):
    return Pred("in_features % 64 == 0", lambda a: a["in_features"] % 64 == 0,
                SourceLoc("patterns/test.fpat", line, 11))


def demo_patterns():
    """A small library shaped like the built-ins: FC1 + activation + Scale? + quantize?, a plain GEMM, and a
    backward pattern (FC2 dgrad with the elementwise backward before it)."""
    fc1 = pat("gemm_act_scale_quant",
              el("gemm", "GroupLinear", "Linear", where=(align64(3),), line=3),
              el("act", "activation", line=4),
              el("scale", "Scale", optional=True, line=5),
              el("quant", "quantize", optional=True, line=6),
              line=2, save=("gemm.out",))
    plain = pat("gemm", el("gemm", "GroupLinear", "Linear", where=(align64(11),), line=11), line=10)
    bwd = pat("dact_dgrad", el("act", "activation", line=16), el("scale", "Scale", optional=True, line=17),
              el("quant", "quantize", optional=True, line=18), el("gemm", "GroupLinear", "Linear", line=19),
              direction="backward", kernel="grouped_gemm_dact", line=15)
    return [fc1, plain, bwd]


E, D, F = 8, 1024, 2048


def demo_block(*middle, dtype=torch.bfloat16, d=D, f=F, **kw):
    """FC1 -> SwiGLU -> Scale -> QuantizeMXFP8 -> FC2 (or FC1 -> *middle -> FC2), weights on the meta device
    (planning never reads them; building is instant)."""
    if not middle:
        middle = (SwiGLU(), Scale(), QuantizeMXFP8())
    return fusion.Sequential(GroupLinear(E, d, 2 * f, device="meta", dtype=dtype), *middle,
                             GroupLinear(E, f, d, device="meta", dtype=dtype), **kw)
