"""GPU correctness of fusion.kernels' grouped GEMM (needs an sm_90 GPU; skipped otherwise).

Every test: fresh random data, outputs poisoned (NaN / bytes no result can have), every element compared with
torch float64 math on the canonical layouts (gated weight = [gate; up] rows, paired tensors = [gate | up]
columns), ragged groups with zero-size groups, and shapes with partial tiles.
"""
import importlib

import pytest
import torch
from conftest import every_bf16_pattern, hopper_available

pytestmark = pytest.mark.gpu


if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402

DEV = "cuda"


def _em():
    return importlib.import_module(K.__name__ + ".epi_math")


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


def _group_of_rows(sizes):
    return torch.repeat_interleave(torch.arange(len(sizes), device=DEV), sizes.to(DEV))


def _gemm_nk(A, B, sizes):
    """A @ B[g].T per group, float64; B (G, N, K)."""
    out, r = [], 0
    for g, n in enumerate(sizes.tolist()):
        out.append(A[r:r + n].double() @ B[g].double().T)
        r += n
    return torch.cat(out, 0) if out else A.new_zeros(0, B.shape[1]).double()


def _gemm_kn(A, W, sizes):
    """A @ W[g] per group, float64; W (G, K, N) (a GroupLinear weight read by its dgrad)."""
    return _gemm_nk(A, W.transpose(-1, -2), sizes)


def _check(x, ref, tol=1e-2):
    """Every element written and close: |x - ref| <= tol (|ref| + rms(ref)), and the whole within tol/2."""
    x = x.double()
    assert x.shape == ref.shape
    assert torch.isfinite(x).all(), f"{(~torch.isfinite(x)).sum().item()} non-finite (unwritten?) elements"
    if ref.numel() == 0:
        return
    rms = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    err = (x - ref).abs()
    bad = err > tol * (ref.abs() + rms)
    assert not bad.any(), f"{bad.sum().item()} elements off, first at {bad.nonzero()[0].tolist()}: " \
                          f"{x[bad][:4].tolist()} vs {ref[bad][:4].tolist()}"
    assert ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item() < tol / 2


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _data(G, M, Kd, dtype):
    """Ragged group sizes summing to M (some zero), A (M, Kd) and the (G+1,) offsets."""
    sizes = _sizes(G, M)
    A = torch.randn(M, Kd, dtype=dtype, device=DEV)
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    return sizes, A, offs


def _swiglu(h, scale):
    gate, up = h.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up * scale.double()[:, None]


# (G, M, N, K): unaligned M, zero-size groups, M = 0, N and K not multiples of the tiles
CASES = [
    (1, 1000, 512, 256),
    (8, 4099, 1024, 512),
    (8, 300, 400, 200),      # gated: N/2 = 200, not a multiple of tile_n/2 (64, 96, 128); K % 64 != 0
    (130, 9000, 256, 256),
    (8, 0, 256, 128),
]


# ------------------------------------------------------------------ K-major, not gated
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cfg", [dict(tile_n=128, stages=6), dict(tile_n=128, stages=6, dynamic=True, sm_margin=4),
                                 dict(tile_n=192, stages=5, pingpong=True, dynamic=True)])
def test_identity(case, dtype, cfg):
    G, M, N, Kd = case
    sizes, A, offs = _data(G, M, Kd, dtype)
    B = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.IdentityEpilogue(), dtype, N, Kd, G)
    out = _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out})
    torch.cuda.synchronize()
    _check(out, _gemm_nk(A, B, sizes))


# ------------------------------------------------------------------ MN-major B: the weight as stored
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cfg", [dict(tile_n=128, stages=6), dict(tile_n=128, stages=6, pingpong=True, dynamic=True),
                                 dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
                                 dict(tile_n=256, stages=4, dynamic=True)])
def test_mn_major_reads_the_parameter(case, dtype, cfg):
    """dX = dY @ W[g] with W a GroupLinear weight (G, out, in): B is W's own storage (K = out, N = in)."""
    G, M, N, Kd = case
    sizes, dY, offs = _data(G, M, Kd, dtype)
    W = torch.nn.Parameter(torch.randn(G, Kd, N, dtype=dtype, device=DEV) / Kd ** 0.5)
    before = W.detach().clone()
    B = W.detach()
    assert B.data_ptr() == W.data_ptr() and B.shape == (G, Kd, N)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg, b_major="MN"), K.IdentityEpilogue(), dtype, N, Kd, G)
    out = _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, dY, B, offs, {"out": out})
    torch.cuda.synchronize()
    _check(out, _gemm_kn(dY, W.detach(), sizes))
    assert torch.equal(W.detach(), before)


