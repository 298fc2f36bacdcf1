"""A bf16/fp16 GroupLinear's forward or input gradient with nothing fused into it: the varlen-M grouped GEMM in place
of torch._grouped_mm where ours measures faster, i.e. at few rows per group.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS, variant "gemm", parts "forward" and
"dgrad"): the GEMMs no pattern fuses (FC2's forward after a fused FC1, FC1's input gradient after a fused FC2
dgrad). `takes(op, x)` decides per call from shapes the host already knows (no sync): the kernel runs where

* the GEMM has several groups (``G >= MIN_GROUPS``: a GroupLinear of one group is a dense GEMM, where cuBLAS's
  per-shape choices were faster on 12 of the 14 dense GEMMs measured at 128x192 tiles, below; the one exception
  is a dense dgrad at ``>= DENSE_DGRAD_MIN_ROWS`` rows into a multiple of 256 columns, which runs 128x256
  cooperative tiles, kernels/tile_policy.dense_dgrad_tile, measured there and at the end of this docstring),
* a forward's K is below ``MAX_K["forward"]`` (6144: Phi-3.5-MoE's, DBRX's and Mixtral's FC2 forwards, and every
  dense one, were cuBLAS's at every tile of ours measured; the wide tile below),
* where the GEMM runs the wide tile (:func:`runs_wide_tile`: 128x256 cooperative dynamic CTA pairs,
  kernels/tile_policy.lone_tile, where its n-tiles pair up and N >= 2560 or K >= 1280): the routed rows average at
  most ``WIDE["max_rows_per_group"]`` per group (2048 for a forward; a dgrad 4096 at N >= 4096, else 512), and
  nothing else (measured at the end of this docstring);
* elsewhere, the routed rows per group are few: ``M <= MAX_ROWS_PER_GROUP[part] * G`` (1024 for a forward, 512 for a
  dgrad: below), and a group's output is small: ``M * N <= MAX_OUTPUTS_PER_GROUP[part] * G`` (2^21 elements for a
  forward, 1.5 * 2^20 for a dgrad: the held-out blocks below), except where the tile runs as dynamic CTA pairs (few
  groups, kernels/tile_policy.dynamic_pairs), and
* the GEMM's output width N is a multiple of 128 or of 192: whole n-tiles of the tile the policy gives it
  (kernels/tile_policy.py choose_config: 128x192 where 192 divides N and 128 does not, e.g. GPT-OSS's 2880). A
  partial last n-tile costs a full tile's work: at 128x128 tiles GPT-OSS-120B's GEMMs were slower than torch's
  (the table's last row); at 128x192 they are faster (below).

Anywhere else torch._grouped_mm runs, as before (a one-group GEMM: torch's dense matmul, fusion.grouped.DENSE_MM).
Why that rule: measured on an H200 (bench/bench_pair_gemm.py, bench/results/H200-2026-11-26-pairs*.json, the
identity epilogue against torch._grouped_mm on the same operands):

| block (rows per expert) | FC2 forward ours / torch ms | FC1 dgrad ours / torch ms |
|---|---|---|
| Qwen3-30B-A3B at 512 tokens (32) | 0.113 / 0.156 | 0.210 / 0.274 |
| Qwen3-235B-A22B (256) | 0.746 / 0.879 | 1.594 / 1.607 |
| Qwen3-30B-A3B (1024) | 0.635 / 0.706 | 1.356 / 1.396 |
| OLMoE (2048) | 0.902 / 0.907 | 1.712 / 1.538 |
| DeepSeek-V3 EP8 share (4096) | 5.779 / 5.781 | - |
| GPT-OSS-120B (512; N = 2880) | 2.023 / 1.846 | 4.063 / 4.023 |

The dgrad's threshold is lower: at 768-1024 rows per expert torch's dgrad was faster on an H100
(bench/results/H100-2026-11-26-tiles.json, T = 16384 top-k routing): Qwen3-30B-A3B's FC1 dgrad (1024 rows) 1.687 ms
ours (the policy's static 128x128 pair) against 1.338 torch, no tile of ours below 1.373; DeepSeek-V2-Lite's (768
rows) 1.020 against 0.881 (0.942 on the H200 table above against 0.874); at 256-512 rows ours led (Qwen3-235B-A22B
1.594 / 1.607 above; GPT-OSS-120B below). The H200's Qwen3 row (1.356 / 1.396) is the one that loses, by 3%.

GPT-OSS-120B at T = 16384, top-4 (512 rows per expert, N = 2880), on an H100 (bench/bench_pair_gemm.py --tiles,
bench/results/H100-2026-11-26-tiles.json): FC2 forward 2.323 ms at 128x128 (23 n-tiles, the last half empty),
1.887 at 128x192 (15 whole n-tiles), torch 2.076; FC1 dgrad 4.689 / 3.617 / 4.021. Where 128 divides N, 192 is no
better than the policy's 128 (Qwen3-30B-A3B's FC1 dgrad 1.373 ms at 192 against torch's 1.338; OLMoE's 128-column
pair 0.847 against 0.881 at 192).

Dense (one group), measured on an H100 with the banded tile order (bench/bench_pair_gemm.py --bands 0,
bench/results/H100-2026-11-26-dense-lone.json): ours / torch ms, FC2 forward and FC1 dgrad: Llama-3-8B at 4096 rows
0.761 / 0.698 and 1.502 / 1.365, at 16384 rows 3.178 / 2.862 and 6.175 / 5.736; Llama-3-70B at 2048 rows 1.517 /
1.349 and 3.044 / 2.615, at 8192 5.500 / 5.222 and 11.120 / 10.378; Qwen2.5-7B at 8192 rows 2.173 / 1.540 and
5.312 / 3.186. (An earlier run on another H100 had ours 3% and 6% ahead on Llama-3-8B at 16384 rows: within the
machines' spread.) At few rows (`-dense-lone-small.json`), where the old rule sent them to our kernel: Llama-3-8B at
1024 rows 0.247 / 0.162 and 0.504 / 0.311 (our 128x192 tiles make 176 tiles for 132 SMs), but Qwen2.5-7B at 512 rows
0.124 / 0.186 and 0.235 / 0.357 (torch at 375 TFLOP/s there). Dense GEMMs go to cuBLAS; a per-shape choice would
need a wider sweep than these.

Dense dgrads at 128x256 cooperative tiles (bench/bench_pair_gemm.py --tiles 256:4:coop, two H100s,
bench/results/H100-2026-11-26i-dense.log and -tiles.log; ms, ours / torch): Llama-3-70B at 8192 rows 10.476 /
11.203 (10.359 / 11.546), Llama-3-8B at 16384 rows 5.320 / 5.902, Qwen2.5-7B at 8192 rows 3.047 / 3.152; below
8192 rows torch led (Llama-3-8B at 4096 rows 1.483 / 1.367, Llama-3-70B at 2048 rows 2.830 / 2.739). The forwards
at the same tile split both ways (Llama-3-70B's FC2 forward 5.452 / 5.071, Llama-3-8B's 2.659 / 2.936): torch's.

The output budget, from the training-step bench's held-out blocks (bench/bench_training_step.py HELD_OUT_BLOCKS,
public configurations no rule was tuned on; H100, 2026-11-27, `bench/results/H100-2026-11-27c-held-out-*`): their
steps' kernel profiles (bench/profile_step.py --timeline) had our lone GEMMs behind torch's where the groups' outputs
were large: Hunyuan-A13B's FC2 forward (1024 rows per expert, N = 4096) 2.965 ms against torch's 2.653, Qwen2-57B-
A14B's (1024, N = 3584) 2.110 against 1.978, GLM-4.5-Air's FC1 dgrad (512, N = 4096) 2.963 against 2.869 (alone,
bench_pair_gemm.py: 2.903 against 2.595); its FC2 forward (512, N = 4096: 2^21 outputs, the boundary, kept on our
kernel) 1.377 against 1.347, a split result. Where ours won the groups' outputs were at most 2^21 elements
(Qwen3-30B-A3B's FC2 forward, 1024 x 2048: 0.733 against 0.787; GPT-OSS-120B's, 512 x 2880; Qwen3-235B-A22B's,
256 x 4096; Qwen1.5-MoE's, 546 x 2048: 0.349 against 0.389) and for dgrads at most 1.5 * 2^20 (GPT-OSS-120B's,
512 x 2880: 3.617 against 4.021; Qwen3-235B-A22B's, 256 x 4096, tied). DeepSeek-V3's EP8 share (32 groups) runs
dynamic pairs, which won at 1024 x 7168 (1.492 against 1.592), so pairs keep the rows cap alone. In the held-out
steps the budget took 0.7-3.8% off four (GPT-OSS-20B read +3.9% in noisy rounds; bench/ab_switch.py,
docs/benchmarks.md).
FUSION_LONE_GEMM_OUTPUTS=0 (read at import) drops the budget: the A/B switch.

The wide tile, from a sweep of both lone GEMMs of 25 MoE blocks at 128x256 cooperative tiles (single CTAs, static and
dynamic pairs along n, dynamic pairs along m; H100, bench/bench_pair_gemm.py --no-schedules --tiles 256:4:coop
--tile-pairs --tile-m-pairs, bench/results/H100-2026-11-27d-lone-tiles*.json). The dynamic pairs along n were the
best of the four on most GEMMs; against the tile policy's own tile they won or tied where N >= 2560 or K >= 1280 (up
to 43%: Qwen2-57B-A14B's FC1 dgrad 6.114 -> 3.508 ms) but on three GEMMs (DeepSeek-V3's FC2 forward, 32 groups, where
the policy's 128x192 dynamic pairs were 1.4% and 3.3% faster; the small batch's FC1 dgrad, 8 groups of 512 rows,
0.074 -> 0.082 ms, torch 0.088), and tied or lost below both (Granite's FC2 forward, N = 1536, K = 512: 0.178 ->
0.196; the Qwen3 and OLMoE FC2 forwards, N = 2048, K <= 1024: +0..2.5%). Against torch._grouped_mm, ms
ours / torch: forwards at <= 2048 rows per group won everywhere the rule takes them (Hunyuan-A13B 2.402 / 2.750,
Qwen2-57B-A14B 1.915 / 1.984, SonicMoE's at 2048 rows 3.480 / 3.754, Qwen3-235B-A22B at 256 rows 0.828 / 0.927)
and lost at 4096 rows (DeepSeek-V3's EP8 share 5.610 / 5.506) and at K >= 6144 (Phi-3.5-MoE 1.327 / 1.246, DBRX
3.148 / 2.961; Mixtral 2.692 / 2.730 a tie); dgrads at <= 512 rows won or tied (GLM-4.5-Air 2.535 / 2.523, Llama-4-
Scout 2.302 / 2.492, Qwen1.5-MoE 0.646 / 0.758); above 512 rows they split by N: at N >= 4096 ours won 4 of 6
(SonicMoE's 6.510 / 6.864, Mixtral 5.265 / 5.729, Phi-3.5-MoE 2.484 / 2.553, DeepSeek-V3 11.025 / 11.151; Hunyuan-A13B
4.927 / 4.803 and DBRX 6.409 / 6.271 lost), below it torch's won 2 of 5 by 3-8% (OLMoE at 2048 rows 1.690 / 1.567,
DeepSeek-V2-Lite 0.907 / 0.883). Training steps, wide tile on / off, alternating in one process (bench/ab_switch.py
--switch fusion.runtime.lone_gemm:WIDE_TILE, three rounds, medians; -lone-wide-ab.json): -0.8% (Mixtral) to -4.4%
(GLM-4.5-Air) on all nine blocks measured. FUSION_LONE_WIDE=0 (read at import; WIDE_TILE per call) is the switch.

torch._grouped_mm stays the reference (backend="emulate", the CPU) and explain() names both and the rule.
Forward: ``Y[rows of g] = X @ W[g].T``, B = the weight K-major. Dgrad: ``dX[rows of g] = dY @ W[g]``, B = the weight
as stored read MN-major. The kernel's tile comes from kernels/tile_policy.py like a fused kernel's.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from fusion.kernels import tile_policy
from fusion.kernels.tile_policy import GemmConfig, dense_dgrad_tile, lone_tile
from fusion.op_table import LONE_GEMM_RULE, dtype_name, gemm_refusal
from fusion.run_context import RunContext
from fusion.runtime.bounds import row_bounds
from fusion.runtime.kernel import ShapeCache
from fusion.targets import cuda_major

#: The kernel may run the dynamic schedule (kernels/tile_policy.py): the step passes a zeroed tile counter.
TILE_COUNTER = True

#: Our kernel runs where the routed rows average at most this many per group (M <= MAX_ROWS_PER_GROUP * G) and
#: the GEMM's output width is a multiple of one of N_MULTIPLES (the plan's table holds them, so explain() states the
#: same)
MIN_GROUPS = LONE_GEMM_RULE["min_groups"]
MAX_ROWS_PER_GROUP = LONE_GEMM_RULE["max_rows_per_group"]
MAX_OUTPUTS_PER_GROUP = LONE_GEMM_RULE["max_outputs_per_group"]
WIDE = LONE_GEMM_RULE["wide"]
MAX_K = LONE_GEMM_RULE["max_k"]
N_MULTIPLES = LONE_GEMM_RULE["n_multiples"]
DENSE_DGRAD_MIN_ROWS = LONE_GEMM_RULE["dense_dgrad_min_rows"]
DENSE_DGRAD_N_MULTIPLE = LONE_GEMM_RULE["dense_dgrad_n_multiple"]
#: FUSION_LONE_GEMM=torch (read at import) sends every lone GEMM to torch._grouped_mm: the A/B switch that
#: bench/ and a user comparing the two use. FUSION_DENSE_DGRAD=0 sends a one-group GEMM's dgrad there only.
ENABLED = os.environ.get("FUSION_LONE_GEMM", "auto") != "torch"
DENSE_DGRAD = os.environ.get("FUSION_DENSE_DGRAD", "1") != "0"
OUTPUT_BUDGET = os.environ.get("FUSION_LONE_GEMM_OUTPUTS", "1") != "0"
#: Several groups run kernels/tile_policy.lone_tile (128x256 dynamic CTA pairs) where its n-tiles pair up, under the
#: wide rows cap alone (FUSION_LONE_WIDE=0: the tile policy's tile and the rule above; read per call, so
#: bench/ab_switch.py flips it between rounds).
WIDE_TILE = tile_policy.LONE_WIDE

_COMPILED: dict = {}
#: Bound launches (kernels.api.BoundGemm) per call shape
_BOUND = ShapeCache(256)


def chooses_kernel(rows: int, groups: int, n: int, k: int, part: str = "forward") -> bool:
    """The measured rule: our kernel for `rows` routed rows over `groups` groups of a GEMM from `k` into `n`
    columns, for a "forward" or a "dgrad" (never with FUSION_LONE_GEMM=torch)."""
    if groups == 1:
        return ENABLED and part == "dgrad" and dense_dgrad(n) and rows >= DENSE_DGRAD_MIN_ROWS
    if not (ENABLED and groups >= MIN_GROUPS and widths_fit(n, k, part)):
        return False
    if runs_wide_tile(n, k, groups):
        return rows <= wide_rows_cap(n, part) * groups
    if rows > MAX_ROWS_PER_GROUP[part] * groups:
        return False
    return (not OUTPUT_BUDGET or rows * n <= MAX_OUTPUTS_PER_GROUP[part] * groups
            or runs_dynamic_pairs(n, groups))


def runs_dynamic_pairs(n: int, groups: int) -> bool:
    """Whether the tile policy runs an `n`-wide GEMM of `groups` groups as dynamic CTA pairs (kernels/tile_policy.py
    dynamic_pairs: 128x192 tiles, at most 32 groups, an even n-tile count), where the rows cap alone holds. Asked
    per call past the budget, so kept per (n, groups) and the policy's pair switches (FUSION_DYNAMIC_PAIRS, or a
    test's patch of tile_policy, still reach it)."""
    key = (n, groups, tile_policy.DYNAMIC_PAIRS, tile_policy.DYNAMIC_PAIRS_MAX_GROUPS)
    hit = _PAIRS.get(key)
    if hit is None:
        config = tile_policy.choose_config(0, n, 0, groups)
        hit = _PAIRS[key] = config.dynamic and config.cluster_n == 2
    return hit


