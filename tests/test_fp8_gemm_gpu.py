"""GPU correctness of the FP8 block-scaled grouped GEMM (fusion.kernels.fp8_gemm; needs sm_90, else skipped).

A is quantized with fusion.quant's FP8-block quantizer (1x128, power-of-two scales) and B with the weight
quantizer (128x128 blocks); the kernel's output is compared with dequantize(A) @ dequantize(B[g]).T in
float64. Data have rows, k-blocks and weight blocks of very different magnitudes (so a scale applied to the
wrong row, block or k-tile shows), ragged groups with empty ones, unaligned M, K and N, outputs poisoned
with NaN (every element must be written).

Tolerance per element: the bf16 (fp16) rounding of the output, 2^-8 |ref|, plus 2^-9 of
sum_k |A_dq[r, k] B_dq[g, c, k]| for the tensor cores' limited-precision FP8 accumulation inside each
128-wide k-block (the kernel promotes every k-block into fp32); the whole output must also agree to 1 %
in the Frobenius norm.
"""
import pytest
import torch
from conftest import every_bf16_pattern, hopper_available

pytestmark = pytest.mark.gpu


if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from dataclasses import replace  # noqa: E402

import fusion.kernels as K  # noqa: E402
from fusion.quant.fp8_block import fp8_block_dequantize_2d, fp8_block_quantize_2d  # noqa: E402
from fusion.quant.fp8_weight import quantize_weight_fp8_block  # noqa: E402
from fusion.quant.mxfp8 import mxfp8_quantize_2d  # noqa: E402

DEV = "cuda"
ACC_TOL = 2.0 ** -9      # of sum |products|: FP8 tensor-core accumulation within a 128-wide k-block
OUT_TOL = 2.0 ** -8      # of |ref|: bf16 / fp16 rounding of the output


