"""The runtime binds each kernel's launch once per call shape (kernels.api.BoundGemm, kernels.wgrad_api.BoundVarlenK)
and reuses it: a fused step's kernel (fusion/runtime/kernel.py CuteKernel), a lone GEMM (fusion/runtime/lone_gemm.py)
and a weight gradient (fusion/runtime/wgrad_gemm.py) bind again only for new rows (or a switched tile), and their
caches stay bounded. No GPU: the compiled kernels and the bindings are stand-ins that record what they are asked.
The bindings' own per-call checks: tests/test_kernels_compile.py and tests/test_wgrad_compile.py."""
import pytest
import torch

import fusion.kernels as K
import fusion.kernels.api as api
from fusion import GroupLinear
from fusion.run_context import RunContext
from fusion.runtime import compile as C
from fusion.runtime import kernel as KR
from fusion.runtime import lone_gemm

BF16 = torch.bfloat16


@pytest.fixture
def bindings(monkeypatch):
    """(binds, launches): what each binding was made for ((compiled, A's rows, routed rows)), and the rows each bound
    launch ran."""
    binds, launches = [], []

    def bind(compiled, A, B, bounds, index=None, num_ctas=None):
        binds.append((compiled, A.shape[0], None if index is None else index.numel()))
        return lambda A, *rest: launches.append(A.shape[0])

    monkeypatch.setattr(C, "load_compiled", lambda job: f"compiled {job.name}")
    monkeypatch.setattr(K, "bind_grouped_gemm", bind, raising=False)
    monkeypatch.setattr(api, "bind_grouped_gemm", bind)
    return binds, launches


def test_a_fused_kernel_binds_once_per_row_count(bindings, monkeypatch):
    binds, launches = bindings
    job = KR.make_job(KR.IDENTITY_SOURCE, BF16, 256, 128, 4, False, "K", False, "F1", "train")
    kernel = KR.CuteKernel(job)
    B, bounds = torch.zeros(4, 256, 128, dtype=BF16), torch.zeros(8, dtype=torch.int32)
    for rows in (16, 16, 32, 16):
        kernel.run(torch.zeros(rows, 128, dtype=BF16), B, bounds, {})
    assert [b[1] for b in binds] == [16, 32]            # bound for 16 rows, then 32; 16 again reuses the first
    assert launches == [16, 16, 32, 16]
    index = torch.zeros(24, dtype=torch.int32)            # a gathering launch: keyed by the routed rows too
    kernel.run(torch.zeros(16, 128, dtype=BF16), B, bounds, {}, index=index)
    assert binds[-1][1:] == (16, 24)
    kernel._bound.limit = 2
    for rows in (48, 64, 80):
        kernel.run(torch.zeros(rows, 128, dtype=BF16), B, bounds, {})
    assert len(kernel._bound) <= 2                        # rows that never repeat: the cache starts again