_PAIRS: dict = {}


def wide_rows_cap(n: int, part: str) -> int:
    """The most routed rows per group (on average) a `part` GEMM into `n` columns takes on the wide tile."""
    return next(cap for min_n, cap in WIDE["max_rows_per_group"][part] if n >= min_n)


def runs_wide_tile(n: int, k: int, groups: int) -> bool:
    """Whether a GEMM of `groups` groups from `k` into `n` columns runs kernels/tile_policy.lone_tile (128x256
    dynamic CTA pairs): several groups, WIDE_TILE on, 256-column n-tiles that pair up, and N >= WIDE["min_n"] or
    K >= WIDE["min_k"] (below both the 128x128 pingpong pair measured as fast or faster; likely because the
    cooperative tile's store is not hidden behind a second warpgroup's mainloop, and a short K leaves the store a
    larger share of each tile)."""
    return (WIDE_TILE and groups >= MIN_GROUPS and tile_policy.lone_pairs(n)
            and (n >= WIDE["min_n"] or k >= WIDE["min_k"]))


def dense_dgrad(n: int) -> bool:
    """Whether a one-group GEMM's dgrad into `n` columns may run on our kernel (at enough rows: the rule above):
    whole 128x256 tiles (kernels/tile_policy.dense_dgrad_tile), and not switched off (FUSION_DENSE_DGRAD=0)."""
    return DENSE_DGRAD and n % DENSE_DGRAD_N_MULTIPLE == 0


