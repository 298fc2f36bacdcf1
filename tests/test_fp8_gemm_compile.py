"""CPU-only: compile the FP8 block-scaled grouped GEMM for sm_90a and check its PTX / SASS (no GPU needed),
the scale-slot planning it relies on, and the configurations and arguments it refuses."""
import os
import re
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import fusion.kernels as K  # noqa: E402
from fusion.errors import DeviceError, KernelConfigError, ShapeError  # noqa: E402
from fusion.kernels.fp8_gemm import Fp8DebugKnobs, Fp8GroupedGemmKernel  # noqa: E402
from fusion.kernels.fp8_scales import (SA_BOX, SA_STAGE_FLOATS, SB_BOX, SB_SLOT_FLOATS, SCALE_ALIGN,  # noqa: E402
                                       SCALE_BLOCK, box_shift, box_start, num_slots, plan_segments, segment_of)
from conftest import sass_or_skip  # noqa: E402


def _cfg(N, K_, G, gated=False, **over):
    """The cooperative configuration (tile_policy.cooperative_fp8_config) with `over`: the cases name their tiles."""
    return replace(K.cooperative_fp8_config(N, K_, G, gated), **over)


CASES = {  # name: (epilogue, N, K, G, config overrides)
    "plain": (K.IdentityEpilogue(), 1024, 512, 8, {}),
    "k-tail": (K.IdentityEpilogue(), 1024, 528, 8, {}),                 # K % 128 != 0: a partial k-block
    "wide-dynamic": (K.IdentityEpilogue(), 4096, 7168, 32, {}),
    "split-192": (K.IdentityEpilogue(), 4096, 2048, 8, dict(tile_m=128, tile_n=192, stages=5)),  # two slots
    "fp16-out": (K.IdentityEpilogue(out_dtype="float16"), 1536, 2048, 128, {}),
    "gated-swiglu": (K.SwiGLUScaleEpilogue(), 5760, 2880, 32, {}),
    "gated-mxfp8": (K.SwiGLUScaleMXFP8Epilogue(), 2048, 1024, 8, {}),
    "gated-split": (K.SwiGLUScaleEpilogue(), 2 * 2888, 1024, 8, {}),     # up-half blocks: a run-time boundary
    "one-k-tile": (K.IdentityEpilogue(), 1024, 64, 8, {}),
    "pair": (K.IdentityEpilogue(), 4096, 7168, 32, dict(cluster_n=2, dynamic=False)),   # A multicast to 2 CTAs
    "pair-dynamic": (K.IdentityEpilogue(), 1536, 2048, 128, dict(cluster_n=2)),        # tile ids sent to rank 1
    "pair-gated": (K.SwiGLUScaleEpilogue(), 3072, 2048, 128, dict(cluster_n=2, dynamic=False)),
    # CTA pairs along m: B multicast to 2 CTAs (GPT-OSS's 2880 columns: 23 n-tiles; tile_policy.FP8_M_PAIRS)
    "m-pair": (K.IdentityEpilogue(), 2880, 2880, 32, dict(cluster_m=2)),
    "m-pair-static": (K.IdentityEpilogue(), 2880, 2880, 32, dict(cluster_m=2, dynamic=False)),
    "m-pair-gated-waves": (K.SwiGLUScaleEpilogue(), 5760, 2880, 32, dict(cluster_m=2)),
    "m-pair-gated": (K.SwiGLUScaleEpilogue(), 3072, 2048, 128, dict(cluster_n=1, cluster_m=2)),
    # 256-row tiles: each warpgroup walks two 64-row waves through one scratch fragment
    "waves": (K.IdentityEpilogue(), 1024, 528, 8, dict(tile_m=256, stages=4)),
    "waves-pair": (K.IdentityEpilogue(), 4096, 7168, 32, dict(tile_m=256, stages=4, cluster_n=2)),
    "waves-gated-split": (K.SwiGLUScaleEpilogue(), 2 * 2888, 1024, 8, dict(tile_m=256, tile_n=128, stages=4)),
    # two CTAs an SM: one consumer warpgroup a CTA walks a 128-row tile as two 64-row waves
    "two-ctas": (K.IdentityEpilogue(), 1024, 528, 8, dict(tile_m=128, ctas_per_sm=2, stages=3, cluster_n=1)),
    "two-ctas-pair": (K.IdentityEpilogue(), 4096, 7168, 32, dict(tile_m=128, ctas_per_sm=2, stages=3, cluster_n=2)),
    "two-ctas-gated-split": (K.SwiGLUScaleEpilogue(), 2 * 2888, 1024, 8,
                             dict(tile_m=128, tile_n=128, ctas_per_sm=2, stages=3, cluster_n=1)),
    # the gated n-wave tile as two CTAs an SM: 64 x 256, CTA pairs along m (tile_policy.two_cta_tile)
    "two-ctas-gated-waves": (K.SwiGLUScaleEpilogue(), 2 * 2888, 2048, 32,
                             dict(tile_m=64, tile_n=256, ctas_per_sm=2, stages=2, cluster_n=1, cluster_m=2)),
}


