"""The tile policy of the grouped GEMM: which tile configuration every kernel is built with, in one place.

Plain Python, importing nothing from fusion and not cutlass: planning, compiling and autotuning read it without
loading the DSL.

    GemmConfig                         the template's tile configuration (KernelJob.config keeps its fields)
    SHORT_TILES                        GemmConfig.short_tiles' default (FUSION_SHORT_TILES=0: off)
    choose_config(M, N, K, G, ...)     the heuristic: a function of the weight shape and gating only (M is dynamic)
    pair_ctas(config, N)               the configuration as CTA pairs sharing the A tile, where it can be
    dynamic_pairs(config, N, G)        ... on the dynamic schedule, for weights of few groups
    dense_dgrad_tile(config)           a one-group GEMM's input gradient on our kernel (fusion/runtime/lone_gemm.py)
    lone_tile(config, N)               a lone GEMM's (several groups, nothing fused) 128x256 dynamic CTA pairs
    m_pairs(config, N)                 ... as CTA pairs on neighbouring m-tiles sharing the B tile, where the
                                       n-tiles do not pair up
    n_tile_count(N, tile_n)            n-tiles per m-tile (gated or not)
    gated_tile(config, N, K)           the gated FC1 forward's CTA pairs (128x192, 128x176, 128x256 cooperative)
    tile_config(N, K, G, gated, b_major, reads_aux, gather, col_block)
                                       a fused kernel's configuration: the heuristic, except for an epilogue
                                       that reads a saved (M, n) tensor, a gathered A, and a gated TMA kernel
    aux_tile(config, N)                the tile of an epilogue reading a saved (M, n) tensor (FC2's dgrad)
    for_gather(config)                 a configuration with A gathered through an index
    gather_tile(config, N)             the wider tile a gathering kernel takes (its A loads bound it)
    gather_pairs(config, gated)        ... as CTA pairs on neighbouring m-tiles sharing the weight's tile (FC1)
    gathers_in_kernel(N)               whether an MoE FC1 gathers in its A loads or reads a copy (wide N)
    spill_fallback(config)             the configuration compile_grouped_gemm rebuilds a spilling kernel at
    band_for, resolved_band, one_band_limit, band_problem, cluster_m_problems
                                       the tile order's bands (GemmConfig.band_m; kernels/scheduler.py)
    candidates(base, N)                what autotune mode times (fusion/runtime/autotune.py)
    WgradConfig, choose_wgrad_config   the varlen-K kernel's (weight gradients, kernels/varlen_k_gemm.py), by rows
    wgrad_configs                      ... every one it may pick for a shape (compiled ahead of time)

Measured on an H200 (bench/results_h200_v3.txt); tests/test_compile_plans.py checks the SASS of the fused
kernels (no spills, wgmma).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sys
from dataclasses import dataclass

from .fp8_scales import SA_STAGE_FLOATS, SB_SLOT_FLOATS, SCALE_BLOCK


#: FUSION_SHORT_TILES=0 (read at import): every tile issues the wgmma of all its rows (the kernels before
#: 2026-11-26's short tiles; the A/B switch: it changes the jobs' keys, so both live in one kernel cache).
SHORT_TILES = os.environ.get("FUSION_SHORT_TILES", "1") != "0"

#: 16-bit outputs beside an FP8-block output (the FP8 FC1's saved pre-activation in a training step) store 4 columns
#: per lane (kernels/fragment_io.py store4_swapped: whole 32-byte sectors) instead of 2 (half sectors): on an H200
#: the FP8 FC1 of a training step 7-13% faster on five MoE shapes (bench/fp8_gated_tiles.py, docs/benchmarks.md
#: session w). FUSION_QUAD_BESIDE_FP8_BLOCK=0 (read at import) keeps the 2-column stores: the A/B switch (a
#: GemmConfig field, so both kernels live in one cache; :func:`fp8_block_output_tile` reads it per call, so
#: bench/ab_switch.py --plan flips it). Since session x a dequantized FP8-block row (the FP8 dgrad's recomputed FC2
#: input after a QuantizeFP8Block) follows it too, its quad neighbours swapping values before the decode (swapped
#: after, as the other stores do, that kernel spilled). Both stores against neither, FP8 training step over 100 steps
#: (session y, bench/results/H200-2026-11-30y-call1-ab-quad.log): Qwen3-30B-A3B -1.6%, OLMoE -2.2%, GPT-OSS-20B -0.2%,
#: what the FC1's store alone gave in session w: the dequantized row's part is not measurable.
QUAD_BESIDE_FP8_BLOCK = os.environ.get("FUSION_QUAD_BESIDE_FP8_BLOCK", "1") != "0"


@dataclass(frozen=True)
class GemmConfig:
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    cluster_m: int = 1      # 2: a CTA pair works on neighbouring m-tiles of one group and multicasts the B tile
                            # (TMA A, B not gated; for n-tile counts that do not pair up; kernels/grouped_gemm.py)
    cluster_n: int = 1      # 2: a CTA pair (cluster) works on neighbouring n-tiles of one m-tile and multicasts
                            # the A tile (TMA A, an even n-tile count, either schedule; kernels/grouped_gemm.py)
    persistent: bool = True  # False: one CTA per tile (grid = number of tiles upper bound)
    dynamic: bool = False    # dynamic (atomic counter) tile scheduler
    sm_margin: int = 0       # leave this many SMs free
    pingpong: bool = False   # 2 consumer warpgroups alternate whole tiles (epilogue overlaps the other's
                             # mainloop); each holds a tile_m x tile_n fp32 accumulator (tile_n <= 192)
    b_major: str = "K"       # "K": B is (G, N, K), K contiguous (a forward reads W[g] (out, in) so);
                             # "MN": B is (G, K, N), N contiguous (a dgrad dX = dY @ W[g] reads W[g] so)
    gather_a: bool = False   # A is the (T, K) token matrix read through an int32 index (M,): routed row r
                             # multiplies A[index[r]] (kernels/gather_producer.py; b_major "K", single CTAs)
    band_m: int = 0          # tile order inside a group: a tall group is cut into bands of at most band_m m-tiles,
                             # m fastest inside a band, then n (L2 reuse; kernels/scheduler.py); 0: band_for(tile_n);
                             # 1: m fastest over the whole group
    short_tiles: bool = SHORT_TILES  # a 128-row tile whose rows end within its first 64 (a group's short last
                                     # m-tile) issues the wgmma of those 64 rows only (kernels/mainloop.py)
    gather_tma: bool = False  # with gather_a: A's rows by one TMA box per row (1 x tile_k, the 128-byte swizzle)
                              # instead of cp.async (kernels/gather_producer.py; opt-in, not in any policy)
    quad_beside_fp8: bool = QUAD_BESIDE_FP8_BLOCK  # 16-bit outputs beside an FP8-block output, and a dequantized
                                                   # FP8-block row, store 4 columns per lane
                                                   # (kernels/tile_epilogue.py; QUAD_BESIDE_FP8_BLOCK)
    ctas_per_sm: int = 1     # FP8 kernel: 2 = one consumer warpgroup a CTA (a 128 x <= 128 tile as two 64-row
                             # m-waves), two CTAs an SM, so one CTA's epilogue overlaps the other's mainloop
                             # (kernels/fp8_gemm.py)
    ordered_waves: bool = False  # FP8 kernel, two consumer warpgroups: they issue their waves' wgmma in turn, so one's
                                 # promotion runs under the other's wgmma (kernels/fp8_mainloop.py; FP8_ORDERED_WAVES)

    @property
    def b_shape_order(self) -> str:
        """The order of B's dimensions in memory: "GNK" or "GKN"."""
        return "GNK" if self.b_major == "K" else "GKN"


#: A group whose A rows (m-tiles x tile_m x K bytes) fit in this much L2 stays one band (m fastest): its A is read
#: from DRAM once however it is walked, and a second band would read the group's B a second time.
BAND_L2_BYTES = 24 << 20


def band_for(tile_n: int) -> int:
    """The band (m-tiles) of GemmConfig.band_m = 0: 16 for tiles wider than 128 columns, else 8, so that the
    CTAs of one wave cover about as many A rows as B columns. Measured on an H100 (bench/bench_pair_gemm.py
    --bands, bench/results/H100-2026-11-26-bands.json: bands of 4 / 8 / 16 on dense Llama-3 and DeepSeek-V3's
    4096-row groups): 16 was the fastest at 128x192 tiles (Llama-3-8B's FC1 forward 7.77 -> 5.29 ms, 5.54 at 8),
    8 at 128x128 (Llama-3-70B's FC2 dgrad 11.50 -> 7.48 ms, 7.86 at 16; the FP8 kernel's 32 x 8192-row FC1 953 ->
    1047 TFLOP/s, 973 at 16)."""
    return 16 if tile_n > 128 else 8


def resolved_band(config) -> int:
    """The band a kernel built at `config` walks: band_m, or where band_m is 0 band_for(tile_n), except 1 (m fastest)
    for a kernel that gathers A through an index. Measured on an H100 (bench/bench_moe.py, DeepSeek-V3's EP8 share
    at T = 16384: 4096 routed rows per expert, 32-33 m-tiles; bench/results/H100-2026-11-26-moe-bands.txt): the
    layer's forward, whose FC1 is the gathering kernel, took 24.9 / 25.6 ms with bands against 21.4 / 20.0 ms
    without (two runs each, alternating), while the TMA kernels gain (FC2's dgrad there, and every dense GEMM).
    That was the gathering kernel on the static schedule; on the dynamic one (:func:`for_gather`, since) bands are
    not measured yet."""
    if config.band_m:
        return config.band_m
    return 1 if getattr(config, "gather_a", False) else band_for(config.tile_n)


def band_problem(config) -> str | None:
    """What is wrong with config.band_m, or None: the one check both kernels' config validations share."""
    if isinstance(config.band_m, int) and config.band_m >= 0:
        return None
    return (f"band_m = {config.band_m!r}: m-tiles per band of the tile order, an int >= 1 (1: m fastest over the "
            f"whole group), or 0 for the tile's default (tile_policy.band_for)")


def cluster_m_problems(config, gated: bool) -> list[str]:
    """What is wrong with config.cluster_m (CTA pairs on neighbouring m-tiles multicasting B), as problem strings:
    the check the bf16 and the FP8 kernel's config validations share (both split each B box between the pair)."""
    if config.cluster_m not in (1, 2):
        return [f"cluster_m = {config.cluster_m}: use 1, or 2 (a CTA pair on neighbouring m-tiles multicasting B)"]
    problems = []
    if config.cluster_m == 2:
        if config.cluster_n != 1:
            problems.append("cluster_m = 2 and cluster_n = 2: a CTA pair runs along m or along n; set one to 1")
        if not config.persistent:
            problems.append("cluster_m = 2 multicasts B in a persistent kernel: use persistent=True")
        box_rows = config.tile_n // 2 if gated else config.tile_n
        if box_rows % 16:
            problems.append(f"cluster_m = 2 splits each B box ({box_rows} rows at tile_n = {config.tile_n}"
                            f"{', gated' if gated else ''}) between the pair in whole 8-row swizzle "
                            f"atoms: pick a tile_n whose boxes are a multiple of 16 rows, or cluster_m = 1")
    return problems


