"""Whole MoE layers (issue 12): router -> top-k routing -> Gather -> experts -> Combine, forward and training step.

    python bench/bench_moe.py                    # all configs, paths, phases -> bench/results/<gpu>-<date>-moe.json
    python bench/bench_moe.py --models qwen3-30b-a3b,sonic-olmoe-7b --tokens 8192 --paths fusion,torch_compiled
    python bench/bench_moe.py --precompile       # no GPU: compile every fused kernel into FUSION_CACHE_DIR
    python bench/bench_moe.py --dry-run --out /tmp/moe.json   # CPU, a tiny float32 layer: structure, numerics

Layer: x (T, d) -> router Linear(d, E, bias=False) -> softmax, top-k, renormalize -> Gather -> GroupLinear(E, d, 2f)
-> SwiGLU -> Scale(probs) -> GroupLinear(E, f, d) -> Combine -> y (T, d), bf16, weights ~ N(0, 1/fan_in), x and dy
~ N(0, 1). Routing is the router's own (random weights: roughly balanced, some experts busier than others).
Phases: `moe_forward` (no grad) and `moe_training_step` (forward + backward of dy, handed over as a fresh copy only
autograd holds (bench_common.loss_of), with gradients to x, both expert weights and the router weight, set to None
before each step; no optimizer). Paths: bench/moe_paths.py.

Metrics per (config, phase, path): b2b_ms, sync_ms, host_us, peak_MB as bench_training_step.py defines them
(bench_common.measure); TFLOP/s from b2b_ms; in training-step rows `activation_MB`, the memory the path holds
between forward and backward (allocated after a forward whose output is alive, minus before it: the weights and x
excluded), `bwd_TFLOPs`, and for `fusion` the bytes explain() lists as saved for backward (`explain_saved_MB`).
With --graphs, `graph_ms`: the call captured in a CUDA graph and replayed (bench_common.graphed_ms), the host
removed; the table's "in CUDA graphs" column is torch_compiled's graph_ms over fusion's.
Path `fusion_rounded` is the same layer with token rounding (`--round-to`, default 128: every expert's rows a
multiple of it, SonicMoE's tile-aligned routing): its speed against `fusion` is the effect of rounding; it routes
differently, so its `rel_err_vs_top_k` is not a numerics check, and its TFLOP/s count the unrounded T*k rows.
`rel_err`: fusion's (and sonicmoe's) y, dx, dw1, dw2, drouter against torch_compiled's; `routing_agreement`: the
share of (token, expert) choices fusion.moe.route and torch.topk agree on (bf16 logits can tie).

FLOPs are counted as SonicMoE counts them (benchmarks/moe-cute.py, moe-token-rounding.py in Dao-AILab/sonic-moe):
the expert GEMMs only, forward 2*T*k*d*(2f) + 2*T*k*f*d = 6*T*k*d*f, backward 12*T*k*d*f (dgrad and wgrad of both
GEMMs), training step 18*T*k*d*f; router, routing, activation and combine are not counted. `bwd_TFLOPs` is
12*T*k*d*f / (step ms - forward ms), SonicMoE's backward figure, except that our forward is the no-grad one
(theirs stores the activations), which makes ours slightly pessimistic.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: `fusion` is this repository
sys.path.insert(0, str(HERE))

from bench_common import B2B_CALLS, graphed_ms, measure, phase_calls, rel_errors, run_header, synchronize  # noqa: E402
from held_out import HELD_OUT as HELD_OUT_TABLE  # noqa: E402
from moe_paths import (FusionLayer, SonicLayer, TorchLayer, rounded_moe, routing_agreement,  # noqa: E402
                       sonicmoe_status)


@dataclass(frozen=True)
class MoEConfig:
    model: str
    d: int              # hidden size
    E: int              # experts on this GPU
    k: int              # experts per token
    f: int              # expert intermediate size (FC1 has 2f outputs)
    tokens: tuple = ()  # fixed token counts (SonicMoE's own configs); empty: --tokens
    source: str = ""

    def flops(self, tokens: int, phase: str) -> float:
        return (18 if phase == "moe_training_step" else 6) * tokens * self.k * self.d * self.f


SONIC = "Dao-AILab/sonic-moe"
# Real models at realistic per-GPU batches (--tokens: 8192, 16384 and a small batch of 1024 by default).
# DeepSeek-V3 (256 experts, top-8, d=7168, f=2048) under 8-way expert parallelism: each GPU holds 32 experts and,
# with T tokens per GPU and balanced routing, receives 8*T*8/8 = 8T routed rows, T/4 per expert. E=32 local
# experts with k=8 over T local tokens gives the same rows per expert and per GPU, so the same GEMM work; what it
# does not model is routing over 256 experts and the two all-to-alls around the experts.
# GPT-OSS-120B runs here with plain SwiGLU and no biases (the model's is a clamped SwiGLU with biases).
MODELS = [
    MoEConfig("qwen3-30b-a3b", 2048, 128, 8, 768, source="Qwen3-30B-A3B config.json"),
    MoEConfig("olmoe-1b-7b", 2048, 64, 8, 1024, source="OLMoE-1B-7B config.json"),
    MoEConfig("deepseek-v3-ep8", 7168, 32, 8, 2048, source="DeepSeek-V3, per-GPU share at EP=8 (see above)"),
    MoEConfig("gpt-oss-120b", 2880, 128, 4, 2880, source="gpt-oss-120b config.json"),
]
# SonicMoE's own (T, d, n=f, E, K), at their own T. Where each comes from, in Dao-AILab/sonic-moe:
SONIC_CONFIGS = [
    MoEConfig("sonic-olmoe-7b", 2048, 64, 8, 1024, (32768,),
              f"{SONIC} blog assets/2026-04-22-sonicmoe-blackwell.md: the 7B OLMoE-sized runtime breakdown "
              f"(T=32768, d=2048, n=1024, E=64, K=8; paper Figure 5 for H100)"),
    MoEConfig("sonic-qwen3-235b", 4096, 128, 8, 1536, (32768,),
              f"{SONIC} README quick start and the blog's Qwen3-235B-A22B profile (32768, 4096, 1536, 128, 8)"),
    MoEConfig("sonic-moe-cute-default", 4096, 128, 8, 1024, (32768,),
              f"{SONIC} benchmarks/moe-cute.py default --thiek 32768,4096,1024,128,8"),
    MoEConfig("sonic-e256-k8", 4096, 256, 8, 1024, (16384,),
              f"{SONIC} README token-rounding example --thiekq 16384,4096,1024,256,8,128 (here: plain top-K)"),
] + [
    # iso-FLOP granularity families (n*K constant per d) of the repository's tests/moe_test.py, at its T=8192
    MoEConfig(f"sonic-iso-d{d}-n{n}-e{e}-k{kk}", d, e, kk, n, (8192,), f"{SONIC} tests/moe_test.py shapes")
    for d, n, e, kk in [(768, 256, 128, 8), (768, 512, 64, 4), (768, 1024, 32, 2),
                        (1536, 256, 128, 8), (1536, 512, 64, 4), (1536, 1024, 32, 2),
                        (4096, 256, 256, 16), (4096, 512, 128, 8), (4096, 1024, 64, 4),
                        (4096, 512, 256, 16), (4096, 1024, 128, 8), (4096, 2048, 64, 4)]
]
CONFIGS = MODELS + SONIC_CONFIGS
# bench/held_out.py's MoE configurations as whole layers (no rule was tuned on them; `--models held-out`, not in the
# default run); Llama-4-Scout's shared expert is not modelled.
HELD_OUT = [MoEConfig(h.model, h.d, h.E, h.top_k, h.f, source=h.source) for h in HELD_OUT_TABLE if h.moe]
ALL_CONFIGS = CONFIGS + HELD_OUT
# SonicMoE's published H100 TFLOP/s (forward, backward) per config, from arXiv 2512.14080. No copy reachable holds
# them as text: they are bar heights read off the paper's Figure 14 ("Forward & backward TFLOPS for different MoE
# kernels on H100"), the image assets/tput.png of Dao-AILab/sonic-moe at commit cbcb12a, measured against the
# plot's gridlines (about +-5 TFLOP/s). Its FLOPs are ours (6 / 12 T k d n); its forward is timed in training
# mode and its backward as the step minus that forward. Only configs this script runs are listed; the figure's
# other d=4096 bars at T=32768 (n, E, K) = (512, 256, 16) 516/525, (2048, 64, 4) 594/585, (256, 256, 16) 426/459,
# (512, 128, 8) 501/510, (1024, 64, 4) 551/553.
SONICMOE_PUBLISHED_H100: dict = {
    "sonic-moe-cute-default": {"fwd": 557, "bwd": 566,
                               "where": "Figure 14 (assets/tput.png @ cbcb12a), read off the bar chart, +-5"},
}
DRY_RUN = MoEConfig("dry-run-tiny", 32, 4, 2, 16, (64,), "a CPU check of the benchmark itself")
PATHS = ["fusion", "fusion_compiled", "fusion_rounded", "torch_compiled", "sonicmoe"]
PHASES = ["moe_forward", "moe_training_step"]


@dataclass
class Options:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    backend: str = "auto"              # fusion.MoE's backend
    compile_backend: str = "inductor"  # torch.compile's, for fusion_compiled and torch_compiled
    torch_variant: str = "best"        # parts | whole | best (measure both, report the faster)
    combine: str = "index_add"
    calls: dict = None                 # measure()'s call counts
    graphs: bool = False               # also time each call captured in a CUDA graph (graph_ms)
    round_to: int = 128                # fusion_rounded's token rounding (rows per expert a multiple of it)

    def measure(self, fn, clear):
        return measure(fn, clear, device=self.device, **(self.calls or {}))


def phase_fn(path, phase: str, x, dy):
    """(call, clear): one forward (no grad) or one training step, and what drops its gradients."""
    return phase_calls(path.forward, path.clear, x, dy, train=phase != "moe_forward")


def fingerprint(path, x, dy) -> dict:
    """One training step's output and gradients (x, both expert weights, the router weight)."""
    xg = x.detach().requires_grad_()
    path.clear()
    y = path.forward(xg)
    y.backward(dy)
    out = {"y": y.detach(), "dx": xg.grad, **path.grads()}
    path.clear()
    return out


