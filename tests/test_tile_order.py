"""The tile order inside a group (kernels/scheduler.py `TileScheduler.coords`, GemmConfig.band_m), on the CPU.

`coords` is plain arithmetic on the kernel's integers, so it runs here on Python ints: the same code the kernels
trace. GPU correctness (banded kernels bitwise equal to unbanded ones) is tests/test_band_gpu.py.
"""
import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fusion.kernels as K
from fusion.errors import KernelConfigError
from fusion.kernels.scheduler import TileScheduler
from fusion.kernels.tile_policy import BAND_L2_BYTES, band_for, one_band_limit, resolved_band


def _order(mt, n_units, band, one_band, cluster_n=1, rank=0):
    s = TileScheduler(128, n_units * cluster_n, 1, False, False, cluster_n, band, one_band)
    return [s.coords(t, 0, mt * n_units, rank) for t in range(mt * n_units)]


@pytest.mark.parametrize("mt,n_units,band,one_band", itertools.product((1, 2, 7, 8, 9, 17, 26, 64, 129), (1, 3, 14),
                                                                       (1, 3, 8, 16), (None, 24)))
def test_every_tile_once(mt, n_units, band, one_band):
    got = _order(mt, n_units, band, one_band)
    assert sorted(got) == [(m, n) for m in range(mt) for n in range(n_units)]


@pytest.mark.parametrize("mt", [1, 5, 8, 16, 24])
def test_a_group_within_the_one_band_limit_keeps_m_fastest(mt):
    """Every MoE group of up to one_band m-tiles walks as without bands: the change leaves them alone."""
    assert _order(mt, 6, 8, 24) == _order(mt, 6, 1, None) == [(t % mt, t // mt) for t in range(mt * 6)]


@pytest.mark.parametrize("mt,band,sizes", [(26, 8, [7, 7, 7, 5]), (26, 3, [3] * 8 + [2]), (128, 16, [16] * 8),
                                           (33, 16, [11, 11, 11]), (17, 16, [9, 8])])
def test_a_tall_group_is_cut_into_even_bands_walked_m_fastest(mt, band, sizes):
    n_units = 5
    order = _order(mt, n_units, band, band)
    start = 0
    for size in sizes:
        chunk = order[start * n_units:(start + size) * n_units]
        assert chunk == [(start + t % size, t // size) for t in range(size * n_units)]
        start += size
    assert start == mt


def test_pairs_take_neighbouring_n_tiles_of_the_banded_unit():
    units = _order(26, 3, 8, 8)
    for rank in (0, 1):
        assert _order(26, 3, 8, 8, cluster_n=2, rank=rank) == [(m, 2 * n + rank) for m, n in units]


@pytest.mark.parametrize("mt,band", [(1, 8), (2, 8), (7, 8), (26, 8), (33, 16)])
def test_m_pairs_take_neighbouring_m_tiles_of_one_n_tile(mt, band):
    """cluster_m = 2: a unit is two neighbouring m-tiles of one n-tile (one per rank); a group's odd last m-tile
    leaves rank 1 a tile one past the group (its rows are masked, nothing stored); bands count units."""
    n_units = 3
    units = -(-mt // 2)
    s = TileScheduler(128, n_units, 1, False, False, 1, band, band, cluster_m=2)
    walks = [[s.coords(t, 0, units * n_units, rank) for t in range(units * n_units)] for rank in (0, 1)]
    for (m0, n0), (m1, n1) in zip(*walks):
        assert m1 == m0 + 1 and n0 == n1 and m0 % 2 == 0
    tiles = sorted(walks[0] + walks[1])
    assert tiles == [(m, n) for m in range(2 * units) for n in range(n_units)]
    assert [t for t in tiles if t[0] >= mt] == ([(mt, n) for n in range(n_units)] if mt % 2 else [])
    with pytest.raises(AssertionError, match="along m or along n"):
        TileScheduler(128, 4, 1, False, False, 2, 1, None, cluster_m=2)


def test_band_policy():
    assert band_for(192) == band_for(256) == 16 and band_for(128) == band_for(64) == 8
    assert resolved_band(K.GemmConfig(tile_n=192)) == 16 and resolved_band(K.GemmConfig(tile_n=128)) == 8
    assert resolved_band(K.GemmConfig(tile_n=192, band_m=1)) == 1
    # the gathering kernel keeps m fastest (bands measured slower there); an explicit band still applies
    assert resolved_band(K.GemmConfig(tile_n=256, gather_a=True)) == 1
    assert resolved_band(K.GemmConfig(tile_n=256, gather_a=True, band_m=8)) == 8
    assert resolved_band(K.choose_fp8_config(4096, 7168, 32)) == 8
    # Mixtral's 2048-row groups (17 m-tiles) at K = 4096 stay one band; a dense 16k-row GEMM (128) is cut
    assert one_band_limit(16, 128, 4096, 2) == BAND_L2_BYTES // (128 * 4096 * 2) == 24
    assert one_band_limit(16, 128, 28672, 2) == 16
    assert one_band_limit(8, 128, 7168, 1) == 27


def test_kernel_names_say_the_band():
    epi = K.IdentityEpilogue()
    assert K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True), epi, "bfloat16", 512, 256,
                                  4).name.endswith("s6_band8_pp")
    assert "_band" not in K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True, band_m=1), epi,
                                               "bfloat16", 512, 256, 4).name


@pytest.mark.parametrize("compile_fn", ["bf16", "fp8"])
def test_a_negative_band_is_refused(compile_fn):
    epi = K.IdentityEpilogue()
    with pytest.raises(KernelConfigError, match="band_m"):
        if compile_fn == "bf16":
            K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True, band_m=-1), epi, "bfloat16",
                                   512, 256, 4)
        else:
            cfg = K.choose_fp8_config(1024, 512, 4)
            K.compile_fp8_grouped_gemm(K.GemmConfig(**{**cfg.__dict__, "band_m": -1}), epi, 1024, 512, 4)