def _sizes(G, M, gen):
    """Random ragged sizes summing to M; about a quarter of the groups empty, the first and last among them
    when G > 4."""
    if G == 1:
        return torch.tensor([M])
    w = torch.rand(G, generator=gen) + 0.05
    w[torch.randperm(G, generator=gen)[: max(1, G // 4)]] = 0
    if G > 4:
        w[0] = w[-1] = 0
    if w.sum() == 0:
        w[1] = 1
    s = torch.floor(w / w.sum() * M).to(torch.int64)
    s[int(torch.argmax(w))] += M - int(s.sum())
    return s


def _blocky(shape, gen, spread=6):
    """Gaussian values times 2^e, e drawn per row and per 128-column block in [-spread, spread]: every
    scale block of the quantized tensor gets a different power-of-two scale."""
    *lead, R, C = shape
    x = torch.randn(*shape, generator=gen)
    row_e = torch.randint(-spread, spread + 1, (*lead, R, 1), generator=gen)
    blk_e = torch.randint(-spread // 2, spread // 2 + 1, (*lead, 1, -(-C // 128)), generator=gen)
    blk_e = blk_e.repeat_interleave(128, -1)[..., :C]
    return x * torch.exp2((row_e + blk_e).float())


def _problem(G, M, N, Kd, seed=0, amp=1.0):
    gen = torch.Generator().manual_seed(seed)
    sizes = _sizes(G, M, gen)
    x = (_blocky((M, Kd), gen) * amp).to(DEV)
    w = (_blocky((G, N, Kd), gen, spread=4) / Kd ** 0.5).to(DEV)
    a_data, a_scale = fp8_block_quantize_2d(x)
    wq = quantize_weight_fp8_block(w)
    a_dq = fp8_block_dequantize_2d(a_data, a_scale).double()
    b_dq = wq.dequantize().double()
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    return sizes, (a_data, a_scale, wq.data, wq.scale, offs), a_dq, b_dq


def _reference(a_dq, b_dq, sizes):
    """(A_dq @ B_dq[g].T, |A_dq| @ |B_dq[g]|.T) per group, float64."""
    ref, mag, r = [], [], 0
    for g, n in enumerate(sizes.tolist()):
        ref.append(a_dq[r:r + n] @ b_dq[g].T)
        mag.append(a_dq[r:r + n].abs() @ b_dq[g].abs().T)
        r += n
    empty = a_dq.new_zeros(0, b_dq.shape[1])
    return (torch.cat(ref) if ref else empty), (torch.cat(mag) if mag else empty)


def _check(out, ref, tol, what=""):
    """Every element written (finite) and within ``tol``; reports max abs / rel error on failure."""
    x = out.double()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    n_bad = (~torch.isfinite(x)).sum().item()
    assert n_bad == 0, f"{what}: {n_bad} non-finite (unwritten?) elements of {x.numel()}"
    if ref.numel() == 0:
        return
    err = (x - ref).abs()
    rel = err / ref.abs().clamp_min(1e-30)
    summary = (f"{what}: max abs err {err.max().item():.3e}, max rel err {rel.max().item():.3e}, "
               f"max |ref| {ref.abs().max().item():.3e}")
    bad = err > tol
    if bad.any():
        i = bad.nonzero()[0].tolist()
        pytest.fail(f"{summary}; {bad.sum().item()} elements out of tolerance, first at {i}: "
                    f"{x[tuple(i)].item()} vs {ref[tuple(i)].item()} (tol {tol[tuple(i)].item():.3e})")
    fro = ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert fro < 1e-2, f"{summary}; relative Frobenius error {fro:.3e}"
    print(summary, f"frobenius {fro:.2e}")


def _config(N, Kd, G, gated=False, **over):
    """The cooperative tile policy's configuration (tile_policy.cooperative_fp8_config) with `over`: the tests name
    their tiles (two CTAs an SM: the two_ctas tests and test_identity_on_the_policys_plain_tile)."""
    return replace(K.cooperative_fp8_config(N, Kd, G, gated), **over)


def _nan(M, N, dtype=torch.bfloat16):
    return torch.full((M, N), float("nan"), dtype=dtype, device=DEV)


# (G, M, N, K, config overrides): unaligned M, empty groups, K % 128 != 0, N not a multiple of the tile
CASES = [
    (8, 3001, 1024, 512, {}),
    (8, 2000, 1024, 528, {}),                              # a partial last k-block (K % 128 = 16)
    (1, 777, 256, 256, {}),
    (4, 1000, 1032, 640, {}),                              # a partial last n-tile and weight block
    (130, 5000, 512, 384, dict(dynamic=True)),             # many groups, dynamic scheduler
    (8, 4099, 4096, 1024, dict(tile_m=128, tile_n=192, stages=5)),  # n-tiles straddling two weight blocks
    (32, 8192, 4096, 7168, {}),                            # wide N (dynamic by default), long K
    (16, 2500, 768, 1024, dict(tile_m=128, tile_n=64, stages=6)),
    (8, 1000, 512, 64, {}),                                # one k-tile
    # launched on 7 CTAs, 20 times: many tiles per CTA, the producer stages ahead of the consumers (a removed
    # overlapped fold went wrong in 2-26 of 60 such launches at K = 512; kernels/fp8_mainloop.py)
    (8, 3001, 1024, 512, dict(num_ctas=7)),
    (8, 3001, 1024, 512, dict(num_ctas=7, cluster_n=2, dynamic=False)),
    (130, 5000, 512, 384, dict(dynamic=True, num_ctas=7)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[0]}-M{c[1]}-N{c[2]}-K{c[3]}-{c[4]}")
def test_identity(case):
    G, M, N, Kd, over = case
    over = dict(over)
    num_ctas = over.pop("num_ctas", None)
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd)
    comp = K.compile_fp8_grouped_gemm(_config(N, Kd, G, **over), K.IdentityEpilogue(), N, Kd, G)
    ref, mag = _reference(a_dq, b_dq, sizes)
    for _ in range(1 if num_ctas is None else 20):
        out = _nan(M, N)
        K.run_fp8_grouped_gemm(comp, *args, {"out": out}, num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(out, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name)


@pytest.mark.parametrize("case", [(32, 8192, 4096, 7168), (8, 3001, 1024, 512), (130, 5000, 512, 384)],
                         ids=lambda c: "G{}-M{}-N{}-K{}".format(*c))
def test_identity_on_the_policys_plain_tile(case):
    """A lone GEMM's configuration (choose_fp8_config with a plain epilogue: two CTAs an SM, tile_policy.fp8_two_ctas)
    against the float64 product."""
    G, M, N, Kd = case
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd, seed=35)
    comp = K.compile_fp8_grouped_gemm(K.choose_fp8_config(N, Kd, G, plain_epilogue=True), K.IdentityEpilogue(), N,
                                      Kd, G)
    assert "_2cta" in comp.name
    out = _nan(M, N)
    K.run_fp8_grouped_gemm(comp, *args, {"out": out})
    torch.cuda.synchronize()
    ref, mag = _reference(a_dq, b_dq, sizes)
    _check(out, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name)


def test_float8_dtype_operands_and_fp16_output():
    """A and B as torch.float8_e4m3fn views of the codes; an fp16 output."""
    G, M, N, Kd = 8, 1500, 512, 768
    sizes, (a, sa, b, sb, offs), a_dq, b_dq = _problem(G, M, N, Kd, seed=1, amp=2.0 ** -8)  # fp16 range
    epi = K.IdentityEpilogue(out_dtype="float16")
    comp = K.compile_fp8_grouped_gemm(_config(N, Kd, G), epi, N, Kd, G, out_dtype="float16")
    out = _nan(M, N, torch.float16)
    K.run_fp8_grouped_gemm(comp, a.view(torch.float8_e4m3fn), sa, b.view(torch.float8_e4m3fn), sb, offs,
                           {"out": out})
    torch.cuda.synchronize()
    ref, mag = _reference(a_dq, b_dq, sizes)
    _check(out, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name)


def test_no_rows():
    G, N, Kd = 4, 256, 256
    sizes, args, _, _ = _problem(G, 0, N, Kd)
    comp = K.compile_fp8_grouped_gemm(_config(N, Kd, G), K.IdentityEpilogue(), N, Kd, G)
    out = K.fp8_grouped_gemm(*args[:4], offsets=args[4])["out"]
    torch.cuda.synchronize()
    assert out.shape == (0, N)
    K.run_fp8_grouped_gemm(comp, *args, {"out": torch.empty(0, N, dtype=torch.bfloat16, device=DEV)})


def test_convenience_matches_run():
    G, M, N, Kd = 8, 2000, 1024, 512
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd, seed=2)
    out = K.fp8_grouped_gemm(*args[:4], group_sizes=sizes.to(DEV))["out"]
    comp = K.compile_fp8_grouped_gemm(K.choose_fp8_config(N, Kd, G), K.IdentityEpilogue(), N, Kd, G)
    out2 = _nan(M, N)
    K.run_fp8_grouped_gemm(comp, *args, {"out": out2})
    torch.cuda.synchronize()
    assert torch.equal(out, out2)


@pytest.mark.parametrize("cluster_n", [1, 2])
def test_dgrad_reads_the_transposed_weight_copy(cluster_n):
    """dX = dY @ W[g] of the recipe: dY quantized 1x128 rowwise, B = the weight's data_t (G, in, out) with
    scale_t; the kernel's N is in_features, its K out_features. Single CTAs and CTA pairs."""
    G, M, f_in, f_out = 8, 2000, 768, 1536
    gen = torch.Generator().manual_seed(5)
    sizes = _sizes(G, M, gen)
    dy = _blocky((M, f_out), gen).to(DEV)
    wq = quantize_weight_fp8_block((_blocky((G, f_out, f_in), gen, spread=4) / f_out ** 0.5).to(DEV))
    d_data, d_scale = fp8_block_quantize_2d(dy)
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    comp = K.compile_fp8_grouped_gemm(_config(f_in, f_out, G, cluster_n=cluster_n), K.IdentityEpilogue(), f_in,
                                      f_out, G)
    out = _nan(M, f_in)
    K.run_fp8_grouped_gemm(comp, d_data, d_scale, wq.data_t, wq.scale_t, offs, {"out": out})
    torch.cuda.synchronize()
    ref, mag = _reference(fp8_block_dequantize_2d(d_data, d_scale).double(), wq.dequantize_t().double(), sizes)
    _check(out, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name + " (dgrad)")


# ------------------------------------------------------------------ gated epilogues on the canonical weight
def _swiglu_ref(ref, mag, scale):
    """silu(gate) * up * scale and its tolerance from the GEMM's (gate, up) error bounds."""
    n = ref.shape[1] // 2
    g, u = ref[:, :n], ref[:, n:]
    eg = ACC_TOL * mag[:, :n]
    eu = ACC_TOL * mag[:, n:]
    s = scale.double()[:, None]
    silu = torch.nn.functional.silu(g)
    val = silu * u * s
    # |d silu / dg| <= 1.1
    tol = s.abs() * (1.1 * u.abs() * eg + (silu.abs() + 1.1 * eg) * eu) + 2.0 ** -7 * val.abs() + 1e-30
    return val, tol


def _check_gated(N, cfg, seed):
    """FC1 + SwiGLU * router prob at `cfg` against the float64 reference and its error bound."""
    G, M, Kd = 8, 3000, 1024
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd, seed=seed)
    scale = torch.rand(M, device=DEV)
    comp = K.compile_fp8_grouped_gemm(cfg(N, Kd, G), K.SwiGLUScaleEpilogue(), N, Kd, G)
    out = _nan(M, N // 2)
    K.run_fp8_grouped_gemm(comp, *args, {"out": out}, extras={"scale": scale})
    torch.cuda.synchronize()
    val, tol = _swiglu_ref(*_reference(a_dq, b_dq, sizes), scale)
    _check(out, val, tol, comp.name)


@pytest.mark.parametrize("N,tile_n", [(2 * 1536, 128), (2 * 2888, 128), (2 * 2880, 192)])
@pytest.mark.parametrize("cluster_n", [1, 2])
def test_gated_swiglu_scale(N, tile_n, cluster_n):
    """FC1 + SwiGLU * router prob, single CTAs and CTA pairs. N/2 = 2888: the up half starts 8 rows into a 64-row
    step, so its 64-row segments straddle weight blocks (a run-time boundary per tile)."""
    _check_gated(N, lambda N, Kd, G: _config(N, Kd, G, gated=True, tile_m=128, tile_n=tile_n, cluster_n=cluster_n,
                                             stages=5 if tile_n > 128 else 6), seed=3)


@pytest.mark.parametrize("N,cluster_n,cluster_m", [(2 * 1536, 1, 1), (2 * 1536, 2, 1), (2 * 1536, 1, 2),
                                                   (2 * 2888, 1, 1), (2 * 2888, 1, 2), (2 * 2880, 1, 1),
                                                   (2 * 2880, 1, 2)])
def test_gated_swiglu_scale_as_two_n_waves(N, cluster_n, cluster_m):
    """The gated 128 x 256 tile (gate half, then up half, through one scratch fragment: kernels/fp8_gemm.py
    n-waves), single CTAs and pairs along n and along m (each CTA of an m-pair loads half of the gate box and half
    of the up box). N/2 = 2888 and 2880: the up half's 128-row segments straddle two weight blocks, and the last
    n-tile is partial."""
    _check_gated(N, lambda N, Kd, G: replace(K.fp8_block_output_tile(N), cluster_n=cluster_n, cluster_m=cluster_m),
                 seed=5)


class _SwiGLUScaleFP8Block(K.SwiGLUScaleEpilogue):
    outputs = (K.FP8BlockOutput("out"),)


def _adversarial_rows(x):
    """Rows of ``x`` that make adversarial FC1 outputs: all-zero rows (zero blocks, scale 1), a row 2^60 times
    larger (bf16 outputs past e4m3's range, some overflowing to Inf), a tiny row (subnormal scales) and a NaN."""
    x = x.clone()
    x[5] = 0
    x[700:760] = 0
    x[11] *= 2.0 ** 60
    x[12] *= 2.0 ** -60
    x[13, 17] = float("nan")
    return x


def _adversarial_problem(G, M, N, Kd, seed):
    """The kernel's operands (A and B quantized, the group offsets) for ragged groups whose A has the adversarial
    rows of :func:`_adversarial_rows`, and a random row scale: ``(args, scale)``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = _sizes(G, M, gen)
    x = _adversarial_rows(_blocky((M, Kd), gen)).to(DEV)
    w = (_blocky((G, N, Kd), gen, spread=4) / Kd ** 0.5).to(DEV)
    a_data, a_scale = fp8_block_quantize_2d(x)
    wq = quantize_weight_fp8_block(w)
    args = (a_data, a_scale, wq.data, wq.scale, K.offsets_from_group_sizes(sizes.to(DEV)))
    return args, torch.rand(M, device=DEV)


class _StoreSaved(_SwiGLUScaleFP8Block):
    """The training FC1's epilogue: FC2's FP8-block input and the bf16 pre-activation (gate, up) saved beside it."""
    outputs = (K.FP8BlockOutput("out"), K.Output("saved", paired=True))

    def apply(self, gate, up, scale):
        from fusion.kernels import epi_math as em
        return em.silu(gate) * up * scale, gate, up


@pytest.mark.parametrize("N", [2 * 2048, 2 * 2888])
def test_saved_pre_activation_in_whole_sectors_is_the_two_column_store(N):
    """GemmConfig.quad_beside_fp8 (4 columns per lane beside the FP8-block store, the policy's since session w)
    writes the same bits as the 2-column store it replaced: the saved (gate, up) halves, and the FP8-block codes,
    scales and amax beside them, with adversarial rows, ragged and empty groups, and (N/2 = 2888) a partial last
    block; nothing past the logical width (the outputs start as NaN)."""
    from fusion.kernels.api import fp8_block_outputs

    G, M, Kd = 8, 2100, 1024
    args, scale = _adversarial_problem(G, M, N, Kd, seed=8)
    got = {}
    for quad in (True, False):
        cfg = replace(K.fp8_block_output_tile(N), quad_beside_fp8=quad)
        outs = fp8_block_outputs(_StoreSaved.outputs[0], M, N // 2, DEV)
        outs["out"].view(torch.uint8).fill_(0x7E)
        outs["out_scale"].fill_(float("nan"))
        outs["saved"] = _nan(M, N)
        K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, _StoreSaved(), N, Kd, G), *args, outs,
                               extras={"scale": scale})
        got[quad] = outs
    torch.cuda.synchronize()
    assert not torch.isnan(got[True]["saved"][:20]).all(), "nothing was saved"
    for name in ("saved", "out", "out_scale", "out_amax"):
        a, b = got[True][name], got[False][name]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"{name} differs between the two stores"


@pytest.mark.parametrize("m_pairs", [False, True], ids=["policy", "m-pairs"])
@pytest.mark.parametrize("N", [2 * 2048, 2 * 2888])
def test_fp8_block_output_is_the_quantized_bf16_output(N, m_pairs):
    """The FP8-block epilogue store (a row's 1 x 128 block whole in the 128 x 256 gated tile) rounds to bf16 and
    quantizes exactly: codes, k-block-major scales and the finite amax equal fusion.quant's quantizer applied to
    the bf16 epilogue output of the same kernel configuration (the same accumulators), with zero, huge, tiny and
    NaN rows, empty groups, unaligned group starts and (N/2 = 2888) a partial last block; on the policy's tiles (CTA
    pairs along n at N/2 = 2048: 16 n-tiles; single CTAs at 2888: 23) and as CTA pairs along m."""
    G, M, Kd = 8, 2100, 1024
    args, scale = _adversarial_problem(G, M, N, Kd, seed=6)
    cfg = K.fp8_block_output_tile(N)
    if m_pairs:
        cfg = replace(cfg, cluster_n=1, cluster_m=2)
    hp = _nan(M, N // 2)
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, K.SwiGLUScaleEpilogue(), N, Kd, G), *args,
                           {"out": hp}, extras={"scale": scale})
    epi = _SwiGLUScaleFP8Block()
    from fusion.kernels.api import fp8_block_outputs
    outs = fp8_block_outputs(epi.outputs[0], M, N // 2, DEV)
    outs["out"].view(torch.uint8).fill_(0x7E)
    outs["out_scale"].fill_(float("nan"))
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, epi, N, Kd, G), *args, outs, extras={"scale": scale})
    torch.cuda.synchronize()
    assert torch.isinf(hp[11]).any() and hp[5].eq(0).all() and torch.isnan(hp[13]).any(), \
        "the adversarial rows did not reach the output"
    ref_data, ref_scale = fp8_block_quantize_2d(hp)
    assert torch.equal(outs["out_scale"].view(torch.int32), ref_scale.view(torch.int32)), "scales differ"
    n_diff = (outs["out"].view(torch.uint8) != ref_data).sum().item()
    assert n_diff == 0, f"{n_diff} E4M3 bytes differ"
    from fusion.quant._common import finite_amax
    assert outs["out_amax"].item() == finite_amax(hp).view(torch.int32).item(), "amax differs"


class _RowScaled(K.Epilogue):
    """acc * scale[row] in bf16: the value the dequantized FP8-block store below round-trips."""
    gated = False
    inputs = (K.RowVector("scale"),)
    outputs = (K.Output("out"),)

    def apply(self, acc, scale):
        return acc * scale


class _RowScaledDequant(_RowScaled):
    outputs = (K.FP8BlockDequantOutput("out"),)


@pytest.mark.parametrize("stores", ["quad", "pairs"])
@pytest.mark.parametrize("tile", ["policy", "128x128", "two-ctas"])
@pytest.mark.parametrize("N", [1024, 1000], ids=["N1024", "N1000-partial-block"])
def test_fp8_block_dequantized_output_is_the_round_trip_of_the_bf16_output(N, tile, stores):
    """The dequantized FP8-block store (what the FP8 dgrad writes for FC2's weight gradient after a
    QuantizeFP8Block(columnwise=False)) equals, bit for bit, fusion.quant's quantize-then-dequantize of the bf16 output
    of the same kernel configuration, with zero, huge (Inf in bf16: NaN after the round trip, as the codes say), tiny
    and NaN rows, empty groups, unaligned group starts, a partial last block (N = 1000), on the dgrad's policy tile
    (256 x 128 CTA pairs: two m-waves) and on 128 x 128 ones; stored 4 columns per lane after the quad swap (the
    policy's since session x: GemmConfig.quad_beside_fp8) and 2 (before)."""
    from fusion.quant.fp8_block import fp8_block_dequantize_2d

    G, M, Kd = 8, 2100, 1024
    args, scale = _adversarial_problem(G, M, N, Kd, seed=7)
    scale[11] = 2.0 ** 100   # the huge row overflows: Inf in float32 and bf16
    cfg = _config(N, Kd, G) if tile == "policy" else K.fp8_block_output_tile(N, gated=False)
    cfg = replace(cfg, quad_beside_fp8=stores == "quad")
    if tile == "two-ctas":
        cfg = replace(cfg, ctas_per_sm=2, stages=3)
    hp, got = _nan(M, N), _nan(M, N)
    for epi, out in ((_RowScaled(), hp), (_RowScaledDequant(), got)):
        K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, epi, N, Kd, G), *args, {"out": out},
                               extras={"scale": scale})
    torch.cuda.synchronize()
    assert torch.isinf(hp[11]).any() and hp[5].eq(0).all() and torch.isnan(hp[13]).any(), \
        "the adversarial rows did not reach the output"
    assert hp[12].ne(0).any() and hp[12].abs().max() < 2.0 ** -40, "the tiny row is not tiny"
    want = fp8_block_dequantize_2d(*fp8_block_quantize_2d(hp), dtype=torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN where the round trip has none, or the other way"
    n_diff = (got[~nan].view(torch.int16) != want[~nan].view(torch.int16)).sum().item()
    assert n_diff == 0, f"{n_diff} of {int((~nan).sum())} bf16 values differ from the round trip"
    assert not torch.equal(got[~nan], hp[~nan]), "the store wrote the value without its FP8 round trip"


class _AuxPatterns(K.Epilogue):
    """Writes its bf16 aux input (every bf16 bit pattern), the accumulator unused (acc * 0 + add would turn -0.0 into
    +0.0): the FP8-block stores then quantize exactly the patterns the test chose."""
    gated = False
    inputs = (K.AuxInput("add"),)
    outputs = (K.FP8BlockOutput("out"),)

    def apply(self, acc, add):
        return add


class _AuxPatternsDequant(_AuxPatterns):
    outputs = (K.FP8BlockDequantOutput("out"),)


@pytest.mark.parametrize("dequant", [False, True], ids=["codes", "dequantized"])
def test_fp8_block_stores_take_every_bf16_bit_pattern(dequant):
    """The FP8 kernel's FP8-block store and dequantized row test bf16 values a packed pair at a time
    (kernels/pow2_quant.py finite_abs2_bf16: a carry into each half's top bit marks Inf and NaN, 0x7F7F the largest
    finite magnitude); fed every one of the 65536 bf16 bit patterns (rolled copies, so each meets both halves of a
    word and blocks of every kind), they equal fusion.quant's quantizer (codes, scales, the finite amax) and its
    quantize-then-dequantize, bit for bit."""
    from fusion.kernels.api import fp8_block_outputs
    from fusion.quant._common import finite_amax

    G, M, N, Kd = 4, 512, 1024, 256
    add = every_bf16_pattern().to(DEV)
    gen = torch.Generator().manual_seed(3)
    a_data, a_scale = fp8_block_quantize_2d(torch.randn(M, Kd, generator=gen).to(DEV))
    wq = quantize_weight_fp8_block((torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV))
    sizes = torch.tensor([128, 0, 200, 184])
    args = (a_data, a_scale, wq.data, wq.scale, K.offsets_from_group_sizes(sizes.to(DEV)))
    cfg = K.fp8_block_output_tile(N, gated=False)
    epi = _AuxPatternsDequant() if dequant else _AuxPatterns()
    kernel = K.compile_fp8_grouped_gemm(cfg, epi, N, Kd, G)
    if dequant:
        got = _nan(M, N)
        K.run_fp8_grouped_gemm(kernel, *args, {"out": got}, extras={"add": add})
        torch.cuda.synchronize()
        want = fp8_block_dequantize_2d(*fp8_block_quantize_2d(add), dtype=torch.bfloat16)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), "NaN where the round trip has none, or the other way"
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
        return
    outs = fp8_block_outputs(epi.outputs[0], M, N, DEV)
    outs["out"].view(torch.uint8).fill_(0x55)
    outs["out_scale"].fill_(float("nan"))
    K.run_fp8_grouped_gemm(kernel, *args, outs, extras={"add": add})
    torch.cuda.synchronize()
    ref_data, ref_scale = fp8_block_quantize_2d(add)
    assert torch.equal(outs["out_scale"].view(torch.int32), ref_scale.view(torch.int32)), "scales differ"
    n_diff = (outs["out"].view(torch.uint8) != ref_data.view(torch.uint8)).sum().item()
    assert n_diff == 0, f"{n_diff} E4M3 bytes differ"
    assert outs["out_amax"].item() == finite_amax(add).view(torch.int32).item(), "amax differs"


def test_mxfp8_output_is_the_quantized_bf16_output():
    """The MXFP8 epilogue rounds to bf16 first and quantizes exactly: byte-equal to quantizing the bf16
    epilogue's output of the same kernel configuration (same accumulators)."""
    G, M, N, Kd = 8, 2100, 2048, 1024
    sizes, args, _, _ = _problem(G, M, N, Kd, seed=4)
    scale = torch.rand(M, device=DEV)
    cfg = _config(N, Kd, G, gated=True)
    hp = _nan(M, N // 2)
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, K.SwiGLUScaleEpilogue(), N, Kd, G), *args,
                           {"out": hp}, extras={"scale": scale})
    data = torch.full((M, N // 2), 0x7E, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    sc = torch.full((M, N // 64), 0xFE, dtype=torch.uint8, device=DEV)
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, K.SwiGLUScaleMXFP8Epilogue(), N, Kd, G), *args,
                           {"out": data, "out_scale": sc}, extras={"scale": scale})
    torch.cuda.synchronize()
    assert torch.isfinite(hp).all()
    ref_data, ref_scale = mxfp8_quantize_2d(hp.float())
    assert torch.equal(sc, ref_scale.view(torch.uint8)), "E8M0 scales differ"
    n_diff = (data.view(torch.uint8) != ref_data.view(torch.uint8)).sum().item()
    assert n_diff == 0, f"{n_diff} E4M3 bytes differ"


# ------------------------------------------------------------------ CTA pairs (cluster_n = 2)
# (G, M, N, K): ragged groups with empty ones and unaligned M, a partial last n-tile and weight block (N = 1000:
# 8 n-tiles, the last 104 wide), many groups, DeepSeek-V3's FC1 widths
PAIR_CASES = [(8, 3001, 1024, 512), (4, 1000, 1000, 640), (130, 5000, 512, 384), (32, 8192, 4096, 7168),
              (1, 777, 256, 256)]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("num_ctas", [None, 7])
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "G{}-M{}-N{}-K{}".format(*c))
def test_pairs_identity_bitwise_equal_to_single_ctas(case, num_ctas, dynamic):
    """A CTA pair multicasts the A tile; each CTA still folds the same k-tiles in the same order, so the output
    is bitwise the single-CTA kernel's, and within the FP8 tolerance of the float64 product. ``num_ctas`` = 7
    launches 3 pairs (whole pairs only)."""
    _check_pair_bitwise(case, _config(*_pair_dims(case), dynamic=dynamic, cluster_n=1), dict(cluster_n=2), "_c2",
                        num_ctas, seed=11)


def _pair_dims(case):
    G, M, N, Kd = case
    return N, Kd, G


def _check_pair_bitwise(case, cfg, pair, name_mark, num_ctas, seed):
    """The identity GEMM at `cfg` (single CTAs) and at `cfg` with the `pair` fields (its name holding `name_mark`),
    launched on `num_ctas` CTAs: the pair's output within the FP8 tolerance of the float64 product and bitwise the
    single CTAs'."""
    G, M, N, Kd = case
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd, seed=seed)
    single = _nan(M, N)
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, K.IdentityEpilogue(), N, Kd, G), *args, {"out": single})
    comp = K.compile_fp8_grouped_gemm(replace(cfg, **pair), K.IdentityEpilogue(), N, Kd, G)
    assert name_mark in comp.name
    paired = _nan(M, N)
    K.run_fp8_grouped_gemm(comp, *args, {"out": paired}, num_ctas=num_ctas)
    torch.cuda.synchronize()
    ref, mag = _reference(a_dq, b_dq, sizes)
    _check(paired, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name)
    assert torch.equal(paired, single)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("N", [2 * 1536, 2 * 2048])