def layer_errors(got: dict, want: dict, k: int) -> dict:
    """rel_errors of a layer's fingerprint against the reference path's. With k = 1 every (normalized) prob is 1, so
    the router's gradient is zero by construction and its relative error would divide one path's rounding noise by
    the other's (Llama-4-Scout read 1.0: ours exactly 0, the torch path's autograd about 1e-6): both paths' largest
    |drouter| instead (`drouter_max_abs`: [this path, the reference path])."""
    if k != 1 or "drouter" not in want:
        return rel_errors(got, want)
    errs = rel_errors({name: t for name, t in got.items() if name != "drouter"}, want)
    errs["drouter_max_abs"] = [float(t.abs().max()) if t is not None else None for t in (got.get("drouter"),
                                                                                           want["drouter"])]
    return errs


def activation_mb(path, x, device) -> float | None:
    """Memory held between forward and backward: allocated with the output alive minus before the forward."""
    if torch.device(device).type != "cuda":
        return None
    xg = x.detach().requires_grad_()
    path.clear()
    synchronize(device)
    before = torch.cuda.memory_allocated()
    y = path.forward(xg)
    synchronize(device)
    held = torch.cuda.memory_allocated() - before
    del y
    return round(held / 2 ** 20, 1)


_SAVED = re.compile(r"saved for backward \(besides x\): ([\d.e+]+) B per routed row \+ ([\d.e+]+) B per token")


