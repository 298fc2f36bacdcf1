"""CPU-only: compile the grouped GEMM for sm_90a and check the SASS / PTX (no GPU needed)."""
import importlib
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import fusion.kernels as K  # noqa: E402
from fusion.errors import KernelConfigError, ShapeError  # noqa: E402
from conftest import sass_or_skip  # noqa: E402

N_, K_, G_ = 1024, 512, 8   # every kernel here: B (G, N, K) or, MN-major, (G, K, N)


def _em():
    return importlib.import_module(K.__name__ + ".epi_math")


def _ops(sass):
    return K.sass_opcodes(sass)


def _check(comp):
    assert comp.ptx and ".target sm_90a" in comp.ptx
    assert isinstance(comp.cubin, (bytes, bytearray)) and comp.cubin[:4] == b"\x7fELF"
    assert comp.registers is not None and 0 < comp.registers <= 255
    assert comp.shared_memory_bytes <= 227 * 1024
    ops = _ops(sass_or_skip(lambda: comp.sass))
    assert any(o.startswith("HGMMA") for o in ops), "no HGMMA in SASS"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert comp.frame_size == 0
    assert any(o.startswith("UTMALDG") for o in ops), "no TMA loads"
    return ops


def _b_loads(ptx):
    """The 3-D (N, K, G) TMA loads of B in the PTX (A's are 2-D)."""
    return re.findall(r"cp\.async\.bulk\.tensor\.3d\.[^\[]*\[[^\]]*\], \[%rd\d+, \{([^}]*)\}\]", ptx)


def _wgmma_trans_b(ptx):
    """The imm-trans-b operand (last) of every wgmma: 1 = MN-major B."""
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned[^;]*, (\d);", ptx))


# ---- the epilogues the product generates (codegen/emit.py), written out by hand
class _SwiGLUTrainMXFP8(K.Epilogue):
    """FC1 training forward: silu(g)*u*scale as MXFP8 + high precision, and the pre-activation [g | u]."""
    gated = True
    inputs = (K.RowVector("scale_x"),)
    outputs = (K.MXFP8Output("out"), K.Output("hp"), K.Output("pre", paired=True))

    def apply(self, gate, up, scale):
        v = _em().silu(gate) * up * scale
        return v, v, gate, up


class _SwiGLUTrain(K.Epilogue):
    gated = True
    inputs = (K.RowVector("scale_x"),)
    outputs = (K.Output("out"), K.Output("pre", paired=True))

    def apply(self, gate, up, scale):
        return _em().silu(gate) * up * scale, gate, up


class _DSwiGLUScaleDgrad(K.Epilogue):
    """FC2 dgrad dH = dY @ W2[g] with d(silu(g)*u*s): reads [g | u], writes [d_gate | d_up] and the per-element
    d(scale) terms (the row reduction of the scale's gradient)."""
    gated = False
    inputs = (K.AuxInput("pre", paired=True), K.RowVector("scale_x"))
    outputs = (K.Output("dpre", paired=True), K.Output("dscale_x"))

    def apply(self, dy, g, u, scale):
        em = _em()
        sig = em.sigmoid(g)
        silu = g * sig
        return dy * scale * u * (sig + silu * (1.0 - sig)), dy * scale * silu, dy * silu * u


class _DSwiGLUScaleDgradRowSum(_DSwiGLUScaleDgrad):
    """The same with the d(scale) terms summed per row in the kernel (float32 partials per 32 columns)."""
    outputs = (K.Output("dpre", paired=True), K.RowSumOutput("dscale_x"))


class _Bias(K.Epilogue):
    gated = True
    inputs = (K.GroupVector("bias", paired=True), K.GroupVector("b2"), K.RowVector("scale"))
    outputs = (K.Output("out"),)

    def apply(self, gate, up, bg, bu, b2, scale):
        return _em().silu(gate + bg) * (up + bu) * scale + b2


PP128 = dict(tile_n=128, stages=6, pingpong=True)                  # choose_config, N < 4096
PP192 = dict(tile_n=192, stages=5, pingpong=True, dynamic=True)    # choose_config, N >= 4096
DGRAD = dict(tile_n=128, stages=6, pingpong=True, dynamic=True, b_major="MN")  # the product's dgrad

