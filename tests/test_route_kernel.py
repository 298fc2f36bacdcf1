"""The routing kernels (fusion/kernels/route.py, run by fusion/runtime/route.py for fusion.moe.route).

CPU: the three kernels compile for sm_90a without spills; CPU tensors, float64, token rounding and
torch.compile take the torch ops. GPU: against route()'s torch ops (the reference) on the same logits: the same
experts, rows, group sizes and token order, probabilities to the last bits, logits gradients to float32 rounding;
bitwise equal across runs; and the whole MoE layer with the kernels really running.
"""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import fusion  # noqa: E402
from fusion.moe import route  # noqa: E402
from fusion.moe import routing  # noqa: E402
from conftest import sass_or_skip  # noqa: E402


def _sass(kernel, *args) -> str:
    import cutlass.cute as cute

    from fusion.kernels.api import sass_text

    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(kernel, *args, options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("E,k,score,bias", [(128, 8, "softmax", False), (256, 8, "sigmoid", True), (1024, 32, "softmax", False)])
def test_kernels_compile_without_spills(E, k, score, bias):
    from cutlass import Float32, Int16, Int32, Int64
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_opcodes
    from fusion.kernels.dtypes import cutlass_dtype
    from fusion.kernels.route import RouteGradKernel, RouteSortKernel, RouteTopKKernel, _ptr

    bf16, s = _ptr(cutlass_dtype("bfloat16"), 2), make_fake_stream()
    f32, i16, i32, i64 = _ptr(Float32, 4), _ptr(Int16, 2), _ptr(Int32, 4), _ptr(Int64, 8)
    listings = {
        "topk": _sass(RouteTopKKernel("bfloat16", E, k, score, True, bias), bf16, f32, i16, f32, i64, Int32(1), s),
        "sort": _sass(RouteSortKernel("bfloat16", E, k), i16, f32, i64, i64, bf16, i32, i32, i64, Int32(1), s),
        "grad": _sass(RouteGradKernel("bfloat16", E, k, score, True, bias), bf16, f32, i16, i32, bf16, bf16,
                      Int32(1), Int32(1), s),
    }
    for name, text in listings.items():
        ops = sass_opcodes(text)
        assert not any(o.startswith(("LDL", "STL")) for o in ops), f"{name}: local-memory spills"
        assert any(o.startswith("SHFL") for o in ops) or name == "sort", f"{name}: warp shuffles expected"


def test_kernel_refuses_what_it_cannot_hold():
    from fusion.kernels.route import RouteTopKKernel

    with pytest.raises(ValueError, match="E <= 1024"):
        RouteTopKKernel("bfloat16", 2048, 8, "softmax", True, False)
    with pytest.raises(ValueError, match="k <= min"):
        RouteTopKKernel("bfloat16", 64, 33, "softmax", True, False)
    with pytest.raises(ValueError, match="score"):
        RouteTopKKernel("bfloat16", 64, 8, "relu", True, False)


def test_cpu_tensors_take_the_torch_ops():
    from fusion.runtime import route as route_kernels

    logits = torch.randn(8, 16)
    assert not route_kernels.takes(logits, 2, None)


def test_a_known_token_layout_is_used_only_for_its_index_version_and_tokens():
    from fusion.ops.routing import call_layout, remember_token_layout, token_layout
    from fusion.run_context import RunContext

    index = torch.tensor([2, 0, 1, 0, 2, 1])
    marker = (torch.arange(6), torch.tensor([0, 2, 4, 6, 6]))   # not index's real layout: shows which one is used
    remember_token_layout(index, 3, marker)
    assert call_layout(RunContext(index=index, tokens=3)) is marker
    assert call_layout(RunContext(index=index, tokens=4)) is not marker     # another token count: made anew
    index.add_(0)                                                            # a new version: made anew
    got = call_layout(RunContext(index=index, tokens=3))
    assert got is not marker and all(torch.equal(a, b) for a, b in zip(got, token_layout(index, 3)))


# -- GPU ---------------------------------------------------------------------------------------------------------------
def routing_layouts():
    from fusion.ops import routing as ops_routing

    return ops_routing._KNOWN_LAYOUTS


def _torch_route(logits, k, score, bias, normalize):
    """route()'s torch ops (the reference the kernels replace), with autograd."""
    return routing._TopKRoute.apply(logits, k, score, bias, normalize)


CASES = [  # T, E, k, score, normalize, bias
    (1, 8, 2, "softmax", True, False), (5, 8, 1, "softmax", True, False), (1024, 128, 8, "softmax", True, False),
    (4099, 64, 8, "softmax", False, False), (777, 256, 8, "sigmoid", True, True), (300, 100, 6, "sigmoid", False, True),
    (2048, 32, 4, "softmax", True, True), (513, 1024, 32, "softmax", True, False), (16384, 128, 8, "softmax", True, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,k,score,normalize,bias", CASES)
def test_kernels_match_the_torch_ops(dtype, T, E, k, score, normalize, bias):
    from fusion.runtime import route as route_kernels

    g = torch.Generator().manual_seed(T * 7 + E)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype).cuda()
    b = (torch.randn(E, generator=g) * 0.1).cuda() if bias else None
    assert route_kernels.takes(logits, k, b)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = route_kernels.route_top_k(x1, k, score, b, normalize)
    want = _torch_route(x2, k, score, b, normalize)
    names = ("index", "group_sizes", "probs", "expert")
    for name, a, w in zip(names, got, want):
        assert a.dtype == w.dtype and a.shape == w.shape, name
    for name in ("index", "group_sizes", "expert"):
        i = names.index(name)
        assert torch.equal(got[i], want[i]), f"{name} differs"
    torch.testing.assert_close(got[2], want[2], rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
    # the token layout the sort wrote is the one the Combine would make by sorting the index
    from fusion.ops.routing import call_layout, token_layout
    from fusion.run_context import RunContext

    known = call_layout(RunContext(index=got[0], tokens=T))
    assert known[0] is routing_layouts()[got[0]][2][0], "the route's layout was not picked up"
    for a, w in zip(known, token_layout(got[0], T)):
        assert torch.equal(a, w)
    dprobs = torch.randn(got[2].shape, generator=g).to(dtype).cuda()
    (d1,) = torch.autograd.grad(got[2], x1, dprobs)
    (d2,) = torch.autograd.grad(want[2], x2, dprobs)
    scale = d2.float().abs().max().clamp_min(1e-30)
    assert ((d1.float() - d2.float()).abs().max() / scale) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
def test_kernels_are_deterministic_and_break_ties_to_the_lower_expert():
    from fusion.runtime import route as route_kernels

    logits = torch.zeros(300, 64, device="cuda", dtype=torch.bfloat16)   # every score tied
    logits[::3, 40] = 1.0
    runs = [route_kernels.route_top_k(logits, 4, "softmax", None, True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    index, sizes, _, expert = runs[0]
    want = _torch_route(logits, 4, "softmax", None, True)
    assert torch.equal(expert, want[3]) and torch.equal(index, want[0]) and torch.equal(sizes, want[1])
    assert sizes[:4].tolist() == [300, 300, 300, 200] and sizes[40].item() == 100


@pytest.mark.gpu
def test_moe_layer_runs_the_kernels(monkeypatch):
    from fusion.runtime import route as route_kernels

    calls = []
    real = route_kernels.forward   # (route() and the merged MoE node both route through it)
    monkeypatch.setattr(route_kernels, "forward", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(256, 16, 128, 4, device="cuda", dtype=torch.bfloat16)
    ref = fusion.MoE.swiglu(256, 16, 128, 4, device="cuda", dtype=torch.bfloat16, backend="reference")
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(500, 256, device="cuda", dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(500, 256, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(route_kernels, "ENABLED", False)   # the reference layer routes by the torch ops
    y2 = ref(x2)
    y2.backward(dy)
    assert not calls
    monkeypatch.setattr(route_kernels, "ENABLED", True)
    y1 = moe(x1)
    assert calls, "the routing kernels did not run"
    torch.testing.assert_close(y1, y2, rtol=2e-2, atol=2e-2)
    y1.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=3e-2, atol=3e-2)
    for a, b in ((moe.router.weight.grad, ref.router.weight.grad), (moe.experts[1].weight.grad, ref.experts[1].weight.grad)):
        assert ((a.float() - b.float()).norm() / b.float().norm()) < 1e-2   # bf16 layers: relative Frobenius


@pytest.mark.gpu
def test_rounding_and_float64_take_the_torch_ops():
    from fusion.runtime import route as route_kernels

    assert not route_kernels.takes(torch.randn(8, 16, device="cuda", dtype=torch.float64), 2, None)
    r = route(torch.randn(64, 16, device="cuda"), 2, round_to=8)   # token rounding: the torch ops
    assert int(r.group_sizes.sum()) % 8 == 0


@pytest.mark.gpu
def test_route_result_reads_the_layout_the_kernels_wrote():
    from fusion.ops.routing import token_layout

    r = route(torch.randn(300, 64, device="cuda", dtype=torch.bfloat16), 6)
    known = routing_layouts()[r.index][2]
    assert r.rows_by_token is known[0] and r.token_offsets is known[1]
    for a, w in zip((r.rows_by_token, r.token_offsets), token_layout(r.index, 300)):
        assert torch.equal(a, w)
