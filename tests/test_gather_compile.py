"""CPU-only: the gather-A grouped GEMM (A's rows read through an int32 index by cp.async) compiles for sm_90a
without spills, at the tile configurations the runtime asks for; its configuration and host checks."""
import collections
import dataclasses
import importlib
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import fusion.kernels as K  # noqa: E402
from fusion.errors import DTypeError, KernelConfigError, ShapeError  # noqa: E402
from fusion.kernels.mainloop import REGISTER_SPLIT  # noqa: E402
from fusion.kernels.tile_policy import (candidates, for_gather, gather_pairs, gather_tile, spill_fallback,  # noqa: E402
                                        tile_config)
from conftest import sass_or_skip  # noqa: E402

# the FC1 of an MoE block: (experts, d, f) -> a gated GEMM with N = 2f, K = d
MOE_FC1 = {"qwen3-30b-a3b": (128, 2048, 768), "deepseek-v2-lite": (64, 2048, 1408),
           "mixtral-8x7b": (8, 4096, 14336), "wide-k": (32, 7168, 2048)}


def _ops(sass):
    return K.sass_opcodes(sass)


class _SwiGLUTrainMXFP8(K.Epilogue):
    """The FC1 training forward's epilogue (MXFP8 for FC2, the high-precision value, the pre-activation)."""
    gated = True
    inputs = (K.RowVector("scale_x"),)
    outputs = (K.MXFP8Output("out"), K.Output("hp"), K.Output("pre", paired=True))

    def apply(self, gate, up, scale):
        v = importlib.import_module(K.__name__ + ".epi_math").silu(gate) * up * scale
        return v, v, gate, up


def _gather_compile(epi, N, Kd, G, dtype="bfloat16"):
    config = K.GemmConfig(*tile_config(N, Kd, G, epi.gated, "K", False, gather=True))
    return K.compile_grouped_gemm(config, epi, dtype, N, Kd, G)


def _check_gather_sass(comp):
    """wgmma, the A copies as LDGSTS, B by TMA only, no local memory, no stack frame."""
    ops = _ops(sass_or_skip(lambda: comp.sass))
    assert any(o.startswith("HGMMA") for o in ops), "no HGMMA in SASS"
    assert any(o.startswith("LDGSTS") for o in ops), "no cp.async (LDGSTS) loads of A"
    assert any(o.startswith("UTMALDG") for o in ops), "no TMA loads of B"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert comp.frame_size == 0
    assert comp.shared_memory_bytes <= 227 * 1024
    ptx = comp.ptx
    assert "cp.async.bulk.tensor.2d" not in ptx, "A is gathered: no 2-D TMA load of A"
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    producer = REGISTER_SPLIT[True][0]
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer};", ptx), "the gather producer's split"
    return ops


@pytest.mark.parametrize("pairs", [False, True], ids=["single", "m-pairs"])
@pytest.mark.parametrize("model", sorted(MOE_FC1))
def test_gated_fc1_gather_compiles_without_spills(model, pairs, monkeypatch):
    """The policy's gathering FC1 of each MoE model, as single CTAs (the default) and as CTA pairs along m
    (FUSION_GATHER_PAIRS=1): spill-free at gather_tile's tile (the widest that divides N), not a spill fallback."""
    from fusion.kernels import tile_policy

    monkeypatch.setattr(tile_policy, "GATHER_PAIRS", pairs)
    E, d, f = MOE_FC1[model]
    comp = _gather_compile(K.SwiGLUScaleEpilogue(), 2 * f, d, E)
    _check_gather_sass(comp)
    assert comp.config.gather_a and comp.config.dynamic
    assert comp.name.endswith("_gA_cm2" if pairs else "_gA") and "_dyn" in comp.name
    want = gather_pairs(gather_tile(for_gather(K.GemmConfig(*tile_config(2 * f, d, E, True, "K", False))), 2 * f),
                        gated=True)
    assert comp.config == want and comp.config.cluster_m == (2 if pairs else 1)
    assert comp.config.tile_n == (192 if 2 * f % 192 == 0 else 256 if 2 * f % 256 == 0 else 128)