def one_band_limit(band_m: int, tile_m: int, K: int, elem_bytes: int) -> int:
    """The most m-tiles a group may have and still be walked as one band: band_m, or more where their A rows fit
    in BAND_L2_BYTES. Mixtral's 2048-row groups at K = 4096 (17 m-tiles, 17 MiB of A) stay one band: walked in bands
    of 16 (16 m-tiles, then 1) its FC1 forward and FC2 dgrad were 2-5% slower (the second band re-reads the 235 MB
    expert weight for one m-tile)."""
    return max(band_m, BAND_L2_BYTES // (tile_m * K * elem_bytes))


#: A fixed row estimate per group for the heuristic: kernels must not depend on the row count, so one compile
#: serves every batch (API.md).
ROWS_PER_GROUP = 512


def _max_stages(tile_m, tile_n, tile_k, elem_bytes=2, smem=227 * 1024, reserve=1024):
    per = (tile_m + tile_n) * tile_k * elem_bytes
    return max(2, (smem - reserve) // per)


def choose_config(M_estimate: int, N: int, K: int, G: int, gated: bool = False, b_major: str = "K") -> GemmConfig:
    """Tile heuristic, a function of the weight shape (N, K, G) and of ``gated`` only (M is dynamic; ``M_estimate``
    is accepted for compatibility and ignored); ``b_major`` is passed through.

    A gated kernel (FC1's forward: SwiGLU of the gate and up halves) takes 128x192 on the dynamic schedule at
    every N (:data:`GATED_192`). Measured on an H100 (bench/bench_pair_gemm.py --gemms fc1_fwd --tiles
    192:5:pp,256:4:coop --tile-pairs, two timing rounds, bench/results/H100-2026-11-26i-fc1.log; ms, the 128x128
    static pair before -> 128x192 dynamic): Qwen3-235B-A22B at 256 rows per expert (N = 3072) 2.057 -> 1.698 (1.654
    as a dynamic pair), Qwen3-30B-A3B (N = 1536) 1.707 -> 1.368, OLMoE (N = 2048, a ragged last n-tile) 1.882 ->
    1.759; 128x256 cooperative 1.726 / 1.521 / 1.856, the 128x128 dynamic pair 1.715 / 1.402 / 1.802.

    Pingpong consumers (epilogue overlapped with the other warpgroup's mainloop) everywhere; 128x192 tiles
    with the dynamic scheduler for wide N (>= 4096; a ragged last n-tile is cheap there) and where 192 divides N
    but 128 does not (GPT-OSS's 2880: 15 whole n-tiles instead of 22 and a half-empty one; measured on an H100,
    bench/bench_pair_gemm.py --tiles, bench/results/H100-2026-11-26-tiles.json: GPT-OSS-120B's FC2 forward 2.32 ->
    1.89 ms, FC1 dgrad 4.69 -> 3.62, both below torch._grouped_mm's 2.08 / 4.02), else 128x128.
    Measured on an H200 (bench/results_h200_v3.txt) against 128x256 cooperative and the other variant.
    A 128x192 pingpong kernel whose epilogue would spill is built at 128x128 instead (:func:`spill_fallback`).

    128x128 tiles run as CTA pairs sharing the A tile (cluster_n = 2, static schedule) where N splits into an even
    number of n-tiles (:func:`pair_ctas`), else as single CTAs on the dynamic schedule. Measured on an H200
    (bench/bench_pair_gemm.py, bench/results/H200-2026-11-26-pairs.json, 8 MoE shapes x 4 routed-row GEMMs): at
    128x128 the static pair was the fastest of static/dynamic x single/pair on 8 of the 13 GEMMs without a
    saved-tensor epilogue (the others within 3%); the dynamic single beat the static single on 20 of 23 (GPT-OSS-
    120B's FC2 forward, 23 n-tiles: 2.36 -> 2.02 ms). An epilogue reading a saved tensor keeps the dynamic single
    (:func:`tile_config`; the static pair is 12-17% slower on Qwen3's and OLMoE's dgrad). Dynamic pairs
    (kernels/scheduler.py's mailbox) are chosen for 128x192 tiles of weights with few groups only
    (:func:`dynamic_pairs`): 4-6% faster on DeepSeek-V3's GEMMs and dense ones, 14% slower on GPT-OSS-120B's FC1
    forward and 11% on OLMoE's dgrad. A fused gated kernel (FC1's forward) then takes :func:`gated_tile`
    (:func:`tile_config`): pairs whatever the group count, measured faster there since.

    CTA pairs along m (:func:`m_pairs`) are not chosen here: measured on an H100 for GPT-OSS-120B's lone GEMMs
    (N=2880: 15 n-tiles at 192), the FC2 forward was slower as m-pairs (1.981 -> 2.084 ms,
    bench/results/H100-2026-11-26f-m-pairs.log); the FC1 dgrad was faster alone (4.044 -> 3.528, torch 3.826), but
    inside training steps (kernel times from bench/profile_step.py and profile_moe.py, one H100) it moved by -2% at
    512 rows per expert and +2% at 256: no gain to take."""
    tk = 64
    if N >= 4096 or (N % 128 and N % 192 == 0) or (gated and GATED_192):
        return dynamic_pairs(GemmConfig(tile_m=128, tile_n=192, tile_k=tk, stages=min(_max_stages(128, 192, tk), 5),
                                        dynamic=True, pingpong=True, b_major=b_major), N, G)
    single = GemmConfig(tile_m=128, tile_n=128, tile_k=tk, stages=6, pingpong=True, b_major=b_major)
    paired = pair_ctas(single, N)
    return paired if paired.cluster_n == 2 else dataclasses.replace(single, dynamic=True)


#: FUSION_GATED_192=0 (read at import): a gated kernel below N = 4096 takes the 128x128 tiles of the other GEMMs (the
#: policy before 2026-11-26's gated rule in :func:`choose_config`; the A/B switch).
GATED_192 = os.environ.get("FUSION_GATED_192", "1") != "0"
#: FUSION_DYNAMIC_PAIRS=0 (read at import): :func:`dynamic_pairs` leaves every configuration single (the A/B switch;
#: it changes the jobs' keys, so both live in one kernel cache).
DYNAMIC_PAIRS = os.environ.get("FUSION_DYNAMIC_PAIRS", "1") != "0"
#: The most groups a weight may have for :func:`dynamic_pairs` (a dense GEMM has one, DeepSeek-V3's EP8 share 32).
DYNAMIC_PAIRS_MAX_GROUPS = 32


def dynamic_pairs(config: GemmConfig, N: int, G: int) -> GemmConfig:
    """A 128x192 dynamic configuration as dynamic CTA pairs sharing the A tile (cluster_n = 2; rank 0 takes the
    tile ids and hands them to rank 1, kernels/scheduler.py) where the weight has at most
    DYNAMIC_PAIRS_MAX_GROUPS groups and its n-tiles pair up; else unchanged.

    Measured on two H100s (bench/bench_pair_gemm.py --tiles 192:5:pp --tile-pairs,
    bench/results/H100-2026-11-26i-tiles.log and -dense.log; ms, single -> pair): DeepSeek-V3's EP8 share at 1024
    rows per expert FC1 forward 3.077 -> 2.912-2.990, FC2 forward 1.674 -> 1.537-1.549 (torch 1.558), FC1 dgrad
    3.106 -> 2.925-2.950; Llama-3-8B at 16384 rows FC1 forward 5.568 -> 5.398-5.645, FC2 forward 2.995-3.179 ->
    2.656-2.813 (torch 2.921-2.936); Mixtral FC2 forward 3.183 -> 2.896. With many groups the pairs lost (an H200,
    bench/results/H200-2026-11-26-pairs.json: GPT-OSS-120B's FC1 forward 14% slower, 128 groups of 512 rows)."""
    if (not DYNAMIC_PAIRS or G > DYNAMIC_PAIRS_MAX_GROUPS or not config.dynamic or config.gather_a
            or config.cluster_m != 1 or n_tile_count(N, config.tile_n) % 2):
        return config
    return dataclasses.replace(config, cluster_n=2)


def dense_dgrad_tile(config: GemmConfig) -> GemmConfig:
    """The tile of a one-group (dense) GEMM's input gradient that runs on our kernel (fusion/runtime/lone_gemm.py):
    128x256 cooperative on the dynamic schedule, single CTAs. Measured on two H100s (bench/bench_pair_gemm.py --tiles
    256:4:coop, bench/results/H100-2026-11-26i-dense.log; ms, ours / torch._grouped_mm): Llama-3-70B's FC1 dgrad at
    8192 rows 10.476 / 11.203 (and 10.359 / 11.546 on the other machine), Llama-3-8B's at 16384 rows 5.320 / 5.902,
    Qwen2.5-7B's at 8192 rows 3.047 / 3.152; at fewer rows torch led (Llama-3-8B at 4096 rows 1.483 / 1.367,
    Llama-3-70B at 2048 rows 2.830 / 2.739). The 128x192 pingpong tile was no faster than torch there."""
    return dataclasses.replace(config, tile_n=256, stages=_max_stages_capped(256, 4), pingpong=False, dynamic=True,
                               cluster_n=1, cluster_m=1)


#: FUSION_LONE_WIDE=0 (read at import): lone GEMMs keep :func:`choose_config`'s tile (and fusion/runtime/lone_gemm.py
#: its older rule); the A/B switch (lone_gemm.WIDE_TILE, flipped per call by bench/ab_switch.py).
LONE_WIDE = os.environ.get("FUSION_LONE_WIDE", "1") != "0"
#: The lone tile's width: its n-tiles must pair up (an even count) for the CTA pairs.
LONE_TILE_N = 256


def lone_pairs(N: int) -> bool:
    """Whether a lone GEMM N wide takes :func:`lone_tile`: its 256-column n-tiles (a partial last one counts) pair
    up."""
    return n_tile_count(N, LONE_TILE_N) % 2 == 0


def lone_tile(config: GemmConfig, N: int) -> GemmConfig:
    """The tile of a lone GEMM of several groups (the identity epilogue: FC2's forward and FC1's input gradient,
    fusion/runtime/lone_gemm.py): 128x256 cooperative on the dynamic schedule as CTA pairs sharing the A tile
    (rank 0 takes the tile ids, kernels/scheduler.py), where the 256-column n-tiles pair up; else `config`.
    torch._grouped_mm's own sm90 grouped kernel is 128x256 cooperative too (with pairs along m).

    Measured on an H100 (bench/bench_pair_gemm.py --no-schedules --tiles 256:4:coop --tile-pairs --tile-m-pairs,
    bench/results/H100-2026-11-27d-lone-tiles.json; ms, choose_config's tile / this tile / torch._grouped_mm): FC2
    forward of Hunyuan-A13B (1024 rows per expert, N = 4096) 2.846 / 2.402 / 2.750, Qwen2-57B-A14B 2.350 / 1.915 /
    1.984, GLM-4.5-Air 1.402 / 1.349 / 1.403, SonicMoE's (2048 rows) 3.684 / 3.480 / 3.754, GPT-OSS-120B (N = 2880:
    a quarter-full last n-tile) 1.990 / 1.931 / 2.070; FC1 dgrad of GLM-4.5-Air 2.859 / 2.535 / 2.523, Qwen2-57B-
    A14B 6.114 / 3.508 / 3.526, Qwen3-30B-A3B 1.561 / 1.369 / 1.397, SonicMoE's 7.332 / 6.510 / 6.864, DeepSeek-V3's
    EP8 share 11.313 / 11.025 / 11.151, Hunyuan-A13B 6.053 / 4.927 / 4.803. The same tile as single CTAs and as static
    pairs was slower on all 16 (bench/results/H100-2026-11-27d-lone-tiles-2.json has 17 more blocks, and
    fusion/runtime/lone_gemm.py the rule that reads them)."""
    if config.gather_a or not lone_pairs(N):
        return config
    return dataclasses.replace(config, tile_n=LONE_TILE_N, stages=_max_stages_capped(LONE_TILE_N, 4), pingpong=False,
                               dynamic=True, cluster_n=2, cluster_m=1)


def n_tile_count(N: int, tile_n: int) -> int:
    """n-tiles of a GEMM N wide at ``tile_n`` columns; a gated GEMM counts the same (its logical tile_n/2 columns
    over N/2)."""
    return -(-N // tile_n)


def m_pairs(config: GemmConfig, N: int) -> GemmConfig:
    """`config` as CTA pairs on neighbouring m-tiles multicasting B (cluster_m = 2, dynamic schedule) where its
    n-tiles do not pair up (an odd count: the pairs along n of :func:`pair_ctas` cannot run) and B is read by
    TMA; else unchanged. The pair reads the weight's tile once for two m-tiles; a group's odd last m-tile leaves
    rank 1 a tile without rows."""
    if config.gather_a or not config.persistent or n_tile_count(N, config.tile_n) % 2 == 0:
        return config
    return dataclasses.replace(config, dynamic=True, cluster_n=1, cluster_m=2)


def pair_ctas(config: GemmConfig, N: int) -> GemmConfig:
    """`config` as CTA pairs multicasting A (cluster_n = 2) where it can be: the static schedule, A loaded by TMA
    (not gathered) and an even number of n-tiles (a gated tile's n-tiles count the same: tile_n/2 logical columns
    of N/2). Measured on an H200 (bench/bench_pair_gemm.py, T=16384 routed by top-k, static single -> static
    pair): the gated FC1 forward 1.61 -> 1.35 ms on Qwen3-30B-A3B (N=1536, K=2048), 1.82 -> 1.54 on OLMoE and
    11.9 -> 6.7 ms on SonicMoE's (N=2048, K=4096); Qwen3's FC2 forward 0.77 -> 0.64 ms (torch._grouped_mm 0.71)."""
    if config.dynamic or config.gather_a or not config.persistent or n_tile_count(N, config.tile_n) % 2:
        return dataclasses.replace(config, cluster_n=1)
    return dataclasses.replace(config, cluster_n=2)


#: Shared memory an FP8 kernel's pipeline stages may take: 227 KiB less barriers, scheduler slots, alignment.
FP8_SMEM = 227 * 1024 - 1024
#: The same for each of two CTAs an SM (GemmConfig.ctas_per_sm = 2): 228 KiB an SM, 1 KiB of it reserved per CTA.
FP8_SMEM_TWO_CTAS = 113 * 1024 - 1024


def fp8_smem_limit(config) -> int:
    """The shared memory an FP8 kernel at `config` may give its pipeline stages."""
    return FP8_SMEM if getattr(config, "ctas_per_sm", 1) == 1 else FP8_SMEM_TWO_CTAS


def fp8_stage_bytes(tile_m: int, tile_n: int, slots: int) -> int:
    """Shared memory of one FP8 pipeline stage: A and B tiles (one byte per element, tile_k = 128), the tile's
    activation scales (one aligned box per 128 rows, padded to 128 bytes) and one 128-byte box per weight-scale slot
    (kernels/fp8_scales.py)."""
    return (tile_m + tile_n) * SCALE_BLOCK + 4 * SA_STAGE_FLOATS * max(1, tile_m // 128) + 4 * SB_SLOT_FLOATS * slots


#: The FP8 kernel's tile rows where its n-tiles pair up (FUSION_FP8_TILE_M, read at import; 128 or 256):
#: :func:`choose_fp8_config`.
FP8_TILE_M = int(os.environ.get("FUSION_FP8_TILE_M", "256"))
#: Where the FP8 kernel's 128-column n-tiles do not pair up but 192-column ones do (GPT-OSS's FC1, 2f = 5760: 45
#: and 30 of them), :func:`choose_fp8_config` takes 128 x 192 CTA pairs instead of single 128 x 128 CTAs, for a
#: GEMM alone (the lone FP8 GEMMs' identity epilogue) and a forward's inference kernel, not the fused kernels of a
#: training step (FUSION_FP8_WIDE_ODD=0, read at import, turns it off). Measured on an H100 (bench/results/H100-2026-11-27j-fp8-wide-odd*): GPT-OSS-120B's FC1 GEMM alone 904
#: against 835 TFLOP/s (interleaved rounds; 128 x 192 single CTAs 848); on the FP8 blocks (bench/ab_switch.py
#: --plan --path fusion_fp8, three rounds) the forward 4.5% / 4.1% faster (GPT-OSS-20B / -120B), the training step,
#: whose FC1 kernel also writes the saved pre-activation, +1.3% / -0.3%: so a training step keeps 128 x 128. Where the
#: 192-column tiles do not pair either (2880: 15) single 128 x 192 CTAs lost (FC2's GEMM 771 against 791; with
#: them the GPT-OSS steps' backward was slower), so those keep 128 x 128.
FP8_WIDE_ODD = os.environ.get("FUSION_FP8_WIDE_ODD", "1") != "0"
#: Every gated FP8 kernel (FC1 + SwiGLU, with or without the FP8-block store) on the 128 x 256 tile walked as gate
#: and up n-waves (:func:`fp8_block_output_tile`) instead of :func:`choose_fp8_config`'s tiles (FUSION_FP8_GATED_WAVES=0,
#: read at import, turns it off; the policy reads this attribute per job, so bench/ab_switch.py can flip it).
#: Measured on an H100 (bench/fp8_gated_tiles.py, the SwiGLU·scale kernel alone, interleaved rounds;
#: bench/results/H100-2026-11-27k-gated-tiles*), TFLOP/s n-waves against the old policy's tile: DeepSeek-V3 EP8 1289 /
#: 1186, Qwen3-30B-A3B 1054 / 932, OLMoE 1150 / 1068, DeepSeek-V2-Lite 1120 / 1021, Qwen3-235B-A22B 920 / 744,
#: Mixtral 1203 / 1124, GPT-OSS-20B 1052 / 1058 (its 128-column n-tiles do not pair: single CTAs).
FP8_GATED_WAVES = os.environ.get("FUSION_FP8_GATED_WAVES", "1") != "0"
#: The FP8 dgrad whose epilogue also writes its chain's output FP8-block dequantized (after a
#: QuantizeFP8Block(columnwise=False): kernels.epilogue.FP8BlockDequantOutput) on 128-row tiles (:func:`fp8_block_output_tile`)
#: rather than the policy's 256-row pairs (FUSION_FP8_DEQUANT_128=0, read at import, keeps the policy's; the runtime
#: reads this attribute per job, so bench/ab_switch.py --plan can flip it). Measured on an H200 (bench/ab_switch.py
#: against keeping the quantized tensor, bench/results/H200-2026-11-28m-dequant-*): with the 256-row pairs the
#: dequantizing epilogue cost more than the dequantize passes it saves (Qwen3-30B-A3B's training step +6.2%, OLMoE
#: +1.3%); on 128 x 128 tiles the same steps -7.6% and -4.4%.
FP8_DEQUANT_128 = os.environ.get("FUSION_FP8_DEQUANT_128", "1") != "0"
#: Average rows per group (a call's rows / G: host-known, no sync) from which a 256-row FP8 tile runs as single
#: CTAs instead of CTA pairs; 0 (the default): never (FUSION_FP8_SINGLE_ROWS, read at import; the runtime reads this
#: attribute per call): :func:`fp8_for_rows`.
FP8_SINGLE_ROWS = int(os.environ.get("FUSION_FP8_SINGLE_ROWS", "0"))
#: The same for the two-CTA 128 x 128 tile (GemmConfig.ctas_per_sm = 2: the lone FP8 GEMMs, FC2's fused dgrad from
#: K = 4096) of a grouped GEMM (G >= 2); 0: never (FUSION_FP8_TWO_CTAS_SINGLE_ROWS, read at import; the runtime reads
#: this attribute per call). Measured on an H200 (session af, bench/results/H200-2026-11-30af-call{3,4}-*): issue 9's
#: target shape (32 groups of 8192 rows, K = 7168, N = 4096; bench/fp8_tile_sweep.py --two-ctas, the identity
#: epilogue, interleaved rounds) single CTAs 1059-1066 TFLOP/s against the pairs' 1024-1039 (+2.6-3.4% at every band),
#: by bench/bench_fp8_gemm.py 1100-1103 on one machine start, 1087 on another (the pairs 1082 in an earlier call;
#: torch's rowwise FP8 grouped GEMM 1080-1099 in the same runs); at 512-1024 rows per group the pairs level or
#: ahead (Qwen3-30B-A3B's FC2 805 against 784, its FC2 dgrad 942 / 917, OLMoE's FC1 923 / 925, DeepSeek-V3 EP8's FC2
#: 939 / 946), hence a threshold by rows per group, as session j's
#: 256-row pairs on an H100 (DeepSeek-V3's FC1 at 4096 rows per group: single 1122, pair 1094). One-group GEMMs keep
#: their pairs: the dense FP8 blocks' steps with single CTAs (bench/ab_switch.py, three rounds of 100 steps)
#: Llama-3-8B +0.6% (forward +0.9%), Llama-3-70B +2.3% (+1.8%), as session j measured for the 256-row tile.
FP8_TWO_CTAS_SINGLE_ROWS = int(os.environ.get("FUSION_FP8_TWO_CTAS_SINGLE_ROWS", "4096"))


def fp8_single_at(rows: int | None, G: int, two_ctas: bool = False) -> bool:
    """Whether a call over `rows` routed rows in G groups runs a 256-row FP8 tile (`two_ctas`: the two-CTA 128-row
    tile, grouped GEMMs only) as single CTAs."""
    threshold = FP8_TWO_CTAS_SINGLE_ROWS if two_ctas else FP8_SINGLE_ROWS
    if two_ctas and G < 2:
        return False
    return bool(threshold) and rows is not None and rows >= threshold * G


def fp8_for_rows(config: GemmConfig, rows: int | None, G: int) -> GemmConfig:
    """The FP8 kernel's configuration for a call over `rows` routed rows (None: not known, `config` as is): with
    :data:`FP8_SINGLE_ROWS` set, a 256-row tile's CTA pairs become single CTAs from that many rows per group.

    Off by default: it wins on one GEMM family and loses on another. Measured on an H100 with the configurations
    timed in interleaved rounds (bench/fp8_tile_sweep.py --pair-vs-single; the card is power-bound on these
    launches, its SM clock falling from 1980 to 1140-1425 MHz at 650-700 W, so timed one after another the first
    configuration ran up to 20% faster; bench/results/H100-2026-11-27j-fp8-pair-single-*), TFLOP/s single against
    pair, balanced groups: DeepSeek-V3's FC1 (K 7168, N 4096, 32 groups) at 8192 rows per group (issue 9's target)
    1128 / 1083, at 4096 1122 / 1094, at 1024 1049 / 1060; its FC2 (K 2048, N 7168) and Qwen3-235B's FC1 (K 4096,
    N 3072, 128 groups) within 0.3% from 4096 rows per group, the pair 0.5-1% ahead at 1024. On FP8 blocks in one
    process (bench/ab_switch.py --path fusion_fp8, at 4096 against off, three rounds; -ab-fp8-single-rows.log):
    Llama-3-70B (one group, 8192 rows) forward +1.9%, training step +5.6% slower with single CTAs; Llama-3-8B (16384
    rows) within 0.6%; DeepSeek-V3 EP8 (1024 rows per group: unchanged kernels) within 0.8%.

    The two-CTA 128-row tile's pairs (GemmConfig.ctas_per_sm = 2) of a grouped GEMM become single CTAs from
    :data:`FP8_TWO_CTAS_SINGLE_ROWS` rows per group (4096 by default)."""
    two = config.ctas_per_sm == 2
    if config.cluster_n != 2 or not (two or config.tile_m == 256) or not fp8_single_at(rows, G, two):
        return config
    return _single_ctas(config)


def fp8_row_configs(config: GemmConfig, G: int) -> list[GemmConfig]:
    """Every configuration :func:`fp8_for_rows` can make of `config` (what Sequential.compile builds ahead)."""
    by_rows = fp8_for_rows(config, 1 << 62, G)   # more rows than any threshold: whatever a threshold can change
    return [config] if by_rows == config else [config, by_rows]


@functools.lru_cache(maxsize=None)
def _single_ctas(config: GemmConfig) -> GemmConfig:
    """`config` as single CTAs (made once per configuration: a call's host path asks for it)."""
    return dataclasses.replace(config, cluster_n=1)


#: Where the FP8 kernel's n-tiles do not pair up (an odd count: GPT-OSS's 2880 columns, DeepSeek-V2-Lite's 1408), CTA
#: pairs on neighbouring m-tiles of one group sharing the B tile (cluster_m = 2: each CTA loads half of every B box and
#: multicasts it) instead of single CTAs: FUSION_FP8_M_PAIRS=1 (read at import; the policy reads this attribute per
#: job, so bench/ab_switch.py --plan can flip it): :func:`fp8_block_output_tile` and :func:`choose_fp8_config`. A
#: group's odd last m-tile leaves rank 1 of its pair a tile past the group's rows (computed, masked).
#:
#: Off by default: measured slower. On an H200 (bench/ab_switch.py --plan --path fusion_fp8, three alternating rounds
#: of ten-step windows, which read boost clocks, not the power-capped ones: to re-time at 100 steps;
#: bench/results/H200-2026-11-29v-ab-fp8-m-pairs.log; ms, m-pairs / single CTAs, the FC1 forward and training FC1
#: and FC2's dgrad affected): DeepSeek-V2-Lite forward 0.958 / 0.951, training step 4.042 / 3.929 (+2.9%);
#: GPT-OSS-20B 1.838 / 1.836 and 7.375 / 7.296 (+1.1%). Sharing the weight's tile saves L2 traffic these kernels are
#: not bound by (their epilogue, not overlapped with the mainloop, is what they wait on), and a pair's CTAs wait for
#: each other at every stage.
FP8_M_PAIRS = os.environ.get("FUSION_FP8_M_PAIRS", "0") != "0"
#: A gated FP8 kernel on the 128 x 256 n-wave tile whose n-tiles do pair up as CTA pairs along m (sharing the 256-row
#: B tile, 32 KiB a stage) instead of along n (sharing the 128-row A tile, 16 KiB): FUSION_FP8_GATED_M_PAIRS=1 (read at
#: import; the policy reads this attribute per job). Off by default: on an H200 (as above,
#: -ab-fp8-gated-m-pairs.log) Qwen3-30B-A3B's forward 0.850 / 0.821 ms (+3.5%), training step +0.3%; DeepSeek-V3
#: EP8's forward +0.5%, step -0.9% (within its rounds' spread). Re-timed over 100-step windows (session y,
#: -call1-ab-gmp.log), training step: Qwen3-30B-A3B +1.4%, OLMoE +0.3%: still off.
FP8_GATED_M_PAIRS = os.environ.get("FUSION_FP8_GATED_M_PAIRS", "0") != "0"


#: FP8 kernels on 128 x 128 tiles with one consumer warpgroup a CTA and two CTAs an SM (GemmConfig.ctas_per_sm = 2:
#: the SM's two CTAs drift apart, so one's epilogue runs while the other's wgmma do, where a cooperative tile's two
#: warpgroups reach their epilogues together and the tensor cores wait), by :func:`fp8_two_ctas`
#: (FUSION_FP8_TWO_CTAS=0, read at import, turns it off; the policy reads this attribute per job, so
#: bench/ab_switch.py --plan can flip it). Measured on an H200 (bench/fp8_dgrad_epilogue.py --variants
#: kernel,two-ctas, the plan's own jobs on six blocks' shapes and group sizes, interleaved rounds, the same bits;
#: bench/results/H200-2026-11-30ae-call1-*): the lone GEMMs (FC2's forward, FC1's dgrad) 3.0-7.3% faster on all twelve;
#: FC2's dgrad with d(SwiGLU·scale) (B1, whose epilogue reads the saved pre-activation and writes three outputs: a
#: thread now runs twice its epilogue) -11.0% / -12.9% at K = 4096 / 7168 (Mixtral-8x7B, DeepSeek-V3 EP8), but -3.6 /
#: -0.1 / +0.7% at K = 2048 (OLMoE, Qwen3-30B-A3B, DeepSeek-V2-Lite) and +6.5% on GPT-OSS-20B (K = 2880): hence
#: :data:`FP8_TWO_CTAS_EPILOGUE_MIN_K`.
FP8_TWO_CTAS = os.environ.get("FUSION_FP8_TWO_CTAS", "1") != "0"
#: The shortest reduction at which a kernel whose epilogue does more than store the accumulator takes two CTAs an
#: SM: a longer mainloop hides more of the other CTA's (doubled) epilogue.
FP8_TWO_CTAS_EPILOGUE_MIN_K = 4096
#: The gated 128 x 256 n-wave tile (the FP8 FC1 with SwiGLU·scale and its FP8-block store) as two CTAs an SM too: a
#: 64 x 256 tile, one warpgroup's 64 rows of the gate and up n-waves (the registers and the epilogue each cooperative
#: warpgroup has today), two stages, CTA pairs along m sharing the 32 KiB B box (:func:`two_cta_tile`).
#: FUSION_FP8_TWO_CTAS_GATED=1 (read at import; the policy reads this attribute per job). **Off: measured slower**
#: (session af, H200, bitwise the cooperative kernel's output; bench/results/H200-2026-11-30af-call{1,2}-*): the
#: training FC1 alone (bench/fp8_dgrad_epilogue.py --step F1, interleaved) +3.4..+4.5% at K = 2048 (OLMoE,
#: Qwen3-30B-A3B, DeepSeek-V2-Lite), +9.7% Qwen3-235B-A22B, +2.8% DeepSeek-V3 EP8, +2.0% GPT-OSS-120B, +0.7%
#: Mixtral-8x7B, +0.2% Llama-3-70B, GPT-OSS-20B -1.0% / -6.2% (two runs); the FP8 step (bench/ab_switch.py --plan,
#: three rounds of 100 steps) +0.5..+1.6% on four blocks, -0.5% on GPT-OSS-20B. Two stages (where the cooperative
#: tile has four) hide less of the mainloop's latency than the overlapped epilogue gains.
FP8_TWO_CTAS_GATED = os.environ.get("FUSION_FP8_TWO_CTAS_GATED", "0") != "0"


#: The switches the FP8 policy reads per job that a lone FP8 GEMM's kernel depends on besides its shape and rows
_FP8_SWITCHES = ("FP8_TWO_CTAS", "FP8_TWO_CTAS_GATED", "FP8_TILE_M", "FP8_WIDE_ODD", "FP8_M_PAIRS")
_read_fp8_switches = operator.attrgetter(*_FP8_SWITCHES)


def fp8_switches() -> tuple:
    """The values of those switches: part of the key under which the runtime keeps an FP8 kernel
    (fusion/runtime/fp8_gemm.py), so that flipping one (an A/B in one process) loads the other kernel instead of
    reusing the one loaded before. (Read per interpretive FP8 GEMM call: one C-level attrgetter over this module.)"""
    return _read_fp8_switches(sys.modules[__name__])


def fp8_switch_sources() -> tuple:
    """Those switches as (module, attribute) pairs: a replay's generated guard reads each attribute itself
    (fusion/runtime/launch_code.py `LaunchCode.switches`), with no function call per replayed call."""
    here = sys.modules[__name__]
    return tuple((here, name) for name in _FP8_SWITCHES)


def two_cta_tile(config: GemmConfig) -> GemmConfig | None:
    """A cooperative FP8 configuration's two-CTA twin (one consumer warpgroup a CTA, two CTAs an SM), or None where
    it has none: a 128-column tile becomes 128 x 128 (its clusters kept); the gated 128 x 256 n-wave tile 64 x 256,
    as CTA pairs along m (two stages fit: the pair shares the B box); tiles of 192 columns have none (the
    accumulator would not fit one warpgroup). As many stages as fit half the SM's shared memory."""
    if config.tile_n == 128:
        slots = 2      # the stage's room for a tile straddling two weight-scale blocks (a gated half: 2 as well)
        stages = FP8_SMEM_TWO_CTAS // (fp8_stage_bytes(128, 128, slots) + 16)
        return dataclasses.replace(config, tile_m=128, ctas_per_sm=2, stages=stages)
    if config.tile_n == 256 and config.tile_m == 128:   # the gated n-wave tile (only gated kernels take 256)
        stages = FP8_SMEM_TWO_CTAS // (fp8_stage_bytes(64, 256, 3) + 16)
        return dataclasses.replace(config, tile_m=64, ctas_per_sm=2, stages=stages, cluster_n=1, cluster_m=2)
    return None


def fp8_two_ctas(config: GemmConfig, K: int, plain_epilogue: bool) -> GemmConfig:
    """`config` as one consumer warpgroup a CTA, two CTAs an SM (:func:`two_cta_tile`) where :data:`FP8_TWO_CTAS`
    and the rule allow: a plain epilogue (the lone GEMMs' store) at any K, any other from
    :data:`FP8_TWO_CTAS_EPILOGUE_MIN_K`; the gated n-wave tile only with :data:`FP8_TWO_CTAS_GATED` (off: measured
    slower). Else `config`."""
    if not FP8_TWO_CTAS:
        return config
    if config.tile_n == 256:
        return (two_cta_tile(config) or config) if FP8_TWO_CTAS_GATED else config
    if config.tile_n != 128 or not (plain_epilogue or K >= FP8_TWO_CTAS_EPILOGUE_MIN_K):
        return config
    return two_cta_tile(config)


def _fp8_pairs(n_tiles_pair: bool, m_pairs_first: bool = False) -> dict:
    """The cluster fields of a 128-row FP8 tile: along n where its n-tiles pair up (unless `m_pairs_first`), else
    along m where :data:`FP8_M_PAIRS` allows, else single CTAs."""
    if n_tiles_pair and not m_pairs_first:
        return dict(cluster_n=2, cluster_m=1)
    return dict(cluster_n=1, cluster_m=2 if (FP8_M_PAIRS or m_pairs_first) else 1)


#: The logical columns of an FP8-block output's scale block (a row's 1 x 128 block must be whole in a tile).
FP8_BLOCK_COLUMNS = 128


def fp8_block_output_tile(N: int, gated: bool = True) -> GemmConfig:
    """The FP8 kernel's tile when its epilogue quantizes to FP8-block (FC1 -> SwiGLU -> Scale -> QuantizeFP8Block):
    128 logical columns, so a row's 1 x 128 block is whole in the tile. Gated: 128 x 256, the gate and up halves
    walked as two n-waves through one scratch fragment (kernels/fp8_gemm.py); plain: 128 x 128 (a 256-row tile's
    two m-waves with the quantizing store's 16-chunk batch spilled). 128 rows either way: a thread holds at most 128
    accumulator and 64 scratch floats. Dynamic CTA pairs sharing the A tile where the n-tiles pair up, else single
    CTAs (CTA pairs along m sharing the B tile with :data:`FP8_M_PAIRS`, and for every gated tile with
    :data:`FP8_GATED_M_PAIRS`: both measured slower, off); as many stages as fit (a gated stage holds three
    weight-scale slots at most: the gate half's block and the up half's one or two)."""
    n_log = N // 2 if gated else N
    pair = n_tile_count(n_log, FP8_BLOCK_COLUMNS) % 2 == 0
    tile_n, slots = (2 * FP8_BLOCK_COLUMNS, 3) if gated else (FP8_BLOCK_COLUMNS, 2)
    stages = min(8, FP8_SMEM // (fp8_stage_bytes(128, tile_n, slots) + 16))
    return GemmConfig(tile_m=128, tile_n=tile_n, tile_k=SCALE_BLOCK, stages=stages, pingpong=False,
                      dynamic=True, quad_beside_fp8=QUAD_BESIDE_FP8_BLOCK,
                      **_fp8_pairs(pair, gated and FP8_GATED_M_PAIRS))


def choose_fp8_config(N: int, K: int, G: int, gated: bool = False, rows: int | None = None,
                      wide_odd: bool | None = None, col_block: int = 8, plain_epilogue: bool = False) -> GemmConfig:
    """The FP8 kernel's configuration: :func:`cooperative_fp8_config`'s, as two CTAs an SM where
    :func:`fp8_two_ctas` says (`plain_epilogue`: the epilogue only stores the accumulator, as a lone GEMM's)."""
    cfg = fp8_two_ctas(cooperative_fp8_config(N, K, G, gated, rows, wide_odd, col_block), K, plain_epilogue)
    if FP8_ORDERED_WAVES and cfg.ctas_per_sm == 1:
        cfg = dataclasses.replace(cfg, ordered_waves=True)
    return cfg


#: The FP8 forward / dgrad kernel's two consumer warpgroups issuing their waves' wgmma in turn
#: (GemmConfig.ordered_waves; FUSION_FP8_ORDERED_WAVES=1, read at import; read per job, so bench/ab_switch.py --plan
#: can flip it), as :data:`FP8_WGRAD_ORDERED_WAVES` for the kernels whose promotion is one FFMA an element. Two-CTA tiles
#: have one consumer warpgroup and are left as they are. **Off: measured slower** (session ai, H200, three rounds of 100
#: FP8 steps, bench/results/H200-2026-12-01ai-call4-ab-ordered.*): +1.1% Mixtral-8x7B and Qwen3-30B-A3B, +1.8% OLMoE,
#: +2.1% GPT-OSS-20B, +3.0% DeepSeek-V2-Lite: these warpgroups already drift apart (kernels/fp8_mainloop.py), and the
#: turns add a barrier's latency to every wave.
FP8_ORDERED_WAVES = os.environ.get("FUSION_FP8_ORDERED_WAVES", "0") != "0"


def cooperative_fp8_config(N: int, K: int, G: int, gated: bool = False, rows: int | None = None,
                           wide_odd: bool | None = None, col_block: int = 8) -> GemmConfig:
    """The FP8 block-scaled kernel's tile (kernels/fp8_gemm.py): 128 columns (one weight-scale block per n-tile),
    cooperative, as many stages as fit, the dynamic scheduler; where the n-tile count is even, CTA pairs
    (cluster_n = 2) on 256-row tiles (:data:`FP8_TILE_M`: each consumer warpgroup walks its 128 rows as two 64-row
    waves through one scratch fragment, so a thread holds 2 x 64 accumulator and 64 scratch floats), else single
    CTAs on 128-row tiles (CTA pairs along m sharing the B tile with :data:`FP8_M_PAIRS`, measured slower). A gated
    tile reads two weight-scale slots (gate and up rows). `rows`: a call's routed rows, where known
    (:func:`fp8_for_rows`: single CTAs at many rows per group). `wide_odd`: whether 128 x 192
    pairs may replace single CTAs where the 128-column n-tiles do not pair up (None: :data:`FP8_WIDE_ODD`; the
    runtime passes False for the fused kernels of a training step, fusion/runtime/kernel.py `make_job`).
    `col_block`: the logical columns the epilogue's block-wise output needs whole in a tile (an FP8-block output:
    128, a row's whole 1 x 128 block): a gated kernel then takes :func:`fp8_block_output_tile` (128 x 256, two
    n-waves), a plain one keeps 128 columns.

    256 rows, measured on an H100 (bench/fp8_tile_sweep.py, one call, the identity epilogue on balanced groups;
    bench/results/H100-2026-11-27i-fp8-sweep-256.{json,log}), TFLOP/s against the 128-row tile, both dynamic CTA
    pairs: ahead or level on all thirteen GEMMs whose n-tiles pair, e.g. DeepSeek-V3 EP8's FC1 1136 against 1051,
    FC2 1040 against 959, OLMoE's FC1 1035 against 946, Qwen3-30B-A3B's FC1 898 against 869, Qwen3-235B-A22B's
    FC2 775 against 775; issue 9's target (32 x 8192 rows, K = 7168, N = 4096) 1056 against 985 (1107 as single
    CTAs). On FP8 blocks in one process (bench/ab_switch.py --plan --path fusion_fp8, three rounds;
    bench/results/H100-2026-11-27i-ab-fp8-tile-m.log), 256 against 128 rows, forward / training step:
    DeepSeek-V3 EP8 -1.7% / -1.9%, Qwen3-30B-A3B -1.5% / -0.6%, OLMoE -3.5% / -1.0%; but GPT-OSS-120B's
    forward, whose n-tiles do not pair (45 and 23), +2.4% (its identity GEMMs alone: 927 against 876 TFLOP/s as
    single CTAs), so single CTAs keep 128 rows.

    128 rows, measured on an H100 (bench/fp8_tile_sweep.py, bench/results/H100-2026-11-24-fp8-tile-sweep.json;
    the expert GEMMs of Qwen3-30B-A3B, OLMoE and DeepSeek-V3's EP8 share): 128 columns beat 64 (by 11-33%) and
    192 (by 1-14%) everywhere; the dynamic schedule beats the static one by 0.5-5.6% on the fine-grained shapes
    and 3% on DeepSeek-V3's FC2, and loses 1.3% on its FC1."""
    if col_block == FP8_BLOCK_COLUMNS or (gated and FP8_GATED_WAVES):
        return fp8_block_output_tile(N, gated)
    slots = 2 if gated else 1
    # CTA pairs sharing the A tile where the n-tiles pair up; measured on an H200 (bench/fp8_tile_sweep.py,
    # bench/results/H200-2026-11-26-fp8-sweep*.json): within -2..+1% of single CTAs on the GEMMs of eight MoE
    # blocks at 16k tokens, and 8% faster (867 against 803 TFLOP/s) on DeepSeek-V3's FC1 at 32 x 8192 rows
    pair = n_tile_count(N, 128) % 2 == 0
    if not pair and (FP8_WIDE_ODD if wide_odd is None else wide_odd) and n_tile_count(N, 192) % 2 == 0:
        # 128 x 192 CTA pairs (a tile's columns, or each gated half's, in at most two weight-scale blocks: two slots
        # per half)
        stages = min(8, FP8_SMEM // (fp8_stage_bytes(128, 192, 2 * slots) + 16))
        return GemmConfig(tile_m=128, tile_n=192, tile_k=SCALE_BLOCK, stages=stages, pingpong=False, dynamic=True,
                          cluster_n=2)
    tile_m = FP8_TILE_M if pair else 128
    stages = min(8, FP8_SMEM // (fp8_stage_bytes(tile_m, 128, slots) + 16))
    return fp8_for_rows(GemmConfig(tile_m=tile_m, tile_n=128, tile_k=SCALE_BLOCK, stages=stages, pingpong=False,
                                   dynamic=True, **_fp8_pairs(pair)), rows, G)


def tile_config(N: int, K: int, G: int, gated: bool, b_major: str, reads_aux: bool, gather: bool = False,
                col_block: int = 8) -> tuple:
    """The tile configuration of a fused kernel (as GemmConfig fields, KernelJob.config): the heuristic, with two
    overrides: an epilogue reading a saved (M, n) tensor (FC2's dgrad + d(act*scale)) takes :func:`aux_tile`
    (tests/test_compile_plans.py checks the SASS); a kernel that gathers A's rows through an index (`gather`) takes
    :func:`gather_tile`'s width and :func:`for_gather`'s schedule. A gated kernel otherwise takes :func:`gated_tile`;
    `col_block`: the logical columns its outputs' blocks need whole in a tile (an MXFP8 output: 32)."""
    config = choose_config(ROWS_PER_GROUP * G, N, K, G, gated, b_major=b_major)
    if reads_aux:
        config = aux_tile(config, N)
    if gather and reads_aux and N % 256 == 0:
        # FC2's dgrad reading dY through the index: 128x256 cooperative, measured on an H100 (bench/
        # bench_dgrad_epilogue.py, bench/results/H100-2026-11-27b-dy-gather-dgrad.log; ms, 256 cooperative against
        # gather_tile's 128x192 pingpong, rebuilt at 128 as it spills, and 128x128 pingpong): Qwen3-30B-A3B (N = 768)
        # 0.942 / 0.985 / 1.048, OLMoE 1.198 / - / 1.261, DeepSeek-V3 EP8 6.844 / 9.362 (128x128)
        config = dataclasses.replace(for_gather(config), tile_n=256, stages=_max_stages_capped(256, 4),
                                     pingpong=False)
    elif gather:
        config = gather_tile(for_gather(config), N)
        if gated:
            config = gather_pairs(config, gated)
    elif gated:
        config = gated_tile(config, N, K, col_block)
    return dataclasses.astuple(config)


#: FUSION_GATED_PAIRS=0 (read at import): the gated FC1 forward keeps :func:`choose_config`'s tile (CTA pairs at
#: most DYNAMIC_PAIRS_MAX_GROUPS groups only); the A/B switch of :func:`gated_tile` (it changes the jobs' keys, so
#: both live in one kernel cache).
GATED_PAIRS = os.environ.get("FUSION_GATED_PAIRS", "1") != "0"
#: The shortest reduction (K, the block's hidden size) at which a gated tile whose 192-column n-tiles do not pair up
#: takes 128x256 cooperative CTA pairs: the cooperative tile's exposed epilogue is amortized over K / 64 k-steps.
GATED_WIDE_MIN_K = 3072
#: The narrower pingpong tile of :func:`gated_tile` (88 logical columns): where the 192-column n-tiles of an
#: expert width f = 1408 do not pair up (14.7 of them), 16 of these do, with no ragged last tile.
GATED_NARROW_TILE = 176


def gated_tile(config: GemmConfig, N: int, K: int, col_block: int = 8) -> GemmConfig:
    """The tile of a gated kernel that loads A by TMA (FC1's forward: SwiGLU of the gate and up halves), given
    :func:`choose_config`'s 128x192 pingpong dynamic tile, as dynamic CTA pairs sharing the A tile (cluster_n = 2),
    whatever the group count, at the first width whose n-tiles pair up: 192; 176 where it tiles N exactly (an
    expert width f of 1408 = 16 x 88: GLM-4.5-Air, DeepSeek-V2-Lite, Qwen1.5-MoE) and the outputs' blocks
    (`col_block` logical columns) fit its 88; 128x256 cooperative where K >= GATED_WIDE_MIN_K. Else `config`.

    Measured on H100s (bench/bench_pair_gemm.py --gemms fc1_fwd --tile-pairs, bench/results/H100-2026-11-27e-
    fused-sweep.json and -fc1-sweep-{a,b}.json; ms, the single 128x192 tile -> this rule's): 192 as pairs:
    GPT-OSS-120B (128 groups of 512 rows) 3.796 -> 3.625, Hunyuan-A13B 5.234 -> 4.774, ERNIE-4.5-21B-A3B 1.289 ->
    1.231, Qwen3-235B-A22B at 1024 rows per expert 5.678 -> 5.024, Granite-3.0 0.385 -> 0.344: DYNAMIC_PAIRS_MAX_GROUPS,
    from an H200 run of an older kernel (GPT-OSS-120B 14% slower as pairs), no longer holds for the gated kernel.
    176 as pairs: GLM-4.5-Air 2.720 -> 2.646, DeepSeek-V2-Lite 0.983 -> 0.928, Qwen1.5-MoE 0.715 -> 0.692 (176 single
    CTAs were slower than 192 on all three). 128x256 cooperative pairs: Qwen2-57B-A14B (K = 3584) 3.983 -> 3.755,
    Phi-3.5-MoE 2.955 -> 2.645, SonicMoE's moe-cute 7.718 -> 6.529, Llama-3-70B at 8192 rows 12.826 -> 11.596 (but
    2.684 -> 2.799 at 2048 rows), against OLMoE (K = 2048) 1.749 -> 1.796 and 0.921 -> 0.991 at 1024 rows per expert.
    Training steps, on / off alternating in one process (bench/ab_switch.py --plan, -gated-ab.json): 1.1-4.2%
    faster on eight blocks, Phi-3.5-MoE unchanged."""
    if not GATED_PAIRS or config.gather_a or not config.dynamic or config.tile_n != 192:
        return config
    pairs = dict(cluster_n=2, cluster_m=1)
    if n_tile_count(N, 192) % 2 == 0:
        return dataclasses.replace(config, **pairs)
    if N % GATED_NARROW_TILE == 0 and (N // GATED_NARROW_TILE) % 2 == 0 and (GATED_NARROW_TILE // 2) % col_block == 0:
        return dataclasses.replace(config, tile_n=GATED_NARROW_TILE, stages=_max_stages_capped(GATED_NARROW_TILE, 5),
                                   **pairs)
    if K >= GATED_WIDE_MIN_K and n_tile_count(N, LONE_TILE_N) % 2 == 0:
        return dataclasses.replace(config, tile_n=LONE_TILE_N, stages=_max_stages_capped(LONE_TILE_N, 4),
                                   pingpong=False, **pairs)
    return config


def aux_tile(config: GemmConfig, N: int) -> GemmConfig:
    """The tile of a kernel whose epilogue reads a saved (M, n) tensor (FC2's dgrad + d(act*scale)): 128x128
    pingpong on the dynamic schedule, as CTA pairs sharing dY's tile (cluster_n = 2) where the n-tiles pair up,
    else as CTA pairs on neighbouring m-tiles sharing the weight's tile (cluster_m = 2, :func:`m_pairs`), at
    128x192 where 192 divides N. The kernel is bound by L2 throughput (ncu, GPT-OSS-120B: L2 87%, DRAM 56%; an L2
    prefetch of the saved tile gained nothing): every n-tile reads dY's rows again, and every m-tile the weight's
    columns; a pair reads one of them once for two tiles.

    The m-pairs, measured on an H100 (bench/bench_dgrad_epilogue.py, bench/results/H100-2026-11-26f-dgrad-m-pairs.log;
    ms, single CTAs -> m-pairs, outputs bitwise equal): GPT-OSS-20B (N=2880, 15 n-tiles at 192) 2.168 -> 1.976,
    GPT-OSS-120B 2.532 -> 2.436, DeepSeek-V2-Lite (N=1408: 11 at 128, 192 does not divide) 0.665 -> 0.643; static
    m-pairs were slower (GPT-OSS-120B 2.863).

    Measured on an H100 (bench/bench_dgrad_epilogue.py, bench/results/H100-2026-11-26e-dgrad-variants.log; ms,
    single 128x128 dynamic -> this rule, the outputs bitwise equal): SonicMoE's Qwen3-235B (N=1536, K=4096, 262144
    rows) 6.719 -> 5.658 (pairs; 128x192 5.931, 128x256 cooperative 5.937), DeepSeek-V3 EP8 (N=2048, K=7168)
    1.845 -> 1.502, a Llama-like dense-ish block (N=14336, K=4096) 7.418 -> 6.550, OLMoE 1.186 -> 1.088,
    Qwen3-30B-A3B 0.949 -> 0.875, GPT-OSS-20B (N=2880: 23 n-tiles, 15 at 192) 2.368 -> 2.179 (128x192),
    GPT-OSS-120B 2.585 -> 2.516 (128x192; an earlier H100 had 2.57 -> 2.63 there). Static pairs were slower than
    single dynamic CTAs on the large shapes (Qwen3-235B 8.104, GPT-OSS 128x128 static 4.164)."""
    config = dataclasses.replace(config, tile_n=128, stages=6, pingpong=True, dynamic=True, cluster_n=1,
                                 cluster_m=1)
    if n_tile_count(N, 128) % 2 == 0:
        return dataclasses.replace(config, cluster_n=2)
    if N % 192 == 0:
        config = dataclasses.replace(config, tile_n=192, stages=5)
    return m_pairs(config, N)


def gather_tile(config: GemmConfig, N: int) -> GemmConfig:
    """The tile of a kernel that gathers A: as wide as divides N, because every n-tile loads its A rows again
    by cp.async through the index, and those scattered row loads (not the tensor cores) bound the kernel:
    at 128 columns it read 7.6 GB from DRAM for a 0.5 GB gathered A (ncu, Qwen3-30B-A3B's FC1, L2 hit rate
    43%). 128x192 pingpong where 192 divides N, else 128x256 cooperative where 256 does, else `config`.
    Measured on an H100 (bench/bench_gather_gemm.py --sweep, T=16384, k=8, SwiGLU*scale): Qwen3-30B-A3B's FC1
    (N=1536) 1.87 -> 1.38 ms (192 pingpong; 256 cooperative 1.70), OLMoE's (N=2048) 2.19 -> 1.78 ms (256
    cooperative; 256 pingpong 2.21); both then at or above the pre-gathered kernel's speed. The same sweep with
    the ragged widths too (bench/results/H100-2026-11-24-gather-sweep.json) keeps this rule: GPT-OSS-120B's FC1
    (N=5760) 3.35 ms at 192 pingpong against 4.29 at 256 cooperative (ragged), DeepSeek-V3's (N=4096) 5.74 ms
    at 256 cooperative against 7.19 at 192 cooperative (ragged); torch's index_select + _grouped_mm 4.21 and
    6.05."""
    if N % 192 == 0:
        return dataclasses.replace(config, tile_n=192, stages=_max_stages_capped(192, 5), pingpong=True)
    if N % 256 == 0:
        return dataclasses.replace(config, tile_n=256, stages=_max_stages_capped(256, 4), pingpong=False)
    return config


def _max_stages_capped(tile_n: int, cap: int) -> int:
    return min(_max_stages(128, tile_n, 64), cap)


#: The narrowest GEMM (output columns N; a gated FC1's 2f) whose Gather runs as a copy before it rather than in its
#: A loads. The copy costs M x d bytes twice whatever N; the TMA kernel's CTA pairs along n (which a cp.async-loaded
#: A cannot share) save a share of the GEMM's work, M x d x N: so a threshold on N. Measured on whole MoE layers
#: with the two settings alternating in one process (bench/ab_switch.py --moe --plan --switch
#: fusion.kernels.tile_policy:FC1_COPY_MIN_N, T = 16384, three rounds, medians; H100, bench/results/
#: H100-2026-11-27h-ab-fc1-copy{,3072}-moe.{json,log}), copy against the gathering kernel, forward / training step:
#: at N >= 3072 the copy won or tied, ERNIE-4.5 (N = 3072) -4.3% / -1.6% and, on another machine, -3.0% / -2.1%,
#: Qwen3-235B-A22B (3072) -2.1% / -1.4%, Qwen2-57B-A14B (5120) -1.5% / -0.8%, DeepSeek-V3 EP8 (4096, d = 7168)
#: +1.1% / 0.0%; at N <= 2816 it lost, GLM-4.5-Air (2816) +3.1% / +0.2%, Qwen1.5-MoE (2816) +4.4% / +0.4%, OLMoE
#: (2048) +13.9% / +2.6%, Qwen3-30B-A3B (1536) +4.9% / +0.4%. Wider FC1s (N >= 5760: GPT-OSS-120B, Hunyuan-A13B,
#: Phi-3.5-MoE, DBRX, Llama-4-Scout) took the copy since an earlier A/B in two processes (their layers' forward
#: 3.6-12.1% faster; docs/benchmarks.md).
FC1_COPY_MIN_N = 3072
#: FUSION_FC1_COPY=0 (read at import): an MoE FC1 always gathers in its A loads (the A/B switch of
#: gathers_in_kernel; the kernel the plan builds follows it, so it changes the jobs' keys).
FC1_COPY = os.environ.get("FUSION_FC1_COPY", "1") != "0"


def gathers_in_kernel(N: int) -> bool:
    """Whether a GEMM after a Gather (an MoE FC1: pattern gather_gemm_act) with N output columns loads its A rows
    through the routing index itself (the gathering kernel: cp.async rows, single CTAs) rather than from a copy
    that the gather kernel writes first (M x d, freed after the GEMM; then the TMA kernel with its CTA pairs):
    below FC1_COPY_MIN_N, or with the switch off. A rule of the weight's shape alone, so the plan builds one
    kernel."""
    return not FC1_COPY or N < FC1_COPY_MIN_N


def for_gather(config: GemmConfig) -> GemmConfig:
    """`config` with A gathered through an index: the same tile, stages and consumer schedule, the dynamic tile
    order (warp 0 takes the ids, the producer's other warps read them at a named barrier), single CTAs (a pair
    multicasts a TMA-loaded A). Dynamic, measured on an H200 (bench/bench_gather_gemm.py, T = 16384, balanced
    top-k; bench/results/H200-2026-11-26-gather-schedules.json), static -> dynamic: GPT-OSS-120B's FC1 3.78 ->
    3.25 ms, Qwen3-235B-A22B's 5.43 -> 4.86, Qwen3-30B-A3B's 1.33 -> 1.18, DeepSeek-V3's 5.87 -> 5.28, OLMoE's
    1.72 -> 1.72; on an H100 the static kernel had taken 7.12 ms on GPT-OSS-120B (docs/benchmarks.md)."""
    return dataclasses.replace(config, gather_a=True, dynamic=True, cluster_n=1, cluster_m=1)


#: FUSION_GATHER_PAIRS=1 (read at import): the gathering FC1 runs as CTA pairs along m (:func:`gather_pairs`; off by
#: default since the in-process layer A/B below; it changes the jobs' keys, so both live in one kernel cache).
GATHER_PAIRS = os.environ.get("FUSION_GATHER_PAIRS", "0") == "1"


def gather_pairs(config: GemmConfig, gated: bool) -> GemmConfig:
    """A gathering kernel's configuration as CTA pairs on neighbouring m-tiles (cluster_m = 2): each CTA gathers
    its own A rows and loads half of the weight's B tile (half of each of the gate and up boxes when gated),
    multicast to both, so B crosses L2 once per pair. B is the larger operand of a wide tile (128x256: 32 KB of B
    per k-step against 16 KB of A), and the pair along n that the TMA kernel uses shares A, which a cp.async-loaded
    A cannot. Where each B box splits into whole 8-row swizzle atoms (kernels/api.py check_config).

    :func:`tile_config` gives it to the gated FC1 forward only. Measured on an H100 (bench/bench_gather_gemm.py
    --rounds 3, T = 16384, the FC1 training job; bench/results/H100-2026-11-27g-gather-pairs-ab.{json,log}), ms,
    median of three alternating rounds (the fastest round), pairs against single CTAs: OLMoE 1.897 (1.719) against
    2.009 (1.984), ERNIE-4.5 2.882 against 3.016, Qwen1.5-MoE 1.405 (1.290) against 1.447 (1.424), Qwen3-30B-A3B
    1.647 (1.459) against 1.691 (1.626), DeepSeek-V3 EP8 6.295 (5.831) against 6.392 (6.284), Qwen2-57B-A14B 7.862
    against 7.942, GLM-4.5-Air 5.146 (4.689) against 5.172 (5.076); Qwen3-235B-A22B 5.980 against 5.900 (the
    fastest round 5.529 against 5.862). This kernel's rounds spread by 10-30% on the lent machines, so the gain
    (0.5-5.6% by medians on seven of eight, 1-13% by the fastest rounds on seven) is within one run's noise on
    some shapes; in the MoE layer the forward measured level to 4.8% faster (DeepSeek-V3 EP8), the training step
    within its noise. FC2's dgrad reading dY through the index keeps single CTAs: as pairs it measured 8% and 15%
    slower on DeepSeek-V3 and GLM in one call, 11% and 3% faster in another (bench/bench_dgrad_epilogue.py,
    `-dgrad-pairs-*.log`).

    Off by default since an in-process A/B on whole MoE layers (bench/ab_switch.py --moe --plan, three alternating
    rounds, T = 16384; bench/results/H100-2026-11-27h-ab-gather-pairs-moe.{json,log}): pairs on against off, medians,
    Qwen3-30B-A3B forward +2.2%, training step +3.0% (every round slower: 7.86-7.98 ms against 7.71-7.75), OLMoE
    -1.1% / -0.2%, DeepSeek-V3 EP8 -2.5% / +0.2%. The kernel alone in the same call (`-gather-static-pairs.log`)
    had pairs 1.7-2.9% faster on four FC1s and 0.4-3.9% slower on four (ERNIE-4.5 2.853 against 2.747 ms): no
    consistent gain, and a loss on the flagship layer's step."""
    box_rows = config.tile_n // 2 if gated else config.tile_n
    if not GATHER_PAIRS or box_rows % 16 or not config.persistent:
        return config
    return dataclasses.replace(config, cluster_m=2, cluster_n=1)


def spill_fallback(config: GemmConfig) -> GemmConfig | None:
    """The configuration to rebuild a kernel at when, built at `config`, it spills registers (its cubin has a
    stack frame), or None when there is none to try.

    A pingpong warpgroup holds the whole tile_m x tile_n accumulator: heavy epilogues (several outputs, paired
    inputs) spill at 192 columns, and 128 columns (stages >= 6) leave them room. compile_grouped_gemm keeps the
    rebuilt kernel only if it does not spill; the kernel it returns says which it is: `.config` is the
    configuration it was built with, `.requested_config` the one asked for. The disk cache records the built one
    (a launch grid depends on it) next to the job's.

    compile_grouped_gemm asks again of the fallback while the rebuilt kernel still spills. A dynamic CTA pair
    (:func:`dynamic_pairs`) is rebuilt as a single CTA first: the mailbox of tile ids costs registers (the demo's
    GPT-OSS-like FC1 with an MXFP8 output at 128x192: a 56-byte stack frame as a pair), then as the single CTA's
    fallback."""
    if config.dynamic and config.cluster_n == 2:
        return dataclasses.replace(config, cluster_n=1)
    if config.pingpong and config.tile_n > 128:
        return dataclasses.replace(config, tile_n=128, stages=max(config.stages, 6))
    return None


def candidates(base: GemmConfig, N: int) -> list[GemmConfig]:
    """Autotune mode's candidates: the heuristic's choice first, then the schedules and the tile widths that
    divide N."""
    out = [base]
    for tile_n, stages in ((128, 6), (192, 5), (256, 4)):
        if N % tile_n:
            continue
        for pingpong in (False, True):
            for dynamic in (False, True):
                cfg = dataclasses.replace(GemmConfig(), tile_n=tile_n, stages=stages, pingpong=pingpong,
                                          dynamic=dynamic, b_major=base.b_major, gather_a=base.gather_a)
                if cfg not in out:
                    out.append(cfg)
    return out


@dataclass(frozen=True)
class WgradConfig:
    """The tile configuration of the varlen-K kernel (kernels/varlen_k_gemm.py): D[g] = A_g.T @ B_g, a
    ``tile_m x tile_n`` tile of D (Ma x Nb) per CTA step, ``tile_k`` rows of the group per k-step."""
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    pingpong: bool = False
    gather_a: bool = False   # A's rows read through the index (A is a (T, Ma) token matrix)
    gather_b: bool = False   # B's rows read through the index (B is a (T, Nb) token matrix)
    sm_margin: int = 0       # leave this many SMs free
    cluster_m: int = 1       # 2: CTA pairs on neighbouring m-tiles share B's tile by TMA multicast (no gather)
    cluster_n: int = 1       # 2: CTA pairs on neighbouring n-tiles share A's tile by TMA multicast (the FP8 kernel)
    n_fastest: bool = False  # the schedule walks a group's n-tiles fastest: running CTAs write whole rows of D
    store_bytes: int = 8     # bytes one lane stores per instruction in the 16-bit epilogue (8 or 16)
    ctas_per_sm: int = 1     # the FP8 kernel: 2 = one consumer warpgroup a CTA (a 128-row tile as two 64-row
    #                          m-waves) and two CTAs an SM, one's epilogue under the other's mainloop
    ordered_waves: bool = False  # the FP8 kernel: its two consumer warpgroups issue their waves' wgmma in turn, so
    #                              one's promotion runs under the other's wgmma (kernels/fp8_wgrad.py)


#: Mean rows per group (a tile's reduction length) from which, and below which, the varlen-K kernel takes
#: pingpong 128x192 tiles over the wide-tile rule, for weights of several groups. Measured on an H100
#: (bench/bench_wgrad.py --sweep; bench/results/H100-2026-11-26k-wgrad-sweep.* derived it,
#: -wgrad-validate.* checked it on shapes it was not derived from): at 256-1024 rows per group 128x192 pingpong was
#: 3-13% faster than 128x256 cooperative on the 16 weight gradients of Qwen3-30B-A3B, Qwen3-235B-A22B and
#: DeepSeek-V3 it changes, the fastest of eight tiles on 14 (its epilogue overlaps the other warpgroup's mainloop
#: where a tile has only 4-16 k-steps; the cooperative tile's epilogue is exposed); on the unseen MoE shapes it
#: was the fastest of the eight wherever it applies (7 gradients, 0.4-10% faster). At 128 rows and fewer it lost
#: by up to 15%, at 2048 and more rows (bench/results/H100-2026-11-24-wgrad.*) on 7 of 8 gradients by 9-51% (it
#: won 3% on Mixtral's FC2); 1536 lies between the measured 1024 and 2048.
#: A one-group weight (a dense Linear) keeps the wide-tile rule: Llama-3-8B's FC1 gradient at 1024 rows took 13%
#: longer at 128x192 pingpong.
WGRAD_PINGPONG_ROWS = (192, 1536)
#: ... where 192-column tiles pad Nb by at most this fraction (Nb = 4096, 2048: 3%). Beyond it the wide-tile rule
#: stays: at Nb = 1024 (12.5%) 128x192 pingpong beat 128x256 cooperative by 4-5% on three of four gradients and
#: lost 3% on one; at Nb = 1408 the rule's 128x128 pingpong was the fastest.
WGRAD_PINGPONG_PAD = 1 / 16
#: FUSION_WGRAD_BY_ROWS=0 (read at import): the wide-tile rule at every row count (the A/B switch of the choice by
#: rows per group).
WGRAD_BY_ROWS = os.environ.get("FUSION_WGRAD_BY_ROWS", "1") != "0"
#: Below WGRAD_PINGPONG_ROWS[0] rows per group (weights of several groups, no gathered operand) a tile has one to
#: three k-steps and the kernel is its store: D's bytes are most of its traffic (at 32 rows per group, GPT-OSS-120B
#: at T = 1024, D is 6.4 GB against 0.1 GB of operands). There 128x128 pingpong CTA pairs storing 16 bytes a lane
#: (kernels/fragment_io.py store8_transposed) take the weight gradient. Measured on an H200, interleaved rounds
#: (bench/probes/wgrad_store_ab.py, bench/results/H200-2026-11-30ad-call3-wgrad-store-ab.json; time against the
#: rule's tile before, FC1 / FC2): GPT-OSS-120B at 32 rows per group 0.900 / 0.855, Qwen3-30B-A3B at 64 0.885 /
#: 0.875, OLMoE at 128 0.984 / 0.908, Qwen3-30B-A3B at 128 0.956 / 0.935; the same tile with 8-byte stores 0.95-1.05,
#: the rule's tile with 16-byte stores 0.88-0.98. At 256 rows per group and more 16-byte stores were no better
#: (0.93-1.10) and the rule's tiles stay. D stored at 3.1-3.3 TB/s at 32-64 rows per group (2.7-3.0 before), where
#: torch's fill_ of D alone reaches 3.3-3.4.
#: FUSION_WGRAD_STORE_BOUND=0 (read at import; read per call, the A/B switch): the rule's tile at every row count.
WGRAD_STORE_BOUND = os.environ.get("FUSION_WGRAD_STORE_BOUND", "1") != "0"


def wgrad_switches() -> tuple:
    """The switches choose_wgrad_config reads per call (besides the shape and rows): part of the key under which the
    runtime keeps a bound weight-gradient launch (fusion/runtime/wgrad_gemm.py), so that flipping one (an A/B)
    binds the other tile instead of reusing the launch bound before."""
    return WGRAD_BY_ROWS, WGRAD_STORE_BOUND


#: Mean rows per group from which the weight gradient of a GroupLinear after a Gather (an MoE FC1: dW = dH.T @
#: x[index]) reads x's rows through the routing index (the varlen-K kernel's gathering producer: x by cp.async, dH
#: by TMA) instead of a regathered copy of x (the gather kernel writing M x d, then the TMA kernel). Measured on an
#: H100 (bench/bench_wgrad.py --sweep, bench/results/H100-2026-11-27-wgrad-gather.*; 128x256 cooperative, ms, the
#: gathering kernel against the TMA kernel plus the regather, M x d read and written at 3 TB/s, 1.44 ms measured at
#: moe-cute): SonicMoE's moe-cute (2048 rows per expert) 7.00 / 7.94, OLMoE (2048) 1.92 / 2.07, DeepSeek-V3 EP8
#: (4096) 12.11 / 12.15, Qwen3-30B-A3B (1024) 1.54 / 1.55, GPT-OSS-120B (512) 4.66 / 4.07. The gathering kernel has
#: no CTA pair sharing x's tile, which costs most where few rows per group make the plain kernel's pairs of
#: pingpong tiles win. It never writes the copy (M x d: 512 MiB at Qwen3-30B-A3B's T = 16384, 2 GiB at moe-cute),
#: which lowers the layer's peak memory by as much: at parity (1024 rows) the memory decides.
WGRAD_GATHER_ROWS = 1024
#: FUSION_WGRAD_GATHER=0 (read at import): always regather (the A/B switch of gather_in_wgrad).
WGRAD_GATHER = os.environ.get("FUSION_WGRAD_GATHER", "1") != "0"


def gather_in_wgrad(Nb: int, G: int, rows: int) -> bool:
    """Whether a weight gradient D (G, Ma, Nb) over `rows` routed rows reads its B operand (x) through the routing
    index rather than from a regathered copy: at WGRAD_GATHER_ROWS or more rows per group, for weights of several
    groups, where the measured tile (128x256 cooperative: 256 divides Nb) applies."""
    return WGRAD_GATHER and G > 1 and rows >= WGRAD_GATHER_ROWS * G and Nb % 256 == 0


#: FUSION_DY_GATHER=0 (read at import): an MoE block's backward always writes the Combine's backward copy (dY per
#: routed row) for FC2's dgrad and weight gradient (the A/B switch of gather_dy).
DY_GATHER = os.environ.get("FUSION_DY_GATHER", "1") != "0"


#: The widest FC2 input (f, the expert's intermediate width) at which its backward reads dY through the index.
#: Measured on an H100 (bench/bench_dgrad_epilogue.py and bench/bench_wgrad.py --sweep, bench/results/
#: H100-2026-11-27b-dy-gather-{dgrad,wgrad}.log; ms, the kernels reading the Combine's copy -> reading dY through the
#: index at their best tile, against the copy itself, a gather kernel writing M x d): Qwen3-30B-A3B (f = 768) dgrad
#: 0.852 -> 0.942, weight gradient 0.590 -> 0.734, copy 0.313 (net -0.08); OLMoE (1024) 1.074 -> 1.198, 0.788 ->
#: 0.963, copy 0.319 (-0.02); SonicMoE's moe-cute (1024) 3.464 -> 3.899, 3.142 -> 3.844, copy 1.374 (-0.24);
#: DeepSeek-V3 EP8 (2048) 6.370 -> 6.844, 5.458 -> 6.288, copy 1.088 (+0.21). The gathering kernels lose the CTA
#: pair that shares dY's tile (a cp.async operand cannot be multicast) and run 10-25% longer, a cost that grows
#: with the GEMMs' work per copied byte, i.e. with f; the copy costs M x d whatever f.
DY_GATHER_MAX_F = 1024


def gather_dy(G: int, rows: int, f: int) -> bool:
    """Whether an MoE FC2 (weight (G, d, f)) reads the tokens' gradient dY (T, d) through the routing index in its
    fused dgrad and its weight gradient (each a gathering kernel: dY by cp.async, the weight or H by TMA) rather
    than the Combine backward's copy (M x d, dY per routed row, which the SonicMoE design never stores): at
    WGRAD_GATHER_ROWS or more rows per group (as the FC1 weight gradient's `gather_in_wgrad`: below it the
    gathering producer fell behind), for weights of several groups, f at most DY_GATHER_MAX_F."""
    return DY_GATHER and G > 1 and rows >= WGRAD_GATHER_ROWS * G and f <= DY_GATHER_MAX_F


def _wide_wgrad_tile(Nb: int) -> WgradConfig:
    """128x256 cooperative where 256 divides Nb, else 128x192 pingpong where 192 does, else 128x128 pingpong."""
    if Nb % 256 == 0:
        return WgradConfig(tile_n=256, stages=_max_stages_capped(256, 4), pingpong=False)
    if Nb % 192 == 0:
        return WgradConfig(tile_n=192, stages=_max_stages_capped(192, 5), pingpong=True)
    return WgradConfig(tile_n=128, stages=6, pingpong=True)


def choose_wgrad_config(Ma: int, Nb: int, G: int, gather_a: bool = False, gather_b: bool = False,
                        rows: int | None = None) -> WgradConfig:
    """The varlen-K kernel's tile for D (G, Ma, Nb) over `rows` routed rows (None: not known, the wide-tile rule).

    The kernel is bound by L2 bandwidth where tiles have many k-steps, so a wider tile (fewer bytes per FLOP) wins
    there (`_wide_wgrad_tile`); where a group's rows make only a few k-steps (WGRAD_PINGPONG_ROWS, weights of
    several groups, no gathered operand), the epilogue of a 128x256 cooperative tile is exposed and 128x192
    pingpong tiles win.
    CTA pairs share B's tile by TMA multicast (cluster_m = 2) where B comes by TMA: no gathered operand, or a
    gathered A (an MoE FC2's dY). Measured for the gathered A on an H100 (bench/bench_wgrad.py --sweep, bench/
    results/H100-2026-11-27b-wgrad-pair.*; ms at 128x256 cooperative, single CTAs -> pairs): Qwen3-30B-A3B's FC2
    0.809 -> 0.756, OLMoE's 0.992 -> 0.958, DeepSeek-V3 EP8's 6.579 -> 6.336, moe-cute's 4.252 -> 3.784."""
    low, high = WGRAD_PINGPONG_ROWS
    # a gathered operand keeps the wide tile at every row count: without the CTA pair's shared tile the pingpong
    # tile lost to 128x256 cooperative on the four MoE FC1 gradients measured where 256 divides Nb
    # (bench/results/H100-2026-11-27-wgrad-gather.*: 1.85 against 1.54 ms at Qwen3-30B-A3B's 1024 rows per
    # group, 2.14 / 1.92 OLMoE, 16.64 / 12.11 DeepSeek-V3, 8.10 / 7.00 moe-cute)
    few_k_steps = (rows is not None and WGRAD_BY_ROWS and G > 1 and low <= rows / G < high
                   and not (gather_a or gather_b))
    store_bound = (rows is not None and WGRAD_BY_ROWS and WGRAD_STORE_BOUND and G > 1 and rows / G < low
                   and not (gather_a or gather_b))
    if store_bound:
        cfg = WgradConfig(tile_n=128, stages=6, pingpong=True, store_bytes=16)
    elif few_k_steps and -(-Nb // 192) * 192 - Nb <= WGRAD_PINGPONG_PAD * Nb:
        cfg = WgradConfig(tile_n=192, stages=_max_stages_capped(192, 5), pingpong=True)
    else:
        cfg = _wide_wgrad_tile(Nb)
    return dataclasses.replace(cfg, gather_a=gather_a, gather_b=gather_b, cluster_m=1 if gather_b else 2)


def wgrad_configs(Ma: int, Nb: int, G: int, gather_a: bool = False, gather_b: bool = False) -> list[WgradConfig]:
    """Every configuration choose_wgrad_config may pick for D (G, Ma, Nb) at some row count: what is compiled ahead
    of time."""
    out = []
    for rows in (None, WGRAD_PINGPONG_ROWS[0] * G, G):
        cfg = choose_wgrad_config(Ma, Nb, G, gather_a, gather_b, rows)
        if cfg not in out:
            out.append(cfg)
    return out


def fp8_wgrad_stage_bytes(tile_m: int, tile_n: int) -> int:
    """Shared memory of one stage of the FP8 varlen-K kernel (kernels/fp8_wgrad.py): A and B tiles (one byte per
    element, 128 per row) and the two scale vectors (float32, each padded to 128 bytes)."""
    return (tile_m + tile_n) * SCALE_BLOCK + 4 * (-(-tile_m // 32) * 32 + -(-tile_n // 32) * 32)


def fp8_wgrad_stages(tile_m: int, tile_n: int, ctas_per_sm: int = 1) -> int:
    """The most stages of the FP8 varlen-K kernel that fit in shared memory (at most 8; with two CTAs an SM, in
    each one's half)."""
    smem = FP8_SMEM if ctas_per_sm == 1 else FP8_SMEM_TWO_CTAS
    return min(8, smem // (fp8_wgrad_stage_bytes(tile_m, tile_n) + 16))


#: The FP8 varlen-K kernel's tile rows (FUSION_FP8_WGRAD_TILE_M, read at import: 128 or 256): 256 (two m-waves
#: through one scratch fragment, as the FP8 forward's 256-row tiles) halves the B traffic per FLOP.
FP8_WGRAD_TILE_M = int(os.environ.get("FUSION_FP8_WGRAD_TILE_M", "256"))


def choose_fp8_wgrad_config(Ma: int, Nb: int, G: int) -> WgradConfig:
    """The FP8 varlen-K kernel's tile for D (G, Ma, Nb): FP8_WGRAD_TILE_M x 128 (one 128-row block slot per
    k-tile), cooperative, as many stages as fit, as CTA pairs along n sharing A's box (:data:`FP8_WGRAD_PAIRS`).
    Measured on an H200 (bench/bench_fp8_wgrad.py, session ag, bench/results/H200-2026-12-01ag-call{1,2}-*, 22
    weight gradients of eleven blocks, eight tiles): the 256 x 128 pair 0.4-10.4% faster than the single CTAs on
    all 22, the fastest tile on 10 and within 3.1% of it on 18 (6.6-13.2% behind on four fine-grained ones, which
    the recipe's rule runs in bf16 anyway: fusion.quant.fp8_linear.wgrad_in_bf16), and the FP8 steps that run it
    2.1-2.4% faster (Mixtral, Llama-3-8B, Llama-3-70B). Session o had measured the pair 3-20% slower on eight of
    twelve, at the kernel of then; the two-CTA tile (:data:`FP8_WGRAD_TWO_CTAS`) and 16-byte stores
    (:data:`FP8_WGRAD_STORE16`) measured slower in the step."""
    if FP8_WGRAD_TWO_CTAS:
        return fp8_wgrad_two_ctas()
    tile_m = FP8_WGRAD_TILE_M
    return WgradConfig(tile_m=tile_m, tile_n=128, tile_k=SCALE_BLOCK, stages=fp8_wgrad_stages(tile_m, 128),
                       pingpong=False, cluster_m=1, cluster_n=2 if FP8_WGRAD_PAIRS else 1,
                       store_bytes=16 if FP8_WGRAD_STORE16 else 8, ordered_waves=FP8_WGRAD_ORDERED_WAVES)


#: The FP8 varlen-K kernel's tiles as CTA pairs along n sharing A's box by TMA multicast (cluster_n = 2;
#: FUSION_FP8_WGRAD_PAIRS=0, read at import, turns it off; the policy reads this attribute per job, so
#: bench/ab_switch.py can flip it). On by default since session ag (H200, bench/ab_switch.py --path fusion_fp8, three
#: rounds of 100 steps, bench/results/H200-2026-12-01ag-call2-ab-pairs.*): the FP8 step -2.1% Mixtral-8x7B (20.670
#: against 21.123 ms), -2.3% Llama-3-8B (19.804 / 20.271), -2.4% Llama-3-70B (37.089 / 38.008).
FP8_WGRAD_PAIRS = os.environ.get("FUSION_FP8_WGRAD_PAIRS", "1") != "0"
#: The FP8 varlen-K kernel's lanes storing 16 bytes of D (8 columns) an instruction instead of 8
#: (FUSION_FP8_WGRAD_STORE16=1, read at import; read per job). Off: beside the pairs the FP8 step +0.8% Llama-3-70B,
#: -0.4% Mixtral-8x7B (session ag, -call2-ab-store16.*); the kernel alone -4..+18% (mixed).
FP8_WGRAD_STORE16 = os.environ.get("FUSION_FP8_WGRAD_STORE16", "0") != "0"
#: The FP8 varlen-K kernel's two consumer warpgroups issuing their waves' wgmma in turn (WgradConfig.ordered_waves;
#: FUSION_FP8_WGRAD_ORDERED_WAVES=1, read at import; read per job). Nsight Compute on Mixtral-8x7B's FP8 step (session
#: ai, H200, bench/results/H200-2026-12-01ai-call2-ncu-mixtral-fp8.log): the FP8 weight gradients kept the tensor pipe
#: 50-52% busy against 78-79% for the FP8 dgrads of the same FLOPs; 60% of their instructions are the promotion (an FMUL
#: and an FFMA an element: the row and column scales both per 128-row slot). Taking turns, one warpgroup promotes under
#: the other's wgmma. **Off: faster alone, slower in the step.** Alone (bench/bench_fp8_wgrad.py --tiles ordered, -call3-)
#: -1.5% / -3.3% on Mixtral's FC1 / FC2, -0.1% DeepSeek-V3 EP8, -1.8..-6.9% GPT-OSS-120B, -6.4..-10.4% Qwen3-235B-A22B
#: and Qwen3-30B-A3B (whose weight gradients the recipe runs in bf16); in the FP8 steps that run it (bench/ab_switch.py,
#: three rounds of 100) +0.4% Mixtral-8x7B, +0.9% Llama-3-70B, +0.6% Llama-3-8B: those steps run at the card's power
#: limit (about 1580 MHz at 640 W, -call4-smi.csv), where a kernel that keeps the tensor cores busier only lowers the
#: clock.
FP8_WGRAD_ORDERED_WAVES = os.environ.get("FUSION_FP8_WGRAD_ORDERED_WAVES", "0") != "0"


#: The FP8 varlen-K kernel as two CTAs an SM (:func:`fp8_wgrad_two_ctas`; FUSION_FP8_WGRAD_TWO_CTAS=1, read at
#: import; the policy reads this attribute per job, so bench/ab_switch.py can flip it). Built for the epilogue: a
#: weight gradient's tile reduces over its group's 128-row blocks only (8 k-tiles at 1024 rows per group) and then
#: stores a 256 x 128 bf16 tile, which the cooperative tile's two warpgroups reach together while the tensor cores
#: wait. **Off: measured slower** (session ag, H200, the same results as the cooperative tile's): the FP8 step +1.3%
#: Mixtral-8x7B, +1.8% Llama-3-70B against the cooperative single CTAs (-call1-ab-wgrad-two-ctas.*); the kernel
#: alone -8..+18% against them and behind the 256 x 128 pair on 19 of 22 (three stages where the pair has four).
FP8_WGRAD_TWO_CTAS = os.environ.get("FUSION_FP8_WGRAD_TWO_CTAS", "0") != "0"


def fp8_wgrad_two_ctas() -> WgradConfig:
    """The FP8 varlen-K kernel's two-CTA tile: 128 x 128, one consumer warpgroup a CTA walking it as two 64-row
    m-waves through one scratch fragment (the registers each warpgroup of the cooperative 256-row tile holds), two
    CTAs an SM, as many stages as fit half the SM's shared memory (three), single CTAs: the forward's lone GEMMs'
    two-CTA tile (:func:`two_cta_tile`)."""
    return WgradConfig(tile_m=128, tile_n=128, tile_k=SCALE_BLOCK, stages=fp8_wgrad_stages(128, 128, 2),
                       pingpong=False, cluster_m=1, cluster_n=1, ctas_per_sm=2)