def test_fusion_tile_band_sets_every_job_band(monkeypatch):
    """FUSION_TILE_BAND (read at import into fusion.runtime.kernel.TILE_BAND) is the A/B switch: it lands in the
    job's configuration, so the two orders get different cache keys."""
    import torch

    from fusion.runtime import kernel
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job

    def band_of(job):
        return K.GemmConfig(*job.config).band_m

    args = (IDENTITY_SOURCE, torch.bfloat16, 4096, 4096, 1, False, "K", False, "s", "v")
    default = make_job(*args)
    fp8 = make_job(*args, mainloop="fp8_block")
    assert band_of(default) == 0 and band_of(fp8) == 0
    monkeypatch.setattr(kernel, "TILE_BAND", "1")
    assert band_of(make_job(*args)) == 1 and band_of(make_job(*args, mainloop="fp8_block")) == 1
    assert make_job(*args).key != default.key


@pytest.mark.parametrize("N,G,pairs", [(4096, 32, True), (28672, 1, True), (5760, 32, True), (4096, 64, False),
                                       (5760, 128, False), (2880, 32, False), (4032, 1, False)])
def test_dynamic_pairs_for_weights_of_few_groups(N, G, pairs, monkeypatch):
    """128x192 dynamic tiles run as dynamic CTA pairs where the weight has <= 32 groups and the n-tiles pair up
    (tile_policy.dynamic_pairs); FUSION_DYNAMIC_PAIRS=0 keeps them single."""
    from fusion.kernels import tile_policy

    cfg = tile_policy.choose_config(0, N, 4096, G)
    assert (cfg.tile_n, cfg.dynamic) == (192, True)
    assert cfg.cluster_n == (2 if pairs else 1)
    gathered = tile_policy.GemmConfig(*tile_policy.tile_config(N, 4096, G, False, "K", False, gather=True))
    assert gathered.cluster_n == 1
    monkeypatch.setattr(tile_policy, "DYNAMIC_PAIRS", False)
    assert tile_policy.choose_config(0, N, 4096, G).cluster_n == 1


