"""The benchmark of record: MLP blocks of real models, forward and training step, every path, one run.

    python bench/bench_training_step.py                      # all blocks, all paths -> bench/results/<gpu>-<date>.json
    python bench/bench_training_step.py --models qwen3-30b-a3b,small --paths fusion,unfused_compiled
    python bench/bench_training_step.py --precompile         # no GPU: compile every fused kernel (bf16 and the
                                                             # FP8 twin's) into FUSION_CACHE_DIR

Block: GroupLinear(E, d, 2f) -> SwiGLU -> Scale (router probabilities, bf16) -> GroupLinear(E, f, d) in bf16; dense
models drop Scale and run one group. Rows = tokens x top-k, split over the experts by random imbalanced weights
(log-normal, sigma 0.6, seeded; some experts may get none).

Paths (all in bf16, the same weights, inputs and group sizes):
- fusion            fusion.Sequential, backend="auto": the fused kernels where the plan has them.
- fusion_compiled   the same block inside torch.compile(fullgraph=True) (its custom ops).
- unfused_compiled  what a user writes: torch._grouped_mm with its autograd around a torch.compile'd
                    silu(g) * u * probs[:, None] (dense: F.linear and a compiled silu(g) * u).
- unfused_fullgraph the same math as one function inside torch.compile(fullgraph=True), torch._grouped_mm traced
                    into the graph: the unfused block as it runs inside a user's compiled model, so the partner of
                    fusion_compiled (both pay the compiled graph's wrappers per call).
- quack             quack-kernels: gemm_act (SwiGLU) + a compiled * probs + gemm forward; backward gemm_dact
                    (dSwiGLU with the router scale, colvec_scale, and its reduction for d probs), gemm for dx,
                    and torch._grouped_mm for the weight gradients (quack's varlen-K GEMM needs 16-byte
                    aligned group starts).
- reference         backend="reference": the eager specification (not a baseline; for scale).
- <path>_graphed    any path above with its forward and backward captured by torch.cuda.make_graphed_callables
                    (fusion_graphed, unfused_compiled_graphed, ...): the host removed, as a user with a small batch
                    runs it; each call copies its inputs into the graphs' static inputs and replays.
- <path>_after_step any path above with each call made as the first after an optimizer step
                    (fusion_fp8_after_step): fusion.quant.invalidate_weight_caches() first, what the optimizer
                    hook does, so an FP8 path quantizes its weights again in every call, as a training loop without
                    gradient accumulation does (session am); a bf16 path holds no quantized weights.
- fusion_fp8, fusion_fp8_fp8wgrad, fusion_fp8_direct, unfused_fp8: the FP8 paths (bench/fp8_paths.py): the
                    fp8_block block against torch._scaled_grouped_mm with compiled act and quantization. Their relative error is
                    against the bf16 reference, so it includes FP8's rounding.

Phase "gemm" (issue 9): the block's FC1 and FC2 forward GEMMs alone, TFLOP/s of our FP8 block-scaled grouped GEMM
(path fp8_kernel), bf16 torch._grouped_mm (grouped_mm_bf16) and torch._scaled_grouped_mm with row-wise scales
(scaled_grouped_mm_rowwise), balanced group sizes (bench/bench_fp8_gemm.py; median of 30 calls between events).

Per (block, phase, path) of the other phases: b2b_ms (100 calls back to back, one sync; 10 before session v), sync_ms (median of calls
each followed by a sync), host_us (CPU time to issue one call, measured while the GPU is busy), peak_MB
(torch.cuda.max_memory_allocated during one call, minus what was allocated before it: the call's own memory,
weights and inputs excluded). A training step is forward + backward of a random output gradient with the weight
gradients freshly allocated (set to None first); no optimizer. The gradient reaches the output as a fresh copy that
only autograd holds (bench_common.loss_of: a loss above the block, as in a model), so each path frees it when its own
autograd lets go of it (from session q; before, the bench held dy through every path's backward).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: `fusion` is this repository
sys.path.insert(0, str(HERE))         # and its sibling bench_common, also when imported from elsewhere

from bench_common import B2B_CALLS as _B2B_CALLS  # noqa: E402
from bench_common import measure, phase_calls, rel_errors, run_header  # noqa: E402  (re-exported: bench_moe imports them too)
from held_out import HELD_OUT  # noqa: E402


@dataclass(frozen=True)
class Block:
    model: str
    E: int          # experts on this GPU (1: dense)
    tokens: int
    top_k: int
    d: int          # hidden size
    f: int          # expert intermediate size (FC1 has 2f outputs)

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def moe(self) -> bool:
        return self.E > 1


# Real models' MLP blocks at realistic per-GPU batch sizes. DeepSeek-V3: 256 experts, 8 per token, the per-GPU
# share under 8-way expert parallelism (32 local experts; each GPU receives tokens x 8 / 8 routed rows).
BLOCKS = [
    Block("llama-3-8b", 1, 16384, 1, 4096, 14336),
    Block("llama-3-70b", 1, 8192, 1, 8192, 28672),
    Block("mixtral-8x7b", 8, 8192, 2, 4096, 14336),
    Block("deepseek-v3-ep8", 32, 8192, 4, 7168, 2048),
    Block("deepseek-v2-lite", 64, 8192, 6, 2048, 1408),
    Block("qwen3-30b-a3b", 128, 8192, 8, 2048, 768),
    Block("qwen3-235b-a22b", 128, 4096, 8, 4096, 1536),
    Block("olmoe-1b-7b", 64, 8192, 8, 2048, 1024),
    Block("gpt-oss-20b", 32, 8192, 4, 2880, 2880),
    Block("gpt-oss-120b", 128, 8192, 4, 2880, 2880),
    Block("small-batch", 8, 2048, 2, 2048, 1024),
    Block("qwen3-30b-a3b-small", 128, 512, 8, 2048, 768),
]
# Blocks no tile rule was tuned on (bench/held_out.py; none of them in BLOCKS): `--models held-out` runs them.
HELD_OUT_BLOCKS = [Block(h.model, h.E, h.tokens, h.top_k, h.d, h.f) for h in HELD_OUT]
#: Calls per back-to-back window (bench_common.measure's b2b_ms; --b2b-calls): bench_common.B2B_CALLS, 100 since
#: session v, 10 in every run before. Ten steps of a few ms see the clocks the card had before them; a training loop
#: runs at its sustained, power-capped clocks, which slow the fused step more than the unfused one
#: (bench/b2b_calls.py, one H200, the paths alternating: DeepSeek-V2-Lite / OLMoE / GPT-OSS-20B 1.28x / 1.24x / 1.19x
#: over 10 steps, 1.13x / 1.13x / 1.14x over 100; bench/results/H200-2026-11-29v-b2b-calls.log).
B2B_CALLS = _B2B_CALLS
PATHS = ["fusion", "fusion_compiled", "unfused_compiled", "unfused_fullgraph", "quack", "reference", "fusion_fp8", "fusion_fp8_fp8wgrad",
         "fusion_fp8_direct", "unfused_fp8", "fusion_fp8_after_step"]
PHASES = ["forward", "training_step", "gemm"]
#: Paths that compile the whole block per shape (only on --compiled-models' blocks).
WHOLE_COMPILED = ("fusion_compiled", "unfused_fullgraph")
#: A path name plus this suffix (fusion_fp8_after_step): each of its calls as the first after an optimizer step
AFTER_STEP = "_after_step"
#: A path name plus this suffix (fusion_graphed, unfused_compiled_graphed, ...): that path captured in CUDA graphs
#: (GraphedPath).
GRAPHED = "_graphed"


#: The spread of the experts' log-normal weights (--sigma): 0.6 by default; 0 is balanced, 1.2 leaves some experts
#: with several times the mean and many nearly empty.
SIGMA = 0.6


def group_sizes(block: Block, seed: int = 0, sigma: float | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if block.E == 1:
        return torch.tensor([block.rows])
    weights = torch.exp((SIGMA if sigma is None else sigma) * torch.randn(block.E, generator=gen))
    return torch.distributions.Multinomial(block.rows, probs=weights / weights.sum()).sample().long()


def fusion_block(block: Block, device="cuda", dtype=torch.bfloat16):
    from fusion import GroupLinear, Scale, Sequential, SwiGLU

    ops = [GroupLinear(block.E, block.d, 2 * block.f), SwiGLU()]
    ops += [Scale()] if block.moe else []
    ops += [GroupLinear(block.E, block.f, block.d)]
    return Sequential(*ops).to(device, dtype)


# -- paths --------------------------------------------------------------------------------------------------------
class Path_:
    """A path's forward(x) and the parameters whose gradients a training step makes."""

    params: list

    def forward(self, x):
        raise NotImplementedError


