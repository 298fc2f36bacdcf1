"""The grouped GEMM's CTA pairs (GemmConfig.cluster_n = 2: neighbouring n-tiles of one m-tile share the A tile by
TMA multicast) without a GPU: the SASS, the tile policy that picks them, the configuration checks, and the launch
grid's whole pairs. GPU numerics: tests/test_cluster_gpu.py."""
import collections
import dataclasses
import types

import pytest
import torch
from conftest import sass_or_skip

from fusion.errors import KernelConfigError
from fusion.kernels import GemmConfig, IdentityEpilogue, SwiGLUScaleEpilogue, compile_grouped_gemm
from fusion.kernels.api import launch_grid
from fusion.kernels.tile_policy import choose_config, pair_ctas, tile_config

PAIR = GemmConfig(tile_n=128, stages=6, pingpong=True, cluster_n=2)


def _opcodes(comp):
    from fusion.kernels.api import sass_opcodes

    return collections.Counter(sass_or_skip(lambda: sass_opcodes(comp.sass)))


@pytest.mark.parametrize("epilogue,N,K", [(IdentityEpilogue(), 2048, 768), (SwiGLUScaleEpilogue(), 1536, 2048)])
def test_pairs_multicast_a_and_single_ctas_do_not(epilogue, N, K):
    pair = compile_grouped_gemm(PAIR, epilogue, "bfloat16", N, K, 128)
    single = compile_grouped_gemm(dataclasses.replace(PAIR, cluster_n=1), epilogue, "bfloat16", N, K, 128)
    ops, ops1 = _opcodes(pair), _opcodes(single)
    for o in (ops, ops1):
        assert any(op.startswith("HGMMA") for op in o)
        assert not any(op.startswith(("LDL", "STL")) for op in o), "register spills"
    assert pair.frame_size == 0 and single.frame_size == 0
    # the pair: A (M, K) 2-D boxes multicast, B (N, K, G) 3-D boxes plain, and a cluster barrier before the
    # pipeline starts (a peer's multicast must find initialized barriers); single CTAs never multicast
    assert ops["UTMALDG.2D.MULTICAST"] > 0 and ops["UTMALDG.2D"] == 0 and ops["UTMALDG.3D"] > 0
    assert ops["UCGABAR_ARV"] > 0 and ops["UCGABAR_WAIT"] > 0
    assert ops1["UTMALDG.2D.MULTICAST"] == 0 and ops1["UTMALDG.2D"] > 0 and ops1["UCGABAR_WAIT"] == 0
    assert pair.name.endswith("_c2") and not single.name.endswith("_c2")


def test_m_pairs_multicast_b():
    """cluster_m = 2 on an odd n-tile count (2880 = 15 x 192, GPT-OSS's width): B's boxes are multicast, A's are
    not, a cluster barrier guards the pipeline's start, no spills; the name says _cm2."""
    cfg = GemmConfig(tile_n=192, stages=5, pingpong=True, dynamic=True, cluster_m=2, b_major="MN")
    comp = compile_grouped_gemm(cfg, IdentityEpilogue(), "bfloat16", 2880, 512, 8)
    ops = _opcodes(comp)
    assert any(op.startswith("HGMMA") for op in ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops) and comp.frame_size == 0, "register spills"
    assert ops["UTMALDG.3D.MULTICAST"] > 0 and ops["UTMALDG.3D"] == 0 and ops["UTMALDG.2D"] > 0
    assert ops["UTMALDG.2D.MULTICAST"] == 0 and ops["UCGABAR_WAIT"] > 0
    assert comp.name.endswith("_cm2")