def test_a_spilling_dynamic_pair_falls_back_to_a_single_cta_then_to_128_columns():
    from fusion.kernels.tile_policy import GemmConfig, spill_fallback

    pair = GemmConfig(tile_n=192, stages=5, pingpong=True, dynamic=True, cluster_n=2)
    single = spill_fallback(pair)
    assert (single.tile_n, single.cluster_n) == (192, 1)
    narrow = spill_fallback(single)
    assert (narrow.tile_n, narrow.cluster_n, narrow.stages) == (128, 1, 6)
    assert spill_fallback(narrow) is None


def test_fusion_gated_192_0_restores_128_column_gated_tiles(monkeypatch):
    from fusion.kernels import tile_policy

    assert tile_policy.choose_config(0, 3072, 4096, 128, gated=True).tile_n == 192
    monkeypatch.setattr(tile_policy, "GATED_192", False)
    assert tile_policy.choose_config(0, 3072, 4096, 128, gated=True).tile_n == 128
    assert tile_policy.choose_config(0, 5760, 2880, 128, gated=True).tile_n == 192   # wide N: 192 either way


def test_short_tiles_are_on_by_default_and_fusion_short_tiles_0_turns_them_off():
    """GemmConfig.short_tiles (a group's last m-tile of at most 64 rows issues only their wgmma) defaults to
    tile_policy.SHORT_TILES, read from FUSION_SHORT_TILES at import: every policy configuration carries it, so the
    A/B switch changes the kernels' cache keys and both builds live in one cache."""
    import subprocess
    import sys

    from fusion.kernels.tile_policy import GemmConfig, choose_config, choose_fp8_config, tile_config

    assert GemmConfig().short_tiles
    assert choose_config(0, 1536, 2048, 128, gated=True).short_tiles
    assert choose_fp8_config(4096, 7168, 32).short_tiles
    assert GemmConfig(*tile_config(2048, 1536, 128, False, "MN", False)).short_tiles
    probe = ("from fusion.kernels.tile_policy import GemmConfig, choose_config, choose_fp8_config; "
             "print(GemmConfig().short_tiles, choose_config(0, 1536, 2048, 128, gated=True).short_tiles, "
             "choose_fp8_config(4096, 7168, 32).short_tiles)")
    env = dict(os.environ, FUSION_SHORT_TILES="0")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


@pytest.mark.parametrize("N,K,G,col_block,want", [
    (6144, 4096, 64, 8, (192, True, 2)),      # Hunyuan-A13B: 32 n-tiles at 192 pair up, at 64 groups
    (5760, 2880, 128, 8, (192, True, 2)),     # GPT-OSS-120B: 30, at 128 groups
    (1024, 1536, 40, 8, (192, True, 2)),      # Granite: 6 (one ragged) pair up
    (2816, 4096, 128, 8, (176, True, 2)),     # f = 1408: 14.7 at 192, 16 at 176
    (2816, 2048, 64, 8, (176, True, 2)),
    (2816, 4096, 128, 32, (192, True, 1)),    # an MXFP8 output needs 32-column blocks: 88 is none
    (5120, 3584, 64, 8, (256, False, 2)),     # Qwen2-57B-A14B: 27 at 192, 20 at 256, K >= 3072
    (12800, 4096, 16, 8, (256, False, 2)),    # Phi-3.5-MoE
    (2048, 4096, 128, 8, (256, False, 2)),    # SonicMoE's moe-cute
    (2048, 2048, 64, 8, (192, True, 1)),      # OLMoE: K < 3072, no width pairs up: single 128x192
    (2304, 2048, 8, 8, (192, True, 2)),       # 12 at 192 (a weight of few groups paired before, too)
])
def test_gated_tile_pairs_the_widest_tile_whose_n_tiles_pair_up(N, K, G, col_block, want, monkeypatch):
    """The gated FC1 forward (tile_policy.gated_tile): dynamic CTA pairs at 192 columns where those n-tiles pair up,
    at 176 where f = 1408 (and the outputs' blocks fit 88 logical columns), at 128x256 cooperative where K >= 3072;
    else choose_config's single 128x192. FUSION_GATED_PAIRS=0 restores choose_config's tile; a gathered A (an MoE
    layer's FC1) keeps its own tile."""
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import GemmConfig, n_tile_count, tile_config

    cfg = GemmConfig(*tile_config(N, K, G, True, "K", False, col_block=col_block))
    assert (cfg.tile_n, cfg.pingpong, cfg.cluster_n) == want
    assert cfg.dynamic and cfg.cluster_m == 1 and n_tile_count(N, cfg.tile_n) % cfg.cluster_n == 0
    gathered = GemmConfig(*tile_config(N, K, G, True, "K", False, gather=True, col_block=col_block))
    assert gathered.cluster_n == 1 and gathered.gather_a and gathered.tile_n in (192, 256)
    monkeypatch.setattr(tile_policy, "GATED_PAIRS", False)
    off = GemmConfig(*tile_config(N, K, G, True, "K", False, col_block=col_block))
    assert off == tile_policy.choose_config(0, N, K, G, gated=True)
    assert off.tile_n == 192 and off.cluster_n == (2 if G <= 32 and n_tile_count(N, 192) % 2 == 0 else 1)


