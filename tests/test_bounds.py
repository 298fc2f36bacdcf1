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