def explain_saved(moe, cfg: MoEConfig, tokens: int, dtype) -> dict:
    """What explain() says the experts block saves for backward (besides x and the routing tensors)."""
    text = moe.experts.explain(dtype=dtype)
    m = _SAVED.search(text)
    if not m:
        return {"explain_saved_MB": None}
    per_row, per_token = float(m.group(1)), float(m.group(2))
    return {"explain_saved_B_per_token": per_token + per_row * cfg.k,
            "explain_saved_MB": round((per_row * tokens * cfg.k + per_token * tokens) / 2 ** 20, 1)}


def make_paths(name: str, moe, cfg: MoEConfig, opts: Options) -> list:
    """[(variant or None, path)]: torch_compiled with --torch-variant best gives both variants."""
    if name == "fusion":
        return [(None, FusionLayer(moe))]
    if name == "fusion_rounded":
        return [(None, FusionLayer(rounded_moe(moe, opts.round_to)))]
    if name == "fusion_compiled":
        return [(None, FusionLayer(moe, compiled=True, compile_backend=opts.compile_backend))]
    if name == "torch_compiled":
        variants = TorchLayer.VARIANTS if opts.torch_variant == "best" else (opts.torch_variant,)
        return [(v, TorchLayer(moe, cfg.k, v, opts.combine, opts.compile_backend)) for v in variants]
    if name == "sonicmoe":
        return [(None, SonicLayer(moe, cfg.k))]
    raise SystemExit(f"unknown path {name!r}; choose from {PATHS}")


