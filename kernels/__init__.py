"""fusion.kernels: CuTe DSL kernel templates (persistent warp-specialized grouped GEMM for sm_90a).

See kernels/README.md for the epilogue protocol. Imports nothing from fusion but fusion.errors.

The names below load on first use (PEP 562): the tile policy (tile_policy.py, plain Python) is read while
planning and compiling, which must not import cutlass (about a second) before a kernel is built or launched.
"""
import importlib as _importlib
import os as _os

# Compile for Hopper even on a machine without a GPU (must be set before cutlass is imported).
_os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

#: Each public name -> the module of this package that defines it.
_EXPORTS = {
    **dict.fromkeys(("Epilogue", "RowVector", "GroupVector", "AuxInput", "Output", "MXFP8Output", "FP8BlockOutput", "RowSumOutput",
                     "FP8BlockDequantOutput", "IdentityEpilogue",
                     "SwiGLUScaleEpilogue", "DSwiGLUEpilogue", "SwiGLUScaleMXFP8Epilogue"), "epilogue"),
    **dict.fromkeys(("CompiledGroupedGemm", "compile_grouped_gemm", "run_grouped_gemm", "bind_grouped_gemm",
                     "BoundGemm", "grouped_gemm", "check_config", "offsets_from_group_sizes", "sass_text", "sass_opcodes"), "api"),
    **dict.fromkeys(("GemmConfig", "choose_config", "fp8_block_output_tile", "cooperative_fp8_config"), "tile_policy"),
    **dict.fromkeys(("CompiledFp8GroupedGemm", "choose_fp8_config", "check_fp8_config", "compile_fp8_grouped_gemm",
                     "run_fp8_grouped_gemm", "bind_fp8_grouped_gemm", "BoundFp8Gemm", "fp8_grouped_gemm"), "fp8_api"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
