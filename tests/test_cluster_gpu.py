"""GPU correctness of the grouped GEMM's CTA pairs (``cluster_n = 2``: two CTAs work on neighbouring n-tiles of one
m-tile and multicast the A tile). Same method as tests/test_kernels_gpu.py: poisoned outputs, ragged groups with
empty ones, partial tiles, every element against float64 torch math. Each kernel is checked to be built as pairs,
and an odd CTA request is made too (the launch must round it to whole pairs: a cluster grid cannot be odd).
"""
import pytest
import torch
from conftest import hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402
from test_kernels_gpu import (CASES, DGRAD_CASES, _check, _data, _DSwiGLUScaleDgrad, _dswiglu_ref,  # noqa: E402
                              _gemm_kn, _gemm_nk, _nan, check_gated_train)

DEV = "cuda"
PAIR_CFGS = [dict(tile_n=128, stages=6, pingpong=True, cluster_n=2), dict(tile_n=256, stages=4, cluster_n=2),
             # the dynamic schedule: rank 0 takes the tile ids and sends them to rank 1 (kernels/scheduler.py)
             dict(tile_n=128, stages=6, pingpong=True, dynamic=True, cluster_n=2),
             dict(tile_n=192, stages=5, pingpong=True, dynamic=True, cluster_n=2),
             dict(tile_n=256, stages=4, dynamic=True, cluster_n=2)]


def _pairs(N, tile_n):
    return -(-N // tile_n) % 2 == 0


def _skip_unpaired(N, tile_n, dtype, cfg):
    """Skip an odd n-tile count (cluster_n = 2 refuses it: tested on the CPU), and fp16 beyond the two 128-column
    pingpong schedules (the producer and the schedule do not depend on the dtype; this keeps compiles few)."""
    if not _pairs(N, tile_n):
        pytest.skip("odd n-tile count")
    if dtype == torch.float16 and cfg not in (PAIR_CFGS[0], PAIR_CFGS[2]):
        pytest.skip("fp16: the 128-column pingpong schedules only")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(8, 300, 384, 200)])
@pytest.mark.parametrize("cfg", PAIR_CFGS)
@pytest.mark.parametrize("num_ctas", [None, 7])
def test_identity_pairs(case, dtype, cfg, num_ctas):
    """A K-major B (a forward). ``num_ctas=7``: an odd request is launched as 3 whole pairs."""
    G, M, N, Kd = case
    _skip_unpaired(N, cfg["tile_n"], dtype, cfg)
    sizes, A, offs = _data(G, M, Kd, dtype)
    B = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.IdentityEpilogue(), dtype, N, Kd, G)
    assert comp.config.cluster_n == 2
    out = _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, num_ctas=num_ctas)
    torch.cuda.synchronize()
    _check(out, _gemm_nk(A, B, sizes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(8, 777, 256, 128)])
@pytest.mark.parametrize("cfg", PAIR_CFGS)
def test_gated_pairs(case, dtype, cfg):
    """The gated forward (two half B boxes per stage) saving the canonical pre-activation."""
    G, M, N, Kd = case
    _skip_unpaired(N // 2, cfg["tile_n"] // 2, dtype, cfg)
    assert check_gated_train(K.GemmConfig(**cfg), case, dtype).config.cluster_n == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DGRAD_CASES)
@pytest.mark.parametrize("cfg", [PAIR_CFGS[0], PAIR_CFGS[2]])
def test_dgrad_pairs(case, dtype, cfg):
    """An MN-major B (the weight as stored) with paired aux inputs prefetched under the mainloop."""
    _skip_unpaired(case[2], cfg["tile_n"], dtype, cfg)
    _check_dgrad(case, dtype, cfg)


