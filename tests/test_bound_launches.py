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
