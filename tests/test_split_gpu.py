"""GPU correctness of split launches (GemmConfig.split, tile_policy.split_tails): a 128-row "head" kernel runs every
m-tile of a group but a last one of at most 64 rows, and its 64-row "tail" kernel runs exactly those.

Splitting changes which kernel computes a row, never its math (a 128-row pingpong tile is two 64-row wgmma atoms
over the same k order): every split kernel must give the bits of the same configuration unsplit, and be within
tolerance of float64 torch. The group sizes put every remainder mod 128 that matters side by side: empty groups,
1, 63, 64 (tail only), 65, 127 (head only), 128, 129, 192, 193, 256, 257, 320, 321... Outputs are poisoned with NaN:
a row neither kernel wrote shows, and the tail kernel launched alone must write exactly the short last tiles' rows.
"""
import pytest
import torch
from conftest import hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402
from fusion.errors import KernelConfigError  # noqa: E402
from test_kernels_gpu import (_check, _DSwiGLUScaleDgradRowSum, _dswiglu_ref, _gemm_kn, _gemm_nk, _nan,  # noqa: E402
                              _SwiGLUTrain, _swiglu)

DEV = "cuda"
SIZES = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 300, 320, 321, 0, 449, 2, 700,
                      1000, 33, 130])
CONFIGS = {   # the head's configuration; the tail's is tile_policy.tail_config of it
    "pp128-dynamic": dict(tile_n=128, stages=6, pingpong=True, dynamic=True),
    "pp128-static-pair": dict(tile_n=128, stages=6, pingpong=True, cluster_n=2),
    "pp192-dynamic": dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
    "coop256-dynamic": dict(tile_n=256, stages=4, dynamic=True),
}


def _tail_rows(sizes):
    """A bool per routed row: whether it lies in its group's last m-tile of at most 64 rows (the tail kernel's)."""
    rows = []
    for n in sizes.tolist():
        r = n % 128
        rows += [False] * (n - r) + [0 < r <= 64] * r
    return torch.tensor(rows, dtype=torch.bool, device=DEV)