@pytest.mark.parametrize("dynamic", [False, True])
def test_both_schedules_gather_without_spills(dynamic):
    """The static walk (every producer thread) and the dynamic one (warp 0 takes the ids, the warpgroup meets at a
    named barrier to read them) both compile to spill-free SASS; only the dynamic one has the barrier and the
    atomic counter."""
    config = dataclasses.replace(K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True)),
                                 dynamic=dynamic)
    comp = K.compile_grouped_gemm(config, K.SwiGLUScaleEpilogue(), "bfloat16", 1536, 2048, 128)
    _check_gather_sass(comp)
    from fusion.kernels.gather_producer import GATHER_BARRIER
    assert bool(re.search(rf"bar\.sync\s+{GATHER_BARRIER}, 128;", comp.ptx)) == dynamic
    assert ("atom.global.add" in comp.ptx or "atom.add" in comp.ptx or "red.global.add" in comp.ptx) == dynamic


@pytest.mark.parametrize("epi,N", [(K.IdentityEpilogue(), 2048), (_SwiGLUTrainMXFP8(), 1536)])
def test_plain_and_training_epilogues_gather_without_spills(epi, N):
    comp = _gather_compile(epi, N, 2048, 128)
    _check_gather_sass(comp)
    want = K.GemmConfig(*tile_config(N, 2048, 128, epi.gated, "K", False, gather=True))
    # the three-output MXFP8 training epilogue spills at 192 pingpong columns and is rebuilt at 128
    assert comp.config == (want if N % 192 else spill_fallback(want))


def test_copies_zero_fill_padding_rows_and_the_k_tail():
    """Every A copy is a cp.async whose source size is chosen at run time (0 = zero fill): a padding row (index -1)
    reads zeros, and so do the chunks past K of a ragged last k-tile (K = 520, not a multiple of tile_k = 64); no
    copy moves 16 bytes unconditionally."""
    for Kd in (520, 512):
        comp = _gather_compile(K.IdentityEpilogue(), 256, Kd, 4)
        _check_gather_sass(comp)
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16, %r\d+;", comp.ptx)
        assert not re.search(r"cp\.async\.cg\.shared\.global [^;]*, 16, 16;", comp.ptx)


@pytest.mark.parametrize("f,d,E", [(768, 2048, 128), (1024, 2048, 64), (2880, 2880, 128)])
def test_fc2_dgrad_gathering_dy_compiles_without_spills(f, d, E):
    """FC2's fused dgrad reading the tokens' gradient through the index (an MoE block's backward without the
    Combine's copy): A (dY) gathered by cp.async, B the weight (E, d, f) as stored, read MN-major by TMA, the
    d(SwiGLU * scale) epilogue reading the saved pre-activation; at the tile the runtime asks for."""
    config = K.GemmConfig(*tile_config(f, d, E, False, "MN", True, gather=True))
    assert config.gather_a and config.b_major == "MN" and config.cluster_n == config.cluster_m == 1
    # 128x256 cooperative where 256 divides f (tile_config's measured rule), else gather_tile's
    assert (config.tile_n, config.pingpong) == ((256, False) if f % 256 == 0 else (192, True))
    comp = K.compile_grouped_gemm(config, K.DSwiGLUEpilogue(), "bfloat16", f, d, E)
    _check_gather_sass(comp)
    assert comp.config == config