def test_pairs_gated_swiglu_scale(N, dynamic):
    """FC1 + SwiGLU * router prob as CTA pairs on either schedule: gate and up B boxes per CTA, the A tile shared."""
    _check_gated(N, lambda N, Kd, G: _config(N, Kd, G, gated=True, cluster_n=2, dynamic=dynamic), seed=12)


# ------------------------------------------------------------------ CTA pairs along m (cluster_m = 2)
# (G, M, N, K): GPT-OSS's 2880 columns (23 n-tiles), ragged groups whose m-tile counts are odd (rank 1 of a group's
# last pair gets a tile past the group's rows), empty groups, many groups, one group, a partial last k-block
M_PAIR_CASES = [(8, 3001, 2880, 512), (4, 1000, 1000, 640), (130, 5000, 512, 384), (1, 777, 256, 256),
                (8, 2000, 1024, 528)]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("num_ctas", [None, 7])
@pytest.mark.parametrize("case", M_PAIR_CASES, ids=lambda c: "G{}-M{}-N{}-K{}".format(*c))
def test_m_pairs_identity_bitwise_equal_to_single_ctas(case, num_ctas, dynamic):
    """A CTA pair along m multicasts the B tile (each CTA loads half of it) and loads its own A rows and scales;
    each CTA folds the same k-tiles in the same order as a single CTA, so the output is bitwise the single-CTA
    kernel's, and within the FP8 tolerance of the float64 product. ``num_ctas`` = 7 launches 3 pairs."""
    cfg = _config(*_pair_dims(case), dynamic=dynamic, tile_m=128, stages=6, cluster_n=1, cluster_m=1)
    _check_pair_bitwise(case, cfg, dict(cluster_m=2), "_cm2", num_ctas, seed=21)