# ------------------------------------------------------------------ gated, canonical weight
GATED_CFGS = [dict(tile_n=256, stages=4), dict(tile_n=256, stages=4, dynamic=True),
              dict(tile_n=128, stages=6, pingpong=True), dict(tile_n=192, stages=5, pingpong=True, dynamic=True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES + [(8, 777, 144, 128)])   # N/2 = 72 < tile_n/2
@pytest.mark.parametrize("cfg", GATED_CFGS)
def test_gated_canonical(case, dtype, cfg):
    G, M, N, Kd = case
    sizes, A, offs = _data(G, M, Kd, dtype)
    W = torch.nn.Parameter(torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5)  # [gate; up] rows
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.SwiGLUScaleEpilogue(), dtype, N, Kd, G)
    out = _nan(M, N // 2, dtype=dtype)
    B = W.detach()
    assert B.data_ptr() == W.data_ptr()
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, {"scale": scale})
    torch.cuda.synchronize()
    _check(out, _swiglu(_gemm_nk(A, W.detach(), sizes), scale))


class _SwiGLUTrain(K.Epilogue):
    """The training forward: out = silu(g)*u*s and the pre-activation [g | u] (paired output)."""
    gated = True
    inputs = (K.RowVector("scale"),)
    outputs = (K.Output("out"), K.Output("pre", paired=True))

    def apply(self, gate, up, scale):
        return _em().silu(gate) * up * scale, gate, up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cfg", GATED_CFGS[1:])
def test_gated_saves_canonical_preactivation(case, dtype, cfg):
    """The saved pre-activation is the GEMM output in its canonical column order, [gate | up]."""
    check_gated_train(K.GemmConfig(**cfg), case, dtype)


