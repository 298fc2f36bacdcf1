"""GPU: short tiles (GemmConfig.short_tiles) give the same bits as full tiles and the right values.

A 128-row tile whose rows end within its first 64 (a group's short last m-tile) issues the wgmma of those 64 rows
only (kernels/mainloop.py): pingpong warpgroups the first of their two 64-row atoms, a cooperative kernel's second
warpgroup none. The group sizes below put every interesting remainder on some group's last m-tile (1, 63, 64, 65,
127, 128 rows past a multiple of 128, and groups of 0), on each consumer schedule, gated and not, K-major and
MN-major B, CTA pairs along n and m, a gathered A and the FP8 kernel, on 4 CTAs (many tiles each). Outputs must be
bitwise equal to the same configuration with short tiles off (no row the epilogue stores comes from the skipped
wgmma) and match float64 torch.
"""
import dataclasses

import pytest
import torch
from conftest import hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402
from test_kernels_gpu import _check, _gemm_kn, _gemm_nk, _nan, _SwiGLUTrain, _swiglu  # noqa: E402

DEV = "cuda"
#: group sizes: every remainder mod 128 that matters, zero-size groups between, one group of many tiles
SIZES = [1, 63, 0, 64, 65, 127, 128, 129, 191, 192, 0, 193, 255, 256, 300, 5, 1000, 62]


def _offsets(sizes):
    return K.offsets_from_group_sizes(torch.tensor(sizes, device=DEV))


def _both(config, epilogue, N, Kd, G):
    """The kernel at `config` with short tiles and without."""
    short = K.compile_grouped_gemm(dataclasses.replace(config, short_tiles=True), epilogue, torch.bfloat16, N, Kd, G)
    full = K.compile_grouped_gemm(dataclasses.replace(config, short_tiles=False), epilogue, torch.bfloat16, N, Kd, G)
    assert short.config.short_tiles and not full.config.short_tiles
    return short, full


def _run_both(kernels, A, B, offs, outs_like, extras=None, index=None):
    """Both kernels on 4 CTAs (two pairs where clustered): each then walks many tiles, so that a mainloop which
    leaves the smem ring's states behind (the next tile waits on stale stages) shows."""
    results = []
    for comp in kernels:
        outs = {k: _nan(*v.shape, dtype=v.dtype) for k, v in outs_like.items()}
        K.run_grouped_gemm(comp, A, B, offs, outs, extras, num_ctas=4, index=index)
        results.append(outs)
    torch.cuda.synchronize()
    for name in outs_like:   # bit patterns (rows no group covers keep their NaN poison in both)
        a, b = (r[name].view(torch.uint8) for r in results)
        assert torch.equal(a, b), f"{name}: short tiles changed the bits"
    return results[0]


PLAIN = [dict(tile_n=128, stages=6, pingpong=True, dynamic=True),
         dict(tile_n=128, stages=6, pingpong=True, cluster_n=2),                   # static pairs along n
         dict(tile_n=128, stages=6, pingpong=True, dynamic=True, cluster_m=2),     # dynamic pairs along m
         dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
         dict(tile_n=256, stages=4, dynamic=True),                                  # cooperative
         dict(tile_n=128, stages=6)]                                                # cooperative, static


@pytest.mark.parametrize("cfg", PLAIN)
@pytest.mark.parametrize("b_major", ["K", "MN"])
def test_identity_short_tiles(cfg, b_major):
    N, Kd, G = 512, 704, len(SIZES)      # 11 k-tiles: the ring's phases turn over within a tile
    M = sum(SIZES)
    A = torch.randn(M, Kd, dtype=torch.bfloat16, device=DEV)
    config = K.GemmConfig(**cfg, b_major=b_major)
    kernels = _both(config, K.IdentityEpilogue(), N, Kd, G)
    sizes = torch.tensor(SIZES)
    if b_major == "K":
        B = torch.randn(G, N, Kd, dtype=torch.bfloat16, device=DEV) / Kd ** 0.5
        ref = _gemm_nk(A, B, sizes)
    else:
        B = torch.randn(G, Kd, N, dtype=torch.bfloat16, device=DEV) / Kd ** 0.5
        ref = _gemm_kn(A, B, sizes)
    out = _run_both(kernels, A, B, _offsets(SIZES), {"out": torch.empty(M, N, dtype=torch.bfloat16)})
    _check(out["out"], ref)