# ------------------------------------------------------------------ two CTAs an SM (one consumer warpgroup a CTA)
# the pair cases, plus a partial last k-block
TWO_CTA_CASES = PAIR_CASES + [(8, 2000, 1024, 528)]


@pytest.mark.parametrize("over", [dict(dynamic=True), dict(dynamic=False), dict(dynamic=True, num_ctas=7),
                                  dict(dynamic=True, cluster_n=2), dict(dynamic=False, cluster_n=2, num_ctas=6)],
                         ids=["dynamic", "static", "dynamic-7-ctas", "dynamic-pairs", "static-pairs-6-ctas"])
@pytest.mark.parametrize("case", TWO_CTA_CASES, ids=lambda c: "G{}-M{}-N{}-K{}".format(*c))
def test_two_ctas_an_sm_bitwise_equal_to_cooperative_tiles(case, over):
    """One consumer warpgroup a CTA (GemmConfig.ctas_per_sm = 2) walks a 128-row tile as two 64-row m-waves, each
    the cooperative tile's wgmma on the same rows, folded in the same k order: bitwise the cooperative 128-row
    kernel's output and within the FP8 tolerance of the float64 product, on either schedule, alone and as CTA pairs
    along n, on a full grid (two CTAs an SM) and on a few CTAs (many tiles each)."""
    if len(over) > 1 and case not in TWO_CTA_CASES[:2]:
        pytest.skip("the launch variants run on the first two cases")
    over = dict(over)
    num_ctas = over.pop("num_ctas", None)
    cfg = _config(*_pair_dims(case), tile_m=128, tile_n=128, stages=6, cluster_n=1, cluster_m=1,
                  dynamic=over.pop("dynamic"))
    _check_pair_bitwise(case, cfg, dict(ctas_per_sm=2, stages=3, **over), "_2cta", num_ctas, seed=31)