def test_policy_pairs_the_static_schedule_where_n_tiles_are_even():
    # 128x128 static: Qwen3's FC2 (N=2048) and an ungated N=1536 (12 n-tiles) pair; N=1152 (9 n-tiles) does not
    assert choose_config(0, 1536, 2048, 128).cluster_n == 2
    assert choose_config(0, 2048, 768, 128).cluster_n == 2
    # a gated FC1 takes 128x192 on the dynamic schedule at any N (tile_policy.GATED_192), single at 128 groups
    gated = choose_config(0, 1536, 2048, 128, gated=True)
    assert (gated.tile_n, gated.dynamic, gated.pingpong, gated.cluster_n) == (192, True, True, 1)
    assert choose_config(0, 2048, 2048, 8, gated=True).cluster_n == 1      # 11 n-tiles (ragged): no pair
    assert choose_config(0, 1536, 2048, 8, gated=True).cluster_n == 2      # 8 n-tiles, 8 groups: dynamic pair
    unpaired = choose_config(0, 1152, 2880, 128)
    assert unpaired.cluster_n == 1 and unpaired.dynamic and unpaired.tile_n == 128   # unpaired: dynamic single
    # GPT-OSS's FC2 (N=2880: 22.5 128-column tiles) takes 15 whole 192-column ones, dynamic, single
    gpt_oss = choose_config(0, 2880, 2880, 128)
    assert (gpt_oss.tile_n, gpt_oss.cluster_n, gpt_oss.dynamic, gpt_oss.pingpong) == (192, 1, True, True)
    # the dynamic schedule (wide N) stays single for weights of many groups; with <= 32 groups its 128x192 tiles
    # run as dynamic pairs (tile_policy.dynamic_pairs: DeepSeek-V3's EP8 share, dense blocks)
    assert choose_config(0, 4096, 2048, 64).cluster_n == 1 and choose_config(0, 4096, 2048, 64).dynamic
    assert choose_config(0, 4096, 2048, 32).cluster_n == 2 and choose_config(0, 4096, 2048, 32).dynamic
    # an epilogue reading a saved tensor (FC2's dgrad) takes 128x128 pingpong on the dynamic schedule, as CTA pairs
    # sharing dY's tile where the n-tiles pair up, else as CTA pairs along m sharing the weight's tile (cluster_m = 2),
    # at 128x192 where 192 divides N; a gathered A is never multicast
    def aux(N):
        c = GemmConfig(*tile_config(N, 2048, 128, False, "MN", True))
        assert c.dynamic and c.pingpong and c.tile_m == 128
        return c.tile_n, c.cluster_n, c.cluster_m
    assert aux(1536) == (128, 2, 1) and aux(768) == (128, 2, 1) and aux(400) == (128, 2, 1)  # 12, 6, 4 n-tiles
    assert aux(2880) == (192, 1, 2)     # GPT-OSS: 23 n-tiles at 128, 15 at 192
    assert aux(2944) == (128, 1, 2)     # 23 n-tiles, 192 does not divide
    assert aux(1408) == (128, 1, 2)     # DeepSeek-V2-Lite: 11
    # the lone GEMMs (no saved-tensor epilogue) keep single CTAs on an odd n-tile count (m-pairs measured no gain)
    assert choose_config(0, 2880, 5760, 128, b_major="MN").cluster_m == 1
    assert choose_config(0, 2880, 2880, 128).cluster_m == 1
    gath = GemmConfig(*tile_config(1536, 2048, 128, True, "K", False, gather=True))
    assert gath.gather_a and gath.cluster_n == 1
    # pair_ctas itself
    assert pair_ctas(GemmConfig(tile_n=128), 384).cluster_n == 1            # 3 n-tiles
    assert pair_ctas(GemmConfig(tile_n=128), 400).cluster_n == 2            # 4, the last one ragged
    assert pair_ctas(GemmConfig(tile_n=128, dynamic=True), 512).cluster_n == 1
    assert pair_ctas(GemmConfig(tile_n=128, persistent=False), 512).cluster_n == 1


@pytest.mark.parametrize("cfg,N,gated,msg", [
    (dataclasses.replace(PAIR, persistent=False), 1024, False, "persistent=True"),
    (dataclasses.replace(PAIR, gather_a=True), 1024, False, "gather_a=False"),
    (PAIR, 384, False, "even number of n-tiles (3"),
    (PAIR, 384, True, "even number of n-tiles (3"),     # gated: 192 logical columns in 64-column tiles
    (dataclasses.replace(PAIR, cluster_n=4), 1024, False, "use 1, or 2"),
    (dataclasses.replace(PAIR, cluster_m=2), 1024, False, "along m or along n"),
    (dataclasses.replace(PAIR, cluster_m=2, cluster_n=1, tile_n=176), 1024, True, r"each B box (88 rows"),
    (dataclasses.replace(PAIR, cluster_m=2, cluster_n=1, persistent=False), 1024, False, "persistent=True"),
    (dataclasses.replace(PAIR, cluster_m=4, cluster_n=1), 1024, False, "use 1, or 2 (a CTA pair on neighbouring m"),
])
def test_config_errors_name_the_constraint(cfg, N, gated, msg):
    epi = SwiGLUScaleEpilogue() if gated else IdentityEpilogue()
    with pytest.raises(KernelConfigError, match=msg.replace("(", r"\(")):
        compile_grouped_gemm(cfg, epi, "bfloat16", N, 256, 8)


def test_launch_grid_takes_whole_pairs():
    offsets = torch.zeros(9, dtype=torch.int32)
    pair = types.SimpleNamespace(config=PAIR, G=8, n_tiles=8)
    single = types.SimpleNamespace(config=dataclasses.replace(PAIR, cluster_n=1), G=8, n_tiles=8)
    assert launch_grid(pair, 1000, torch.device("cpu"), offsets, num_ctas=7)[0] == 6
    assert launch_grid(pair, 1000, torch.device("cpu"), offsets, num_ctas=1)[0] == 2
    assert launch_grid(single, 1000, torch.device("cpu"), offsets, num_ctas=7)[0] == 7
    m_pair = types.SimpleNamespace(config=dataclasses.replace(PAIR, cluster_n=1, cluster_m=2), G=8, n_tiles=8)
    assert launch_grid(m_pair, 1000, torch.device("cpu"), offsets, num_ctas=7)[0] == 6