def _err(exc) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def run_path(name, moe, cfg, tokens, x, dy, want, phases, opts, log) -> list[dict]:
    """The rows of one path (one per phase; a path that cannot run gives rows with `error`)."""
    base = {"path": name}
    if name == "sonicmoe" and sonicmoe_status():
        return [{**base, "phase": p, "error": sonicmoe_status()} for p in phases]
    try:
        variants = make_paths(name, moe, cfg, opts)
    except Exception as exc:  # noqa: BLE001 - a path that cannot be built here is reported, not fatal
        return [{**base, "phase": p, "error": _err(exc)} for p in phases]
    extra, results = {}, {p: {} for p in phases}
    for variant, path in variants:
        try:
            if name == "fusion_rounded":   # other routing (rows dropped and added): not the same function
                extra["rel_err_vs_top_k"] = layer_errors(fingerprint(path, x, dy), want, cfg.k)
                extra["round_to"] = opts.round_to
            elif name != "torch_compiled":
                extra["rel_err"] = layer_errors(fingerprint(path, x, dy), want, cfg.k)
            elif variant == "whole":
                extra["rel_err_whole_vs_parts"] = layer_errors(fingerprint(path, x, dy), want, cfg.k)
            act = activation_mb(path, x, opts.device)
        except Exception as exc:  # noqa: BLE001
            log(f"  {name} {variant or ''}: failed ({_err(exc)})")
            for p in phases:
                results[p][variant] = {"error": _err(exc)}
            synchronize(opts.device)
            continue
        for phase in phases:
            try:
                res = opts.measure(*phase_fn(path, phase, x, dy))
                if phase == "moe_training_step":
                    res["activation_MB"] = act
                if opts.graphs:
                    res.update(graph_row(path, phase, x, dy, opts.device))
                results[phase][variant] = res
            except Exception as exc:  # noqa: BLE001
                results[phase][variant] = {"error": _err(exc)}
                synchronize(opts.device)
        path.clear()
    if name == "fusion":
        extra.update(explain_saved(moe, cfg, tokens, opts.dtype))
    rows = []
    for phase in phases:
        measured = {v: r for v, r in results[phase].items() if "b2b_ms" in r}
        row = {**base, "phase": phase, **extra}
        if len(results[phase]) > 1 or name == "torch_compiled":
            row["variants"] = {v: r.get("b2b_ms", r.get("error")) for v, r in results[phase].items()}
        if not measured:
            row["error"] = next((r["error"] for r in results[phase].values()), "not measured")
        else:
            variant, res = min(measured.items(), key=lambda vr: vr[1]["b2b_ms"])
            row.update(res)
            if variant:
                row["variant"] = variant
            row["TFLOPs"] = round(cfg.flops(tokens, phase) / (res["b2b_ms"] * 1e-3) / 1e12, 2)
        rows.append(row)
    return rows


def make_layer(cfg: MoEConfig, tokens: int, opts: Options):
    """(the fusion.MoE layer, x, dy) of a configuration, seeded: every path and every script times the same."""
    import fusion

    torch.manual_seed(0)
    dev, dt = opts.device, opts.dtype
    moe = fusion.MoE.swiglu(cfg.d, cfg.E, cfg.f, cfg.k, device=dev, dtype=dt, backend=opts.backend)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
    x = torch.randn(tokens, cfg.d, device=dev, dtype=dt)
    dy = torch.randn(tokens, cfg.d, device=dev, dtype=dt)
    return moe, x, dy


def run_config(cfg: MoEConfig, tokens: int, paths, phases, opts: Options, log) -> list[dict]:
    moe, x, dy = make_layer(cfg, tokens, opts)
    key = {"model": cfg.model, "tokens": tokens, "d": cfg.d, "f": cfg.f, "f2": 2 * cfg.f, "E": cfg.E, "k": cfg.k,
           "rows": tokens * cfg.k}
    log(f"{cfg.model}: T={tokens} d={cfg.d} f={cfg.f} E={cfg.E} k={cfg.k}")
    # the numerics anchor: torch_compiled, elementwise parts compiled (always computed, even if not measured)
    want = fingerprint(TorchLayer(moe, cfg.k, "parts", opts.combine, opts.compile_backend), x, dy)
    key["routing_agreement"] = routing_agreement(moe, x, cfg.k)
    rows = []
    for name in paths:
        t0 = time.time()
        for row in run_path(name, moe, cfg, tokens, x, dy, want, phases, opts, log):
            rows.append({**key, **row})
            log("  " + _row_text(rows[-1]) + f"  ({time.time() - t0:.0f}s)")
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    _add_bwd_tflops(rows, cfg, tokens)
    return rows


