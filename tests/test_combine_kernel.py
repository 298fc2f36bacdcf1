"""The MoE combine kernel (fusion/kernels/combine.py, run by fusion/runtime/combine.py).

CPU: it compiles for sm_90a with 16-byte loads and stores and no spills. GPU: bit for bit the reference
combine (the same additions in the same order), for every routing shape that matters (k=1, k=8, token
rounding's padding rows, tokens with no rows, E up to 256), as the Combine forward and the Gather backward of
a fused MoE block, and deterministic across runs.
"""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fusion.moe import route  # noqa: E402
from fusion.ops.routing import combine_rows, token_layout  # noqa: E402
from fusion.run_context import RunContext  # noqa: E402
from conftest import sass_or_skip  # noqa: E402


def _sass(dtype: str, d: int) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_text
    from fusion.kernels.combine import CombineKernel
    from fusion.kernels.dtypes import cutlass_dtype

    rows = make_ptr(cutlass_dtype(dtype), 0, cute.AddressSpace.gmem, assumed_align=16)
    index = make_ptr(Int64, 0, cute.AddressSpace.gmem, assumed_align=8)
    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(CombineKernel(dtype, d), rows, index, index, rows, Int32(1), Int32(1), make_fake_stream(),
                          options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    del cutlass
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("dtype,d", [("bfloat16", 2048), ("float16", 7168), ("float32", 2880), ("bfloat16", 8)])
def test_combine_compiles_to_wide_loads_without_spills(dtype, d):
    sass = _sass(dtype, d)
    from fusion.kernels.api import sass_opcodes

    ops = sass_opcodes(sass)
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert any(o.startswith("LDG") and ".128" in o for o in ops), "rows are read in 16-byte chunks"
    assert any(o.startswith("STG") and ".128" in o for o in ops), "tokens are written in 16-byte chunks"
    assert not any(o.startswith("ATOM") or o.startswith("RED") for o in ops), "no atomics"


def test_kernel_refuses_widths_of_partial_chunks():
    from fusion.kernels.combine import CombineKernel

    with pytest.raises(ValueError, match="multiple of 8"):
        CombineKernel("bfloat16", 2044)


def test_cpu_tensors_take_the_reference():
    from fusion.runtime import combine

    y, index = torch.randn(6, 16), torch.tensor([0, 2, 1, 0, -1, 2])
    ctx = RunContext(index=index, tokens=3)
    assert not combine.takes(None, y)
    torch.testing.assert_close(combine.run(None, y, ctx), combine_rows(y, index, 3), rtol=0, atol=0)


# -- GPU ---------------------------------------------------------------------------------------------------------------
def _routing(T, E, k, round_to=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).cuda()
    return route(logits, k, round_to=round_to)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,E,k,round_to,d", [(1000, 8, 2, None, 1024), (513, 64, 8, None, 2048),
                                              (300, 256, 8, 16, 7168), (257, 16, 1, 8, 2880), (64, 4, 1, None, 8)])
def test_kernel_matches_reference_bitwise(dtype, T, E, k, round_to, d):
    from fusion.runtime import combine

    r = _routing(T, E, k, round_to)
    M = r.index.numel()
    y = torch.randn(M, d, device="cuda").to(dtype)
    ctx = RunContext(index=r.index, tokens=T)
    got = combine.run(None, y, ctx)
    want = combine_rows(y, r.index, T, token_layout(r.index, T))
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(combine.run(None, y, RunContext(index=r.index, tokens=T)), got)  # deterministic


@pytest.mark.gpu
def test_tokens_without_rows_are_zero():
    from fusion.runtime import combine

    index = torch.tensor([0, 0, 3, -1], device="cuda")
    y = torch.ones(4, 16, device="cuda", dtype=torch.bfloat16)
    out = combine.run(None, y, RunContext(index=index, tokens=5))
    assert out[:, 0].tolist() == [2, 0, 0, 1, 0]


@pytest.mark.gpu
def test_fused_moe_block_runs_the_kernel_and_matches_the_reference():
    """Combine's forward and Gather's backward through the kernel in a whole MoE block (backend auto) agree with
    backend="reference" to bf16 rounding of the GEMMs; the kernel really ran (the reference is patched out)."""
    import fusion
    from fusion.ops import routing

    T, E, d, f, k = 512, 16, 256, 128, 4
    moe = fusion.MoE.swiglu(d, E, f, k, device="cuda", dtype=torch.bfloat16)
    ref = fusion.MoE.swiglu(d, E, f, k, device="cuda", dtype=torch.bfloat16, backend="reference")
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer in (ref, moe):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.float().square().sum().backward()
        results.append((y, xi.grad, layer.router.weight.grad))
    for a, b in zip(*results):
        rel = (a.float() - b.float()).norm() / a.float().norm()
        assert rel < 2e-2, rel
    calls = []
    real = routing._combine
    try:
        routing._combine = lambda *a: calls.append(1) or real(*a)
        xi = x.clone().requires_grad_()
        moe(xi).sum().backward()
    finally:
        routing._combine = real
    assert calls == [], "the fused block ran the reference combine"