@pytest.mark.parametrize("N", [2 * 1536, 2 * 2888, 2 * 2880])
def test_two_ctas_an_sm_gated_n_waves_swiglu_scale(N):
    """FC1 + SwiGLU * router prob on the gated n-wave tile as two CTAs an SM: 64 x 256 (one warpgroup's gate and up
    n-waves), CTA pairs along m sharing each B box (tile_policy.two_cta_tile; FP8_TWO_CTAS_GATED, off: slower).
    N/2 = 2888 and 2880: up-half segments straddling weight blocks, a partial last n-tile."""
    from fusion.kernels.tile_policy import two_cta_tile

    _check_gated(N, lambda N, Kd, G: two_cta_tile(K.fp8_block_output_tile(N)), seed=36)


@pytest.mark.parametrize("N", [2 * 1536, 2 * 2888])
def test_two_ctas_an_sm_gated_swiglu_scale(N):
    """FC1 + SwiGLU * router prob on a gated 128 x 128 tile, one consumer warpgroup a CTA, two CTAs an SM."""
    _check_gated(N, lambda N, Kd, G: _config(N, Kd, G, gated=True, tile_m=128, tile_n=128, cluster_n=1, stages=3,
                                             ctas_per_sm=2), seed=32)


# ------------------------------------------------------------------ 256-row tiles (two 64-row waves per warpgroup)
# ragged groups with empty ones (many partial 256-row tiles), a partial n-tile and weight block, many groups,
# issue 9's target widths
WAVE_CASES = [(8, 3001, 1024, 512), (4, 1000, 1000, 640), (130, 5000, 512, 384), (32, 8192, 4096, 7168)]


