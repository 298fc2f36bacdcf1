"""The varlen-K kernel (kernels/varlen_k_gemm.py) compiles without a GPU: SASS per producer kind, the tile policy, the
config checks, and the disk cache round trip. GPU numerics: tests/test_wgrad_gpu.py."""
import collections
import dataclasses

import pytest
from conftest import sass_or_skip

from fusion.errors import FusionError, KernelConfigError
from fusion.kernels.tile_policy import WGRAD_PINGPONG_ROWS, WgradConfig, choose_wgrad_config, wgrad_configs


def _compile(cfg, Ma, Nb, G, dtype="bfloat16"):
    from fusion.kernels.wgrad_api import compile_varlen_k_gemm

    return compile_varlen_k_gemm(cfg, dtype, Ma, Nb, G)


def _opcodes(comp):
    from fusion.kernels.api import sass_opcodes

    return collections.Counter(sass_or_skip(lambda: sass_opcodes(comp.sass)))


@pytest.mark.parametrize("Ma,Nb,gather", [(1536, 2048, ""), (5760, 2880, ""), (2048, 768, "b"), (2880, 2880, "a"),
                                          (1536, 2048, "ab")])
def test_policy_kernels_compile_to_wgmma_without_spills(Ma, Nb, gather):
    cfg = choose_wgrad_config(Ma, Nb, 128, "a" in gather, "b" in gather)
    comp = _compile(cfg, Ma, Nb, 128)
    ops = _opcodes(comp)
    assert comp.frame_size == 0 and not any(op.startswith(("LDL", "STL")) for op in ops), "register spills"
    assert any(op.startswith("HGMMA") for op in ops)
    # the paired 8-byte stores of the epilogue (a quad writes whole 32-byte sectors), one shuffle per store
    assert ops["STG.E.64"] > 0 and ops["SHFL.BFLY"] == ops["STG.E.64"]
    if gather == "a":
        # A gathered (cp.async rows through the index), B by TMA multicast to the CTA pair
        assert cfg.cluster_m == 2 and ops["LDGSTS.E.BYPASS.128"] + ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0
        assert ops["UTMALDG.2D.MULTICAST"] > 0 and ops["UTMALDG.2D"] == 0
    elif gather:
        # a gathered B: cp.async rows through the index, no cluster; A by TMA (no multicast) where only B is
        # gathered, by cp.async too where both are
        assert cfg.cluster_m == 1 and ops["LDGSTS.E.BYPASS.128"] + ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0
        assert not any(op.startswith("UTMALDG.2D.MULTICAST") for op in ops)
        assert (ops["UTMALDG.2D"] > 0) == (len(gather) == 1)
    else:
        # TMA, B multicast to the CTA pair; a partial last k-step's rows zeroed by 16-byte smem stores
        assert cfg.cluster_m == 2 and ops["UTMALDG.2D.MULTICAST"] > 0 and ops["UTMALDG.2D"] > 0
        assert ops["STS.128"] > 0 and not any(op.startswith("LDGSTS") for op in ops)


def test_store_bound_tile_stores_16_bytes_a_lane_without_spills():
    """The tile the policy takes below WGRAD_PINGPONG_ROWS rows per group (GPT-OSS-120B at T = 1024: 32): 128x128
    pingpong CTA pairs whose epilogue stores 16 bytes a lane after a quad's 4x4 transpose (2 shuffles a word)."""
    cfg = choose_wgrad_config(5760, 2880, 128, rows=32 * 128)
    assert cfg.store_bytes == 16 and cfg.tile_n == 128 and cfg.pingpong and cfg.cluster_m == 2
    ops = _opcodes(_compile(cfg, 5760, 2880, 128))
    assert not any(op.startswith(("LDL", "STL")) for op in ops), "register spills"
    assert any(op.startswith("HGMMA") for op in ops)
    assert ops["STG.E.128"] > 0 and ops["STG.E.64"] == 0 and ops["SHFL.BFLY"] == 4 * ops["STG.E.128"]


@pytest.mark.parametrize("cfg", [WgradConfig(tile_n=256, stages=4, gather_a=True, cluster_m=2),
                                 WgradConfig(tile_n=192, stages=5, pingpong=True, gather_a=True, cluster_m=2)])