def widths_fit(n: int, k: int, part: str) -> bool:
    """The rule's part that the weight's widths alone decide, for several groups: whole n-tiles, and a K below the
    part's MAX_K."""
    return whole_tiles(n) and (MAX_K[part] is None or k < MAX_K[part])


def _widths(op, part: str) -> tuple[int, int]:
    """(N, K) of `op`'s `part` GEMM: (out, in) for a forward, (in, out) for a dgrad."""
    return (op.out_features, op.in_features) if part == "forward" else (op.in_features, op.out_features)


def whole_tiles(n: int) -> bool:
    """Whether an output `n` columns wide is whole n-tiles of a tile the kernel takes (LONE_GEMM_RULE)."""
    return any(n % m == 0 for m in N_MULTIPLES)


def takes(op, x) -> bool:
    """Whether the kernel runs `op`'s forward at input `x` on this call (see :func:`_takes`)."""
    return _takes(op, x, "forward")


def takes_dgrad(op, dy) -> bool:
    """Whether the kernel runs `op`'s dgrad of `dy` on this call: the dgrad step asks this (fusion.op_table)."""
    return _takes(op, dy, "dgrad")


def _takes(op, x, part: str) -> bool:
    """A plain CUDA bf16/fp16 tensor of the weight's dtype on a Hopper GPU, a GroupLinear without bias, widths of
    16-byte rows, and the measured rule for `part` (:func:`chooses_kernel`). Runs on every call, so the answer is
    kept per (weight, input shape and dtype, device, part, and the rule's switches): asking the rule again costs
    several microseconds of host time."""
    if type(x) is not torch.Tensor or not x.is_cuda:
        return False
    weight = op._parameters["weight"]
    key = (weight.shape, weight.dtype, x.shape, x.dtype, x.get_device(), part, type(op),
           getattr(op, "bias", None) is None, ENABLED, WIDE_TILE, OUTPUT_BUDGET, DENSE_DGRAD, tile_policy.DYNAMIC_PAIRS,
           tile_policy.DYNAMIC_PAIRS_MAX_GROUPS)
    hit = _TAKES.get(key)
    if hit is None:
        hit = _TAKES.keep(key, _rule_takes(op, x, weight, part))
    return hit