class FusionPath(Path_):
    def __init__(self, seq, sizes, probs, compiled=False):
        self.seq, self.sizes, self.probs = seq, sizes, probs
        self.params = list(seq.parameters())
        self.call = torch.compile(seq, fullgraph=True) if compiled else seq

    def forward(self, x):
        extra = {"scale": self.probs} if self.probs is not None else {}
        return self.call(x, group_sizes=self.sizes, **extra)


#: The compiled elementwise functions of the unfused paths, compiled for static shapes, as a user's are at a fixed
#: token count (one graph per block shape: dynamo's recompile limit raised for a run over every block). Until
#: session t (2026-11-29) they were compiled for dynamic shapes, whose kernels ran 1.6-3.0x slower than the static
#: ones (Qwen3-30B-A3B's step: 1.02 against 0.39 ms of elementwise kernels; docs/benchmarks.md, session t): every
#: unfused_compiled figure before that flattered the fused path.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


@torch.compile(dynamic=False)
def _swiglu_scale(h, probs):
    g, u = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u * probs[:, None]


@torch.compile(dynamic=False)
def _swiglu(h):
    g, u = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


@torch.compile(dynamic=False)
def _scale_rows(y, probs):
    return y * probs[:, None]


class UnfusedCompiledPath(Path_):
    """torch._grouped_mm + a compiled elementwise function: what a user writes in five lines."""

    def __init__(self, seq, offsets, probs):
        self.w1, self.w2 = seq[0].weight, seq[-1].weight  # (E, 2f, d), (E, d, f): the same parameters
        self.params = [self.w1, self.w2]
        self.offsets, self.probs = offsets, probs

    def forward(self, x):
        if self.probs is None:  # dense
            h = torch.nn.functional.linear(x, self.w1[0])
            return torch.nn.functional.linear(_swiglu(h), self.w2[0])
        h = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=self.offsets)
        y = _swiglu_scale(h, self.probs)
        return torch._grouped_mm(y, self.w2.transpose(-2, -1), offs=self.offsets)