def test_gathered_a_pair_multicasts_b_without_spills(cfg):
    """A gathered (dY through the index: an MoE FC2's weight gradient) in a CTA pair on neighbouring m-tiles: A by
    cp.async in each CTA, B (H) by TMA multicast to the pair, no spills."""
    comp = _compile(cfg, 2048, 768, 128)
    ops = _opcodes(comp)
    assert comp.frame_size == 0 and not any(op.startswith(("LDL", "STL")) for op in ops), "register spills"
    assert any(op.startswith("HGMMA") for op in ops)
    assert ops["UTMALDG.2D.MULTICAST"] > 0 and ops["UTMALDG.2D"] == 0
    assert ops["LDGSTS.E.BYPASS.128"] + ops["LDGSTS.E.BYPASS.LTC128B.128"] > 0


def test_a_gathered_b_cannot_be_multicast():
    from fusion.kernels.wgrad_api import check_wgrad_config

    with pytest.raises(KernelConfigError, match="a gathered B is loaded by cp.async"):
        check_wgrad_config(WgradConfig(gather_b=True, cluster_m=2), "bfloat16", 256, 256)


def test_tile_policy():
    assert choose_wgrad_config(1536, 2048, 128) == WgradConfig(tile_n=256, stages=4, cluster_m=2)
    assert choose_wgrad_config(5760, 2880, 128) == WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2)
    assert choose_wgrad_config(2048, 1408, 64) == WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2)
    gathered = choose_wgrad_config(1536, 2048, 128, gather_b=True)
    assert gathered.gather_b and gathered.cluster_m == 1


def test_tile_policy_by_rows_per_group():
    """128x192 pingpong where a group's rows make few k-steps (WGRAD_PINGPONG_ROWS) and 192-column tiles pad Nb
    little; the wide-tile rule at fewer or more rows, for an unknown row count, and where 192 pads Nb too much."""
    pp192 = WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2)
    stores = WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2, store_bytes=16)   # below low: store-bound
    wide = choose_wgrad_config(3072, 4096, 128)
    assert wide == WgradConfig(tile_n=256, stages=4, cluster_m=2)
    low, high = WGRAD_PINGPONG_ROWS
    for rows, want in ((0, stores), (32 * 128, stores), (low * 128 - 1, stores), (low * 128, pp192),
                       (1024 * 128, pp192), (high * 128 - 1, pp192), (high * 128, wide), (None, wide)):
        assert choose_wgrad_config(3072, 4096, 128, rows=rows) == want, rows
    assert choose_wgrad_config(4096, 7168, 32, rows=256 * 32) == pp192      # 7168 = 37.3 tiles: 1.8% padding
    assert choose_wgrad_config(2048, 1024, 64, rows=512 * 64) == choose_wgrad_config(2048, 1024, 64)   # 12.5%
    assert choose_wgrad_config(3072, 4096, 128, gather_b=True, rows=256 * 128).cluster_m == 1
    assert choose_wgrad_config(28672, 4096, 1, rows=1024) == choose_wgrad_config(28672, 4096, 1)   # one group
    assert choose_wgrad_config(28672, 4096, 1, rows=16) == choose_wgrad_config(28672, 4096, 1)
    assert choose_wgrad_config(3072, 4096, 128, gather_a=True, rows=32 * 128).store_bytes == 8   # gathered: as was
    # every configuration the policy may pick is compiled ahead of time
    assert wgrad_configs(3072, 4096, 128) == [wide, pp192, stores]
    assert wgrad_configs(5760, 2880, 128) == [pp192, stores]
    assert wgrad_configs(2048, 1024, 64) == [choose_wgrad_config(2048, 1024, 64), stores]


