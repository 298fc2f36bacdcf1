"""fusion: a declarative fusion-pattern compiler for the MLP blocks of MoE and dense transformers.

Compose ops like PyTorch modules; matched patterns run as fused CuTe DSL kernels on Hopper, every other op
runs its reference implementation. See docs/user-guide.md.
"""
from fusion.errors import (CompileError, DeviceError, DTypeError, ExtraInputError, FallbackError, FusionError,
                           GroupSizesError, PatternError, ShapeError)
from fusion.ops import (Activation, Bias, Clamp, GeGLU, GroupLinear, Linear, QuantizeMXFP8, QuantizeNVFP4, Scale,
                        SReLU, SwiGLU)
from fusion.sequential import Sequential

__version__ = "0.1.0"


def load_patterns(path):
    """Load a .fpat file, or every .fpat file of a folder, into the activation registry and pattern library."""
    from fusion.patterns.registry import load_patterns as _load

    return _load(path)


__all__ = ["Sequential", "GroupLinear", "Linear", "SwiGLU", "GeGLU", "SReLU", "Activation", "Clamp", "Scale",
           "Bias", "QuantizeMXFP8", "QuantizeNVFP4", "load_patterns", "FusionError", "ShapeError", "DTypeError",
           "DeviceError", "ExtraInputError", "GroupSizesError", "FallbackError", "PatternError", "CompileError"]