@pytest.mark.parametrize("over", [dict(), dict(num_ctas=7), dict(dynamic=False)], ids=["", "7-ctas", "static"])
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("case", WAVE_CASES, ids=lambda c: "G{}-M{}-N{}-K{}".format(*c))
def test_256_row_tiles_bitwise_equal_to_128_row_tiles(case, cluster_n, over):
    """A 256-row tile's wave is the 128-row tile's wgmma on the same 64 rows, folded in the same k order through
    the same scratch arithmetic: bitwise the 128-row kernel's output, and within the FP8 tolerance of the float64
    product. Rows past a group's end (a partial tile) are computed and masked, never stored."""
    if over and case != WAVE_CASES[0]:
        pytest.skip("the launch and schedule variants run on the first case")
    G, M, N, Kd = case
    over = dict(over)
    num_ctas = over.pop("num_ctas", None)
    sizes, args, a_dq, b_dq = _problem(G, M, N, Kd, seed=13)
    cfg = _config(N, Kd, G, cluster_n=cluster_n, tile_m=128, stages=6, **over)
    rows_128 = _nan(M, N)
    K.run_fp8_grouped_gemm(K.compile_fp8_grouped_gemm(cfg, K.IdentityEpilogue(), N, Kd, G), *args, {"out": rows_128})
    comp = K.compile_fp8_grouped_gemm(replace(cfg, tile_m=256, stages=4), K.IdentityEpilogue(), N, Kd, G)
    assert "_256x" in comp.name
    rows_256 = _nan(M, N)
    K.run_fp8_grouped_gemm(comp, *args, {"out": rows_256}, num_ctas=num_ctas)
    torch.cuda.synchronize()
    ref, mag = _reference(a_dq, b_dq, sizes)
    _check(rows_256, ref, OUT_TOL * ref.abs() + ACC_TOL * mag + 1e-30, comp.name)
    assert torch.equal(rows_256, rows_128)