def _unfused_block(x, w1, w2, offsets, probs):
    """unfused_compiled's math as one function, for torch.compile(fullgraph=True) (path unfused_fullgraph)."""
    if probs is None:  # dense
        g, u = torch.nn.functional.linear(x, w1[0]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w2[0])
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    g, u = h.chunk(2, dim=-1)
    return torch._grouped_mm(torch.nn.functional.silu(g) * u * probs[:, None], w2.transpose(-2, -1), offs=offsets)


class UnfusedFullgraphPath(UnfusedCompiledPath):
    """The unfused block compiled whole (one graph per block shape), as inside a user's torch.compile'd model."""

    def __init__(self, seq, offsets, probs):
        super().__init__(seq, offsets, probs)
        # (one compiled function for every block of a run: each block's shapes are one more graph of it, within the
        # module's raised recompile limit; fullgraph=True would fail past it rather than fall back)
        self.call = torch.compile(_unfused_block, fullgraph=True)

    def forward(self, x):
        return self.call(x, self.w1, self.w2, self.offsets, self.probs)


class _QuackBlock(torch.autograd.Function):
    """FC1 (gemm_act, SwiGLU) -> * probs -> FC2, with quack's kernels forward and backward."""

    @staticmethod
    def forward(ctx, x, w1t, w2t, probs, cu_seqlens):
        from quack.gemm_interface import gemm, gemm_act

        preact, post = gemm_act(x, w1t, activation="swiglu", cu_seqlens_m=cu_seqlens,
                                store_preact=torch.is_grad_enabled() or ctx.needs_input_grad[0], tuned=False)
        y = post if probs is None else _scale_rows(post, probs)
        out = gemm(y, w2t, cu_seqlens_m=cu_seqlens, tuned=False)
        ctx.save_for_backward(x, w1t, w2t, probs, cu_seqlens, preact)
        return out

    @staticmethod
    def backward(ctx, dout):
        from quack.gemm_interface import gemm, gemm_dact

        x, w1t, w2t, probs, cu_seqlens, preact = ctx.saved_tensors
        dout = dout.contiguous()
        # d preact = dSwiGLU(preact, (dout @ W2) * probs); postact = SwiGLU(preact) * probs; d probs = row sums
        # colvec_scale in fp32: quack's cp.async load of it needs 4-byte elements
        res = gemm_dact(dout, w2t.transpose(-2, -1), preact, activation="swiglu",
                        colvec_scale=None if probs is None else probs.float(),
                        colvec_reduce=probs is not None, cu_seqlens_m=cu_seqlens, tuned=False)
        dpre, y = res[0], res[1]
        dprobs = res[2].to(probs.dtype) if probs is not None else None
        # weight gradients: torch._grouped_mm (quack's varlen-K GEMM needs 16-byte aligned group starts, which
        # random group sizes do not give)
        offs = cu_seqlens[1:]
        dw2t = torch._grouped_mm(y.T, dout, offs=offs)       # (E, f, d)
        dw1t = torch._grouped_mm(x.T, dpre, offs=offs)       # (E, d, 2f)
        dx = gemm(dpre, w1t.transpose(-2, -1), cu_seqlens_m=cu_seqlens, tuned=False)
        return dx, dw1t, dw2t, dprobs, None