def _add_bwd_tflops(rows, cfg, tokens) -> None:
    """SonicMoE's backward figure: 12*T*k*d*f / (training-step time - forward time), per path."""
    fwd = {r["path"]: r["b2b_ms"] for r in rows if r["phase"] == "moe_forward" and "b2b_ms" in r}
    for r in rows:
        before = fwd.get(r["path"])
        if r["phase"] == "moe_training_step" and "b2b_ms" in r and before is not None and r["b2b_ms"] > before:
            r["bwd_TFLOPs"] = round(12 * tokens * cfg.k * cfg.d * cfg.f / ((r["b2b_ms"] - before) * 1e-3) / 1e12, 2)


def graph_row(path, phase: str, x, dy, device) -> dict:
    """{"graph_ms": ms per CUDA-graph replay of one call} (bench_common.graphed_ms), or {"graph_error": why}."""
    if torch.device(device).type != "cuda":
        return {}
    call, clear = phase_fn(path, phase, x, dy)
    try:
        return {"graph_ms": round(graphed_ms(call), 4)}
    except Exception as exc:  # noqa: BLE001 - a path that cannot be captured is reported, not fatal
        synchronize(device)
        return {"graph_error": _err(exc)}
    finally:
        clear()


def _row_text(r: dict) -> str:
    if "error" in r and "b2b_ms" not in r:
        return f"{r['path']:15s} {r['phase']:17s} {r['error']}"
    act = f"  act {r['activation_MB']} MB" if r.get("activation_MB") is not None else ""
    err = f"  rel_err {r['rel_err']}" if "rel_err" in r else ""
    variant = f"  ({r['variant']})" if "variant" in r else ""
    graph = f"  graph {r['graph_ms']:.3f} ms" if "graph_ms" in r else \
        f"  graph failed ({r['graph_error']})" if "graph_error" in r else ""
    return (f"{r['path']:15s} {r['phase']:17s} b2b {r['b2b_ms']:9.3f} ms  sync {r['sync_ms']:9.3f} ms  "
            f"host {r['host_us']} us  peak {r['peak_MB']} MB  {r['TFLOPs']} TFLOP/s{graph}{act}{err}{variant}")