CASES = {
    # gated canonical forward (the product's FC1 variants)
    "fc1-train-mxfp8-bf16": (_SwiGLUTrainMXFP8(), PP128, "bfloat16"),
    "fc1-train-mxfp8-fp16": (_SwiGLUTrainMXFP8(), PP128, "float16"),
    "fc1-train-wide-bf16": (_SwiGLUTrain(), PP192, "bfloat16"),
    "fc1-mxfp8-coop": (K.SwiGLUScaleMXFP8Epilogue(), dict(tile_n=256, stages=4), "bfloat16"),
    "fc1-coop-dynamic": (K.SwiGLUScaleEpilogue(), dict(tile_n=256, stages=4, dynamic=True), "float16"),
    "fc1-paired-bias": (_Bias(), dict(tile_n=256, stages=4), "bfloat16"),
    # MN-major dgrad on the weight as stored
    "fc2-dgrad-bf16": (_DSwiGLUScaleDgrad(), DGRAD, "bfloat16"),
    "fc2-dgrad-fp16": (_DSwiGLUScaleDgrad(), DGRAD, "float16"),
    "fc2-dgrad-coop-prefetch": (K.DSwiGLUEpilogue(), dict(tile_n=128, stages=6, b_major="MN"), "bfloat16"),
    "fc2-dgrad-wide": (_DSwiGLUScaleDgrad(), dict(PP192, b_major="MN"), "bfloat16"),   # 4-chunk epilogue batches
    "fc2-dgrad-rowsum": (_DSwiGLUScaleDgradRowSum(), DGRAD, "bfloat16"),              # d(scale) summed in-kernel
    "fc2-dgrad-rowsum-wide": (_DSwiGLUScaleDgradRowSum(), dict(PP192, b_major="MN"), "bfloat16"),
    "fc1-dgrad-wide": (K.IdentityEpilogue(), dict(PP192, b_major="MN"), "bfloat16"),
    # K-major, not gated
    "plain": (K.IdentityEpilogue(), dict(tile_n=128, stages=6), "bfloat16"),
    "dswiglu-k256": (K.DSwiGLUEpilogue(), dict(tile_n=256, stages=4), "bfloat16"),
}


def _compile(name):
    epi, cfg, dtype = CASES[name]
    return K.compile_grouped_gemm(K.GemmConfig(**cfg), epi, dtype, N=N_, K=K_, G=G_)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compile_sass(name):
    epi, cfg, dtype = CASES[name]
    comp = _compile(name)
    ops = _check(comp)
    assert _compile(name) is comp  # cached in memory
    b_loads = _b_loads(comp.ptx)
    if epi.gated:
        # two half-tile boxes of B per stage: the gate rows and the up rows N/2 further
        assert len(b_loads) == 2, b_loads
        assert sum(o.startswith("UTMALDG") for o in ops) >= 3     # A, gate box, up box
    mn = cfg.get("b_major") == "MN"
    assert _wgmma_trans_b(comp.ptx) == {"1" if mn else "0"}
    if mn:
        assert comp.config.b_major == "MN" and comp.name.endswith("_bmn")


def test_wide_aux_epilogue_keeps_its_tile():
    """A 128x192 pingpong dgrad reading the saved pre-activation (192 accumulator registers a thread) runs its
    epilogue in 4-chunk batches and so builds at 128x192 without spills (at 8-chunk batches it spilled, and the
    spill fallback rebuilt it at 128x128)."""
    comp = _compile("fc2-dgrad-wide")
    assert comp.config.tile_n == 192 and comp.requested_config.tile_n == 192
    assert comp.kernel.tile_epi.batch == 4 and _compile("fc2-dgrad-bf16").kernel.tile_epi.batch == 8


def test_row_sum_output_stores_one_partial_per_block():
    """A RowSumOutput adds its terms in registers, reduces them over the quad (two butterfly shuffles a block) and
    stores one float32 per (row, block): a thread's 4 fragment rows (2 x 2) x 4 blocks of a 128-column tile = 16
    scalar 32-bit stores, in place of the term tensor's 32 quad-swapped 8-byte stores; a block that does not
    divide the tile is refused."""
    rowsum, terms = _compile("fc2-dgrad-rowsum").ptx, _compile("fc2-dgrad-bf16").ptx
    assert rowsum.count("st.global.b32") == 16 and "st.global.b32" not in terms
    assert rowsum.count("st.global.v2.b32") == terms.count("st.global.v2.b32") - 32
    with pytest.raises(KernelConfigError, match="row-sum output"):
        class Odd(_DSwiGLUScaleDgrad):
            outputs = (K.Output("dpre", paired=True), K.RowSumOutput("dscale_x", block=48))
        K.check_config(K.GemmConfig(**DGRAD), Odd(), "bfloat16", N_, K_)


