"""Dtype names (torch spelling, as the epilogue protocol declares them) -> CuTe DSL numeric types."""
from __future__ import annotations

import cutlass

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "uint8": cutlass.Uint8,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
}


def cutlass_dtype(name):
    """``"bfloat16"`` or ``torch.bfloat16`` -> ``cutlass.BFloat16``."""
    if not isinstance(name, str):
        name = str(name).replace("torch.", "")
    return _DTYPES[name]