class QuackPath(Path_):
    def __init__(self, seq, offsets, probs):
        # quack's B operand is (E, K, N): the transposed views of our (E, N, K) weights (no copies).
        self.w1, self.w2 = seq[0].weight, seq[-1].weight
        self.params = [self.w1, self.w2]
        self.cu_seqlens = torch.cat([offsets.new_zeros(1), offsets]).to(torch.int32)
        self.probs = probs

    def forward(self, x):
        return _QuackBlock.apply(x, self.w1.transpose(-2, -1), self.w2.transpose(-2, -1), self.probs,
                                 self.cu_seqlens)


class _Graphable(torch.nn.Module):
    """A path as a module of (x[, probs]) for torch.cuda.make_graphed_callables: the block's weights are its
    parameters (their gradients come out of the backward graph), the router probabilities an input (theirs too)."""

    def __init__(self, path: Path_, seq):
        super().__init__()
        self.seq, self.path = seq, path

    def forward(self, x, probs=None):
        kept, self.path.probs = self.path.probs, probs
        try:
            return self.path.forward(x)
        finally:
            self.path.probs = kept


class GraphedPath(Path_):
    """Another path with its forward and backward captured in CUDA graphs (torch.cuda.make_graphed_callables, as a
    user with a small batch runs a block to take the host out): each call copies its inputs into the graphs'
    static inputs and replays. The kernels and the math are the inner path's."""

    def __init__(self, inner: Path_, seq, rows: int):
        self.inner, self.params, self.probs = inner, inner.params, inner.probs
        param = next(seq.parameters())
        x = torch.randn(rows, seq[0].in_features, device=param.device, dtype=param.dtype, requires_grad=True)
        args = (x,) if self.probs is None else (x, self.probs.detach().clone().requires_grad_())
        self.call = torch.cuda.make_graphed_callables(_Graphable(inner, seq), args)

    def forward(self, x):
        return self.call(x) if self.probs is None else self.call(x, self.probs)


# -- timing: measure() and rel_errors() live in bench_common.py (shared with bench_moe.py) ----------------------
def phase_fn(path: Path_, phase: str, x, dy):
    """(call, clear): one forward or training step, and what drops its gradients."""
    def clear_grads():
        for p in path.params:
            p.grad = None
        if path.probs is not None:
            path.probs.grad = None

    return phase_calls(path.forward, clear_grads, x, dy, train=phase != "forward")