def check_gated_train(config, case, dtype):
    """The training forward (SwiGLU*scale and the pre-activation) at `config` on `case`, checked; returns the kernel
    (tests/test_cluster_gpu.py runs it at CTA-pair configurations too)."""
    G, M, N, Kd = case
    sizes, A, offs = _data(G, M, Kd, dtype)
    W = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    comp = K.compile_grouped_gemm(config, _SwiGLUTrain(), dtype, N, Kd, G)
    out, pre = _nan(M, N // 2, dtype=dtype), _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, A, W, offs, {"out": out, "pre": pre}, {"scale": scale})
    torch.cuda.synchronize()
    h = _gemm_nk(A, W, sizes)
    _check(pre, h)
    _check(out, _swiglu(h, scale))
    return comp


# ------------------------------------------------------------------ dgrad: paired aux in, paired out
class _DSwiGLUScaleDgrad(K.Epilogue):
    """dH = dY @ W2[g]; reads pre = [g | u]; writes dpre = [d_gate | d_up] and d(scale) terms (M, f)."""
    gated = False
    inputs = (K.AuxInput("pre", paired=True), K.RowVector("scale"))
    outputs = (K.Output("dpre", paired=True), K.Output("dscale"))

    def apply(self, dy, g, u, scale):
        em = _em()
        sig = em.sigmoid(g)
        silu = g * sig
        return dy * scale * u * (sig + silu * (1.0 - sig)), dy * scale * silu, dy * silu * u


class _DSwiGLUScaleDgradRowSum(_DSwiGLUScaleDgrad):
    """The same, with d(scale) summed in the kernel: float32 partials per 32 columns (RowSumOutput), as the
    product's generated dgrad epilogue declares it."""
    outputs = (K.Output("dpre", paired=True), K.RowSumOutput("dscale"))


def _dgrad_data(case, dtype, b_shape):
    """A dgrad case (G, M, f, d): ragged sizes, dY (M, d), offsets, B of shape b_shape(G, f, d), the saved
    pre-activation (M, 2f) and a float32 row scale (M,)."""
    G, M, f, d = case
    sizes, dY, offs = _data(G, M, d, dtype)
    B = torch.randn(*b_shape(G, f, d), dtype=dtype, device=DEV) / d ** 0.5
    pre = torch.randn(M, 2 * f, dtype=dtype, device=DEV)
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    return sizes, dY, offs, B, pre, scale


def _as_stored(G, f, d):
    return G, d, f      # W2 (G, out=d, in=f): the MN-major dgrad B


def _dswiglu_ref(dh, pre, scale):
    g, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(g)
    dhs = dh * scale.double()[:, None]
    return torch.cat([dhs * u * (s + g * s * (1 - s)), dhs * g * s], -1), dh * g * s * u


DGRAD_CASES = [(1, 1000, 512, 256), (8, 4099, 1024, 512), (8, 300, 200, 200), (130, 9000, 256, 256), (8, 0, 256, 128)]


@pytest.mark.parametrize("case", DGRAD_CASES)
@pytest.mark.parametrize("cfg", [dict(tile_n=128, stages=6, pingpong=True, dynamic=True),   # the product's
                                 dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
                                 dict(tile_n=128, stages=6)])
def test_dgrad_row_sums(case, cfg):
    """The row scale's gradient summed in the kernel: one float32 partial per (row, 32 columns), each the sum of
    the reference's terms over its block (the last block partial); the rows' totals match the reference's; the
    same inputs give the same bits twice (each partial has one tile and a fixed order: no atomics)."""
    G, M, f, d = case
    dtype = torch.bfloat16
    sizes, dY, offs, W2, pre, scale = _dgrad_data(case, dtype, _as_stored)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg, b_major="MN"), _DSwiGLUScaleDgradRowSum(), dtype, f, d, G)
    parts = -(-f // 32)
    runs = []
    for _ in range(2):
        dpre, partials = _nan(M, 2 * f, dtype=dtype), _nan(M, parts, dtype=torch.float32)
        K.run_grouped_gemm(comp, dY, W2, offs, {"dpre": dpre, "dscale": partials}, {"pre": pre, "scale": scale})
        torch.cuda.synchronize()
        runs.append(partials)
    assert torch.equal(runs[0], runs[1]), "row sums differ between two runs of the same inputs"
    ref_dpre, ref_terms = _dswiglu_ref(_gemm_kn(dY, W2, sizes), pre, scale)
    _check(dpre, ref_dpre)
    ref_blocks = torch.nn.functional.pad(ref_terms, (0, parts * 32 - f)).view(M, parts, 32).sum(-1)
    _check(runs[0], ref_blocks)
    _check(runs[0].sum(-1), ref_blocks.sum(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DGRAD_CASES)
@pytest.mark.parametrize("cfg", [dict(tile_n=128, stages=6, pingpong=True, dynamic=True),   # the product's
                                 dict(tile_n=192, stages=5, pingpong=True, dynamic=True),   # 4-chunk batches
                                 dict(tile_n=128, stages=6)])                               # + aux prefetch
def test_dgrad_canonical(case, dtype, cfg):
    """(G, M, f, d): dY (M, d), W2 (G, d, f) as stored (b_major MN, K = d, N = f), pre / dpre (M, 2f)."""
    G, M, f, d = case
    sizes, dY, offs, W2, pre, scale = _dgrad_data(case, dtype, _as_stored)
    W2 = torch.nn.Parameter(W2)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg, b_major="MN"), _DSwiGLUScaleDgrad(), dtype, f, d, G)
    dpre, dscale = _nan(M, 2 * f, dtype=dtype), _nan(M, f, dtype=dtype)
    B = W2.detach()
    assert B.data_ptr() == W2.data_ptr()
    K.run_grouped_gemm(comp, dY, B, offs, {"dpre": dpre, "dscale": dscale}, {"pre": pre, "scale": scale})
    torch.cuda.synchronize()
    ref_dpre, ref_dscale = _dswiglu_ref(_gemm_kn(dY, W2.detach(), sizes), pre, scale)
    _check(dpre, ref_dpre)
    _check(dscale, ref_dscale)


@pytest.mark.parametrize("case", DGRAD_CASES[:4])
def test_dswiglu_k_major(case):
    """The stock DSwiGLUEpilogue on a K-major B (G, f, d): the split paired layout also with b_major K."""
    G, M, f, d = case
    dtype = torch.bfloat16
    sizes, dY, offs, B, pre, scale = _dgrad_data(case, dtype, lambda G, f, d: (G, f, d))   # K-major (G, N=f, K=d)
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=256, stages=4), K.DSwiGLUEpilogue(), dtype, f, d, G)
    out = _nan(M, 2 * f, dtype=dtype)
    K.run_grouped_gemm(comp, dY, B, offs, {"dpre": out}, {"pre": pre, "scale": scale})
    torch.cuda.synchronize()
    _check(out, _dswiglu_ref(_gemm_nk(dY, B, sizes), pre, scale)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(8, 4099, 512, 256), (32, 3000, 192, 200), (8, 0, 256, 128)])