def table(rows: list[dict]) -> str:
    """Markdown: per (config, phase), each path's b2b ms (TFLOP/s) and the speedup of fusion over torch_compiled."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["tokens"], r["phase"]), {})[r["path"]] = r
    out = ["| config (T, d, f, E, k) | phase | " + " | ".join(PATHS) +
           " | torch_compiled / fusion | in CUDA graphs | activation MB fusion / torch |",
           "|---" * (len(PATHS) + 5) + "|"]
    for (model, tokens, phase), by_path in cells.items():
        r0 = next(iter(by_path.values()))
        fmt = []
        for p in PATHS:
            c = by_path.get(p)
            fmt.append("-" if c is None else "n/a" if "b2b_ms" not in c else f"{c['b2b_ms']:.3f} ({c['TFLOPs']:.0f})")
        f, t = by_path.get("fusion", {}), by_path.get("torch_compiled", {})
        speed = f"{t['b2b_ms'] / f['b2b_ms']:.2f}x" if "b2b_ms" in f and "b2b_ms" in t else "-"
        graphed = f"{t['graph_ms'] / f['graph_ms']:.2f}x" if "graph_ms" in f and "graph_ms" in t else "-"
        act = (f"{f['activation_MB']:.0f} / {t['activation_MB']:.0f}"
               if f.get("activation_MB") is not None and t.get("activation_MB") is not None else "-")
        out.append(f"| {model} ({tokens}, {r0['d']}, {r0['f']}, {r0['E']}, {r0['k']}) | {phase} | " + " | ".join(fmt)
                   + f" | {speed} | {graphed} | {act} |")
    return "\n".join(out)


def select(args) -> list[tuple[MoEConfig, int]]:
    if args.dry_run:
        return [(DRY_RUN, t) for t in DRY_RUN.tokens]
    names = None if args.models is None else set(args.models.split(","))
    if names and "held-out" in names:
        names = (names - {"held-out"}) | {c.model for c in HELD_OUT}
    unknown = set(names or ()) - {c.model for c in ALL_CONFIGS}
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {[c.model for c in ALL_CONFIGS]} "
                         f"or held-out")
    tokens = [int(t) for t in args.tokens.split(",")]
    chosen = CONFIGS if names is None else [c for c in ALL_CONFIGS if c.model in names]
    return [(c, t) for c in chosen for t in (c.tokens or tokens)]


def precompile(selected) -> None:
    """Compile every fused kernel these layers' plans launch into FUSION_CACHE_DIR (no GPU needed)."""
    import fusion
    from fusion.runtime.aot import compile_jobs, plan_jobs

    jobs = []
    for cfg in {c for c, _ in selected}:
        with torch.device("meta"):
            moe = fusion.MoE.swiglu(cfg.d, cfg.E, cfg.f, cfg.k, device="meta")
        jobs += plan_jobs(moe.experts, torch.bfloat16)
    print(f"{len(jobs)} kernels ({len({j.key for j in jobs})} distinct)", flush=True)
    compile_jobs(jobs, parallel=int(os.environ.get("FUSION_COMPILE_WORKERS", "1")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help=f"comma-separated config names (default: all): "
                                                   f"{', '.join(c.model for c in CONFIGS)}; 'held-out': "
                                                   f"{', '.join(c.model for c in HELD_OUT)} (not in the default)")
    ap.add_argument("--tokens", default="8192,16384,1024", help="token counts for the model configs (SonicMoE's "
                                                               "configs keep their own)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--compiled-models", default="qwen3-30b-a3b,olmoe-1b-7b,sonic-olmoe-7b",
                    help="configs that also run path fusion_compiled (a torch.compile per layer costs a minute "
                         "of device time each); 'all' for every one")
    ap.add_argument("--torch-variant", default=None, choices=["parts", "whole", "best"],
                    help="torch_compiled: compile the elementwise part, the whole layer, or measure both and "
                         "report the faster (default best; parts with --dry-run: torch._grouped_mm's fake-tensor "
                         "check accepts bf16 only, so the float32 layer cannot be traced whole)")
    ap.add_argument("--combine", default="index_add", choices=["index_add", "gather_sum"],
                    help="torch_compiled's combine: index_add (atomics), or gather + sum over k (deterministic)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<gpu>-<date>-moe.json)")
    ap.add_argument("--round-to", type=int, default=128, help="fusion_rounded's token rounding (rows per expert "
                                                                  "rounded to a multiple of it)")
    ap.add_argument("--graphs", action="store_true", help="also time every call captured in a CUDA graph (graph_ms: "
                                                         "the host removed, as under torch.cuda.graph)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny float32 layer, fusion backend='reference' "
                                                          "and torch.compile backend='eager': checks the benchmark")
    args = ap.parse_args(argv)
    unknown = [p for p in args.phases.split(",") if p not in PHASES]
    if unknown:   # a phase name not listed would otherwise be measured as a training step (phase_fn)
        ap.error(f"--phases: unknown {unknown}; choose from {PHASES}")
    selected = select(args)
    if args.precompile:
        return precompile(selected)
    opts = Options()
    if args.dry_run:
        opts = Options(device="cpu", dtype=torch.float32, backend="reference", compile_backend="eager",
                       calls={"b2b_calls": 2, "sync_calls": 1})
    opts.torch_variant = args.torch_variant or ("parts" if args.dry_run else "best")
    opts.combine = args.combine
    opts.graphs = args.graphs
    opts.round_to = args.round_to
    header = run_header(opts.device)
    out = Path(args.out) if args.out else \
        HERE / "results" / f"{header['gpu'].replace(' ', '-')}-{header['date']}-moe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{header['gpu']}, torch {torch.__version__}, commit {header['commit']}", flush=True)
    data = {**header, "flops": "expert GEMMs only: forward 6*T*k*d*f, training step 18*T*k*d*f (SonicMoE's count)",
            "configs": {c.model: c.source for c, _ in selected},
            "sonicmoe_published_h100": SONICMOE_PUBLISHED_H100,
            "b2b_calls": (opts.calls or {}).get("b2b_calls", B2B_CALLS), "rows": []}
    # torch.compile may recompile per config; past its limit it would silently run eager: raise instead
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    compiled = {c.model for c, _ in selected} if args.compiled_models == "all" else \
        set(args.compiled_models.split(",")) | {DRY_RUN.model}
    for cfg, tokens in selected:
        paths = [p for p in args.paths.split(",") if p != "fusion_compiled" or cfg.model in compiled]
        data["rows"] += run_config(cfg, tokens, paths, args.phases.split(","), opts, lambda msg: print(msg, flush=True))
        out.write_text(json.dumps(data, indent=1))  # after every config: a run cut short keeps what it measured
    print(table(data["rows"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
