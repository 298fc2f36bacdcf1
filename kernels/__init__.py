"""fusion.kernels: CuTe DSL kernel templates (persistent warp-specialized grouped GEMM for sm_90a).

See kernels/README.md for the epilogue protocol.
"""
import os as _os

# Compile for Hopper even on a machine without a GPU (must be set before cutlass is imported).
_os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from .epilogue import (  # noqa: E402,F401
    Epilogue, RowVector, GroupVector, AuxInput, Output, MXFP8Output,
    IdentityEpilogue, SwiGLUScaleEpilogue, DSwiGLUEpilogue, SwiGLUScaleMXFP8Epilogue,
)
from .api import (  # noqa: E402,F401
    GemmConfig, CompiledGroupedGemm, compile_grouped_gemm, run_grouped_gemm, grouped_gemm,
    choose_config, check_config, offsets_from_group_sizes, sass_text,
)
from .fp8_api import (  # noqa: E402,F401
    CompiledFp8GroupedGemm, choose_fp8_config, check_fp8_config, compile_fp8_grouped_gemm, run_fp8_grouped_gemm,
    fp8_grouped_gemm,
)
