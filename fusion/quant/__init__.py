"""MXFP8 / NVFP4 / FP8-block reference quantization (the specification of the fused kernels).

Self-contained: imports nothing else from ``fusion``. Layouts and rounding rules:
``docs/quantization.md``.
"""

from ._common import finite_amax
from .blocks import columnwise_blocks, columnwise_capacity
from .errors import QuantizationError
from .formats import (E2M1_MAX, E4M3_MAX, decode_e2m1, decode_e4m3, decode_e8m0, encode_e2m1,
                      encode_e4m3, encode_e8m0, pack_fp4, pow2_f32, unpack_fp4)
from .fp8_block import (FP8_BLOCK, fp8_block_dequantize_2d, fp8_block_dequantize_columnwise,
                        fp8_block_quantize_2d, fp8_block_quantize_columnwise, fp8_block_scale_exponent)
from .mxfp8 import (MXFP8_BLOCK, mxfp8_dequantize_2d, mxfp8_dequantize_columnwise, mxfp8_quantize_2d,
                    mxfp8_quantize_columnwise, mxfp8_scale_exponent)
from .nvfp4 import (NVFP4_BLOCK, nvfp4_dequantize_2d, nvfp4_dequantize_columnwise, nvfp4_global_scale,
                    nvfp4_quantize_2d, nvfp4_quantize_columnwise)
from .tensor import QuantizedTensor, dequantize, quantize, quantize_fp8_block, quantize_mxfp8, quantize_nvfp4
from .fp8_weight import (FP8BlockWeight, FP8BlockWeightCache, invalidate_weight_caches, quantize_weight_fp8_block,
                         quantize_weight_fp8_block_reference)
from .fp8_linear import fp8_block_linear

__all__ = [
    "quantize_mxfp8", "quantize_nvfp4", "quantize_fp8_block", "quantize", "dequantize", "QuantizedTensor",
    "MXFP8_BLOCK", "NVFP4_BLOCK", "FP8_BLOCK", "QuantizationError",
    "E4M3_MAX", "E2M1_MAX",
    "encode_e4m3", "decode_e4m3", "encode_e8m0", "decode_e8m0", "encode_e2m1", "decode_e2m1",
    "pack_fp4", "unpack_fp4", "pow2_f32",
    "columnwise_capacity", "columnwise_blocks", "finite_amax",
    "mxfp8_scale_exponent", "mxfp8_quantize_2d", "mxfp8_dequantize_2d",
    "mxfp8_quantize_columnwise", "mxfp8_dequantize_columnwise",
    "nvfp4_global_scale", "nvfp4_quantize_2d", "nvfp4_dequantize_2d",
    "nvfp4_quantize_columnwise", "nvfp4_dequantize_columnwise",
    "fp8_block_scale_exponent", "fp8_block_quantize_2d", "fp8_block_dequantize_2d",
    "fp8_block_quantize_columnwise", "fp8_block_dequantize_columnwise",
    "FP8BlockWeight", "quantize_weight_fp8_block", "quantize_weight_fp8_block_reference", "FP8BlockWeightCache",
    "invalidate_weight_caches",
    "fp8_block_linear",
]
