"""GPU correctness of fusion.kernels' grouped GEMM (needs an sm_90 GPU; skipped otherwise)."""
import importlib

import pytest
import torch

pytestmark = pytest.mark.gpu


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


if not _hopper():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402


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
    # exactness: the kernel quantizes exactly what SwiGLUScaleEpilogue stores (the bf16 value)
    hp = torch.empty(M, N // 2, dtype=dtype, device=dev)
    comp_hp = K.compile_grouped_gemm(K.GemmConfig(tile_n=256, stages=4), K.SwiGLUScaleEpilogue(), dtype, N, Kd, G)
    K.run_grouped_gemm(comp_hp, A, K.interleave_gated_weight(W), offs, {"out": hp}, {"scale": scale})
    torch.cuda.synchronize()
    from fusion.quant.mxfp8 import mxfp8_quantize_2d
    rd, rs = mxfp8_quantize_2d(hp.float().cpu())
    assert torch.equal(sc.cpu(), rs), "scale bytes differ from the exact rule"
    assert torch.equal(data.cpu(), rd), "e4m3 bytes differ from the reference"


class _MXFP8HighPrecision(K.Epilogue):
    """gated: v = silu(gate) * up * scale + add (add: fp32 aux with NaN/Inf/huge entries); writes v both
    MXFP8-quantized and in the GEMM dtype."""
    gated = True
    inputs = (K.RowVector("scale"), K.AuxInput("add", dtype="float32"))
    outputs = (K.MXFP8Output("out"), K.Output("hp"))

    def apply(self, gate, up, scale, add):
        em = importlib.import_module(K.__name__ + ".epi_math")
        v = em.silu(gate) * up * scale + add
        return v, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(8, 4099, 1024, 512), (130, 9000, 256, 256), (1, 1000, 512, 256)])
