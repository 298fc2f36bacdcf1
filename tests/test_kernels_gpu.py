"""GPU correctness of fusion.kernels' grouped GEMM (needs an sm_90 GPU; skipped otherwise)."""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


if not _hopper():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

try:
    import fusion.kernels as K
except Exception:  # layout of the package may not be installed: import the folder directly
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import kernels as K


def _sizes(G, M, zeros=True, gen=None):
    """Random ragged group sizes summing to M, with some zero groups."""
    if G == 1:
        return torch.tensor([M], dtype=torch.int64)
    w = torch.rand(G, generator=gen) + 0.05
    if zeros:
        w[torch.randperm(G, generator=gen)[: max(1, G // 4)]] = 0
        if w.sum() == 0:
            w[0] = 1
    s = torch.floor(w / w.sum() * M).to(torch.int64)
    s[int(torch.argmax(w))] += M - int(s.sum())
    return s


def _ref_grouped(A, B, sizes):
    out = []
    r = 0
    for g, n in enumerate(sizes.tolist()):
        out.append(A[r:r + n].double() @ B[g].double().T)
        r += n
    return torch.cat(out, 0) if out else A.new_zeros(0, B.shape[1]).double()


def _rel(x, ref):
    x = x.double()
    assert torch.isfinite(x).all(), "non-finite (unwritten?) output"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CASES = [
    # (G, M, N, K)
    (1, 1000, 512, 256),
    (8, 4099, 1024, 512),
    (8, 300, 256, 128),
    (130, 9000, 256, 256),
    (8, 0, 256, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_identity(case, dtype, dynamic):
    G, M, N, Kd = case
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    B = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    cfg = K.GemmConfig(tile_n=128, stages=6, dynamic=dynamic, sm_margin=4 if dynamic else 0)
    comp = K.compile_grouped_gemm(cfg, K.IdentityEpilogue(), dtype, N, Kd, G)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out})
    torch.cuda.synchronize()
    if M == 0:
        return
    ref = _ref_grouped(A, B, sizes)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_swiglu_scale(case, dtype):
    G, M, N, Kd = case
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    W = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5  # canonical [gate; up]
    Wi = K.interleave_gated_weight(W)
    scale = torch.rand(M, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=256, stages=4), K.SwiGLUScaleEpilogue(), dtype, N, Kd, G)
    out = torch.full((M, N // 2), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, Wi, offs, {"out": out}, {"scale": scale})
    torch.cuda.synchronize()
    if M == 0:
        return
    h = _ref_grouped(A, W, sizes)
    gate, up = h.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up * scale.double()[:, None]
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("case", CASES[:4])
def test_dswiglu(case):
    G, M, N, Kd = case  # N = f (dgrad output width); pre is (M, 2f)
    dtype = torch.bfloat16
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    B = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    pre = torch.randn(M, 2 * N, dtype=dtype, device=dev)
    scale = torch.rand(M, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6), K.DSwiGLUEpilogue(), dtype, N, Kd, G)
    out = torch.full((M, 2 * N), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, B, offs, {"dpre": out},
                       {"pre": K.interleave_gated_weight(pre, dim=-1), "scale": scale})
    torch.cuda.synchronize()
    dh = _ref_grouped(A, B, sizes) * scale.double()[:, None]
    g, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(g)
    ref = torch.cat([dh * u * (s + g * s * (1 - s)), dh * g * s], -1)
    got = K.deinterleave_gated(out, dim=-1)
    assert _rel(got, ref) < 1e-2


def _decode_mxfp8(data, scale):
    vals = data.view(torch.float8_e4m3fn).float()
    e = scale.to(torch.int32) - 127
    s = torch.pow(2.0, e.float())
    return (vals.view(vals.shape[0], -1, 32) * s[..., None]).view(vals.shape)


@pytest.mark.parametrize("case", [(8, 4099, 1024, 512), (130, 9000, 256, 256)])
def test_swiglu_scale_mxfp8(case):
    G, M, N, Kd = case
    dtype = torch.bfloat16
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    W = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    scale = torch.rand(M, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=256, stages=4), K.SwiGLUScaleMXFP8Epilogue(), dtype, N, Kd, G)
    data = torch.full((M, N // 2), 0x7F, dtype=torch.uint8, device=dev)  # poison: e4m3 NaN
    sc = torch.full((M, N // 64), 0xFF, dtype=torch.uint8, device=dev)   # poison: e8m0 NaN
    K.run_grouped_gemm(comp, A, K.interleave_gated_weight(W), offs,
                       {"out": data.view(torch.float8_e4m3fn), "out_scale": sc}, {"scale": scale})
    torch.cuda.synchronize()
    assert (sc != 0xFF).all(), "unwritten scales"
    h = _ref_grouped(A, W, sizes)
    gate, up = h.chunk(2, -1)
    ref = (torch.nn.functional.silu(gate) * up * scale.double()[:, None])
    got = _decode_mxfp8(data, sc).double()
    assert _rel(got, ref) < 4e-2
    # scales follow the exact rule on the (fp32) block amax; allow rare off-by-one at 2^k boundaries
    amax = ref.abs().view(M, -1, 32).amax(-1).float()
    bits = amax.view(torch.int32) & 0x7FFFFFFF
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).int()
    e = torch.where((bits >> 23) == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    mism = (sc.int() != (e + 127)).float().mean().item()
    assert mism < 0.01, mism
