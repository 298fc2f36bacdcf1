"""The MoE gather kernel (fusion/kernels/gather_rows.py, run by fusion/runtime/gather.py).

CPU: it compiles for sm_90a with 16-byte loads and stores and no spills. GPU: bit for bit the reference gather
(padding rows zero) for int32 and int64 indexes and every routing shape that matters, and in a whole fused MoE
block as the Combine's backward and FC1's recomputed input, where the reference gather must not run.
"""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fusion.moe import route  # noqa: E402
from fusion.ops.routing import gather_rows  # noqa: E402
from fusion.run_context import RunContext  # noqa: E402
from conftest import sass_or_skip  # noqa: E402


def _sass(dtype: str, d: int, index_dtype: str) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_text
    from fusion.kernels.dtypes import cutlass_dtype
    from fusion.kernels.gather_rows import _INDEX_DTYPES, GatherRowsKernel

    rows = make_ptr(cutlass_dtype(dtype), 0, cute.AddressSpace.gmem, assumed_align=16)
    index = make_ptr(_INDEX_DTYPES[index_dtype], 0, cute.AddressSpace.gmem, assumed_align=4)
    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(GatherRowsKernel(dtype, d, index_dtype), rows, index, rows, Int32(1), Int32(1),
                          make_fake_stream(), options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    del cutlass
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("dtype,d,index_dtype", [("bfloat16", 2048, "int64"), ("float16", 7168, "int32"),
                                                 ("float32", 2880, "int64"), ("bfloat16", 8, "int32")])
def test_gather_compiles_to_wide_loads_without_spills(dtype, d, index_dtype):
    from fusion.kernels.api import sass_opcodes
    from fusion.kernels.gather_rows import ROWS

    ops = sass_opcodes(_sass(dtype, d, index_dtype))
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert sum(o.startswith("LDG") and ".128" in o for o in ops) == ROWS, "each row's chunk read in 16 bytes"
    assert sum(o.startswith("STG") and ".128" in o for o in ops) == ROWS, "each row's chunk written in 16 bytes"


def test_kernel_refuses_partial_chunks_and_other_indexes():
    from fusion.kernels.gather_rows import GatherRowsKernel

    with pytest.raises(ValueError, match="multiple of 8"):
        GatherRowsKernel("bfloat16", 2044)
    with pytest.raises(ValueError, match="index dtype"):
        GatherRowsKernel("bfloat16", 2048, "int16")


def test_cpu_tensors_take_the_reference():
    from fusion.runtime import gather

    x, index = torch.randn(3, 16), torch.tensor([0, 2, -1, 1, 0])
    assert not gather.takes(None, x)
    torch.testing.assert_close(gather.run(None, x, RunContext(index=index, tokens=3)), gather_rows(x, index),
                               rtol=0, atol=0)


# -- GPU ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("T,E,k,round_to,d", [(1000, 8, 2, None, 1024), (513, 64, 8, None, 2048),
                                              (300, 256, 8, 16, 7168), (257, 16, 1, 8, 2880), (3, 4, 1, None, 8)])
def test_kernel_matches_reference_bitwise(dtype, index_dtype, T, E, k, round_to, d):
    from fusion.runtime import gather

    g = torch.Generator().manual_seed(T)
    r = route(torch.randn(T, E, generator=g).cuda(), k, round_to=round_to)
    index = r.index.to(index_dtype)
    x = torch.randn(T, d, device="cuda").to(dtype)
    got = gather.run(None, x, RunContext(index=index, tokens=T))
    want = gather_rows(x, r.index)
    assert got.shape == want.shape and torch.equal(got, want)
    if round_to:
        assert (r.index < 0).any() and got[r.index < 0].eq(0).all()  # padding rows were there, and are zeros


@pytest.mark.gpu
def test_fused_moe_block_runs_the_kernel_and_matches_the_reference():
    """The Combine's backward and FC1's recomputed input through the kernel in a whole MoE block (backend auto),
    with token rounding's padding rows: x's, the weights' and the router's gradients agree with
    backend="reference" to bf16 rounding of the GEMMs; the reference gather never ran."""
    import fusion
    from fusion.ops import routing

    T, E, d, f, k = 512, 16, 256, 128, 4
    moe = fusion.MoE.swiglu(d, E, f, k, device="cuda", dtype=torch.bfloat16, round_to=16)
    ref = fusion.MoE.swiglu(d, E, f, k, device="cuda", dtype=torch.bfloat16, backend="reference", round_to=16)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    results, calls = [], []
    real = routing._gather
    for layer in (ref, moe):
        xi = x.clone().requires_grad_()
        routing._gather = (lambda *a: calls.append(1) or real(*a)) if layer is moe else real
        try:
            y = layer(xi)
            y.float().square().sum().backward()
        finally:
            routing._gather = real
        results.append((y, xi.grad, layer.router.weight.grad, *(p.grad for p in layer.experts.parameters())))
    for a, b in zip(*results):
        rel = (a.float() - b.float()).norm() / a.float().norm()
        assert rel < 2e-2, rel
    assert calls == [], "the fused block ran the reference gather"