@pytest.mark.parametrize("pingpong", [False, True])
def test_mxfp8_exact(case, dtype, pingpong):
    """Byte-exact MXFP8: kernel bytes == fusion.quant.mxfp8.mxfp8_quantize_2d(hp.float()), with NaN, +-Inf,
    all-zero blocks, fp16 overflow, tiny values and blocks whose amax sits on 448 * 2^k boundaries."""
    from fusion.quant.mxfp8 import mxfp8_quantize_2d
    G, M, N, Kd = case
    dev = "cuda"
    gen = torch.Generator().manual_seed(1234 + M)
    sizes = _sizes(G, M, gen=gen)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    W = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    n = N // 2
    scale = torch.rand(M, dtype=torch.float32, device=dev) * 4
    scale[::7] = 0.0                                   # all-zero rows (with add = 0) -> scale byte 0
    scale[1::11] = 2.0 ** -120                         # tiny values (subnormal after rounding)
    add = torch.zeros(M, n, dtype=torch.float32, device=dev)
    pos = torch.rand(M, n, device=dev)
    add[pos < 0.01] = float("nan")
    add[(pos >= 0.01) & (pos < 0.02)] = float("inf")
    add[(pos >= 0.02) & (pos < 0.03)] = -float("inf")
    add[(pos >= 0.03) & (pos < 0.04)] = 448.0 * 2.0 ** torch.randint(-20, 20, (1,)).item()
    add[(pos >= 0.04) & (pos < 0.045)] = 70000.0       # overflows fp16 -> inf in hp (and in the kernel)
    add[::7] = 0.0
    add[2::13] = float("nan")                          # all-NaN rows: amax over no finite element -> 0
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    tn = 256 if not pingpong else 128
    cfg = K.GemmConfig(tile_n=tn, stages=4, pingpong=pingpong)
    comp = K.compile_grouped_gemm(cfg, _MXFP8HighPrecision(), dtype, N, Kd, G)
    data = torch.full((M, n), 0x55, dtype=torch.uint8, device=dev)
    sc = torch.full((M, n // 32), 0xFF, dtype=torch.uint8, device=dev)
    hp = torch.full((M, n), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, K.interleave_gated_weight(W), offs,
                       {"out": data.view(torch.float8_e4m3fn), "out_scale": sc, "hp": hp},
                       {"scale": scale, "add": add})
    torch.cuda.synchronize()
    rd, rs = mxfp8_quantize_2d(hp.float().cpu())
    sc, data = sc.cpu(), data.cpu()
    bad_s = (sc != rs).sum().item()
    bad_d = (data != rd).sum().item()
    assert bad_s == 0 and bad_d == 0, (bad_s, bad_d, sc[sc != rs][:8], rs[sc != rs][:8],
                                       data[data != rd][:8], rd[data != rd][:8])
    assert (rs == 0).any() and (rd == 0x7F).any()     # the special cases were exercised


class _BiasUnpaired(K.Epilogue):
    gated = False
    inputs = (K.GroupVector("bias"),)
    outputs = (K.Output("out"),)

    def apply(self, acc, bias):
        return acc + bias


class _BiasPairedSwiGLU(K.Epilogue):
    gated = True
    inputs = (K.GroupVector("bias", paired=True), K.RowVector("scale"))
    outputs = (K.Output("out"),)

    def apply(self, gate, up, b_gate, b_up, scale):
        em = importlib.import_module(K.__name__ + ".epi_math")
        return em.silu(gate + b_gate) * (up + b_up) * scale


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("pingpong", [False, True])
def test_group_vector_unpaired(case, pingpong):
    G, M, N, Kd = case
    dtype = torch.bfloat16
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    B = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    bias = torch.randn(G, N, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    cfg = K.GemmConfig(tile_n=128, stages=6, pingpong=pingpong)
    comp = K.compile_grouped_gemm(cfg, _BiasUnpaired(), dtype, N, Kd, G)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, {"bias": bias})
    torch.cuda.synchronize()
    if M == 0:
        return
    gidx = torch.repeat_interleave(torch.arange(G, device=dev), sizes.to(dev))
    ref = _ref_grouped(A, B, sizes) + bias.double()[gidx]
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("pingpong", [False, True])
def test_group_vector_paired(case, pingpong):
    G, M, N, Kd = case
    dtype = torch.bfloat16
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    W = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5      # canonical [gate; up]
    bias = torch.randn(G, N, dtype=torch.float32, device=dev)           # canonical [gate; up]
    scale = torch.rand(M, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    cfg = K.GemmConfig(tile_n=128 if pingpong else 256, stages=4, pingpong=pingpong)
    comp = K.compile_grouped_gemm(cfg, _BiasPairedSwiGLU(), dtype, N, Kd, G)
    out = torch.full((M, N // 2), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, K.interleave_gated_weight(W), offs, {"out": out},
                       {"bias": K.interleave_gated_weight(bias, dim=-1), "scale": scale})
    torch.cuda.synchronize()
    if M == 0:
        return
    gidx = torch.repeat_interleave(torch.arange(G, device=dev), sizes.to(dev))
    h = _ref_grouped(A, W, sizes) + bias.double()[gidx]
    gate, up = h.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up * scale.double()[:, None]
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tile_n,dynamic,dtype", [(192, False, torch.bfloat16), (192, True, torch.float16),
                                                  (128, True, torch.bfloat16)])
def test_pingpong(case, dtype, dynamic, tile_n):
    """Pingpong consumers (each warpgroup owns whole tiles; epilogue overlaps the other's mainloop)."""
    G, M, N, Kd = case
    dev = "cuda"
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=dev)
    W = torch.randn(G, N, Kd, dtype=dtype, device=dev) / Kd ** 0.5
    scale = torch.rand(M, dtype=torch.float32, device=dev)
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    cfg = K.GemmConfig(tile_n=tile_n, stages=5, pingpong=True, dynamic=dynamic)
    comp = K.compile_grouped_gemm(cfg, K.SwiGLUScaleEpilogue(), dtype, N, Kd, G)
    out = torch.full((M, N // 2), float("nan"), dtype=dtype, device=dev)
    K.run_grouped_gemm(comp, A, K.interleave_gated_weight(W), offs, {"out": out}, {"scale": scale})
    torch.cuda.synchronize()
    if M == 0:
        return
    h = _ref_grouped(A, W, sizes)
    gate, up = h.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up * scale.double()[:, None]
    assert _rel(out, ref) < 1e-2
