"""CPU-only: compile the grouped GEMM for sm_90a and check the SASS (no GPU needed)."""
import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import fusion.kernels as K  # noqa: E402


def _ops(sass):
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)


def _check(comp):
    assert comp.ptx and ".target sm_90a" in comp.ptx
    assert isinstance(comp.cubin, (bytes, bytearray)) and comp.cubin[:4] == b"\x7fELF"
    assert comp.registers is not None and 0 < comp.registers <= 255
    assert comp.shared_memory_bytes <= 227 * 1024
    try:
        sass = comp.sass
    except RuntimeError as e:  # nvdisasm missing
        pytest.skip(str(e))
    ops = _ops(sass)
    assert any(o.startswith("HGMMA") for o in ops), "no HGMMA in SASS"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert comp.frame_size == 0
    assert any(o.startswith("UTMALDG") for o in ops), "no TMA loads"


class _Bias(K.Epilogue):
    gated = True
    inputs = (K.GroupVector("bias", paired=True), K.GroupVector("b2"), K.RowVector("scale"))
    outputs = (K.Output("out"),)

    def apply(self, gate, up, bg, bu, b2, scale):
        em = importlib.import_module(K.__name__ + ".epi_math")
        return em.silu(gate + bg) * (up + bu) * scale + b2


class _MXHP(K.SwiGLUScaleMXFP8Epilogue):
    outputs = (K.MXFP8Output("out"), K.Output("hp"))

    def apply(self, gate, up, scale):
        v = super().apply(gate, up, scale)
        return v, v


@pytest.mark.parametrize("epi,cfg", [
    (K.IdentityEpilogue(), K.GemmConfig(tile_n=128, stages=6)),
    (K.SwiGLUScaleEpilogue(), K.GemmConfig(tile_n=256, stages=4, dynamic=True)),
    (K.DSwiGLUEpilogue(), K.GemmConfig(tile_n=128, stages=6)),
    (K.DSwiGLUEpilogue(), K.GemmConfig(tile_n=256, stages=4)),
    (K.SwiGLUScaleMXFP8Epilogue(), K.GemmConfig(tile_n=256, stages=4)),
    (_MXHP(), K.GemmConfig(tile_n=256, stages=4)),
    (_Bias(), K.GemmConfig(tile_n=256, stages=4)),
    (K.SwiGLUScaleEpilogue(), K.GemmConfig(tile_n=192, stages=5, pingpong=True)),
    (K.SwiGLUScaleEpilogue(), K.GemmConfig(tile_n=192, stages=5, pingpong=True, dynamic=True)),
    (K.SwiGLUScaleMXFP8Epilogue(), K.GemmConfig(tile_n=128, stages=6, pingpong=True)),
    (K.DSwiGLUEpilogue(), K.GemmConfig(tile_n=128, stages=6, pingpong=True)),
])
def test_compile_sass(epi, cfg):
    comp = K.compile_grouped_gemm(cfg, epi, "bfloat16", N=1024, K=512, G=8)
    _check(comp)
    # cached in memory
    assert K.compile_grouped_gemm(cfg, epi, "bfloat16", N=1024, K=512, G=8) is comp


def test_interleave_roundtrip():
    import torch
    W = torch.randn(3, 64, 5)
    Wi = K.interleave_gated_weight(W)
    assert torch.equal(Wi[:, 8:16], W[:, 32:40])
    assert torch.equal(K.deinterleave_gated(Wi), W)
    x = torch.randn(7, 32)
    assert torch.equal(K.deinterleave_gated(K.interleave_gated_weight(x, dim=-1), dim=-1), x)


def test_mxfp8_exact_rule_in_ptx():
    """The MXFP8 epilogue computes the scale with integer ops (no float log2 / division), rounds to the
    GEMM dtype first, and encodes with one RNE cvt per element pair."""
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=256, stages=4), K.SwiGLUScaleMXFP8Epilogue(), "bfloat16",
                                  N=1024, K=512, G=8)
    ptx = comp.ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "cvt.rn.bf16.f32" in ptx                 # rounded to the GEMM dtype before quantizing
    assert "lg2" not in ptx and "div.rn.f32" not in ptx
    assert "max.u32" in ptx or "max.s32" in ptx     # integer amax over |x| bit patterns