def test_gated_up_box_starts_at_half_n():
    """The second B box of a gated stage is at row N/2 + (the gate box's row) and lands tile_n/2 rows further
    in smem."""
    ptx = _compile("fc1-coop-dynamic").ptx
    text = ptx.replace("\n", " ")
    # up-box row = gate-box row + N/2 (512)
    assert re.search(r"add\.s32\s+%r\d+, %r\d+, 512;", text)
    offs = [int(o) for o in re.findall(r"cp\.async\.bulk\.tensor\.3d\.[^\[]*\[%r\d+\+(\d+)\]", ptx)]
    assert len(offs) == 2 and offs[1] - offs[0] == 128 * 64 * 2  # tile_n/2 rows of 64 16-bit values


def test_paired_tensors_use_the_split_layout():
    """The dgrad reads pre and writes dpre with the up half n = 1024 columns (2048 bytes) after the gate half."""
    ptx = _compile("fc2-dgrad-bf16").ptx
    offs = {int(o) for o in re.findall(r"(?:ld|st)\.global[^\[]*\[%rd\d+\+(\d+)\]", ptx)}
    assert {2048, 2048 + 16, 2048 + 32} <= offs, sorted(offs)


def test_mxfp8_exact_rule_in_ptx():
    """The MXFP8 epilogue computes the scale with integer ops (no float log2 / division), rounds to the
    GEMM dtype first, and encodes with one RNE cvt per element pair. bf16 values go a packed pair at a time (since
    session z): each pair rounded by one cvt into a word, its non-finite halves found by prmt's sign replication,
    the block amax a halfwise integer max over the |x| bit patterns."""
    ptx = _compile("fc1-mxfp8-coop").ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "cvt.rn.bf16x2.f32" in ptx               # rounded to the GEMM dtype before quantizing, a pair a word
    assert "lg2" not in ptx and "div.rn.f32" not in ptx
    assert "max.u16x2" in ptx and "prmt.b32" in ptx  # integer amax over |x| bit patterns, a pair at a time


# ---- configurations the template cannot build are refused by name (no compile)
@pytest.mark.parametrize("epi,cfg,N,match", [
    (K.SwiGLUScaleEpilogue(), dict(b_major="MN"), 1024, "gated GEMM reads the canonical"),
    (K.SwiGLUScaleEpilogue(), dict(tile_k=128), 1024, "tile_k must be 64"),
    (K.SwiGLUScaleEpilogue(), dict(), 1000, "N % 16"),
    (K.IdentityEpilogue(), dict(b_major="MN"), 1020, "N % 8"),
    (K.IdentityEpilogue(), dict(b_major="KN"), 1024, "b_major"),
    (K.DSwiGLUEpilogue(), dict(), 1020, "paired"),
    (K.SwiGLUScaleMXFP8Epilogue(), dict(tile_n=48), 1024, "32-column"),
])
def test_unsupported_configs_are_rejected(epi, cfg, N, match):
    with pytest.raises(KernelConfigError, match=match):
        K.compile_grouped_gemm(K.GemmConfig(**cfg), epi, "bfloat16", N=N, K=512, G=8)


def test_gemm_config_tuples_of_the_old_fields_still_build_a_k_major_config():
    old = K.GemmConfig(tile_n=128, stages=6, pingpong=True)
    fields = (128, 128, 64, 6, 1, 1, True, False, 0, True)      # the ten fields before b_major
    assert K.GemmConfig(*fields) == old and old.b_major == "K"
    assert K.choose_config(4096, 4096, 1024, 8, b_major="MN").b_major == "MN"


@pytest.mark.parametrize("epi, cfg", [
    (K.SwiGLUScaleEpilogue(), dict(tile_n=192, stages=5, pingpong=True, dynamic=True)),
    (K.IdentityEpilogue(), dict(tile_n=128, stages=6, pingpong=True, cluster_n=2)),
    (K.IdentityEpilogue(), dict(tile_n=256, stages=4, dynamic=True)),            # cooperative
])
def test_short_tiles_add_a_mainloop_without_serializing_wgmma(epi, cfg):
    """GemmConfig.short_tiles builds a second mainloop for a group's short last m-tile (kernels/mainloop.py). Its
    branch must sit around whole mainloops: inside the k-loop, ptxas serialized every wgmma (a WARPGROUP.DEPBAR
    wait after each HGMMA: 24 of 24). A pingpong kernel's short mainloop issues half of the HGMMAs of the full one."""
    full, short = (K.compile_grouped_gemm(K.GemmConfig(**cfg, short_tiles=st), epi, "bfloat16", N=N_, K=K_, G=G_)
                   for st in (False, True))
    counts = []
    for comp in (full, short):
        ops = _check(comp)
        hgmma = sum(o.startswith("HGMMA") for o in ops)
        waits = sum(o.startswith("WARPGROUP.DEPBAR") for o in ops)
        assert waits < hgmma / 2, f"{comp.name}: {waits} wgmma waits for {hgmma} HGMMAs (serialized)"
        counts.append(hgmma)
    if cfg.get("pingpong"):
        assert counts[1] == counts[0] * 3 // 2, counts     # the full mainloop's HGMMAs and half as many again


