"""The group-bounds prologue (fusion/kernels/bounds.py, fusion/runtime/bounds.py): one launch validates the
group sizes, writes the int32 row bounds and zeroes the tile counters.

CPU: it compiles for sm_90a with the checks in it (a trap, a warp scan, no spills), and a device-checked
context leaves the values to it. GPU: exact bounds for many group counts and both size dtypes, and bad sizes
stop the process with the kernel's message (a trap loses the CUDA context, so those run in a subprocess)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fusion import GroupLinear, Scale, Sequential, SwiGLU  # noqa: E402
from fusion.errors import GroupSizesError  # noqa: E402
from conftest import sass_or_skip  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _sass(G: int, dtype) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_text
    from fusion.kernels.bounds import GroupBoundsKernel
    from fusion.kernels.dtypes import cutlass_dtype

    kern = GroupBoundsKernel(G, dtype)
    sizes = make_ptr(cutlass_dtype(dtype or "int32"), 0, cute.AddressSpace.gmem, assumed_align=4)
    out = make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(kern, sizes, out, Int32(1), Int32(0), make_fake_stream(),
                          options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("G,dtype", [(1, None), (8, "int32"), (128, "int64"), (300, "int32")])
def test_prologue_compiles_with_checks_and_without_spills(G, dtype):
    sass = _sass(G, dtype)
    from fusion.kernels.api import sass_opcodes

    ops = sass_opcodes(sass)
    assert not any(o.startswith("LDL") for o in ops), "local-memory spills"  # (printf's arguments are stored)
    if dtype is not None:
        assert "BPT.TRAP" in ops, "bad sizes must stop the kernel"
        assert any(o.startswith("SHFL.UP") for o in ops), "the lane sums are scanned across the warp"


def test_device_checked_context_leaves_values_and_offsets_to_the_prologue():
    block = Sequential(GroupLinear(4, 8, 16), SwiGLU(), Scale(), GroupLinear(4, 8, 8))
    x, probs = torch.randn(10, 8), torch.rand(10)
    bad = torch.tensor([5, 5, 5, 5])  # sums to 20, not 10: only a value check sees it
    ctx = block.inputs.context(x, {"group_sizes": bad, "scale": probs}, check_sum=False, host=False,
                               device_checked=True)
    assert ctx.offsets is None and ctx.group_sizes is bad
    with pytest.raises(GroupSizesError, match="shape"):  # metadata is still checked on the host
        block.inputs.context(x, {"group_sizes": bad[:3], "scale": probs}, device_checked=True)
    with pytest.raises(GroupSizesError, match="sums to 20"):  # and without device checks, the values are
        block.inputs.context(x, {"group_sizes": bad, "scale": probs})


# -- GPU ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("G", [1, 7, 32, 33, 256, 384])
def test_prologue_bounds_and_counters(G, dtype):
    from fusion.kernels.bounds import compile_group_bounds

    gen = torch.Generator().manual_seed(G)
    sizes = torch.randint(0, 50, (G,), generator=gen)
    sizes[torch.randperm(G, generator=gen)[: G // 3]] = 0  # empty groups
    rows = int(sizes.sum())
    counters = 5
    compiled = compile_group_bounds(G, str(dtype).removeprefix("torch."))
    out = torch.full((G + 1 + counters,), -7, dtype=torch.int32, device="cuda")
    dev_sizes = sizes.to("cuda", dtype)
    compiled.launch(dev_sizes.data_ptr(), out.data_ptr(), rows, counters, torch.cuda.current_stream().cuda_stream)
    want = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0), torch.zeros(counters, dtype=torch.int64)])
    assert torch.equal(out.cpu().long(), want)


_BAD_CALL = """
import torch
from fusion import GroupLinear, Scale, Sequential, SwiGLU
E = 8
block = Sequential(GroupLinear(E, 64, 256), SwiGLU(), Scale(), GroupLinear(E, 128, 64)).cuda().bfloat16()
x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
probs = torch.rand(256, device="cuda", dtype=torch.bfloat16)
sizes = torch.tensor({sizes}, device="cuda", dtype=torch.{dtype})
y = block(x, group_sizes=sizes, scale=probs)
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("sizes,dtype", [
    ([32] * 7 + [31], "int32"),                 # sums to 255, not 256
    ([-1, 33] + [32] * 6, "int32"),             # a negative count that keeps the sum
    ([2 ** 62] * 4 + [32] * 3 + [256], "int64"),  # int64 values whose sum wraps
])
def test_bad_group_sizes_stop_the_fused_call_on_the_device(sizes, dtype):
    code = _BAD_CALL.format(sizes=sizes, dtype=dtype)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert "NO ERROR" not in out, out[-2000:]
    assert run.returncode != 0
    assert "fusion: group_sizes must each be in [0, rows]" in out, out[-2000:]