def test_an_mxfp8_fc1_never_gets_the_176_column_tile():
    """A block whose FC1 stores MXFP8 (32-column scale blocks) must not be planned at 128x176 (88 logical columns):
    the kernel could not be built. The plan's job passes the output's block to the tile policy."""
    import torch

    import fusion
    from fusion import GroupLinear, QuantizeMXFP8, Scale, SwiGLU
    from fusion.kernels.tile_policy import GemmConfig
    from fusion.runtime.aot import plan_jobs

    with torch.device("meta"):
        plain = fusion.Sequential(GroupLinear(64, 2048, 2816), SwiGLU(), Scale(), GroupLinear(64, 1408, 2048))
        quant = fusion.Sequential(GroupLinear(64, 2048, 2816), SwiGLU(), Scale(), QuantizeMXFP8(),
                                  GroupLinear(64, 1408, 2048))
    f1 = {seq: [GemmConfig(*j.config) for j in plan_jobs(s, torch.bfloat16) if j.step == "F1"]
          for seq, s in (("plain", plain), ("quant", quant))}
    assert f1["plain"] and all(c.tile_n == 176 and c.cluster_n == 2 for c in f1["plain"])
    assert f1["quant"] and all(c.tile_n == 192 for c in f1["quant"])


@given(half=st.integers(8, 8192).map(lambda n: 8 * n), K=st.integers(1, 128).map(lambda k: 64 * k),
       G=st.integers(1, 256), mxfp8=st.booleans())
@settings(max_examples=300, deadline=None)
def test_every_gated_tile_can_be_built_and_its_pairs_pair_up(half, K, G, mxfp8):
    """Whatever the gated FC1's shape: a tile the template builds for its epilogue (tile_n a multiple of 16 up to
    256, an MXFP8 output's 32-column blocks whole in the logical tile: kernels/grouped_gemm.py asserts both), CTA
    pairs only where the n-tiles pair up, and the same tile whatever the group count."""
    from fusion.kernels.tile_policy import GemmConfig, n_tile_count, tile_config

    N = 2 * half
    col_block = 32 if mxfp8 else 8
    cfg = GemmConfig(*tile_config(N, K, G, True, "K", False, col_block=col_block))
    assert cfg.tile_n % 16 == 0 and cfg.tile_n <= 256 and (cfg.tile_n // 2) % col_block == 0
    assert cfg.cluster_m == 1 and cfg.dynamic
    if cfg.cluster_n == 2:
        assert n_tile_count(N, cfg.tile_n) % 2 == 0
    for other in (1, 256):
        assert cfg == GemmConfig(*tile_config(N, K, other, True, "K", False, col_block=col_block))