def _rule_takes(op, x, weight, part: str) -> bool:
    if x.dim() != 2 or weight.dim() != 3 or weight.dtype != x.dtype or getattr(op, "bias", None) is not None:
        return False
    if cuda_major(x.get_device()) != 9 or gemm_refusal(op, dtype_name(x.dtype)) is not None:
        return False
    return chooses_kernel(x.shape[0], weight.shape[0], *_widths(op, part), part)


#: `_takes`'s answers by call shape and switches
_TAKES = ShapeCache(256)


def _job(op, part: str, dtype: torch.dtype):
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job

    G, out_f, in_f = op.weight.shape
    if part == "forward":
        return with_lone_tile(make_job(IDENTITY_SOURCE, dtype, out_f, in_f, G, False, "K", False, "lone_fprop",
                                        "identity"))
    job = with_lone_tile(make_job(IDENTITY_SOURCE, dtype, in_f, out_f, G, False, "MN", False, "lone_dgrad",
                                   "identity"))
    if G == 1:   # a dense dgrad runs at its own tile
        job = dataclasses.replace(job, config=dataclasses.astuple(dense_dgrad_tile(GemmConfig(*job.config))))
    return job


def with_lone_tile(job):
    """`job` at kernels/tile_policy.lone_tile where :func:`runs_wide_tile`."""
    if not runs_wide_tile(job.N, job.K, job.G):
        return job
    return dataclasses.replace(job, config=dataclasses.astuple(lone_tile(GemmConfig(*job.config), job.N)))