@pytest.mark.parametrize("cfg,Ma,Nb,needle", [
    (WgradConfig(tile_n=96), 256, 256, "tile_n a multiple of 64"),
    (WgradConfig(tile_n=256, pingpong=True), 256, 256, "pingpong with tile_n = 256"),
    (WgradConfig(cluster_m=2, gather_b=True), 256, 256, "cluster_m = 2 multicasts"),
    (WgradConfig(cluster_m=4), 256, 256, "cluster_m = 4"),
    (WgradConfig(), 252, 256, "multiples of 8"),
    (WgradConfig(stages=9), 256, 256, "stages = 9"),
])
def test_config_errors_name_the_constraint(cfg, Ma, Nb, needle):
    from fusion.kernels.wgrad_api import check_wgrad_config

    with pytest.raises(KernelConfigError, match=needle) as err:
        check_wgrad_config(cfg, "bfloat16", Ma, Nb)
    assert isinstance(err.value, FusionError)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    """A job compiled into FUSION_CACHE_DIR loads back (another process: the memory caches cleared) as the same
    kernel, with the configuration it was built with."""
    import torch

    import fusion.kernels.wgrad_api as api
    from fusion.runtime import compile as C
    from fusion.runtime.kernel import make_wgrad_job

    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    job = make_wgrad_job(torch.bfloat16, 256, 512, 4, "", "t")
    assert job.mainloop == "varlen_k" and WgradConfig(*job.config) == choose_wgrad_config(256, 512, 4)
    built = C.compile_to_disk(job)
    assert built == job.key and C.is_cached(job)
    monkeypatch.setattr(C, "_LOADED", {})
    monkeypatch.setattr(api, "_CACHE", {})
    loaded = C.load_compiled(job)
    assert isinstance(loaded, api.CompiledVarlenKGemm)
    assert loaded.config == WgradConfig(*job.config) and loaded.name.endswith("_c2")
    art = C.artifact(job)
    assert art.config == WgradConfig(*job.config) and art.cubin == loaded.cubin
    assert job.name == "wgrad_t_bfloat16_Ma256_Nb512_G4_128x256"   # the tile: a shape may have several (by rows)
    # the gathered variant is another kernel
    assert make_wgrad_job(torch.bfloat16, 256, 512, 4, "b", "t").key != job.key
    assert dataclasses.astuple(choose_wgrad_config(256, 512, 4, gather_b=True)) == \
        make_wgrad_job(torch.bfloat16, 256, 512, 4, "b", "t").config


def test_the_runtime_launches_the_tile_for_each_calls_rows(monkeypatch):
    """fusion/runtime/wgrad_gemm.wgrad picks the tile per call from the routed rows (launch mocked: no GPU): 256
    rows per group of a 128-group weight take 128x192 pingpong, 64 the store-bound 128x128 pingpong pairs with
    16-byte stores, an unknown count the wide 128x256 cooperative tile; each row count's kernel is loaded once and
    every one of them is among the jobs Sequential.compile() builds."""
    import torch

    import fusion.kernels.wgrad_api as api
    from fusion import GroupLinear
    from fusion.ops.base import RunContext
    from fusion.runtime import compile as C
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.kernel import ShapeCache

    loaded, launched = [], []
    monkeypatch.setattr(wgrad_gemm, "_BOUND", ShapeCache(256))
    monkeypatch.setattr(C, "load_compiled", lambda job: loaded.append(job) or WgradConfig(*job.config))
    monkeypatch.setattr(api, "bind_varlen_k_gemm",
                        lambda compiled, dy, x, bounds, dw, index=None: lambda *a: launched.append(compiled))
    bf16 = torch.bfloat16
    op = GroupLinear(128, 4096, 3072, device="meta", dtype=bf16)   # weight (128, 3072, 4096): Qwen3-235B's FC1
    for rows_per_group in (256, 64, 256):
        rows = 128 * rows_per_group
        ctx = RunContext(group_sizes=torch.full((128,), rows_per_group))
        x, dy = torch.empty(rows, 4096, device="meta", dtype=bf16), torch.empty(rows, 3072, device="meta", dtype=bf16)
        wgrad_gemm.wgrad(op, x, dy, ctx)
    pp192 = WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2)
    stores = WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2, store_bytes=16)
    assert launched == [pp192, stores, pp192]
    assert [WgradConfig(*job.config) for job in loaded] == [pp192, stores]   # kept per row count: no reload
    assert {job.key for job in loaded} < {job.key for job in wgrad_gemm.kernel_jobs(op, "wgrad", bf16)}
    # a flipped policy switch (an A/B) binds that setting's tile, not the launch bound before it
    from fusion.kernels import tile_policy

    monkeypatch.setattr(tile_policy, "WGRAD_STORE_BOUND", False)
    ctx = RunContext(group_sizes=torch.full((128,), 64))
    x = torch.empty(128 * 64, 4096, device="meta", dtype=bf16)
    dy = torch.empty(128 * 64, 3072, device="meta", dtype=bf16)
    wgrad_gemm.wgrad(op, x, dy, ctx)
    assert launched[-1] == WgradConfig(tile_n=256, stages=4, cluster_m=2)