def test_a_lone_gemm_binds_once_per_call_shape_and_tile_switch(bindings, monkeypatch):
    binds, launches = bindings
    monkeypatch.setattr(lone_gemm, "_BOUND", KR.ShapeCache(256))
    monkeypatch.setattr(lone_gemm, "_COMPILED", {})
    op = GroupLinear(4, 128, 256).to(BF16)
    for rows in (16, 32, 16):
        ctx = RunContext(group_sizes=torch.tensor([rows // 4] * 4))
        y = lone_gemm.run(op, torch.zeros(rows, 128, dtype=BF16), ctx)
        assert y.shape == (rows, 256)
    assert [b[1] for b in binds] == [16, 32] and launches == [16, 32, 16]
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", not lone_gemm.WIDE_TILE)   # another tile: another kernel, bound anew
    lone_gemm.run(op, torch.zeros(16, 128, dtype=BF16), RunContext(group_sizes=torch.tensor([4] * 4)))
    assert len(binds) == 3


def test_a_weight_gradient_binds_once_per_call_shape(monkeypatch):
    import fusion.kernels.wgrad_api as wapi
    from fusion.runtime import wgrad_gemm

    binds, launches = [], []

    def bind(compiled, dy, x, bounds, dw, index=None):
        binds.append(dy.shape[0])
        return lambda dy, x, bounds, dw, index=None: launches.append(dy.shape[0])

    monkeypatch.setattr(C, "load_compiled", lambda job: job)
    monkeypatch.setattr(wapi, "bind_varlen_k_gemm", bind)
    monkeypatch.setattr(wgrad_gemm, "_BOUND", KR.ShapeCache(256))
    op = GroupLinear(4, 128, 256).to(BF16)
    for rows in (16, 32, 16, 32):
        ctx = RunContext(group_sizes=torch.tensor([rows // 4] * 4))
        dw = wgrad_gemm.wgrad(op, torch.zeros(rows, 128, dtype=BF16), torch.zeros(rows, 256, dtype=BF16), ctx)
        assert dw.shape == (4, 256, 128)
    assert binds == [16, 32] and launches == [16, 32, 16, 32]


class _FakeFp8Compiled:
    """What kernels.fp8_api.BoundFp8Gemm reads of a compiled FP8 kernel: N x K weights of G groups, its epilogue's
    slots ("out"; an FP8-block output with its scale and amax), a dynamic persistent tile, and a launch that records
    its arguments."""

    def __init__(self, N=256, K=384, G=4, slots=(("out", ()),)):
        import types

        self.N, self.K, self.G, self.name = N, K, G, "fake_fp8"
        self.k_blocks, self.b_scale_shape = -(-K // 128), (G, -(-N // 128), -(-K // 128))
        self.slots = slots
        self.config = types.SimpleNamespace(dynamic=True)
        self.launches = []
        self.launch = lambda *args: self.launches.append(args)


def _fp8_operands(c, rows):
    u8, f32 = torch.uint8, torch.float32
    return (torch.zeros(rows, c.K, dtype=u8), torch.zeros(c.k_blocks, rows, dtype=f32),
            torch.zeros(c.G, c.N, c.K, dtype=u8), torch.zeros(c.b_scale_shape, dtype=f32),
            torch.zeros(c.G + 1, dtype=torch.int32))


def test_a_bound_fp8_launch_checks_every_call_before_it_launches(monkeypatch):
    """kernels.fp8_api.BoundFp8Gemm (what the runtime keeps per FP8 kernel and rows): each call refuses, before any
    launch, operands of other shapes or dtypes than it was bound at, non-contiguous ones, a misaligned scale, too few
    offsets and a non-contiguous epilogue tensor; a good call launches with the pointers in the kernel's order (A, B,
    A's scales, B's, offsets, counter, the epilogue's in slot order), the bound rows and CTAs and the stream.
    bind_fp8_grouped_gemm itself checks every shape (no GPU: the launch is a stand-in)."""
    from fusion.errors import ShapeError
    from fusion.kernels import fp8_api

    monkeypatch.setattr(fp8_api, "_raw_stream", lambda device: 77)
    comp = _FakeFp8Compiled(slots=(("q", ("_scale", "_amax")),))
    A, SA, B, SB, offs = _fp8_operands(comp, 8)
    bound = fp8_api.BoundFp8Gemm(comp, 8, 6)
    assert bound.names == ("q", "q_scale", "q_amax")
    outs = {"q": torch.zeros(8, comp.N, dtype=torch.uint8), "q_scale": torch.zeros(2, 8),
            "q_amax": torch.zeros((), dtype=torch.int32)}
    bad = [((torch.zeros(9, comp.K, dtype=torch.uint8), SA, B, SB, offs), "bound at 8 rows"),
           ((A, torch.zeros(3, 9), B, SB, offs), "A_scale"),
           ((A, SA.to(torch.float64), B, SB, offs), "A_scale"),
           ((A.to(torch.int16), SA, B, SB, offs), "A must be"),
           ((A, SA, B[:, :128], SB, offs), "B must be"),
           ((A, SA, B, SB.transpose(0, 1).contiguous().transpose(0, 1), offs), "B_scale"),
           ((A, SA, B.transpose(1, 2).contiguous().transpose(1, 2), SB, offs), "B must be"),
           ((A, torch.zeros(3 * 8 + 1)[1:].view(3, 8), B, SB, offs), "A_scale"),    # 4 bytes past 16-byte alignment
           ((A, SA, B, SB, offs[:comp.G]), "G\\+1")]
    for args, match in bad:
        with pytest.raises(ShapeError, match=match):
            bound(*args, outs)
    with pytest.raises(ShapeError, match="'q_scale' must be contiguous"):
        bound(A, SA, B, SB, offs, {**outs, "q_scale": torch.zeros(8, 2).t()})
    assert comp.launches == []
    bound(A, SA, B, SB, offs, outs, counter_ptr=1234)
    (args,) = comp.launches
    assert args[:6] == (A.data_ptr(), B.data_ptr(), SA.data_ptr(), SB.data_ptr(), offs.data_ptr(), 1234)
    assert args[6] == tuple(outs[n].data_ptr() for n in ("q", "q_scale", "q_amax")) and args[7:] == (8, 6, 77)
    with pytest.raises(ShapeError, match="B must be"):
        fp8_api.bind_fp8_grouped_gemm(comp, A, SA, torch.zeros(comp.G, comp.K, comp.N, dtype=torch.uint8), SB, offs)
    empty = fp8_api.bind_fp8_grouped_gemm(comp, *_fp8_operands(comp, 0))   # no rows: bound, launches nothing
    empty(*_fp8_operands(comp, 0), {n: t[:0] if t.dim() else t for n, t in outs.items()})
    assert len(comp.launches) == 1


@pytest.fixture
def fp8_bindings(monkeypatch):
    """(binds, launches) of the FP8 kernels' bindings: ((compiled, A's rows)) per binding, the rows of each launch."""
    from fusion.kernels import fp8_api

    binds, launches = [], []

    class Bound:
        def __init__(self, compiled):
            self.compiled = compiled

        def __call__(self, A, *rest):
            launches.append(A.shape[0])

    def bind(compiled, A, A_scale, B, B_scale, bounds, num_ctas=None):
        binds.append((compiled, A.shape[0]))
        return Bound(compiled)

    monkeypatch.setattr(C, "load_compiled", lambda job: f"compiled {job.name}")
    monkeypatch.setattr(K, "bind_fp8_grouped_gemm", bind, raising=False)
    monkeypatch.setattr(fp8_api, "bind_fp8_grouped_gemm", bind)
    return binds, launches


def test_a_fused_fp8_kernel_binds_once_per_row_count(fp8_bindings):
    from fusion.runtime.kernel import BlockScaled

    binds, launches = fp8_bindings
    job = KR.make_job(KR.IDENTITY_SOURCE, BF16, 256, 384, 4, False, "K", False, "F1", "train", mainloop="fp8_block")
    kernel = KR.CuteKernel(job)
    comp = _FakeFp8Compiled()
    _, _, B, SB, bounds = _fp8_operands(comp, 0)
    for rows in (16, 16, 32, 16):
        A, SA, *_ = _fp8_operands(comp, rows)
        kernel.run(BlockScaled(A, SA), BlockScaled(B, SB), bounds, {})
    assert [b[1] for b in binds] == [16, 32] and launches == [16, 16, 32, 16]
    kernel._by_rows.clear()    # another compiled kernel for these rows (a switched tile): bound anew
    kernel.run(BlockScaled(*_fp8_operands(comp, 16)[:2]), BlockScaled(B, SB), bounds, {})
    assert [b[1] for b in binds] == [16, 32, 16]


def test_a_lone_fp8_gemm_binds_once_per_call_shape(fp8_bindings, monkeypatch):
    from fusion.runtime import fp8_gemm
    from fusion.runtime.kernel import BlockScaled

    binds, launches = fp8_bindings
    monkeypatch.setattr(fp8_gemm, "_BOUND", KR.ShapeCache(256))
    monkeypatch.setattr(fp8_gemm, "_COMPILED", {})
    comp = _FakeFp8Compiled()
    _, _, B, SB, bounds = _fp8_operands(comp, 0)
    for rows in (16, 32, 16, 32):
        out = fp8_gemm._gemm(BlockScaled(*_fp8_operands(comp, rows)[:2]), BlockScaled(B, SB), bounds, BF16, "fprop")
        assert out.shape == (rows, comp.N) and out.dtype == BF16
    assert [b[1] for b in binds] == [16, 32] and launches == [16, 32, 16, 32]