# -- the routed prologue (a block that starts with a Gather) -------------------------------------------------------
def _routed_sass(G: int, sizes_dtype: str, index_dtype: str) -> str:
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream

    from fusion.kernels.api import sass_text
    from fusion.kernels.bounds import RoutedBoundsKernel
    from fusion.kernels.dtypes import cutlass_dtype

    def ptr(d):
        return make_ptr(cutlass_dtype(d), 0, cute.AddressSpace.gmem, assumed_align=4)

    with tempfile.TemporaryDirectory() as dump:
        fn = cute.compile(RoutedBoundsKernel(G, sizes_dtype, index_dtype), ptr(sizes_dtype), ptr(index_dtype),
                          ptr("int32"), ptr("int32"), Int32(1), Int32(1), Int32(0), make_fake_stream(),
                          options=f"--enable-tvm-ffi --keep-cubin --dump-dir={dump}")
        cubin = fn.__cubin__
    return sass_or_skip(lambda: sass_text(cubin))


@pytest.mark.parametrize("G,sizes_dtype,index_dtype", [(128, "int32", "int64"), (300, "int64", "int32")])
def test_routed_prologue_compiles_with_checks_and_without_spills(G, sizes_dtype, index_dtype):
    from fusion.kernels.api import sass_opcodes

    ops = sass_opcodes(_routed_sass(G, sizes_dtype, index_dtype))
    assert not any(o.startswith("LDL") for o in ops), "local-memory spills"
    assert "BPT.TRAP" in ops, "a bad size or index must stop the kernel"
    assert any(o.startswith("SHFL.UP") for o in ops), "the lane sums are scanned across the warp"


def _experts_block(E=4, d=8, f=8):
    from fusion import Combine, Gather

    return Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d), Combine())


def test_device_checked_gather_context_leaves_index_padding_and_offsets_to_the_prologue():
    block = _experts_block()
    x = torch.randn(5, 8)
    index = torch.tensor([0, 1, 7, 2, 3, 4, 1, 2])  # 7 is out of range for 5 tokens: only a value check sees it
    sizes = torch.tensor([2, 2, 2, 1])              # sums to 7 < 8: row 7 must be padding (-1), and is not
    extra = {"index": index, "group_sizes": sizes, "scale": torch.rand(8)}
    ctx = block.inputs.context(x, extra, check_sum=False, host=False, device_checked=True)
    assert ctx.offsets is None and ctx.group_sizes is sizes and ctx.routed_group_sizes is sizes
    with pytest.raises(Exception, match="index"):  # without device checks the torch checks see it
        block.inputs.context(x, extra)
    # an empty call has nothing for the prologue to launch on: the torch checks and offsets
    empty = {"index": index[:0], "group_sizes": torch.zeros(4, dtype=torch.long), "scale": torch.rand(0)}
    ctx = block.inputs.context(x, empty, check_sum=False, host=False, device_checked=True)
    assert ctx.offsets is not None and ctx.offsets.numel() == 4