@pytest.mark.parametrize("N", [2 * 1536, 2 * 2888])
@pytest.mark.parametrize("cluster_n", [1, 2])
def test_256_row_tiles_gated_swiglu_scale(N, cluster_n):
    """FC1 + SwiGLU * router prob on 256-row tiles (N/2 = 2888: up-half segments straddle weight blocks)."""
    _check_gated(N, lambda N, Kd, G: _config(N, Kd, G, gated=True, tile_m=256, tile_n=128, stages=4, cluster_n=cluster_n),
                 seed=14)


# ------------------------------------------------------------------ two CTAs an SM on a training step's own kernels
@pytest.mark.parametrize("step,quantized", [("B1", True), ("fp8_fprop", True), ("fp8_dgrad", True), ("B1", False),
                                            ("F1", True), ("F1", False)],
                         ids=["B1", "fp8_fprop", "fp8_dgrad", "B1-direct", "F1", "F1-direct"])
def test_two_ctas_an_sm_run_the_fp8_training_kernels_bit_for_bit(step, quantized):
    """The FP8 block's own kernels (fusion_fp8: GroupLinear -> SwiGLU -> Scale -> QuantizeFP8Block -> GroupLinear, FP8
    weights): FC2's dgrad with its generated d(SwiGLU·scale) epilogue (saved pre-activation in, d(gate, up), the
    router scale's row-sum partials and FC2's input dequantized out), FC2's forward and FC1's dgrad, at the tile
    policy's configuration and as one consumer warpgroup a CTA, two CTAs an SM (as CTA pairs, and as single CTAs
    where the policy pairs them: a grouped call's from FP8_TWO_CTAS_SINGLE_ROWS): every output bit for bit the same
    (ragged groups with empty ones, unaligned rows). "B1-direct": the block without the QuantizeFP8Block (FC2's dgrad
    writes d(gate, up) and the row sums only; the policy's two-CTA B1 from K = 4096 is this epilogue on the large
    blocks of fusion_fp8_direct). "F1": the training FC1 (SwiGLU·scale, FC2's input stored as FP8 blocks, the
    pre-activation saved) on its gated n-wave tile as two CTAs an SM, 64 x 256 CTA pairs along m
    (tile_policy.FP8_TWO_CTAS_GATED, off: measured slower in session af)."""
    import sys
    from pathlib import Path

    from fusion import GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU
    from fusion.kernels.api import allocate_outputs
    from fusion.kernels.tile_policy import two_cta_tile
    from fusion.runtime.aot import plan_jobs
    from fusion.runtime.compile import _config, _epilogue

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench_pair_gemm import slot_tensors   # random inputs of every slot an epilogue declares

    G, d, f, M = 8, 1024, 768, 3001
    quantize = [QuantizeFP8Block(columnwise=False)] if quantized else []
    seq = Sequential(GroupLinear(G, d, 2 * f, weight_format="fp8_block"), SwiGLU(), Scale(), *quantize,
                     GroupLinear(G, f, d, weight_format="fp8_block")).to("meta")
    job = next(j for j in plan_jobs(seq, torch.bfloat16) if j.step == step and j.mainloop == "fp8_block")
    cfg, epilogue = _config(job), _epilogue(job)
    two = two_cta_tile(cfg)
    sizes, args, _, _ = _problem(G, M, job.N, job.K, seed=33)
    _, extras = slot_tensors(epilogue, M, job.N, G, torch.bfloat16, torch.Generator(DEV).manual_seed(34), DEV)
    # the two-CTA tile as CTA pairs along n and as single CTAs (tile_policy.fp8_for_rows: a grouped call's from
    # FP8_TWO_CTAS_SINGLE_ROWS rows per group)
    configs = [cfg, two] + ([replace(two, cluster_n=1)] if two.cluster_n == 2 else [])
    outs, names = [], []
    for c in configs:
        comp = K.compile_fp8_grouped_gemm(c, epilogue, job.N, job.K, job.G)
        out = allocate_outputs(epilogue, M, job.N, "bfloat16", DEV)
        for t in out.values():
            (t.zero_() if t.dim() == 0 else t.view(torch.uint8).fill_(0x7F))
        K.run_fp8_grouped_gemm(comp, *args, out, extras=extras)
        outs.append(out)
        names.append(comp.name)
    torch.cuda.synchronize()
    assert all("_2cta" in n for n in names[1:])
    for name, want in outs[0].items():
        for got, kernel in zip(outs[1:], names[1:]):
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
                f"{step}: {name} differs between the policy's tile and {kernel}"


