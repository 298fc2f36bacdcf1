"""fusion: a declarative fusion-pattern compiler for the MLP blocks of MoE and dense transformers.

Compose ops like PyTorch modules; matched patterns run as fused CuTe DSL kernels on Hopper, every other op
runs its reference implementation. See docs/user-guide.md.
"""


def _map_source_checkout() -> None:
    """Let a source checkout import like the installed package.

    Installed, patterns/, codegen/ and kernels/ live inside fusion/ (pyproject's package-dir). In a checkout
    they sit next to it, and `python -m fusion` or `python -m pytest` run from the repository root import
    fusion/ from the working directory. This finder resolves exactly those three subpackages to their folders
    there; it does nothing for an installed package.
    """
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "patterns")) or not os.path.isfile(os.path.join(root, "patterns", "fpat.lark")):
        return
    names = {"fusion.patterns", "fusion.codegen", "fusion.kernels"}

    class SourceCheckoutFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in names:
                return None
            return importlib.machinery.PathFinder.find_spec(name, [root])

    if not any(getattr(f, "__name__", "") == "SourceCheckoutFinder" for f in sys.meta_path):
        sys.meta_path.append(SourceCheckoutFinder)


_map_source_checkout()

from fusion.errors import (CompileError, DeviceError, DTypeError, ExtraInputError, FallbackError, FusionError,
                           GroupSizesError, OpArgumentError, PatternError, SecondBackwardError, ShapeError)
from fusion.ops import (Activation, Bias, Clamp, Combine, Gather, GeGLU, GroupLinear, Linear, QuantizeFP8Block,
                        QuantizeMXFP8, QuantizeNVFP4, Scale, SReLU, SwiGLU)
from fusion.sequential import Sequential
from fusion import moe
from fusion.moe import MoE
from fusion.patterns.registry import load_patterns as _load_patterns
from fusion.version import __version__


def load_patterns(path):
    """Load a .fpat file, or every .fpat file of a folder, into the activation registry and pattern library."""
    return _load_patterns(path)


__all__ = ["Sequential", "GroupLinear", "Linear", "SwiGLU", "GeGLU", "SReLU", "Activation", "Clamp", "Scale",
           "Bias", "QuantizeMXFP8", "QuantizeNVFP4", "QuantizeFP8Block", "Gather", "Combine", "MoE", "moe",
           "load_patterns", "FusionError", "ShapeError", "DTypeError", "DeviceError", "ExtraInputError",
           "GroupSizesError", "FallbackError", "PatternError", "CompileError", "OpArgumentError",
           "SecondBackwardError"]