def test_moe_block_backward_without_copies(case, dtype):
    """FC1 forward (gated, saves pre) -> FC2 dgrad with d(SwiGLU*s) -> FC1 dgrad, all on the parameters'
    storage, against torch autograd in float64.  (G, M, f, d)."""
    G, M, f, d = case
    sizes, x, offs = _data(G, M, d, dtype)
    W1 = torch.nn.Parameter(torch.randn(G, 2 * f, d, dtype=dtype, device=DEV) / d ** 0.5)
    W2 = torch.nn.Parameter(torch.randn(G, d, f, dtype=dtype, device=DEV) / f ** 0.5)
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    dy = torch.randn(M, d, dtype=dtype, device=DEV)
    pp = dict(tile_n=128, stages=6, pingpong=True, dynamic=True)
    fwd = K.compile_grouped_gemm(K.GemmConfig(**pp), _SwiGLUTrain(), dtype, 2 * f, d, G)
    bwd2 = K.compile_grouped_gemm(K.GemmConfig(**pp, b_major="MN"), _DSwiGLUScaleDgrad(), dtype, f, d, G)
    bwd1 = K.compile_grouped_gemm(K.GemmConfig(**pp, b_major="MN"), K.IdentityEpilogue(), dtype, d, 2 * f, G)
    h, pre = _nan(M, f, dtype=dtype), _nan(M, 2 * f, dtype=dtype)
    K.run_grouped_gemm(fwd, x, W1.detach(), offs, {"out": h, "pre": pre}, {"scale": scale})
    dpre, dscale = _nan(M, 2 * f, dtype=dtype), _nan(M, f, dtype=dtype)
    K.run_grouped_gemm(bwd2, dy, W2.detach(), offs, {"dpre": dpre, "dscale": dscale}, {"pre": pre, "scale": scale})
    dx = _nan(M, d, dtype=dtype)
    K.run_grouped_gemm(bwd1, dpre, W1.detach(), offs, {"out": dx})
    torch.cuda.synchronize()

    xr = x.double().requires_grad_()
    sr = scale.double().requires_grad_()
    hr = _gemm_nk(xr, W1.detach(), sizes)
    ar = _swiglu(hr, sr)
    yr = _gemm_nk(ar, W2.detach(), sizes)
    yr.backward(dy.double())
    _check(pre, hr.detach())
    _check(h, ar.detach())
    _check(dx, xr.grad, tol=2e-2)
    if M:
        dscale_ref = sr.grad
        got = dscale.double().sum(-1)
        assert ((got - dscale_ref).norm() / dscale_ref.norm()).item() < 2e-2


