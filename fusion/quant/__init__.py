"""MXFP8 / NVFP4 reference quantization (the specification of the fused kernels).

Self-contained: imports nothing else from ``fusion``. Layouts and rounding rules:
``docs/quantization.md``.
"""

from .errors import QuantizationError
from .formats import (E2M1_MAX, E4M3_MAX, decode_e2m1, decode_e4m3, decode_e8m0, encode_e2m1,
                      encode_e4m3, encode_e8m0, pack_fp4, unpack_fp4)
from .mxfp8 import MXFP8_BLOCK, mxfp8_dequantize_2d, mxfp8_quantize_2d, mxfp8_scale_exponent, quantize_mxfp8
from .nvfp4 import (NVFP4_BLOCK, nvfp4_dequantize_2d, nvfp4_global_scale, nvfp4_quantize_2d,
                    quantize_nvfp4)
from .tensor import QuantizedTensor, dequantize, quantize

__all__ = [
    "quantize_mxfp8", "quantize_nvfp4", "quantize", "dequantize", "QuantizedTensor",
    "MXFP8_BLOCK", "NVFP4_BLOCK", "QuantizationError",
    "E4M3_MAX", "E2M1_MAX",
    "encode_e4m3", "decode_e4m3", "encode_e8m0", "decode_e8m0", "encode_e2m1", "decode_e2m1",
    "pack_fp4", "unpack_fp4",
    "mxfp8_scale_exponent", "mxfp8_quantize_2d", "mxfp8_dequantize_2d",
    "nvfp4_global_scale", "nvfp4_quantize_2d", "nvfp4_dequantize_2d",
]