@pytest.mark.gpu
@pytest.mark.parametrize("sizes_dtype,index_dtype", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
@pytest.mark.parametrize("G,tokens", [(1, 10), (33, 700), (128, 3000), (300, 9000)])
def test_routed_prologue_bounds_index_and_counters(G, tokens, sizes_dtype, index_dtype):
    from fusion.kernels.bounds import compile_routed_bounds

    gen = torch.Generator().manual_seed(G)
    sizes = torch.randint(0, 40, (G,), generator=gen)
    sizes[torch.randperm(G, generator=gen)[: G // 3]] = 0        # empty groups
    total = int(sizes.sum())
    rows = total + 5000 + G                                       # padding rows past the sum, over two chunks
    index = torch.full((rows,), -1, dtype=torch.int64)
    index[:total] = torch.randint(0, tokens, (total,), generator=gen)
    index[torch.randperm(total, generator=gen)[: total // 10]] = -1  # padding rows inside the groups too
    counters = 3
    compiled = compile_routed_bounds(G, str(sizes_dtype).removeprefix("torch."), str(index_dtype).removeprefix("torch."))
    out = torch.full((G + 1 + counters + G,), -7, dtype=torch.int32, device="cuda")
    index32 = torch.full((rows,), -7, dtype=torch.int32, device="cuda")
    dev_index = index.to("cuda", index_dtype)
    compiled.launch(sizes.to("cuda", sizes_dtype).data_ptr(), dev_index.data_ptr(), out.data_ptr(),
                    index32.data_ptr(), rows, tokens, counters, torch.cuda.current_stream().cuda_stream)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    bounds[-1] = rows                                             # the padding joins the last group
    # the bounds, the zeroed counters, then the sizes of those bounds (the padding in the last group)
    assert torch.equal(out.cpu().long(), torch.cat([bounds, torch.zeros(counters, dtype=torch.int64),
                                                    torch.diff(bounds)]))
    assert torch.equal(index32.cpu().long(), index)                  # the int32 copy, padding rows -1 kept


_BAD_ROUTED_CALL = """
import torch
from fusion import Combine, Gather, GroupLinear, Scale, Sequential, SwiGLU
block = Sequential(Gather(), GroupLinear(4, 64, 256), SwiGLU(), Scale(), GroupLinear(4, 128, 64),
                   Combine()).cuda().bfloat16()
x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
index = torch.tensor({index}, device="cuda")
sizes = torch.tensor({sizes}, device="cuda", dtype=torch.int32)
probs = torch.rand(index.numel(), device="cuda", dtype=torch.bfloat16)
y = block(x, index=index, group_sizes=sizes, scale=probs)
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("index,sizes,message", [
    (list(range(16)) + [16], [4, 4, 4, 5], "the index must lie in [-1, tokens = 16)"),       # token 16 of 16
    (list(range(16)) + [3], [4, 4, 4, 4], "be -1 on every routed row past sum(group_sizes)"),  # row 16 not padding
    (list(range(16)), [4, 4, 4, 5], "sum to at most the routed rows = 16"),                 # sizes sum past M
])
def test_bad_routing_stops_the_fused_call_on_the_device(index, sizes, message):
    code = _BAD_ROUTED_CALL.format(index=index, sizes=sizes)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert "NO ERROR" not in out, out[-2000:]
    assert run.returncode != 0
    assert message in out, out[-2000:]


@pytest.mark.gpu
def test_gather_block_on_the_gpu_checks_and_absorbs_padding_in_the_prologue(monkeypatch):
    """The torch checks of the routed rows are not called: the prologue does them (and the result still matches
    the reference, padding rows included)."""
    import fusion.inputs as inputs
    from fusion import Combine, Gather

    def not_called(*a, **k):
        raise AssertionError("a torch check ran where the routed prologue should")

    torch.manual_seed(0)
    ops = lambda: (Gather(), GroupLinear(4, 64, 256), SwiGLU(), Scale(), GroupLinear(4, 128, 64), Combine())  # noqa: E731
    fused = Sequential(*ops()).cuda().bfloat16()
    ref = Sequential(*ops(), backend="reference").cuda().bfloat16()
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    index = torch.cat([torch.randint(0, 32, (60,)), torch.full((4,), -1)]).cuda()
    sizes = torch.tensor([20, 0, 25, 15], device="cuda", dtype=torch.int32)
    probs = torch.rand(64, device="cuda", dtype=torch.bfloat16)
    want = ref(x, index=index, group_sizes=sizes, scale=probs)
    for name in ("_absorb_padding", "_check_padding_rows"):
        monkeypatch.setattr(inputs, name, not_called)
    got = fused(x, index=index, group_sizes=sizes, scale=probs)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_routed_prologue_sets_the_absorbed_sizes_from_its_own_buffer():
    """RoutedPrologue's buffer is the bounds and counters alone, and ctx.group_sizes the kernel's sizes after them
    (the padding rows in the last group, int32), not a torch op over the bounds."""
    from fusion.run_context import RunContext
    from fusion.runtime.bounds import RoutedPrologue

    sizes = torch.tensor([5, 0, 7, 3], device="cuda", dtype=torch.int64)
    index = torch.cat([torch.randint(0, 9, (15,)), torch.full((6,), -1)]).cuda()
    ctx = RunContext(group_sizes=sizes, routed_group_sizes=sizes, index=index, tokens=9)
    buffer = RoutedPrologue(4)(ctx, index.numel(), index.device, 2)
    assert buffer.numel() == 4 + 1 + 2
    assert torch.equal(buffer.cpu(), torch.tensor([0, 5, 5, 12, 21, 0, 0], dtype=torch.int32))
    assert ctx.group_sizes.dtype == torch.int32 and ctx.group_sizes.is_contiguous()
    assert torch.equal(ctx.group_sizes.cpu(), torch.tensor([5, 0, 7, 9], dtype=torch.int32))
    assert torch.equal(ctx.derived["gather_index"].cpu(), index.cpu().to(torch.int32))