def test_tile_policy_gives_gather_a_the_dynamic_schedule():
    for gated, N in ((True, 28672), (True, 1536), (False, 4096)):
        base = K.GemmConfig(*tile_config(N, 4096, 8, gated, "K", False))
        gath = K.GemmConfig(*tile_config(N, 4096, 8, gated, "K", False, gather=True))
        tile = gather_tile(dataclasses.replace(base, gather_a=True, dynamic=True, cluster_n=1, cluster_m=1), N)
        assert gath == (gather_pairs(tile, gated) if gated else tile)
        assert gath.gather_a and gath.dynamic and gath.cluster_n == 1   # a gathered A is never multicast
        assert gath.cluster_m == 1                                      # m-pairs only when asked (gather_pairs)
        # the widest tile that divides N: every n-tile gathers its A rows again
        assert (gath.tile_n, gath.pingpong) == {28672: (256, False), 1536: (192, True), 4096: (256, False)}[N]
    assert gather_tile(for_gather(K.GemmConfig(tile_n=128)), 1000) == for_gather(K.GemmConfig(tile_n=128))
    tried = candidates(for_gather(K.GemmConfig()), 4096)
    assert all(c.gather_a for c in tried) and {c.dynamic for c in tried} == {False, True}
    assert not any(c.gather_a for c in candidates(K.GemmConfig(), 4096))


def test_runtime_job_carries_gather():
    from fusion.runtime.kernel import make_job

    job = make_job("src", torch.bfloat16, 1536, 2048, 128, True, "K", False, "f1", "inference", gather=True)
    assert K.GemmConfig(*job.config).gather_a
    plain = make_job("src", torch.bfloat16, 1536, 2048, 128, True, "K", False, "f1", "inference")
    assert not K.GemmConfig(*plain.config).gather_a and plain.key != job.key


@pytest.mark.parametrize("cfg,epi,match", [
    (dict(gather_a=True, cluster_n=2), K.IdentityEpilogue(), "multicasts a TMA-loaded A"),
    (dict(gather_a=True, cluster_m=2, persistent=False), K.IdentityEpilogue(), "persistent=True"),
    (dict(gather_a=True, cluster_m=2, tile_n=176), K.SwiGLUScaleEpilogue(), r"each B box \(88 rows"),
])
def test_gather_configs_the_kernel_cannot_build_are_rejected(cfg, epi, match):
    with pytest.raises(KernelConfigError, match=match):
        K.compile_grouped_gemm(K.GemmConfig(**cfg), epi, "bfloat16", N=1024, K=512, G=8)


def test_gathering_m_pairs_multicast_b(monkeypatch):
    """The FC1 forward's gathering kernel as CTA pairs on neighbouring m-tiles (tile_policy.gather_pairs): both
    halves of the gated B tile (gate and up boxes) are loaded half per CTA and multicast, A is still each CTA's own
    cp.async rows, a cluster barrier guards the pipeline's start, and the dynamic pair's tile ids go from rank 0
    to rank 1 through the mailbox (st.async into the peer's smem); no spills."""
    from fusion.kernels import tile_policy

    monkeypatch.setattr(tile_policy, "GATHER_PAIRS", True)
    config = K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True))
    assert config.cluster_m == 2 and config.dynamic
    comp = K.compile_grouped_gemm(config, K.SwiGLUScaleEpilogue(), "bfloat16", 1536, 2048, 128)
    ops = collections.Counter(_check_gather_sass(comp))
    assert ops["UTMALDG.3D.MULTICAST"] == 2 and ops["UTMALDG.3D"] == 0, "the gate and up boxes, multicast"
    assert ops["UCGABAR_WAIT"] > 0
    assert "st.async" in comp.ptx, "the dynamic pair's mailbox"
    assert comp.name.endswith("_gA_cm2")


def test_gather_pairs_rule(monkeypatch):
    """gather_pairs: single CTAs by default; with FUSION_GATHER_PAIRS=1 (the module's GATHER_PAIRS) m-pairs where
    every B box splits into whole 8-row swizzle atoms; FC2's dgrad reading dY through the index keeps single CTAs."""
    from fusion.kernels import tile_policy

    assert K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True)).cluster_m == 1
    monkeypatch.setattr(tile_policy, "GATHER_PAIRS", True)
    gated = K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True))
    assert gated.cluster_m == 2
    assert gather_pairs(dataclasses.replace(gated, cluster_m=1, tile_n=176), gated=True).cluster_m == 1  # 88 rows
    assert gather_pairs(dataclasses.replace(gated, cluster_m=1, tile_n=176), gated=False).cluster_m == 2
    assert K.GemmConfig(*tile_config(768, 2048, 128, False, "MN", True, gather=True)).cluster_m == 1
    monkeypatch.setattr(tile_policy, "GATHER_PAIRS", False)
    assert K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True)).cluster_m == 1