# ------------------------------------------------------------------ ordered waves (GemmConfig.ordered_waves)
# (G, M, N, K, config overrides): 128-row tiles with short last m-tiles (their second warpgroup idle, still taking its
# turns), 256-row tiles as CTA pairs (two m-waves), the dynamic scheduler, many groups
ORDERED_CASES = [(8, 3001, 1024, 512, dict(tile_m=128, cluster_n=1)), (130, 5000, 512, 384, dict(dynamic=True)),
                 (32, 8192, 4096, 7168, {}), (8, 3001, 1024, 512, dict(cluster_n=2, dynamic=False)),
                 (4, 1000, 1000, 640, dict(tile_m=128, cluster_n=1, dynamic=True))]


@pytest.mark.parametrize("num_ctas", [None, 7])
@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: "G{}-M{}-N{}-K{}-{}".format(*c))
def test_ordered_waves_are_bitwise_the_unordered_kernel(case, num_ctas):
    """The two consumer warpgroups issuing their waves in turn (named-barrier turns, kernels/fp8_mainloop.py
    ``take_turn``) change when each wgmma runs, not what it folds: bitwise the unordered kernel's output, within the FP8
    tolerance of the float64 product; launched on 7 CTAs, each walks many tiles (the turns carry across tiles)."""
    G, M, N, Kd, over = case
    _check_pair_bitwise((G, M, N, Kd), _config(N, Kd, G, **over), dict(ordered_waves=True), "_ord", num_ctas,
                        seed=13)


@pytest.mark.parametrize("N", [2 * 1536, 2 * 2048])
def test_ordered_waves_gated_swiglu_scale(N):
    """FC1 + SwiGLU * router prob with ordered waves: the policy's gated tile (two n-waves) against float64."""
    _check_gated(N, lambda N, Kd, G: replace(K.choose_fp8_config(N, Kd, G, gated=True), ordered_waves=True), seed=14)