def kernel_jobs(op, part: str, dtype: torch.dtype) -> list:
    """The KernelJob of `op`'s `part` ("forward" or "dgrad"; none for a Linear, a bias, other parts, or where the
    kernel does not take the op's widths at `dtype`, or the output width fails the rule): what Sequential.compile()
    builds ahead of time. Built even where many rows may send a call to torch: the rows are known only per call."""
    if part not in ("forward", "dgrad") or op.weight.dim() != 3 or getattr(op, "bias", None) is not None:
        return []
    if gemm_refusal(op, str(dtype).removeprefix("torch.")) is not None:
        return []
    n, k = _widths(op, part)
    dense = op.weight.shape[0] == 1
    if (dense and not (part == "dgrad" and dense_dgrad(n))) or (not dense and not widths_fit(n, k, part)):
        return []   # the rule never sends this GEMM to the kernel
    return [_job(op, part, dtype)]


def _kernel(op, part: str, dtype: torch.dtype):
    """The compiled kernel (memory, the disk cache, or compiled now), per weight shape, part and dtype."""
    key = (tuple(op.weight.shape), part, dtype, WIDE_TILE)
    compiled = _COMPILED.get(key)
    if compiled is None:
        from fusion.runtime.compile import load_compiled

        compiled = _COMPILED[key] = load_compiled(_job(op, part, dtype))
    return compiled