def fingerprint(path: Path_, x, dy) -> dict:
    """One training step's output and gradients (x, weights, router probabilities), to check that the paths
    compute the same math."""
    step, clear = phase_fn(path, "training_step", x, dy)
    xg = x.detach().requires_grad_()
    clear()
    y = path.forward(xg)
    y.backward(dy)
    out = {"y": y.detach(), "dx": xg.grad, "dw1": path.params[0].grad, "dw2": path.params[1].grad}
    if path.probs is not None:
        out["dprobs"] = path.probs.grad
    clear()
    return out


class AfterStepPath(Path_):
    """Another path with each call made as the first after an optimizer step: fusion.quant.invalidate_weight_caches()
    (what the optimizer hook does) before its forward, so every FP8 weight is quantized again in the call, as in a
    training loop that steps the optimizer after every batch."""

    def __init__(self, inner: Path_):
        self.inner, self.params, self.probs = inner, inner.params, inner.probs

    def forward(self, x):
        from fusion.quant import invalidate_weight_caches

        invalidate_weight_caches()
        return self.inner.forward(x)


def make_path(name: str, seq, sizes, offsets, probs):
    if name.endswith(AFTER_STEP):
        return AfterStepPath(make_path(name.removesuffix(AFTER_STEP), seq, sizes, offsets, probs))
    if name.endswith(GRAPHED):
        inner = make_path(name.removesuffix(GRAPHED), seq, sizes, offsets, probs)
        return GraphedPath(inner, seq, int(sizes.sum()))
    if name == "fusion":
        return FusionPath(seq, sizes, probs)
    if name == "fusion_compiled":
        return FusionPath(seq, sizes, probs, compiled=True)
    if name == "unfused_compiled":
        return UnfusedCompiledPath(seq, offsets, probs)
    if name == "unfused_fullgraph":
        return UnfusedFullgraphPath(seq, offsets, probs)
    if name == "quack":
        import quack_compat  # noqa: F401  (.gpu/quack_compat.py: quack 0.6.5 on DSL 4.8.1)
        return QuackPath(seq, offsets, probs)
    if name in ("fusion_fp8", "fusion_fp8_fp8wgrad", "fusion_fp8_direct"):
        from fp8_paths import fusion_fp8_block
        block = fusion_fp8_block(seq, probs, wgrad_bf16=False if name == "fusion_fp8_fp8wgrad" else "auto",
                                 quantize=name != "fusion_fp8_direct")
        return FusionPath(block, sizes, probs)
    if name == "unfused_fp8":
        from fp8_paths import UnfusedFP8Path
        return UnfusedFP8Path(seq, offsets, probs)
    if name == "reference":
        import copy
        ref = copy.copy(seq)
        ref.backend = "reference"
        return FusionPath(ref, sizes, probs)
    raise SystemExit(f"unknown path {name!r}; choose from {PATHS}")


def check_fused_ran(seq, x, sizes, probs) -> dict:
    """The fused kernels of the plan launched (a silent fallback would make the fusion row a reference row)."""
    from fusion.runtime.kernel import LAUNCHES

    LAUNCHES.reset()
    xg = x.detach().requires_grad_()
    extra = {"scale": probs} if probs is not None else {}
    seq(xg, group_sizes=sizes, **extra).sum().backward()
    torch.cuda.synchronize()
    return dict(LAUNCHES.by_step)


@dataclass
class BlockSetup:
    """One block's weights, inputs and group sizes on the GPU, the same for every path (seeded)."""

    seq: object
    sizes: torch.Tensor
    offsets: torch.Tensor
    x: torch.Tensor
    probs: torch.Tensor | None
    dy: torch.Tensor

    def path(self, name: str):
        return make_path(name, self.seq, self.sizes, self.offsets, self.probs)


def setup_block(block: Block) -> BlockSetup:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    seq = fusion_block(block, dev, dt)
    for p in seq.parameters():
        torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
    sizes = group_sizes(block).to(dev)
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    x = torch.randn(block.rows, block.d, device=dev, dtype=dt)
    probs = torch.rand(block.rows, device=dev, dtype=dt).requires_grad_() if block.moe else None
    dy = torch.randn(block.rows, block.d, device=dev, dtype=dt)
    return BlockSetup(seq, sizes, offsets, x, probs, dy)


