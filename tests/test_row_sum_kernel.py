"""The row-sum kernel (fusion/kernels/row_sum.py, run by fusion/runtime/row_sums.py): a row scale's gradient from
the fused dgrad's float32 partials in one launch.

CPU: it compiles for sm_90a without spills, one load per partial and one store per row; the runtime keeps torch's
sum where the kernel does not run (CPU tensors, float64 partials, backend "emulate"). GPU: bit for bit the partials
added left to right in float32 and rounded once, for every output dtype and row count that matters (none, one, a
CTA's edge, many); in a fused block's training step the kernel, not torch's sum, makes the scale's gradient.
"""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from conftest import sass_or_skip  # noqa: E402


def _sass(parts: int, out_dtype: str) -> str:
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_text
    from fusion.kernels.dtypes import cutlass_dtype
    from fusion.kernels.row_sum import RowSumKernel

    partials = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=4)
    out_type = cutlass_dtype(out_dtype)
    out = make_ptr(out_type, 0, cute.AddressSpace.gmem, assumed_align=out_type.width // 8)
    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(RowSumKernel(parts, out_dtype), partials, out, Int32(1), make_fake_stream(),
                          options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("parts,out_dtype", [(12, "bfloat16"), (1, "float32"), (45, "float16")])
def test_compiles_one_load_per_partial_without_spills(parts, out_dtype):
    from fusion.kernels.api import sass_opcodes

    ops = sass_opcodes(_sass(parts, out_dtype))
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert sum(o.startswith("LDG") for o in ops) == parts, "each partial read once"
    assert sum(o.startswith("STG") for o in ops) == 1, "one store per row"
    assert sum(o.startswith("FADD") for o in ops) == parts - 1, "the partials added one by one"


def test_kernel_refuses_no_parts_and_other_dtypes():
    from fusion.kernels.row_sum import RowSumKernel

    with pytest.raises(ValueError, match="at least 1"):
        RowSumKernel(0, "bfloat16")
    with pytest.raises(ValueError, match="output dtype"):
        RowSumKernel(4, "int32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_keeps_the_sum_where_the_kernel_does_not_run(dtype):
    from fusion.runtime.row_sums import device_takes, row_sums

    partials = torch.randn(37, 5)
    assert not device_takes(partials, dtype)
    torch.testing.assert_close(row_sums(partials, dtype), partials.sum(-1).to(dtype), rtol=0, atol=0)
    wide = partials.double()
    torch.testing.assert_close(row_sums(wide, torch.float64), wide.sum(-1), rtol=0, atol=0)


def _left_to_right(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    total = partials[:, 0].clone()
    for p in range(1, partials.shape[1]):
        total = total + partials[:, p]
    return total.to(dtype)


# -- GPU ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,parts", [(0, 4), (1, 1), (127, 12), (128, 16), (129, 3), (70001, 45)])
def test_kernel_adds_left_to_right_bitwise(dtype, rows, parts):
    from fusion.runtime.row_sums import device_takes, row_sums

    g = torch.Generator().manual_seed(rows * 64 + parts)
    # magnitudes far apart, so that another order of the additions rounds differently
    partials = (torch.randn(rows, parts, generator=g) * torch.logspace(-6, 6, parts)).cuda()
    assert device_takes(partials, dtype)
    got = row_sums(partials, dtype)
    want = _left_to_right(partials, dtype)
    assert got.dtype == dtype and got.shape == (rows,) and torch.equal(got, want)
    if rows > 1000:   # another order (torch's sum) gives other bits here: the comparison can tell orders apart
        assert not torch.equal(_left_to_right(partials, torch.float32), partials.sum(-1))


@pytest.mark.gpu
def test_fused_step_makes_the_scale_gradient_with_the_kernel():
    """A fused MoE-style block's training step (backend auto): the router probabilities' gradient comes from the
    kernel (counted), and agrees with backend="reference" to the GEMMs' bf16 rounding."""
    import fusion
    from fusion.kernels import row_sum

    E, rows, d, f = 8, 1000, 256, 256
    seq = fusion.Sequential(fusion.GroupLinear(E, d, 2 * f), fusion.SwiGLU(), fusion.Scale(),
                            fusion.GroupLinear(E, f, d)).cuda().to(torch.bfloat16)
    ref = fusion.Sequential(fusion.GroupLinear(E, d, 2 * f), fusion.SwiGLU(), fusion.Scale(),
                            fusion.GroupLinear(E, f, d), backend="reference").cuda().to(torch.bfloat16)
    ref.load_state_dict(seq.state_dict())
    sizes = torch.tensor([300, 0, 1, 199, 128, 129, 200, 43], device="cuda")
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(rows, device="cuda", dtype=torch.bfloat16)
    launches = []
    real = row_sum.compile_row_sum

    def counting(parts, out_dtype):
        kernel = real(parts, out_dtype)

        class Counted:
            def launch(self, *args):
                launches.append(parts)
                kernel.launch(*args)
        return Counted()

    grads = []
    row_sum.compile_row_sum = counting
    try:
        for block in (ref, seq):
            p = probs.clone().requires_grad_()
            y = block(x, group_sizes=sizes, scale=p)
            y.float().square().sum().backward()
            grads.append(p.grad.float())
    finally:
        row_sum.compile_row_sum = real
    assert len(launches) == 1, launches   # FC2's fused dgrad's scale gradient, in one launch
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert rel < 2e-2, rel