def _gemm(op, part: str, a: torch.Tensor, n: int, ctx: RunContext, counter: int | None) -> torch.Tensor:
    a = a if a.is_contiguous() else a.contiguous()
    rows = a.shape[0]
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    # read from the parameter table, never differentiated here (the program is the autograd node), no detach:
    # the kernel reads the pointer only
    weight = op._parameters["weight"]
    weight = weight if weight.is_contiguous() else weight.contiguous()
    bounds = row_bounds(op, rows, ctx, a.device)
    bound = bound_launch(op, part, a, weight)
    if bound is None:
        from fusion.kernels.api import bind_grouped_gemm

        bound = _BOUND.keep(_bound_key(weight, part, a), bind_grouped_gemm(_kernel(op, part, a.dtype), a, weight,
                                                                            bounds))
    bound(a, weight, bounds, {"out": out}, counter)
    return out


def _bound_key(weight: torch.Tensor, part: str, a: torch.Tensor) -> tuple:
    """The launch bound per call shape (kernels.api.BoundGemm): its checks and grid once per (weight shape, part,
    dtype, rows, device, tile switch), not per call."""
    return weight.shape, part, a.dtype, a.shape[0], a.get_device(), WIDE_TILE


def bound_launch(op, part: str, a: torch.Tensor, weight: torch.Tensor | None = None):
    """The kernel's launch already bound at `a`'s call shape (a BoundGemm), or None: not bound yet. The forward's
    replay (fusion/runtime/replay.py) keeps it after asking :func:`takes`."""
    weight = op._parameters["weight"] if weight is None else weight
    return _BOUND.get(_bound_key(weight, part, a))


def run(op, x: torch.Tensor, ctx: RunContext, counter: int | None = None) -> torch.Tensor:
    """Y = X @ W[g].T per group, in x's dtype."""
    return _gemm(op, "forward", x, op.out_features, ctx, counter)


def dgrad(op, dy: torch.Tensor, ctx: RunContext, counter: int | None = None) -> torch.Tensor:
    """dX = dY @ W[g] per group, in dY's dtype."""
    return _gemm(op, "dgrad", dy, op.in_features, ctx, counter)