def test_run_checks_b_shape_for_its_major_mode():
    comp = _compile("fc2-dgrad-bf16")                           # MN-major: B must be (G, K, N)
    A = torch.zeros(4, K_, dtype=torch.bfloat16)
    offs = torch.zeros(G_ + 1, dtype=torch.int32)
    with pytest.raises(ShapeError, match=r"\(8, 512, 1024\)"):
        K.run_grouped_gemm(comp, A, torch.zeros(G_, N_, K_, dtype=torch.bfloat16), offs, {})
    comp_k = _compile("plain")                                  # K-major: B must be (G, N, K)
    with pytest.raises(ShapeError, match=r"\(8, 1024, 512\)"):
        K.run_grouped_gemm(comp_k, A, torch.zeros(G_, K_, N_, dtype=torch.bfloat16), offs, {})


def test_a_bound_launch_checks_every_call_before_it_launches():
    """kernels.api.BoundGemm (what the runtime keeps per kernel and call shape): bound once at A's and B's shapes,
    each call still refuses, before any launch (no GPU needed), an A of other rows than it was bound at, a
    non-contiguous A or epilogue tensor, and too few offsets; bind_grouped_gemm itself checks B's shape."""
    comp = _compile("plain")
    bf16 = torch.bfloat16
    A, B = torch.zeros(4, K_, dtype=bf16), torch.zeros(G_, N_, K_, dtype=bf16)
    offs = torch.zeros(G_ + 1, dtype=torch.int32)
    bound = K.bind_grouped_gemm(comp, A, B, offs, num_ctas=8)
    assert (bound.M, bound.T, bound.num_ctas, bound.names) == (4, 4, 8, ("out",))
    out = {"out": torch.zeros(4, N_, dtype=bf16)}
    with pytest.raises(ShapeError, match="bound at A"):
        bound(torch.zeros(5, K_, dtype=bf16), B, offs, out)
    with pytest.raises(ShapeError, match="contiguous"):
        bound(torch.zeros(K_, 4, dtype=bf16).t(), B, offs, out)
    with pytest.raises(ShapeError, match="G\\+1"):
        bound(A, B, offs[:G_], out)
    with pytest.raises(ShapeError, match="'out' must be contiguous"):
        bound(A, B, offs, {"out": torch.zeros(4, 2 * N_, dtype=bf16)[:, ::2]})
    with pytest.raises(ShapeError, match=r"\(8, 1024, 512\)"):
        K.bind_grouped_gemm(comp, A, torch.zeros(G_, K_, N_, dtype=bf16), offs, num_ctas=8)


def test_an_odd_epilogue_batch_stores_its_chunk_pairs_in_whole_sectors():
    """The gated 176-wide pair tile of an expert width f = 1408 (tile_policy.gated_tile: DeepSeek-V2-Lite, GLM-4.5-Air,
    Qwen1.5-MoE) has 88 logical columns, 11 chunks: one odd epilogue batch. Its chunk pairs store 4 columns per lane
    (8-byte STG, whole 32-byte sectors per quad) and only the last chunk 2 (4-byte STG); before session w every chunk
    of both outputs (FC2's input and the saved pre-activation) stored 2 columns, half sectors: 132 4-byte stores and
    no 8-byte one a thread."""
    from fusion.kernels.tile_policy import gated_tile

    N, Kd, G = 2 * 1408, 2048, 64
    cfg = gated_tile(K.GemmConfig(**PP192), N, Kd)
    assert (cfg.tile_n, cfg.cluster_n) == (176, 2), cfg
    comp = K.compile_grouped_gemm(cfg, _SwiGLUTrain(), "bfloat16", N=N, K=Kd, G=G)
    assert comp.config.tile_n == 176   # no spill fallback
    ops = _check(comp)
    narrow, wide = sum(o == "STG.E" for o in ops), sum(o == "STG.E.64" for o in ops)
    # per fragment row (4 a thread): out 1 + pre 2 halves x 1 chunk narrow; 5 pairs x 3 wide
    assert (narrow, wide) == (12, 60), (narrow, wide)