def _check_dgrad(case, dtype, cfg):
    """FC2's dgrad + d(SwiGLU·scale) at `cfg` (MN-major B) against float64 math; returns the compiled kernel."""
    G, M, f, d = case
    sizes, dY, offs = _data(G, M, d, dtype)
    W2 = torch.randn(G, d, f, dtype=dtype, device=DEV) / d ** 0.5
    pre = torch.randn(M, 2 * f, dtype=dtype, device=DEV)
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg, b_major="MN"), _DSwiGLUScaleDgrad(), dtype, f, d, G)
    dpre, dscale = _nan(M, 2 * f, dtype=dtype), _nan(M, f, dtype=dtype)
    K.run_grouped_gemm(comp, dY, W2, offs, {"dpre": dpre, "dscale": dscale}, {"pre": pre, "scale": scale})
    torch.cuda.synchronize()
    ref_dpre, ref_dscale = _dswiglu_ref(_gemm_kn(dY, W2, sizes), pre, scale)
    _check(dpre, ref_dpre)
    _check(dscale, ref_dscale)
    return comp


@pytest.mark.parametrize("dynamic", [False, True])
def test_pairs_match_single_ctas_bitwise(dynamic):
    """The multicast changes where A's bytes come from, not the math: same tiles, same k order, same bits."""
    G, M, N, Kd = 16, 20000, 1024, 768
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    B = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    outs = []
    for cn in (1, 2):
        comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=True, dynamic=dynamic,
                                                   cluster_n=cn), K.IdentityEpilogue(), dtype, N, Kd, G)
        out = _nan(M, N, dtype=dtype)
        K.run_grouped_gemm(comp, A, B, offs, {"out": out})
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    _check(outs[1], _gemm_nk(A, B, sizes))


# ---------------------------------------------------------------------------------------------------------------
# CTA pairs along m (cluster_m = 2): two CTAs on neighbouring m-tiles of one group share the B tile by multicast
MPAIR_CFGS = [dict(tile_n=128, stages=6, pingpong=True, dynamic=True, cluster_m=2),
              dict(tile_n=192, stages=5, pingpong=True, dynamic=True, cluster_m=2),
              dict(tile_n=192, stages=5, pingpong=True, cluster_m=2),                 # static schedule
              dict(tile_n=256, stages=4, dynamic=True, cluster_m=2)]                  # cooperative


@pytest.mark.parametrize("case", CASES + [(8, 300, 384, 200), (5, 1300, 2880, 320)])
@pytest.mark.parametrize("cfg", MPAIR_CFGS)
@pytest.mark.parametrize("num_ctas", [None, 7])
def test_identity_m_pairs(case, cfg, num_ctas):
    """A K-major B, any n-tile count (odd ones included), groups whose m-tile count is odd (rank 1 of the last
    pair has no rows) and empty ones; ``num_ctas=7`` is launched as 3 whole pairs."""
    G, M, N, Kd = case
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    B = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.IdentityEpilogue(), dtype, N, Kd, G)
    assert comp.config.cluster_m == 2 and comp.name.endswith("_cm2")
    out = _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, num_ctas=num_ctas)
    torch.cuda.synchronize()
    _check(out, _gemm_nk(A, B, sizes))


@pytest.mark.parametrize("case", DGRAD_CASES + [(16, 5000, 2880, 640)])
@pytest.mark.parametrize("cfg", MPAIR_CFGS[:2])
def test_dgrad_m_pairs(case, cfg):
    """FC2's fused dgrad (MN-major B multicast, the saved pre-activation read in the epilogue) as m-pairs: what
    the tile policy picks where the n-tiles do not pair up (GPT-OSS's 2880)."""
    assert _check_dgrad(case, torch.bfloat16, cfg).config.cluster_m == 2


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("b_major", ["K", "MN"])
def test_m_pairs_match_single_ctas_bitwise(dynamic, b_major):
    """B's multicast changes where its bytes come from, not the math: same tiles, same k order, same bits."""
    G, M, N, Kd = 16, 20000, 960, 768
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    shape = (G, N, Kd) if b_major == "K" else (G, Kd, N)
    B = torch.randn(*shape, dtype=dtype, device=DEV) / Kd ** 0.5
    outs = []
    for cm in (1, 2):
        comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=192, stages=5, pingpong=True, dynamic=dynamic,
                                                   cluster_m=cm, b_major=b_major), K.IdentityEpilogue(), dtype,
                                      N, Kd, G)
        out = _nan(M, N, dtype=dtype)
        K.run_grouped_gemm(comp, A, B, offs, {"out": out})
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    _check(outs[1], _gemm_nk(A, B, sizes) if b_major == "K" else _gemm_kn(A, B, sizes))