def test_gather_needs_k_multiple_of_8():
    with pytest.raises(KernelConfigError, match="multiple of 8"):
        K.check_config(K.GemmConfig(gather_a=True), K.IdentityEpilogue(), "bfloat16", 1024, 516)


def test_run_checks_the_index():
    """Host checks before any launch (no GPU needed): a gathering kernel needs an int32 index; a kernel that
    reads A in order refuses one."""
    comp = _gather_compile(K.IdentityEpilogue(), 256, 512, 4)
    A = torch.zeros(10, 512, dtype=torch.bfloat16)
    B = torch.zeros(4, 256, 512, dtype=torch.bfloat16)
    offs = torch.zeros(5, dtype=torch.int32)
    out = {"out": torch.zeros(16, 256, dtype=torch.bfloat16)}
    with pytest.raises(ShapeError, match="pass index="):
        K.run_grouped_gemm(comp, A, B, offs, out)
    with pytest.raises(DTypeError, match="int32"):
        K.run_grouped_gemm(comp, A, B, offs, out, index=torch.zeros(16, dtype=torch.int64))
    with pytest.raises(ShapeError, match="contiguous"):
        K.run_grouped_gemm(comp, A, B, offs, out, index=torch.zeros(32, dtype=torch.int32)[::2])
    in_order = K.compile_grouped_gemm(dataclasses.replace(comp.config, gather_a=False), K.IdentityEpilogue(),
                                      "bfloat16", 256, 512, 4)
    assert not in_order.name.endswith("_gA")
    with pytest.raises(ShapeError, match="gather_a=True"):
        K.run_grouped_gemm(in_order, A, B, offs, out, index=torch.zeros(16, dtype=torch.int32))


@pytest.mark.parametrize("cluster_n", [1, 2], ids=["single", "n-pairs"])
def test_gather_tma_rows_compile_to_one_box_per_row(cluster_n):
    """GemmConfig.gather_tma (opt-in, in no policy): the gathering kernel loads A's rows by one TMA box each (32 per
    producer warp and k-step, issued from uniform registers; as a pair along n 16, each multicast to both CTAs, the
    pair's tile ids through the mailbox), B by its two gated boxes, no cp.async, no spills."""
    config = dataclasses.replace(K.GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True)),
                                 gather_tma=True, cluster_n=cluster_n)
    comp = K.compile_grouped_gemm(config, K.SwiGLUScaleEpilogue(), "bfloat16", 1536, 2048, 128)
    assert comp.config == config, "built as asked, not a spill fallback"
    ops = collections.Counter(_ops(sass_or_skip(lambda: comp.sass)))
    row_boxes = "UTMALDG.2D.MULTICAST" if cluster_n == 2 else "UTMALDG.2D"
    assert ops[row_boxes] == 32 // cluster_n and ops["UTMALDG.3D"] == 2 and ops["LDGSTS.E.BYPASS.128"] == 0
    assert not any(o.startswith(("STL", "LDL")) for o in ops) and any(o.startswith("HGMMA") for o in ops)
    assert comp.name.endswith("_gAT" + ("_c2" if cluster_n == 2 else "")) and comp.config.gather_tma
    assert ("st.async" in comp.ptx) == (cluster_n == 2), "a dynamic pair's mailbox"


@pytest.mark.parametrize("cfg,match", [
    (dict(gather_tma=True), "set gather_a=True"),
    (dict(gather_a=True, gather_tma=True, cluster_m=2, persistent=True), "use cluster_m = 1"),
    (dict(gather_a=True, gather_tma=True, tile_m=64), "tile_m = 128"),
])
def test_gather_tma_configs_it_cannot_build_are_rejected(cfg, match):
    with pytest.raises(KernelConfigError, match=match):
        K.check_config(K.GemmConfig(**cfg), K.IdentityEpilogue(), "bfloat16", 1024, 512)