def run_block(block: Block, paths, phases, out_rows, log):
    t0 = time.time()
    setup = setup_block(block)
    seq, sizes, offsets, x, probs, dy = setup.seq, setup.sizes, setup.offsets, setup.x, setup.probs, setup.dy
    launched = check_fused_ran(seq, x, sizes, probs)
    want = fingerprint(make_path("reference", seq, sizes, offsets, probs), x, dy)
    # the seconds a block costs before its timings (kernel loads, the reference): device time to plan for
    log(f"{block.model}: E={block.E} rows={block.rows} d={block.d} 2f={2 * block.f}; fused launches {launched} "
        f"(setup and reference {time.time() - t0:.0f}s)")
    if "gemm" in phases:
        gemm_rows(block, out_rows, log)
    phases = [p for p in phases if p != "gemm"]
    for name in paths:
        try:
            t0 = time.time()
            path = make_path(name, seq, sizes, offsets, probs)
            err = rel_errors(fingerprint(path, x, dy), want)
            log(f"  {name}: relative error against the reference {err} ({time.time() - t0:.0f}s with its warm-up)")
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is reported, not fatal
            log(f"  {name}: unavailable ({type(exc).__name__}: {str(exc)[:300]})")
            torch.cuda.synchronize()
            continue
        for phase in phases:
            t0 = time.time()
            try:
                res = measure(*phase_fn(path, phase, x, dy), b2b_calls=B2B_CALLS)
            except Exception as err:  # noqa: BLE001
                log(f"  {name} {phase}: failed ({type(err).__name__}: {str(err)[:300]})")
                torch.cuda.synchronize()
                continue
            row = {"model": block.model, "E": block.E, "rows": block.rows, "d": block.d, "f2": 2 * block.f,
                   "phase": phase, "path": name, **res, "rel_err": err}
            out_rows.append(row)
            log(f"  {name:17s} {phase:13s} b2b {res['b2b_ms']:9.3f} ms  sync {res['sync_ms']:9.3f} ms  "
                f"host {res['host_us']:8.1f} us  peak {res['peak_MB']:9.1f} MB  ({time.time() - t0:.0f}s)")
        del path
    del seq, want
    torch.cuda.empty_cache()


#: phase "gemm": the block's FC1 and FC2 forward GEMMs alone (K, N), each on three kernels (bench/bench_fp8_gemm.py)
GEMM_PATHS = (("fp8_kernel", "ours"), ("grouped_mm_bf16", "bf16"), ("scaled_grouped_mm_rowwise", "scaled"))


def _gemm_shapes(block: Block):
    return (("fc1", block.d, 2 * block.f), ("fc2", block.f, block.d))


def gemm_rows(block: Block, out_rows, log) -> None:
    """Phase "gemm" (issue 9): TFLOP/s of our FP8 block-scaled grouped GEMM, bf16 torch._grouped_mm and
    torch._scaled_grouped_mm (row-wise scales) on the block's FC1 and FC2 shapes, balanced group sizes."""
    from bench_fp8_gemm import bench_shape

    for gemm, K, N in _gemm_shapes(block):
        res = bench_shape(block.E, K, N, block.rows, reps=30, gen=torch.Generator().manual_seed(0))
        for path, key in GEMM_PATHS:
            row = {"model": block.model, "E": block.E, "rows": block.rows, "d": block.d, "f2": 2 * block.f,
                   "phase": "gemm", "gemm": gemm, "K": K, "N": N, "path": path, "ms": res[f"{key}_ms"],
                   "tflops": res[f"{key}_tflops"], "error": res[f"{key}_error"]}
            out_rows.append(row)
            log(f"  gemm {gemm} (K={K}, N={N}) {path:26s} {row['ms']} ms  {row['tflops']} TFLOP/s")


def select_blocks(models: str | None) -> list[Block]:
    """The blocks `--models` names, in table order: all of BLOCKS by default; "held-out" stands for every held-out
    block; an unknown name is an error (a typo must not run an empty benchmark)."""
    if not models:
        return list(BLOCKS)
    names = set(models.split(","))
    if "held-out" in names:
        names |= {b.model for b in HELD_OUT_BLOCKS}
    unknown = names - {b.model for b in BLOCKS + HELD_OUT_BLOCKS} - {"held-out"}
    if unknown:
        raise SystemExit(f"unknown --models {sorted(unknown)}; known: {[b.model for b in BLOCKS + HELD_OUT_BLOCKS]}")
    return [b for b in BLOCKS + HELD_OUT_BLOCKS if b.model in names]