@pytest.mark.parametrize("cfg", [dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
                                 dict(tile_n=192, stages=5, pingpong=True, dynamic=True, cluster_n=2),
                                 dict(tile_n=128, stages=6, pingpong=True, cluster_n=2),
                                 dict(tile_n=256, stages=4, dynamic=True)])
def test_gated_training_forward_short_tiles(cfg):
    """FC1's training forward (SwiGLU * scale and the saved pre-activation)."""
    N, Kd, G = 768, 256, len(SIZES)
    M = sum(SIZES)
    A = torch.randn(M, Kd, dtype=torch.bfloat16, device=DEV)
    W = torch.randn(G, N, Kd, dtype=torch.bfloat16, device=DEV) / Kd ** 0.5
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    kernels = _both(K.GemmConfig(**cfg), _SwiGLUTrain(), N, Kd, G)
    outs = _run_both(kernels, A, W, _offsets(SIZES), {"out": torch.empty(M, N // 2, dtype=torch.bfloat16),
                                                      "pre": torch.empty(M, N, dtype=torch.bfloat16)},
                     {"scale": scale})
    h = _gemm_nk(A, W, torch.tensor(SIZES))
    _check(outs["pre"], h)
    _check(outs["out"], _swiglu(h, scale))


@pytest.mark.parametrize("cfg", [dict(tile_n=192, stages=5, pingpong=True), dict(tile_n=256, stages=4)])
def test_gathered_a_short_tiles(cfg):
    """A read through an index (the MoE layer's FC1): tokens routed to several groups, an index with padding."""
    N, Kd, G, T = 384, 256, len(SIZES), 700
    gen = torch.Generator().manual_seed(3)
    rows = sum(SIZES)
    index = torch.cat([torch.randint(0, T, (rows,), generator=gen), torch.full((5,), -1)]).to(torch.int32).to(DEV)
    x = torch.randn(T, Kd, dtype=torch.bfloat16, device=DEV)
    W = torch.randn(G, N, Kd, dtype=torch.bfloat16, device=DEV) / Kd ** 0.5
    config = K.GemmConfig(**cfg, gather_a=True, dynamic=True)
    kernels = _both(config, K.IdentityEpilogue(), N, Kd, G)
    out = _run_both(kernels, x, W, _offsets(SIZES), {"out": torch.empty(index.numel(), N, dtype=torch.bfloat16)},
                    index=index)
    _check(out["out"][:rows], _gemm_nk(x[index[:rows].long()], W, torch.tensor(SIZES)))


@pytest.mark.parametrize("over", [dict(), dict(cluster_n=2, dynamic=False)])
def test_fp8_short_tiles(over):
    """The FP8 block-scaled kernel (cooperative): on a short tile its second warpgroup waits for and releases every
    stage without wgmma (kernels/fp8_mainloop.py); the same bits as with short tiles off, on 4 CTAs."""
    from fusion.quant.fp8_block import fp8_block_quantize_2d
    from fusion.quant.fp8_weight import quantize_weight_fp8_block

    N, Kd, G = 512, 640, len(SIZES)
    M = sum(SIZES)
    x = torch.randn(M, Kd, device=DEV)
    a_data, a_scale = fp8_block_quantize_2d(x)
    wq = quantize_weight_fp8_block(torch.randn(G, N, Kd, device=DEV) / Kd ** 0.5)
    outs = []
    for short in (True, False):
        # 128-row tiles: a 256-row tile has no short-tile path (kernels/fp8_gemm.py)
        config = dataclasses.replace(K.cooperative_fp8_config(N, Kd, G), tile_m=128, stages=6, short_tiles=short, **over)
        comp = K.compile_fp8_grouped_gemm(config, K.IdentityEpilogue(), N, Kd, G)
        out = _nan(M, N, dtype=torch.bfloat16)
        K.run_fp8_grouped_gemm(comp, a_data, a_scale, wq.data, wq.scale, _offsets(SIZES), {"out": out}, num_ctas=4)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