def _compile(name):
    epi, N, K_, G, over = CASES[name]
    over = dict(over)
    out = "float16" if name == "fp16-out" else "bfloat16"
    return K.compile_fp8_grouped_gemm(_cfg(N, K_, G, epi.gated, **over), epi, N, K_, G, out_dtype=out)


def _ops(sass):
    return K.sass_opcodes(sass)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compile_sass(name):
    epi, N, K_, G, over = CASES[name]
    comp = _compile(name)
    assert comp.ptx and ".target sm_90a" in comp.ptx
    assert "wgmma.mma_async.sync.aligned" in comp.ptx and ".f32.e4m3.e4m3" in comp.ptx
    assert comp.shared_memory_bytes <= 227 * 1024
    assert comp.frame_size == 0, f"{comp.name}: {comp.frame_size}-byte stack frame (spills)"
    sass = sass_or_skip(lambda: comp.sass)
    ops = _ops(sass)
    # FP8 wgmma is QGMMA in SASS (HGMMA is the 16-bit one): E4M3 x E4M3 into F32
    gmma = re.findall(r"\b([HQ]GMMA\.[\w.]+)", sass)
    assert gmma and all(re.fullmatch(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", g) for g in gmma), \
        f"{comp.name}: expected only FP8 E4M3 wgmma, got {sorted(set(gmma))}"
    # a gated 128 x 256 tile issues 64 x 128 wgmmas, its gate and up halves as two n-waves (kernels/fp8_gemm.py)
    n_waves = epi.gated and comp.config.tile_n == 256
    assert f"x{comp.config.tile_n // (2 if n_waves else 1)}x32" in gmma[0]
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    tma = {o for o in ops if o.startswith("UTMALDG")}
    assert "UTMALDG.1D" in tma, tma   # scales (1-D)
    # A (2-D) multicast to both CTAs of a pair along n, B (3-D) to both of a pair along m; the pair's CTAs wait at a
    # cluster barrier for each other's mbarriers
    a_paired, b_paired = comp.config.cluster_n == 2, comp.config.cluster_m == 2
    assert ("UTMALDG.2D.MULTICAST" in tma) == a_paired and ("UTMALDG.2D" in tma) != a_paired, tma
    assert ("UTMALDG.3D.MULTICAST" in tma) == b_paired and ("UTMALDG.3D" in tma) != b_paired, tma
    assert any(o.startswith("UCGABAR") for o in ops) == (a_paired or b_paired)
    assert ("_c2" in comp.name) == a_paired and ("_cm2" in comp.name) == b_paired
    assert K.compile_fp8_grouped_gemm(comp.config, epi, N, K_, G, out_dtype=comp.dtype) is comp  # cached


@pytest.mark.parametrize("name", sorted(CASES))
def test_promotion_folds_each_k_tile_after_its_wgmma(name):
    """Every k-tile's wgmma is waited for (``wgmma.wait_group 0``) before its partial sums are folded: the
    overlapped fold (``wait_group 1``, a second scratch fragment) gave wrong results under load on an H200 and was
    removed (kernels/fp8_mainloop.py)."""
    comp = _compile(name)
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", comp.ptx))
    assert waits == {"0"}, waits


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_stage_expects_data_and_scales(name):
    """One mbarrier transaction per stage covers the A and B tiles, 132 activation scales per 128 rows (a box
    from an aligned start, one per wave: a 256-row tile's 260 in one box exceed TMA's 256 elements per box
    dimension; built so, the DSL issued it as two copies and the kernel trapped, "illegal instruction", on the H100)
    and one 16-byte box per weight-scale slot; the producer issues one 1-D TMA per scale box."""
    epi, N, K_, G, over = CASES[name]
    comp = _compile(name)
    cfg = comp.config
    slots = num_slots(plan_segments(cfg.tile_n, N, epi.gated))
    waves = max(1, cfg.tile_m // 128)   # scale boxes: one per 128 rows (a 64-row tile's reads half of one)
    tx = (cfg.tile_m + cfg.tile_n) * cfg.tile_k + 4 * 132 * waves + 16 * slots
    assert re.search(rf"mov\.b32\s+%r\d+, {tx};\s+mbarrier\.arrive\.expect_tx", comp.ptx), tx
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.1d", comp.ptx)) == waves + slots
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d", comp.ptx)) == (2 if epi.gated else 1)


@pytest.mark.parametrize("name", ["waves", "waves-pair", "waves-gated-split"])
def test_a_256_row_tile_folds_two_waves_per_k_tile(name):
    """A 256-row tile: per k-tile each consumer warpgroup issues its first wave's wgmma, waits, folds it, then the
    second's (two wgmma commit groups in the k-loop, each waited for), through one 64 x tile_n scratch fragment:
    a second wave's FFMAs, no spills (the stage's bytes: test_every_stage_expects_data_and_scales)."""
    comp = _compile(name)
    one_wave = K.compile_fp8_grouped_gemm(replace(comp.config, tile_m=128, stages=6), *_args(name))
    sass, sass_one = sass_or_skip(lambda: comp.sass), one_wave.sass
    assert sass.count("WARPGROUP.ARRIVE") == 2 * sass_one.count("WARPGROUP.ARRIVE") == 2
    assert sass.count("WARPGROUP.DEPBAR") == 2 * sass_one.count("WARPGROUP.DEPBAR")
    ffma = [sum(o.startswith("FFMA") for o in _ops(x)) for x in (sass, sass_one)]
    assert ffma[0] >= ffma[1] + comp.config.tile_n // 2, ffma   # a second wave's 64 x tile_n / 128 folds
    assert comp.frame_size == 0 and not any(o.startswith(("LDL", "STL")) for o in _ops(sass))


def _args(name):
    epi, N, K_, G, _ = CASES[name]
    return epi, N, K_, G


@pytest.mark.parametrize("name", ["two-ctas", "two-ctas-pair", "two-ctas-gated-split", "two-ctas-gated-waves"])
def test_two_ctas_an_sm_fit_one_sm_together(name):
    """Two CTAs an SM (GemmConfig.ctas_per_sm = 2): 256 threads a CTA (the producer warpgroup and one consumer
    warpgroup), launched for two CTAs an SM (.minnctapersm 2: 128 registers a thread, 65536 an SM), the
    consumer taking 224 of them by setmaxnreg from the producer's 32 (a sum over 256 would hang), the stages in half
    the SM's shared memory, and per k-tile two waves (two 64-row m-waves, or a 64-row tile's gate and up n-waves:
    wgmma, wait, fold twice) with no spills."""
    from fusion.kernels.fp8_gemm import TWO_CTA_REGISTER_SPLIT
    from fusion.kernels.tile_policy import FP8_SMEM_TWO_CTAS

    comp = _compile(name)
    assert "_2cta" in comp.name
    assert re.search(r"\.minnctapersm 2", comp.ptx)
    producer, consumer = TWO_CTA_REGISTER_SPLIT
    assert producer + consumer <= 256
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{producer};", comp.ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{consumer};", comp.ptx)
    assert comp.registers <= 128 and comp.shared_memory_bytes <= FP8_SMEM_TWO_CTAS + 1024
    sass = sass_or_skip(lambda: comp.sass)
    assert sass.count("WARPGROUP.ARRIVE") == 2 and comp.frame_size == 0
    assert not any(o.startswith(("LDL", "STL")) for o in _ops(sass))


@pytest.mark.parametrize("over,match", [
    (dict(tile_m=256, ctas_per_sm=2, stages=3), "ctas_per_sm = 2 with a 256x128 tile"),
    (dict(tile_m=128, tile_n=192, ctas_per_sm=2, stages=3), "ctas_per_sm = 2 with a 128x192 tile"),
    (dict(tile_m=128, ctas_per_sm=2, stages=4), "for each of two CTAs an SM"),
    (dict(ctas_per_sm=3), "ctas_per_sm = 3"),
    (dict(tile_m=64, stages=3), "tile 64x128: 64 rows are one warpgroup's"),
    (dict(tile_m=64, ctas_per_sm=2, stages=3), "ctas_per_sm = 2 with a 64x128 tile"),
])
def test_two_ctas_configs_that_cannot_fit_are_refused(over, match):
    with pytest.raises(KernelConfigError, match=match):
        K.check_fp8_config(_cfg(1024, 2048, 8, **over), K.IdentityEpilogue(), 1024, 2048)


@pytest.mark.parametrize("plain,K_,two", [(True, 2048, True), (True, 512, True), (False, 2048, False),
                                          (False, 4096, True), (False, 7168, True)])
def test_policy_takes_two_ctas_an_sm_by_epilogue_and_reduction(plain, K_, two, monkeypatch):
    """tile_policy.fp8_two_ctas: a plain epilogue (a lone GEMM's store) on two CTAs an SM at any K; an epilogue that
    does more (FC2's dgrad with d(SwiGLU·scale)) from FP8_TWO_CTAS_EPILOGUE_MIN_K; 128 x 128 tiles, three stages,
    the cooperative tile's clusters kept; gated n-wave tiles never; nothing with FP8_TWO_CTAS off."""
    from fusion.kernels import tile_policy as tp

    cfg = K.choose_fp8_config(4096, K_, 32, plain_epilogue=plain)
    coop = K.cooperative_fp8_config(4096, K_, 32)
    if two:
        assert (cfg.tile_m, cfg.tile_n, cfg.ctas_per_sm, cfg.stages) == (128, 128, 2, 3)
        assert (cfg.cluster_n, cfg.cluster_m, cfg.dynamic) == (coop.cluster_n, coop.cluster_m, coop.dynamic)
        K.check_fp8_config(cfg, K.IdentityEpilogue(), 4096, K_)
    else:
        assert cfg == coop
    dequant = K.choose_fp8_config(1024, K_, 32, col_block=128, plain_epilogue=plain)   # B1's 128 x 128 tile
    assert (dequant.ctas_per_sm == 2) == two
    gated = K.choose_fp8_config(2 * 2048, K_, 32, gated=True, col_block=128, plain_epilogue=plain)
    assert gated.ctas_per_sm == 1 and gated.tile_n == 256
    # the gated n-wave tile only with FP8_TWO_CTAS_GATED (off: measured slower): 64 x 256, CTA pairs along m
    monkeypatch.setattr(tp, "FP8_TWO_CTAS_GATED", True)
    waves = K.choose_fp8_config(2 * 2048, K_, 32, gated=True, col_block=128, plain_epilogue=plain)
    assert (waves.tile_m, waves.tile_n, waves.ctas_per_sm, waves.stages, waves.cluster_m, waves.cluster_n) == \
        (64, 256, 2, 2, 2, 1)
    K.check_fp8_config(waves, K.SwiGLUScaleEpilogue(), 2 * 2048, K_)
    monkeypatch.setattr(tp, "FP8_TWO_CTAS", False)
    assert K.choose_fp8_config(4096, K_, 32, plain_epilogue=plain) == coop
    assert K.choose_fp8_config(2 * 2048, K_, 32, gated=True, col_block=128, plain_epilogue=plain) == gated


def test_two_ctas_launch_two_ctas_an_sm(monkeypatch):
    """The persistent launch of a two-CTA kernel asks for two CTAs an SM (whole pairs), at most one a tile."""
    from fusion.kernels import api

    monkeypatch.setattr(api, "_num_sms", lambda idx: 132)
    cpu = torch.device("cpu")
    comp = _compile("two-ctas-pair")
    assert api.launch_grid(comp, 8192 * 32, cpu, None, counter_ptr=0)[0] == 264
    cooperative = _compile("pair")
    assert api.launch_grid(cooperative, 8192 * 32, cpu, None, counter_ptr=0)[0] == 132
    # fewer tiles than two CTAs an SM: one CTA a tile (100 rows in 8 groups: 1 + 8 m-tiles of 8 n-tiles)
    assert api.launch_grid(_compile("two-ctas"), 100, cpu, None, counter_ptr=0)[0] == 72


# ---- the weight-scale slots of an n-tile
def _blocks_by_slot(segs, n_idx):
    """What the producer loads: the 128-row block of B behind every slot of n-tile n_idx."""
    out = []
    for s in segs:
        b = s.first_row(n_idx) // SCALE_BLOCK
        out += [b, b + 1] if s.split else [b]
    return out


@pytest.mark.parametrize("tile_n,N,gated", [
    (128, 1024, False), (128, 1000 + 24, False), (192, 4096, False), (160, 4096, False), (64, 2048, False),
    (128, 5760, True), (128, 2 * 2888, True), (192, 2 * 2880, True), (64, 2 * 1064, True),
])
def test_slots_cover_every_column_with_its_block(tile_n, N, gated):
    """For every n-tile and 8-column chunk, the slot the consumer picks (trace-time segment, run-time
    boundary for a split one) holds the scale block of the B row behind that column."""
    segs = plan_segments(tile_n, N, gated)
    n_log = N // 2 if gated else N
    width = tile_n // 2 if gated else tile_n
    for n_idx in range(-(-n_log // width)):
        blocks = _blocks_by_slot(segs, n_idx)
        for c in range(tile_n // 8):
            seg = segment_of(segs, 8 * c)
            local = 8 * c - seg.col0
            row = seg.first_row(n_idx) + local                      # the B row behind the column
            slot = seg.slot
            if seg.split and local >= SCALE_BLOCK - seg.first_row(n_idx) % SCALE_BLOCK:
                slot += 1
            assert blocks[slot] == row // SCALE_BLOCK, (n_idx, c)
    assert num_slots(segs) <= 4


def test_aligned_tiles_need_one_slot_per_segment():
    assert num_slots(plan_segments(128, 4096, False)) == 1
    assert num_slots(plan_segments(128, 5760, True)) == 2        # gate and up: N/2 = 2880 = 45 * 64
    assert num_slots(plan_segments(192, 4096, False)) == 2       # 192-row tiles straddle 128-row blocks
    assert num_slots(plan_segments(128, 2 * 2888, True)) == 3    # the up half starts 8 rows into a 64-row step


def test_a_segment_over_three_blocks_is_refused():
    with pytest.raises(ValueError, match="three"):
        plan_segments(176, 4096, False)


# ---- TMA boxes of the scales: a box whose start is not 16-byte aligned along its (only) dimension traps
def test_scale_boxes_start_aligned_and_hold_the_wanted_floats():
    for c in range(4099):
        start, shift = box_start(c), box_shift(c)
        assert start % SCALE_ALIGN == 0 and start + shift == c
        assert shift + 128 <= SA_BOX and shift < SB_BOX      # the tile's 128 rows / the block's scale are in the box
    assert 4 * SA_BOX % 16 == 0 and 4 * SB_BOX % 16 == 0     # boxes of whole 16-byte units
    assert 4 * SA_STAGE_FLOATS % 128 == 0 and SA_STAGE_FLOATS >= SA_BOX   # 128-byte aligned smem destinations
    assert 4 * SB_SLOT_FLOATS % 128 == 0 and SB_SLOT_FLOATS >= SB_BOX


def _box_starts(debug, sizes, N, K_, tile_n=128, gated=False):
    """Every scale box start the producer computes (its trace-time methods on plain ints) for every tile and
    k-tile of a problem, and whether the consumer's shift finds each wanted float in its box."""
    epi = K.SwiGLUScaleEpilogue() if gated else K.IdentityEpilogue()
    kern = Fp8GroupedGemmKernel(_cfg(N, K_, len(sizes), gated, tile_n=tile_n), epi, debug=debug)
    kern.k_tiles, kern.n_blocks = -(-K_ // 128), -(-N // 128)
    kern.segments = plan_segments(tile_n, N, gated)
    M, offs = sum(sizes), [sum(sizes[:g]) for g in range(len(sizes) + 1)]
    width = tile_n // 2 if gated else tile_n
    starts, found = [], True
    for g in range(len(sizes)):
        for m in range(-(-sizes[g] // 128)):
            for n_idx in range(-(-(N // 2 if gated else N) // width)):
                row0, sb_rows = kern.scale_coords(g, offs[g] + m * 128, n_idx)
                for kt in range(kern.k_tiles):
                    for c in [kt * M + row0] + [b + kt for b in sb_rows]:
                        starts.append(kern.box_start(c))
                        found &= kern.box_start(c) + kern.box_shift(c) == c
    return starts, found


@pytest.mark.parametrize("sizes,N,K_,tile_n,gated", [
    ([5, 0, 251, 1000, 3], 512, 640, 128, False),
    ([1, 777], 4096, 1024, 192, False),
    ([130, 99], 2 * 2888, 384, 128, True),
])
def test_every_scale_box_of_a_ragged_problem_starts_aligned(sizes, N, K_, tile_n, gated):
    starts, found = _box_starts(Fp8DebugKnobs(), sizes, N, K_, tile_n, gated)
    assert found and all(s % SCALE_ALIGN == 0 for s in starts)
    old, found = _box_starts(Fp8DebugKnobs(scales="unaligned"), sizes, N, K_, tile_n, gated)
    assert found and any(s % SCALE_ALIGN for s in old)        # the original layout: what trapped


@pytest.mark.parametrize("knobs", [Fp8DebugKnobs(scales="off"), Fp8DebugKnobs(scales="unaligned"),
                                   Fp8DebugKnobs(reg_realloc=False)], ids=str)
def test_debug_knobs_build_what_they_say(knobs):
    """bench/fp8_bisect.py's variants: no scale TMA (the transaction counts A and B only), the original box
    starts, no setmaxnreg. Each is its own cached kernel, named for its knobs."""
    N, K_, G = 1024, 512, 8
    comp = K.compile_fp8_grouped_gemm(_cfg(N, K_, G, tile_m=128, stages=6), K.IdentityEpilogue(), N, K_, G,
                                      debug=knobs)
    off = knobs.scales == "off"
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.1d", comp.ptx)) == (0 if off else 2)
    tx = 256 * 128 + (0 if off else 4 * SA_BOX + 4 * SB_BOX)
    assert re.search(rf"mov\.b32\s+%r\d+, {tx};\s+mbarrier\.arrive\.expect_tx", comp.ptx), tx
    assert ("setmaxnreg" in comp.ptx) == knobs.reg_realloc
    plain = K.compile_fp8_grouped_gemm(_cfg(N, K_, G, tile_m=128, stages=6), K.IdentityEpilogue(), N, K_, G)
    assert comp is not plain and comp.name != plain.name
    assert comp.frame_size == 0 or not knobs.reg_realloc


def test_unknown_scale_mode_is_rejected():
    with pytest.raises(KernelConfigError, match="scales"):
        K.compile_fp8_grouped_gemm(_cfg(1024, 512, 8), K.IdentityEpilogue(), 1024, 512, 8,
                                   debug=Fp8DebugKnobs(scales="none"))


# ---- configurations and arguments the kernel refuses, by name (no compile)
@pytest.mark.parametrize("epi,over,N,K_,match", [
    (K.IdentityEpilogue(), {}, 1024, 520, r"K % 16|multiple of 16"),
    (K.IdentityEpilogue(), dict(pingpong=True), 1024, 512, "cooperative"),
    (K.IdentityEpilogue(), dict(tile_n=256, stages=4), 1024, 512, "256 spills"),
    (K.IdentityEpilogue(), dict(tile_k=64), 1024, 512, "tile_k = 128"),
    (K.IdentityEpilogue(), dict(tile_m=64), 1024, 512, "tile 64x128: 64 rows are one warpgroup's"),
    (K.IdentityEpilogue(), dict(tile_m=256, tile_n=192, stages=3), 1024, 512, "tile_n <= 128"),
    (K.IdentityEpilogue(), dict(b_major="MN"), 1024, 512, "K-major"),
    (K.IdentityEpilogue(), {}, 1020, 512, "multiple of 8"),
    (K.IdentityEpilogue(), dict(tile_m=128, tile_n=176), 4096, 512, "three"),
    (K.IdentityEpilogue(), dict(stages=9), 1024, 512, "shared memory"),
    (K.IdentityEpilogue(), dict(stages=1), 1024, 512, "at least 2"),
    (K.SwiGLUScaleEpilogue(), {}, 1000, 512, "multiple of 16"),
    (K.SwiGLUScaleMXFP8Epilogue(), dict(tile_n=32), 1024, 512, "32-column"),
    (K.IdentityEpilogue(), dict(tile_n=128, cluster_n=2), 1152, 512, "even number of n-tiles"),   # 9 n-tiles
    (K.IdentityEpilogue(), dict(cluster_n=4), 1024, 512, "cluster_n = 4"),
    (K.IdentityEpilogue(), dict(cluster_m=2, cluster_n=2), 1024, 512, "along m or along n"),
    (K.IdentityEpilogue(), dict(cluster_m=3), 2880, 512, "cluster_m = 3"),
    (K.SwiGLUScaleEpilogue(), dict(cluster_m=2, cluster_n=1, tile_n=176, stages=5), 2816, 512,
     "8-row swizzle atoms"),   # 88-row gate and up boxes
    (K.IdentityEpilogue(), dict(cluster_m=2, cluster_n=1, persistent=False), 2880, 512, "persistent kernel"),
])
def test_unsupported_configs_are_rejected(epi, over, N, K_, match):
    with pytest.raises(KernelConfigError, match=match):
        K.compile_fp8_grouped_gemm(_cfg(N, K_, 8, epi.gated, **over), epi, N, K_, 8)


def test_a_heavy_epilogue_compiles_without_spills():
    """dSwiGLU (paired AuxInput and Output, a RowVector) beside the accumulator and the scratch fragment."""
    epi, N, K_ = K.DSwiGLUEpilogue(), 2048, 1536
    assert K.compile_fp8_grouped_gemm(_cfg(N, K_, 8), epi, N, K_, 8).frame_size == 0


def test_unsupported_out_dtype_is_rejected():
    with pytest.raises(KernelConfigError, match="out_dtype"):
        K.compile_fp8_grouped_gemm(_cfg(1024, 512, 8), K.IdentityEpilogue(), 1024, 512, 8, out_dtype="float32")


def _operands(M, N=1024, K_=512, G=8):
    kb, nb = -(-K_ // 128), -(-N // 128)
    return (torch.zeros(M, K_, dtype=torch.uint8), torch.ones(kb, M), torch.zeros(G, N, K_, dtype=torch.uint8),
            torch.ones(G, nb, kb), torch.zeros(G + 1, dtype=torch.int32))


def test_run_checks_operand_shapes_before_launching():
    comp = _compile("plain")
    A, sa, B, sb, offs = _operands(5)
    out = {"out": torch.empty(5, 1024, dtype=torch.bfloat16)}
    with pytest.raises(ShapeError, match=r"A_scale must be .*\(4, 5\)"):
        K.run_fp8_grouped_gemm(comp, A, sa.t().contiguous(), B, sb, offs, out)       # (M, kb): wrong order
    with pytest.raises(ShapeError, match=r"B_scale must be .*\(8, 8, 4\)"):
        K.run_fp8_grouped_gemm(comp, A, sa, B, sb[:, :, :3].contiguous(), offs, out)
    with pytest.raises(ShapeError, match="B must be"):
        K.run_fp8_grouped_gemm(comp, A, sa, B.to(torch.bfloat16), sb, offs, out)
    with pytest.raises(ShapeError, match="offsets"):
        K.run_fp8_grouped_gemm(comp, A, sa, B, sb, offs.long(), out)
    with pytest.raises(DeviceError, match="CUDA"):
        K.run_fp8_grouped_gemm(comp, A, sa, B, sb, offs, out)                       # CPU tensors


def test_run_with_no_rows_launches_nothing():
    """M = 0 returns after the checks (CPU tensors here: a launch would fail)."""
    comp = _compile("plain")
    A, sa, B, sb, offs = _operands(0)
    assert K.run_fp8_grouped_gemm(comp, A, sa, B, sb, offs, {"out": torch.empty(0, 1024, dtype=torch.bfloat16)}) \
        is None


@pytest.mark.parametrize("N,gated,tile", [(4096, False, (256, 128, 2, 1, 4)), (1536, False, (256, 128, 2, 1, 4)),
                                          (2880, False, (128, 128, 1, 1, 6)), (5760, True, (128, 256, 1, 1, 4)),
                                          (3072, True, (128, 256, 2, 1, 4)), (1032, False, (128, 192, 2, 1, 5)),
                                          (2816, True, (128, 256, 1, 1, 4))])
def test_policy_pairs_ctas_where_the_n_tiles_pair_up(N, gated, tile):
    """(tile_m, tile_n, cluster_n, cluster_m, stages), dynamic schedule: CTA pairs along n on 256-row tiles where the
    128-column n-tiles come in pairs; else 128 x 192 pairs where those pair up (1032: 9 and 6;
    tile_policy.FP8_WIDE_ODD); single 128 x 128 CTAs elsewhere (GPT-OSS's 2880 columns: 23 and 15; pairs along m,
    tile_policy.FP8_M_PAIRS, measured slower); stages as many as fit. A gated kernel takes the 128 x 256 n-waves
    (tile_policy.FP8_GATED_WAVES), pairs along n where its 128 logical columns pair up (3072: 12 n-tiles), single
    where they do not (GPT-OSS's FC1, 2f = 5760: 23; DeepSeek-V2-Lite's, 2816: 11)."""
    cfg = K.choose_fp8_config(N, 2048, 32, gated)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n, cfg.cluster_m, cfg.stages) == tile and cfg.dynamic


@pytest.mark.parametrize("N,gated", [(2880, False), (5760, True), (2816, True)])
def test_policy_switches_m_pairs(N, gated, monkeypatch):
    """FP8_M_PAIRS on: CTA pairs along m where the n-tiles do not pair up; FP8_GATED_M_PAIRS on: a gated tile pairs
    along m even where its n-tiles pair up along n."""
    from fusion.kernels import tile_policy
    monkeypatch.setattr(tile_policy, "FP8_M_PAIRS", True)
    cfg = K.choose_fp8_config(N, 2048, 32, gated)
    assert (cfg.cluster_n, cfg.cluster_m, cfg.tile_m) == (1, 2, 128)
    monkeypatch.setattr(tile_policy, "FP8_M_PAIRS", False)
    assert (K.choose_fp8_config(N, 2048, 32, gated).cluster_m) == 1
    monkeypatch.setattr(tile_policy, "FP8_GATED_M_PAIRS", True)
    cfg = K.choose_fp8_config(3072, 2048, 32, True)
    assert (cfg.cluster_n, cfg.cluster_m) == (1, 2)
    assert K.choose_fp8_config(4096, 2048, 32, False).cluster_n == 2     # not gated: unchanged


class _StoreSaved(K.SwiGLUScaleEpilogue):
    """The training FC1's epilogue (patterns/fp8.fpat fp8_gemm_act, train variant): FC2's FP8-block input, and the
    pre-activation (gate, up) saved in bf16 for the backward."""
    outputs = (K.FP8BlockOutput("out"), K.Output("saved", paired=True))

    def apply(self, gate, up, scale):
        from fusion.kernels import epi_math as em
        return em.silu(gate) * up * scale, gate, up


def test_saved_pre_activation_beside_the_fp8_block_store_leaves_in_whole_sectors():
    """GemmConfig.quad_beside_fp8 (the policy's: tile_policy.QUAD_BESIDE_FP8_BLOCK): the training FC1 stores its
    saved bf16 pre-activation 4 columns per lane (8-byte STG, whole 32-byte sectors per quad) instead of 2 (4-byte
    STG, half sectors), without spills. The 2-column build (quad_beside_fp8=False) is what ran before session w."""
    N, K_, G = 1536, 2048, 128
    cfg = K.fp8_block_output_tile(N)
    assert cfg.quad_beside_fp8
    counts = {}
    for quad in (True, False):
        comp = K.compile_fp8_grouped_gemm(replace(cfg, quad_beside_fp8=quad), _StoreSaved(), N, K_, G)
        assert comp.frame_size == 0, f"{comp.name}: {comp.frame_size}-byte stack frame (spills)"
        ops = _ops(sass_or_skip(lambda: comp.sass))
        assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
        counts[quad] = (sum(o == "STG.E" for o in ops), sum(o == "STG.E.64" for o in ops))
    (narrow_q, wide_q), (narrow, wide) = counts[True], counts[False]
    # 2 x 2 rows x 16 chunks x 2 halves of the saved tile: 64 4-byte stores as pairs; 32 8-byte ones as quads
    assert narrow - narrow_q >= 60 and wide_q - wide >= 30, counts


def test_the_quad_switch_reaches_the_kernel_key(monkeypatch):
    """tile_policy.QUAD_BESIDE_FP8_BLOCK is read when the policy makes the gated FP8 tile, so the two builds are two
    cache entries (a job key holds the configuration) and bench/ab_switch.py --plan can flip it."""
    from fusion.kernels import tile_policy
    on = K.fp8_block_output_tile(1536)
    monkeypatch.setattr(tile_policy, "QUAD_BESIDE_FP8_BLOCK", False)
    off = K.fp8_block_output_tile(1536)
    assert on.quad_beside_fp8 and not off.quad_beside_fp8 and on != off