def precompile(blocks, fp8: bool = True) -> None:
    """Compile every fused kernel these blocks' plans launch into FUSION_CACHE_DIR (no GPU needed); `fp8`: the
    FP8 twins' and phase gemm's too."""
    from fusion.planner import clear_cache
    from fusion.quant import fp8_linear
    from fusion.runtime.aot import compile_jobs, plan_jobs
    from fusion.runtime.fp8_gemm import identity_job

    from fp8_paths import fusion_fp8_block

    jobs = []
    default_wgrad = fp8_linear.WGRAD_IN_BF16
    for block in blocks:
        with torch.device("meta"):
            seq = fusion_block(block, "meta")
            probs = True if block.moe else None
            jobs += plan_jobs(seq, torch.bfloat16)
            # the FP8 twins with and without the QuantizeFP8Block, under both weight-gradient recipes (the bf16
            # varlen-K kernel's jobs, or the FP8 one's: fusion_fp8_fp8wgrad, an A/B of WGRAD_IN_BF16)
            try:
                for wgrad_bf16 in ("auto", False) if fp8 else ():
                    fp8_linear.WGRAD_IN_BF16 = wgrad_bf16
                    clear_cache()
                    jobs += [job for q in (True, False) for job in plan_jobs(fusion_fp8_block(seq, probs, quantize=q),
                                                                             torch.bfloat16)]
            finally:
                fp8_linear.WGRAD_IN_BF16 = default_wgrad
                clear_cache()
        if fp8:
            jobs += [identity_job(N, K, block.E, torch.bfloat16) for _, K, N in _gemm_shapes(block)]  # phase gemm
    print(f"{len(jobs)} kernels ({len({j.key for j in jobs})} distinct)", flush=True)
    compile_jobs(jobs, parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "1")))


def main(argv=None):
    global SIGMA, B2B_CALLS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None,
                    help="comma-separated model names (default: all of BLOCKS); 'held-out': HELD_OUT_BLOCKS")
    ap.add_argument("--sigma", type=float, default=SIGMA,
                    help="spread of the experts' log-normal weights (0: balanced groups)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--compiled-models", default="qwen3-30b-a3b,olmoe-1b-7b,small-batch,llama-3-8b",
                    help="blocks that also run paths fusion_compiled and unfused_fullgraph (a torch.compile per "
                         "shape costs time)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<gpu>-<date>.json)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--b2b-calls", type=int, default=B2B_CALLS,
                    help="calls per back-to-back window (b2b_ms); more see the card's sustained, power-bound clocks")
    args = ap.parse_args(argv)
    SIGMA, B2B_CALLS = args.sigma, args.b2b_calls
    blocks = select_blocks(args.models)
    if args.precompile:
        fp8 = any("fp8" in p for p in args.paths.split(",")) or "gemm" in args.phases.split(",")
        return precompile(blocks, fp8=fp8)
    paths = args.paths.split(",")
    compiled_models = set(args.compiled_models.split(","))
    header = run_header()  # FUSION_COMMIT names the commit where a copied tree has no history
    gpu, date, commit = header["gpu"], header["date"], header["commit"]
    rows: list[dict] = []

    def log(msg):
        print(msg, flush=True)

    log(f"{gpu}, torch {torch.__version__}, commit {commit}")
    out = Path(args.out) if args.out else HERE / "results" / f"{gpu.replace(' ', '-')}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for block in blocks:
        use = [p for p in paths if p not in WHOLE_COMPILED or block.model in compiled_models]
        run_block(block, use, args.phases.split(","), rows, log)
        # written after every block: a run cut short keeps what it measured
        out.write_text(json.dumps({"gpu": gpu, "date": date, "commit": commit, "sigma": SIGMA, "b2b_calls": B2B_CALLS,
                                    "rows": rows}, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
