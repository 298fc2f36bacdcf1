"""GPU correctness of the banded tile order (GemmConfig.band_m, kernels/scheduler.py `TileScheduler.coords`).

Bands change which tile a CTA takes when, never a tile's math: every kernel below must give the same bits at
band_m = 3 and 8 as at band_m = 1 (m fastest over the whole group), and be within tolerance of float64 torch.
One group is tall (26 m-tiles, more than the 24 whose A rows fit the one-band L2 budget at K = 4096 in bf16 and
8192 in FP8: tile_policy.one_band_limit), so bands really cut it, with a shorter last band; beside it an 11-tile
group (one band), an empty group and a one-tile group. Outputs are poisoned with NaN (a tile the order skipped
shows). Schedules: static and
dynamic, single CTAs and pairs, pingpong and cooperative, the gathering producer (its threads walk the
order themselves), a dgrad (B MN-major) and the FP8 kernel; and launches on 7 CTAs (many tiles each).
"""
from dataclasses import replace

import pytest
import torch
from conftest import hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402
from fusion.kernels.tile_policy import one_band_limit  # noqa: E402
from test_kernels_gpu import _check, _gemm_kn, _gemm_nk, _nan  # noqa: E402

DEV = "cuda"
#: 26, 0, 11 and 1 m-tiles of 128 rows; the first is cut (band 3: 8 bands of 3, then 2; band 8: 7, 7, 7, 5)
SIZES = torch.tensor([3300, 0, 1300, 77])
#: K where a group of 26 m-tiles exceeds the one-band limit (24 m-tiles) in bf16
K_BF16 = 4096
BANDS = (3, 8)
CONFIGS = {
    "static-pp": dict(tile_n=128, stages=6, pingpong=True),
    "dynamic-pp": dict(tile_n=128, stages=6, pingpong=True, dynamic=True),
    "static-pair": dict(tile_n=128, stages=6, pingpong=True, cluster_n=2),
    "dynamic-pair": dict(tile_n=128, stages=6, pingpong=True, dynamic=True, cluster_n=2),
    "coop-256": dict(tile_n=256, stages=4),
}


def _operands(N, Kd, gen, b_major="K"):
    M = int(SIZES.sum())
    A = torch.randn(M, Kd, generator=gen).to(DEV, torch.bfloat16)
    shape = (len(SIZES), N, Kd) if b_major == "K" else (len(SIZES), Kd, N)
    B = (torch.randn(*shape, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    return A, B, K.offsets_from_group_sizes(SIZES.to(DEV))


def _run_bands(cfg, N, Kd, A, B, offs, num_ctas=None, index=None):
    """{band_m: output} of the identity kernel at `cfg` with each band (1 first)."""
    for band in BANDS:   # the tall group really is cut (else this tests nothing)
        assert -(-int(SIZES.max()) // 128) > one_band_limit(band, 128, Kd, 2)
    outs = {}
    for band in (1,) + BANDS:
        comp = K.compile_grouped_gemm(K.GemmConfig(**cfg, band_m=band), K.IdentityEpilogue(), "bfloat16", N, Kd,
                                      len(SIZES))
        assert (f"_band{band}" in comp.name) == (band > 1)
        out = _nan(A.shape[0] if index is None else index.numel(), N, dtype=torch.bfloat16)
        K.run_grouped_gemm(comp, A, B, offs, {"out": out}, num_ctas=num_ctas, index=index)
        outs[band] = out
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("num_ctas", [None, 7])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bands_are_bitwise_the_unbanded_kernel(name, num_ctas):
    N, Kd = 1024, K_BF16
    A, B, offs = _operands(N, Kd, torch.Generator().manual_seed(3))
    outs = _run_bands(CONFIGS[name], N, Kd, A, B, offs, num_ctas)
    _check(outs[1], _gemm_nk(A, B, SIZES))
    for band in BANDS:
        assert torch.equal(outs[band], outs[1]), f"band_m={band}"


def test_bands_dgrad_mn_major():
    """A dgrad reads the weight as stored (B MN-major): the order is the scheduler's alone."""
    N, Kd = 512, K_BF16
    A, W, offs = _operands(N, Kd, torch.Generator().manual_seed(4), b_major="MN")
    outs = _run_bands(dict(CONFIGS["dynamic-pp"], b_major="MN"), N, Kd, A, W, offs)
    _check(outs[1], _gemm_kn(A, W, SIZES))
    for band in BANDS:
        assert torch.equal(outs[band], outs[1]), f"band_m={band}"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_bands_gathering_producer(dynamic):
    """The gather producer's 128 threads walk the tile order themselves (static: each its own walk; dynamic: the
    ids warp 0 takes): they must agree with the consumers on every banded tile."""
    gen = torch.Generator().manual_seed(5)
    N, Kd, T = 512, K_BF16, 1500
    x = torch.randn(T, Kd, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(len(SIZES), N, Kd, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    index = torch.randint(0, T, (int(SIZES.sum()),), generator=gen).to(DEV, torch.int32)
    offs = K.offsets_from_group_sizes(SIZES.to(DEV))
    outs = _run_bands(dict(tile_n=128, stages=6, pingpong=True, gather_a=True, dynamic=dynamic), N, Kd, x, W, offs,
                      index=index)
    _check(outs[1], _gemm_nk(x[index.long()], W, SIZES))
    for band in BANDS:
        assert torch.equal(outs[band], outs[1]), f"band_m={band}"


@pytest.mark.parametrize("over", [dict(dynamic=False), dict(dynamic=True), dict(dynamic=False, cluster_n=2),
                                  dict(dynamic=True, cluster_n=2)], ids=str)
def test_bands_fp8_kernel(over):
    from fusion.quant.fp8_block import fp8_block_dequantize_2d, fp8_block_quantize_2d
    from fusion.quant.fp8_weight import quantize_weight_fp8_block

    gen = torch.Generator().manual_seed(6)
    N, Kd, G = 1024, 2 * K_BF16, len(SIZES)     # one byte per element: the same one-band limit at twice K
    M = int(SIZES.sum())
    x = torch.randn(M, Kd, generator=gen).to(DEV)
    w = (torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV)
    a_data, a_scale = fp8_block_quantize_2d(x)
    wq = quantize_weight_fp8_block(w)
    offs = K.offsets_from_group_sizes(SIZES.to(DEV))
    base = replace(K.cooperative_fp8_config(N, Kd, G), tile_m=128, stages=6, **over)   # the band limit below is 128 rows
    for band in BANDS:
        assert -(-int(SIZES.max()) // 128) > one_band_limit(band, 128, Kd, 1)
    outs = {}
    for band in (1,) + BANDS:
        comp = K.compile_fp8_grouped_gemm(replace(base, band_m=band), K.IdentityEpilogue(), N, Kd, G)
        out = _nan(M, N, dtype=torch.bfloat16)
        K.run_fp8_grouped_gemm(comp, a_data, a_scale, wq.data, wq.scale, offs, {"out": out}, num_ctas=7)
        outs[band] = out
    torch.cuda.synchronize()
    ref = _gemm_nk(fp8_block_dequantize_2d(a_data, a_scale), wq.dequantize(), SIZES)
    _check(outs[1], ref, tol=2e-2)
    for band in BANDS:
        assert torch.equal(outs[band], outs[1]), f"band_m={band}"