def test_fc1_weight_gradient_gathers_its_tokens_at_many_rows_per_group(monkeypatch):
    """kernels/tile_policy.py gather_in_wgrad: at >= WGRAD_GATHER_ROWS routed rows per group, several groups and
    in_features a multiple of 256, the weight gradient after a Gather reads x through the index; the runtime then
    launches the gathering kernel (128x256 cooperative, x's rows by cp.async, no cluster) with the index, and
    Sequential.compile() builds that kernel for a GroupLinear after a Gather (launch mocked: no GPU)."""
    import torch

    import fusion.kernels.wgrad_api as api
    from fusion import GroupLinear
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import WGRAD_GATHER_ROWS, gather_in_wgrad
    from fusion.ops.base import RunContext
    from fusion.runtime import compile as C
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.kernel import ShapeCache

    G, rows = 64, 64 * WGRAD_GATHER_ROWS
    assert gather_in_wgrad(2048, G, rows) and not gather_in_wgrad(2048, G, rows - 1)
    assert not gather_in_wgrad(2880, G, rows) and not gather_in_wgrad(2048, 1, rows)
    monkeypatch.setattr(tile_policy, "WGRAD_GATHER", False)
    assert not gather_in_wgrad(2048, G, rows)                  # FUSION_WGRAD_GATHER=0
    monkeypatch.setattr(tile_policy, "WGRAD_GATHER", True)

    launched, loaded = [], []
    monkeypatch.setattr(wgrad_gemm, "_BOUND", ShapeCache(256))
    monkeypatch.setattr(C, "load_compiled", lambda job: loaded.append(job) or WgradConfig(*job.config))
    monkeypatch.setattr(api, "bind_varlen_k_gemm", lambda compiled, dy, x, bounds, dw, index=None:
                        lambda a, b, offs, out, index=None: launched.append((compiled, index)))
    bf16 = torch.bfloat16
    op = GroupLinear(G, 2048, 2048, device="meta", dtype=bf16)   # OLMoE's FC1: weight (64, 2048, 2048)
    assert wgrad_gemm.gathers(op, rows) and not wgrad_gemm.gathers(op, rows // 2)
    T = rows // 8
    tokens, dy = torch.empty(T, 2048, device="meta", dtype=bf16), torch.empty(rows, 2048, device="meta", dtype=bf16)
    index = torch.zeros(rows, dtype=torch.int32, device="meta")
    wgrad_gemm.wgrad(op, tokens, dy, RunContext(group_sizes=torch.full((G,), rows // G)), index=index)
    (cfg, got_index), = launched
    assert cfg == WgradConfig(tile_n=256, stages=4, gather_b=True, cluster_m=1) and got_index is index
    gathered_jobs = wgrad_gemm.kernel_jobs(op, "wgrad", bf16, gathered=True)
    assert loaded[0].key in {j.key for j in gathered_jobs}     # the kernel it launches is one compile() builds
    assert not [j for j in wgrad_gemm.kernel_jobs(op, "wgrad", bf16) if WgradConfig(*j.config).gather_b]


def test_explain_states_the_weight_gradient_rules_the_tile_policy_applies():
    """The op table's text (what explain() prints; fusion/op_table.py sits below the kernels and cannot import
    their constants) names the row counts kernels/tile_policy.py uses."""
    from fusion.kernels.tile_policy import WGRAD_GATHER_ROWS, WGRAD_PINGPONG_ROWS
    from fusion.op_table import DEVICE_METHODS

    text = DEVICE_METHODS[("gemm", "wgrad")][1]
    low, high = WGRAD_PINGPONG_ROWS
    assert f"at {low}-{high - 1} rows per group" in text
    assert f"after a Gather, at >= {WGRAD_GATHER_ROWS} rows per group" in text
    from fusion.kernels.tile_policy import DY_GATHER_MAX_F

    # tile_policy.gather_dy's
    assert f"before a Combine, at >= {WGRAD_GATHER_ROWS} rows per group with in_features <= {DY_GATHER_MAX_F}" in text
    assert (f">= {WGRAD_GATHER_ROWS} routed rows per group, in_features <= {DY_GATHER_MAX_F}"
            in DEVICE_METHODS[("combine", "backward")][1])


def test_fc2_weight_gradient_reads_dy_through_the_index_at_many_rows_per_group(monkeypatch):
    """kernels/tile_policy.py gather_dy: at >= WGRAD_GATHER_ROWS routed rows per group and several groups an MoE FC2's
    weight gradient reads the tokens' gradient through the index; the runtime then launches the kernel that gathers
    A (dY's rows by cp.async, H by TMA multicast to a CTA pair) with the index, and Sequential.compile() builds it for a
    GroupLinear before a Combine (launch mocked: no GPU)."""
    import torch

    import fusion.kernels.wgrad_api as api
    from fusion import GroupLinear
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import WGRAD_GATHER_ROWS, gather_dy
    from fusion.ops.base import RunContext
    from fusion.runtime import compile as C
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.kernel import ShapeCache

    G = 16
    rows = G * WGRAD_GATHER_ROWS
    f = tile_policy.DY_GATHER_MAX_F
    assert gather_dy(G, rows, f) and not gather_dy(G, rows - 1, f) and not gather_dy(1, rows, f)
    assert not gather_dy(G, rows, f + 128)                     # wide experts keep the copy (tile_policy's note)
    monkeypatch.setattr(tile_policy, "DY_GATHER", False)
    assert not gather_dy(G, rows, f)                           # FUSION_DY_GATHER=0
    monkeypatch.setattr(tile_policy, "DY_GATHER", True)

    launched, loaded = [], []
    monkeypatch.setattr(C, "load_compiled", lambda job: loaded.append(job) or job)
    monkeypatch.setattr(api, "bind_varlen_k_gemm", lambda comp, a, b, offs, out, index=None:
                        lambda a, b, offs, out, index=None: launched.append((WgradConfig(*comp.config), a.shape, index)))
    monkeypatch.setattr(wgrad_gemm, "_BOUND", ShapeCache(256))   # (the stand-in bindings never outlive the test)
    op = GroupLinear(G, 256, 512).to(torch.bfloat16)            # FC2: f = 256 -> d = 512
    T = rows // 2
    dy_tokens = torch.empty(T, 512, dtype=torch.bfloat16)
    h = torch.empty(rows, 256, dtype=torch.bfloat16)
    index = torch.zeros(rows, dtype=torch.int32)
    ctx = RunContext(group_sizes=torch.full((G,), WGRAD_GATHER_ROWS))
    wgrad_gemm.wgrad(op, h, dy_tokens, ctx, dy_index=index)
    ((cfg, a_shape, got_index),) = launched
    assert cfg.gather_a and not cfg.gather_b and cfg.cluster_m == 2 and a_shape == (T, 512) and got_index is index
    jobs = wgrad_gemm.kernel_jobs(op, "wgrad", torch.bfloat16, dy_gathered=True)
    assert loaded[0].key in {j.key for j in jobs}              # the kernel it launches is one compile() builds
    assert not [j for j in wgrad_gemm.kernel_jobs(op, "wgrad", torch.bfloat16) if WgradConfig(*j.config).gather_a]


def test_a_bound_weight_gradient_launch_checks_every_call_before_it_launches():
    """kernels.wgrad_api.BoundVarlenK (what the runtime keeps per call shape): each call refuses, before any launch
    (no GPU needed), operands of other rows than it was bound at, a dtype it was not built for and a non-contiguous
    operand, naming the problem."""
    import torch

    from fusion.errors import DTypeError, ShapeError
    from fusion.kernels.wgrad_api import bind_varlen_k_gemm

    G, Ma, Nb, M = 4, 256, 512, 64
    comp = _compile(WgradConfig(), Ma, Nb, G)
    bf16 = torch.bfloat16
    dy, x = torch.zeros(M, Ma, dtype=bf16), torch.zeros(M, Nb, dtype=bf16)
    out, offs = torch.zeros(G, Ma, Nb, dtype=bf16), torch.zeros(G + 1, dtype=torch.int32)
    bound = bind_varlen_k_gemm(comp, dy, x, offs, out, num_ctas=8)
    assert (bound.M, bound.num_ctas) == (M, 8)
    with pytest.raises(ShapeError, match="bound at"):
        bound(torch.zeros(M + 8, Ma, dtype=bf16), torch.zeros(M + 8, Nb, dtype=bf16), offs, out)
    with pytest.raises(DTypeError, match="bfloat16"):
        bound(dy, x.half(), offs, out)
    with pytest.raises(ShapeError, match="contiguous"):
        bound(dy, torch.zeros(Nb, M, dtype=bf16).t(), offs, out)


def test_one_group_takes_torchs_weight_gradient(monkeypatch):
    """fusion.op_table.WGRAD_RULE: a one-group GroupLinear's weight gradient is a dense GEMM and takes torch's matmul
    (cuBLAS measured faster on Llama-3-8B's); several groups take our varlen-K kernel, large weights too (torch's
    grouped GEMM measured slower on Mixtral's, DBRX's, Llama-4-Scout's); MIN_GROUPS = 1 sends one group to ours too;
    Sequential.compile() builds no kernel for a weight the rule sends to torch."""
    import torch

    from fusion import GroupLinear
    from fusion.runtime import wgrad_gemm

    bf16 = torch.bfloat16

    class OnHopper:   # what `takes` reads of its input: a CUDA bf16 matrix on a Hopper GPU (no GPU here)
        is_cuda, dtype = True, bf16

        @staticmethod
        def dim():
            return 2

        @staticmethod
        def get_device():
            return 0

    monkeypatch.setattr(wgrad_gemm, "cuda_major", lambda device: 9)
    dense = GroupLinear(1, 4096, 28672, device="meta", dtype=bf16)
    mixtral_fc1 = GroupLinear(8, 4096, 28672, device="meta", dtype=bf16)
    assert not wgrad_gemm.takes(dense, OnHopper())
    assert wgrad_gemm.kernel_jobs(dense, "wgrad", bf16) == []
    assert wgrad_gemm.takes(mixtral_fc1, OnHopper())
    assert wgrad_gemm.kernel_jobs(mixtral_fc1, "wgrad", bf16)
    monkeypatch.setattr(wgrad_gemm, "MIN_GROUPS", 1)
    assert wgrad_gemm.takes(dense, OnHopper())
    assert wgrad_gemm.kernel_jobs(dense, "wgrad", bf16)


def test_a_16_byte_store_needs_an_aligned_output(monkeypatch):
    """The store-bound tile stores 16 bytes a lane: an output view 8 bytes off 16 is refused at binding, naming the
    alignment (the 8-byte form takes it)."""
    import torch

    from fusion.errors import ShapeError
    from fusion.kernels.wgrad_api import bind_varlen_k_gemm

    G, Ma, Nb, M = 2, 128, 128, 64
    A, B = torch.zeros(M, Ma, dtype=torch.bfloat16), torch.zeros(M, Nb, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 32, 64], dtype=torch.int32)
    out = torch.empty(G * Ma * Nb + 4, dtype=torch.bfloat16)[4:].view(G, Ma, Nb)   # 8 bytes past an aligned start
    assert out.data_ptr() % 16 == 8
    wide = _compile(WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2, store_bytes=16), Ma, Nb, G)
    with pytest.raises(ShapeError, match="16-byte aligned"):
        bind_varlen_k_gemm(wide, A, B, offsets, out)
    import fusion.kernels.wgrad_api as api

    monkeypatch.setattr(api, "_num_sms", lambda device: 132)   # (no GPU to ask)
    narrow = _compile(WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2), Ma, Nb, G)
    assert bind_varlen_k_gemm(narrow, A, B, offsets, out) is not None
