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
    G, M, f, d = case
    _skip_unpaired(f, cfg["tile_n"], dtype, cfg)
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