def _operands(N, Kd, gen, b_major="K", gather_T=None):
    M = int(SIZES.sum())
    A = torch.randn(gather_T or M, Kd, generator=gen).to(DEV, torch.bfloat16)
    shape = (len(SIZES), N, Kd) if b_major == "K" else (len(SIZES), Kd, N)
    B = (torch.randn(*shape, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    index = None if gather_T is None else torch.randint(0, gather_T, (M,), generator=gen).to(DEV, torch.int32)
    return A, B, K.offsets_from_group_sizes(SIZES.to(DEV)), index


def _split_and_whole(cfg, epilogue, N, Kd):
    head = K.compile_grouped_gemm(K.GemmConfig(**cfg, split="head"), epilogue, "bfloat16", N, Kd, len(SIZES))
    whole = K.compile_grouped_gemm(K.GemmConfig(**cfg), epilogue, "bfloat16", N, Kd, len(SIZES))
    assert head.name.endswith("_head") and head.tail is not None and head.tail.name.endswith("_tail")
    assert head.tail.config.tile_m == 64 and not head.tail.config.dynamic
    return head, whole


def _identity_outputs(comp, A, B, offs, N, index=None, num_ctas=None):
    out = _nan(int(SIZES.sum()), N, dtype=torch.bfloat16)
    K.run_grouped_gemm(comp, A, B, offs, {"out": out}, index=index, num_ctas=num_ctas)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_identity_is_bitwise_the_whole_kernel(name):
    N, Kd = 512, 768
    A, B, offs, _ = _operands(N, Kd, torch.Generator().manual_seed(11))
    head, whole = _split_and_whole(CONFIGS[name], K.IdentityEpilogue(), N, Kd)
    got, want = _identity_outputs(head, A, B, offs, N), _identity_outputs(whole, A, B, offs, N)
    _check(want, _gemm_nk(A, B, SIZES))
    assert torch.equal(got, want)


def test_the_tail_kernel_writes_exactly_the_short_last_tiles():
    """The tail kernel alone: the rows of each group's last m-tile of at most 64 rows, nothing else."""
    N, Kd = 256, 512
    A, B, offs, _ = _operands(N, Kd, torch.Generator().manual_seed(12))
    head, _ = _split_and_whole(CONFIGS["pp128-dynamic"], K.IdentityEpilogue(), N, Kd)
    out = _identity_outputs(head.tail, A, B, offs, N)
    tail = _tail_rows(SIZES)
    assert tail.any() and (~tail).any()
    assert torch.isfinite(out[tail]).all()
    assert torch.isnan(out[~tail]).all()
    _check(out[tail], _gemm_nk(A, B, SIZES)[tail])


def test_a_head_kernel_without_its_tail_is_refused():
    N, Kd = 256, 512
    A, B, offs, _ = _operands(N, Kd, torch.Generator().manual_seed(13))
    head, _ = _split_and_whole(CONFIGS["pp128-dynamic"], K.IdentityEpilogue(), N, Kd)
    bare = head   # the compile cache's one object: take its tail away for the test, then give it back
    saved, bare.tail = bare.tail, None
    try:
        with pytest.raises(KernelConfigError, match="no tail kernel"):
            K.run_grouped_gemm(bare, A, B, offs, {"out": _nan(int(SIZES.sum()), N, dtype=torch.bfloat16)})
    finally:
        bare.tail = saved


def test_split_dgrad_mn_major_with_row_sums():
    """FC2's fused dgrad: B MN-major, a saved (M, 2f) input and the router scale's row sums (partials per 32
    columns), written by whichever kernel owns the row."""
    G, N, Kd = len(SIZES), 256, 384    # dH (M, N = f) from dY (M, Kd = d) and W2 (G, d, f) as stored
    gen = torch.Generator().manual_seed(14)
    M = int(SIZES.sum())
    dY = torch.randn(M, Kd, generator=gen).to(DEV, torch.bfloat16)
    W2 = (torch.randn(G, Kd, N, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    pre = torch.randn(M, 2 * N, generator=gen).to(DEV, torch.bfloat16)
    scale = torch.rand(M, generator=gen).to(DEV)
    offs = K.offsets_from_group_sizes(SIZES.to(DEV))
    epi = _DSwiGLUScaleDgradRowSum()
    outs = []
    for comp in _split_and_whole(dict(CONFIGS["pp128-dynamic"], b_major="MN"), epi, N, Kd):
        dpre = _nan(M, 2 * N, dtype=torch.bfloat16)
        dscale = torch.full((M, N // 32), float("nan"), device=DEV)
        K.run_grouped_gemm(comp, dY, W2, offs, {"dpre": dpre, "dscale": dscale}, {"pre": pre, "scale": scale})
        outs.append((dpre, dscale))
    torch.cuda.synchronize()
    ref_dpre, ref_dscale = _dswiglu_ref(_gemm_kn(dY, W2, SIZES), pre, scale)
    _check(outs[1][0], ref_dpre)
    _check(outs[1][1].sum(1), ref_dscale.sum(1))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("cfg", [CONFIGS["pp128-static-pair"], CONFIGS["pp192-dynamic"]], ids=["pair", "192"])
def test_split_gated_training_forward(cfg):
    """FC1's training forward: SwiGLU*scale of the gate and up halves, and the pre-activation."""
    G, N, Kd = len(SIZES), 768, 512
    gen = torch.Generator().manual_seed(15)
    M = int(SIZES.sum())
    A = torch.randn(M, Kd, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    scale = torch.rand(M, generator=gen).to(DEV)
    offs = K.offsets_from_group_sizes(SIZES.to(DEV))
    outs = []
    for comp in _split_and_whole(cfg, _SwiGLUTrain(), N, Kd):
        out, pre = _nan(M, N // 2, dtype=torch.bfloat16), _nan(M, N, dtype=torch.bfloat16)
        K.run_grouped_gemm(comp, A, W, offs, {"out": out, "pre": pre}, {"scale": scale})
        outs.append((out, pre))
    torch.cuda.synchronize()
    h = _gemm_nk(A, W, SIZES)
    _check(outs[1][1], h)
    _check(outs[1][0], _swiglu(h, scale))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("cfg", [dict(tile_n=192, stages=5, pingpong=True, dynamic=True),
                                 dict(tile_n=256, stages=4, dynamic=True)], ids=["pp192", "coop256"])
def test_split_gathering_kernel(cfg):
    """A read through the routing index (cp.async rows): the tail kernel gathers its 64 rows the same way."""
    N, Kd, T = 768, 512, 1500
    x, W, offs, index = _operands(N, Kd, torch.Generator().manual_seed(16), gather_T=T)
    head, whole = _split_and_whole(dict(cfg, gather_a=True), K.IdentityEpilogue(), N, Kd)
    got = _identity_outputs(head, x, W, offs, N, index=index)
    want = _identity_outputs(whole, x, W, offs, N, index=index)
    _check(want, _gemm_nk(x[index.long()], W, SIZES))
    assert torch.equal(got, want)


def test_split_with_few_ctas():
    """num_ctas=7 for the head (many tiles per CTA); the tail takes its own grid."""
    N, Kd = 512, 768
    A, B, offs, _ = _operands(N, Kd, torch.Generator().manual_seed(17))
    head, whole = _split_and_whole(CONFIGS["pp128-dynamic"], K.IdentityEpilogue(), N, Kd)
    got = _identity_outputs(head, A, B, offs, N, num_ctas=7)
    assert torch.equal(got, _identity_outputs(whole, A, B, offs, N))