# ------------------------------------------------------------------ group vectors
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
        return _em().silu(gate + b_gate) * (up + b_up) * scale


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("pingpong", [False, True])
def test_group_vector_unpaired(case, pingpong):
    G, M, N, Kd = case
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    B = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    bias = torch.randn(G, N, dtype=torch.float32, device=DEV)
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6, pingpong=pingpong), _BiasUnpaired(),
                                  dtype, N, Kd, G)
    out = _nan(M, N, dtype=dtype)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, {"bias": bias})
    torch.cuda.synchronize()
    _check(out, _gemm_nk(A, B, sizes) + bias.double()[_group_of_rows(sizes)])


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("pingpong", [False, True])
def test_group_vector_paired(case, pingpong):
    """A gated layer's bias (G, 2f) = [gate | up] as stored, read with the canonical weight."""
    G, M, N, Kd = case
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    W = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    bias = torch.randn(G, N, dtype=torch.float32, device=DEV)
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    cfg = K.GemmConfig(tile_n=128 if pingpong else 256, stages=4, pingpong=pingpong)
    comp = K.compile_grouped_gemm(cfg, _BiasPairedSwiGLU(), dtype, N, Kd, G)
    out = _nan(M, N // 2, dtype=dtype)
    K.run_grouped_gemm(comp, A, W, offs, {"out": out}, {"bias": bias, "scale": scale})
    torch.cuda.synchronize()
    _check(out, _swiglu(_gemm_nk(A, W, sizes) + bias.double()[_group_of_rows(sizes)], scale))


# ------------------------------------------------------------------ MXFP8 outputs (gated, canonical)
def _decode_mxfp8(data, scale):
    vals = data.view(torch.float8_e4m3fn).float()
    e = scale.to(torch.int32) - 127
    s = torch.pow(2.0, e.float())
    return (vals.view(vals.shape[0], -1, 32) * s[..., None]).view(vals.shape)


@pytest.mark.parametrize("case", [(8, 4099, 1024, 512), (130, 9000, 256, 256), (8, 300, 320, 200)])
@pytest.mark.parametrize("cfg", [dict(tile_n=256, stages=4), dict(tile_n=128, stages=6, pingpong=True)])
def test_swiglu_scale_mxfp8(case, cfg):
    G, M, N, Kd = case
    dtype = torch.bfloat16
    sizes, A, offs = _data(G, M, Kd, dtype)
    W = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    scale = torch.rand(M, dtype=torch.float32, device=DEV)
    comp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.SwiGLUScaleMXFP8Epilogue(), dtype, N, Kd, G)
    data = torch.full((M, N // 2), 0x7F, dtype=torch.uint8, device=DEV)  # poison: e4m3 NaN
    sc = torch.full((M, N // 64), 0xFF, dtype=torch.uint8, device=DEV)   # poison: e8m0 NaN
    K.run_grouped_gemm(comp, A, W, offs, {"out": data.view(torch.float8_e4m3fn), "out_scale": sc}, {"scale": scale})
    torch.cuda.synchronize()
    assert (sc != 0xFF).all(), "unwritten scales"
    ref = _swiglu(_gemm_nk(A, W, sizes), scale)
    got = _decode_mxfp8(data, sc).double()
    assert ((got - ref).norm() / ref.norm()).item() < 4e-2
    # exactness: the kernel quantizes exactly what SwiGLUScaleEpilogue stores (the bf16 value)
    hp = _nan(M, N // 2, dtype=dtype)
    comp_hp = K.compile_grouped_gemm(K.GemmConfig(**cfg), K.SwiGLUScaleEpilogue(), dtype, N, Kd, G)
    K.run_grouped_gemm(comp_hp, A, W, offs, {"out": hp}, {"scale": scale})
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
        v = _em().silu(gate) * up * scale + add
        return v, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(8, 4099, 1024, 512), (130, 9000, 256, 256), (1, 1000, 512, 256)])
@pytest.mark.parametrize("pingpong", [False, True])
def test_mxfp8_exact(case, dtype, pingpong):
    """Byte-exact MXFP8: kernel bytes == fusion.quant.mxfp8.mxfp8_quantize_2d(hp.float()), with NaN, +-Inf,
    all-zero blocks, fp16 overflow, tiny values and blocks whose amax sits on 448 * 2^k boundaries."""
    from fusion.quant.mxfp8 import mxfp8_quantize_2d
    G, M, N, Kd = case
    gen = torch.Generator().manual_seed(1234 + M)
    sizes = _sizes(G, M, gen=gen)
    A = torch.randn(M, Kd, dtype=dtype, device=DEV)
    W = torch.randn(G, N, Kd, dtype=dtype, device=DEV) / Kd ** 0.5
    n = N // 2
    scale = torch.rand(M, dtype=torch.float32, device=DEV) * 4
    scale[::7] = 0.0                                   # all-zero rows (with add = 0) -> scale byte 0
    scale[1::11] = 2.0 ** -120                         # tiny values (subnormal after rounding)
    add = torch.zeros(M, n, dtype=torch.float32, device=DEV)
    pos = torch.rand(M, n, device=DEV)
    add[pos < 0.01] = float("nan")
    add[(pos >= 0.01) & (pos < 0.02)] = float("inf")
    add[(pos >= 0.02) & (pos < 0.03)] = -float("inf")
    add[(pos >= 0.03) & (pos < 0.04)] = 448.0 * 2.0 ** torch.randint(-20, 20, (1,)).item()
    add[(pos >= 0.04) & (pos < 0.045)] = 70000.0       # overflows fp16 -> inf in hp (and in the kernel)
    add[::7] = 0.0
    add[2::13] = float("nan")                          # all-NaN rows: amax over no finite element -> 0
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    cfg = K.GemmConfig(tile_n=128 if pingpong else 256, stages=4, pingpong=pingpong)
    comp = K.compile_grouped_gemm(cfg, _MXFP8HighPrecision(), dtype, N, Kd, G)
    data = torch.full((M, n), 0x55, dtype=torch.uint8, device=DEV)
    sc = torch.full((M, n // 32), 0xFF, dtype=torch.uint8, device=DEV)
    hp = _nan(M, n, dtype=dtype)
    K.run_grouped_gemm(comp, A, W, offs, {"out": data.view(torch.float8_e4m3fn), "out_scale": sc, "hp": hp},
                       {"scale": scale, "add": add})
    torch.cuda.synchronize()
    rd, rs = mxfp8_quantize_2d(hp.float().cpu())
    sc, data = sc.cpu(), data.cpu()
    bad_s = (sc != rs).sum().item()
    bad_d = (data != rd).sum().item()
    assert bad_s == 0 and bad_d == 0, (bad_s, bad_d, sc[sc != rs][:8], rs[sc != rs][:8],
                                       data[data != rd][:8], rd[data != rd][:8])
    assert (rs == 0).any() and (rd == 0x7F).any()     # the special cases were exercised
    # hp itself (finite where add is) against float64 math on the canonical weight
    ref = _swiglu(_gemm_nk(A, W, sizes), scale) + add.double()
    fin = torch.isfinite(ref) & (ref.abs() < 6e4)
    got = hp.double()
    assert (((got - ref).abs() <= 1e-2 * (ref.abs() + 1)) | ~fin).all()


class _MXFP8Patterns(K.Epilogue):
    """Its bf16 aux input as the MXFP8 output, the accumulator unused (every bf16 bit pattern, -0.0 included)."""
    gated = False
    inputs = (K.AuxInput("add"),)
    outputs = (K.MXFP8Output("out"),)

    def apply(self, acc, add):
        return add


def test_mxfp8_takes_every_bf16_bit_pattern():
    """The MXFP8 store tests bf16 values a packed pair at a time (kernels/pow2_quant.py finite_abs2_bf16; 0x7F7F the
    largest finite magnitude, 0x7F80 Inf): fed every one of the 65536 bf16 bit patterns (rolled copies, so each meets
    both halves of a word and 32-column blocks of every kind, NaN of either sign among them), its bytes and scales
    equal fusion.quant.mxfp8's."""
    from fusion.quant.mxfp8 import mxfp8_quantize_2d
    G, M, N, Kd = 4, 512, 1024, 128
    add = every_bf16_pattern().to(DEV)
    sizes = torch.tensor([128, 0, 200, 184])
    A = torch.randn(M, Kd, dtype=torch.bfloat16, device=DEV)
    W = torch.randn(G, N, Kd, dtype=torch.bfloat16, device=DEV) / Kd ** 0.5
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=4), _MXFP8Patterns(), torch.bfloat16, N, Kd, G)
    data = torch.full((M, N), 0x55, dtype=torch.uint8, device=DEV)
    sc = torch.full((M, N // 32), 0xFF, dtype=torch.uint8, device=DEV)
    K.run_grouped_gemm(comp, A, W, K.offsets_from_group_sizes(sizes.to(DEV)),
                       {"out": data.view(torch.float8_e4m3fn), "out_scale": sc}, {"add": add})
    torch.cuda.synchronize()
    rd, rs = mxfp8_quantize_2d(add.float().cpu())
    assert torch.equal(sc.cpu(), rs), "scale bytes differ from the exact rule"
    assert torch.equal(data.cpu(), rd), "e4m3 bytes differ from the reference"


def test_zero_rows_does_not_launch():
    comp = K.compile_grouped_gemm(K.GemmConfig(tile_n=128, stages=6), K.SwiGLUScaleEpilogue(), torch.bfloat16,
                                  256, 128, 4)
    out = torch.empty(0, 128, dtype=torch.bfloat16, device=DEV)
    K.run_grouped_gemm(comp, torch.empty(0, 128, dtype=torch.bfloat16, device=DEV),
                       torch.randn(4, 256, 128, dtype=torch.bfloat16, device=DEV),
                       torch.zeros(5, dtype=torch.int32, device=DEV), {"out": out},
                       {"scale": torch.empty(0, device=DEV)})
    torch.cuda.synchronize()
