"""A/B of one runtime switch inside one process: the fused block's step with a module attribute on and off, rounds
alternating, on the training-step bench's blocks (bench_training_step.py; its held-out blocks too).

    python bench/ab_switch.py --switch fusion.runtime.lone_gemm:OUTPUT_BUDGET --models glm-4.5-air,hunyuan-a13b

Why in one process: the switches are read at import (FUSION_* variables), so an A/B across processes pays each
block's setup and reference check twice, and the machine's clocks move between processes by several per cent. A
switch that the runtime reads per call (a module global) is flipped here between rounds instead. Rounds alternate
which setting goes first (on-off, off-on, ...) after a discarded warm-up round, so a drift of the clocks within a
round favours neither. Each timing is a window of --b2b-calls steps back to back: 100 since session v, which
found ten-step windows reading the clocks of a card that had just idled, not the power-capped ones a training loop
runs at (bench/b2b_calls.py); every A/B before it timed ten. Prints, per block and phase, each round's back-to-back ms and the medians; with --baseline
also an unfused path once (--baseline-path: unfused_fullgraph by default, the block compiled whole for static
shapes; unfused_compiled until session u). Each setting's peak memory of one call (bench_common.measure's, the last
round's) and the median of its rounds' host µs per call (measure's host_us) go with its times.

A switch read when a block's kernels are chosen (a tile policy's rule: tile_policy.GATED_PAIRS) rather than per call
takes --plan: the B setting then runs a copy of the block (the same parameters) whose plan and kernels were made, and
run once, with the attribute off; the rounds alternate the two blocks.

--moe: the whole MoE layers of bench_moe.py instead (its configurations, --tokens, phases moe_forward and
moe_training_step; with --plan the copy is moe_paths.twin_layer, the same parameters and a distinct experts block):

    python bench/ab_switch.py --moe --plan --switch fusion.kernels.tile_policy:GATHER_PAIRS --models qwen3-30b-a3b

--on / --off: the two settings when they are not True and False (Python literals), e.g. a threshold:

    python bench/ab_switch.py --moe --plan --switch fusion.kernels.tile_policy:FC1_COPY_MIN_N --on 0 --off 5760 ...

--path fusion_fp8: the blocks' FP8 path instead of the bf16 one, e.g. the FP8 kernel's tile rows:

    python bench/ab_switch.py --plan --path fusion_fp8 --switch fusion.kernels.tile_policy:FP8_TILE_M --on 256 \
        --off 128 --models qwen3-30b-a3b,deepseek-v3-ep8

--precompile (no GPU): compile the kernels both settings' plans launch into FUSION_CACHE_DIR, for the device run.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_training_step as B  # noqa: E402
from bench_common import measure, run_header  # noqa: E402


def round_orders(rounds: int) -> list[tuple[bool, bool]]:
    """The settings' order in each round: a warm-up round (not kept), then `rounds` rounds alternating which
    setting goes first."""
    return [(True, False) if r % 2 else (False, True) for r in range(rounds + 1)]


def fused_tiles(seq) -> dict:
    """{step label: tile configuration} of the fused kernels the block's runs have made (to show that the two
    settings really run different kernels)."""
    from fusion.runtime import _RUNNERS

    out = {}
    for runner in _RUNNERS.get(seq, {}).values():
        program = runner.program
        for step in [] if program is None else program.forward_steps + program.backward_steps:
            for (_, variant), kernel in getattr(step, "_kernels", {}).items():
                out[f"{step.label} {variant}"] = tuple(kernel.job.config)[:10]
    return out


def planned_off(module, attr: str, make_twin, call, phases: str, off=False):
    """`make_twin()` (a path over a copy of the block or layer, sharing its parameters) planned, compiled and run
    once per phase (`call(path, phase)` -> (call, clear)) with `attr` set to `off`: its kernels keep that setting's
    tiles after the attribute is restored."""
    from fusion.planner import clear_cache

    original = getattr(module, attr)
    try:
        setattr(module, attr, off)
        clear_cache()
        twin = make_twin()
        for phase in phases.split(","):
            run, clear = call(twin, phase)
            clear()
            run()
        torch.cuda.synchronize()
    finally:
        setattr(module, attr, original)
        clear_cache()
    return twin


def block_subject(block, module, attr: str, plan: bool, phases: str, off=False, fused="fusion"):
    """A training-step block as an A/B subject: its name, the paths by setting ({True: ..., False: ...}), `call(path,
    phase)` -> (call, clear), the fused Sequential of each setting, and `baseline(name)`: its unfused path `name`.
    `fused`: the fused path of bench_training_step.py to time (fusion, or an FP8 one: fusion_fp8, ...)."""
    import copy

    setup = B.setup_block(block)

    def call(path, phase):
        return B.phase_fn(path, phase, setup.x, setup.dy)

    paths = {True: B.make_path(fused, setup.seq, setup.sizes, setup.offsets, setup.probs)}
    paths[False] = paths[True]
    if plan:
        paths[False] = planned_off(module, attr, lambda: B.make_path(fused, copy.copy(setup.seq), setup.sizes,
                                                                     setup.offsets, setup.probs), call, phases, off)
    return types.SimpleNamespace(
        name=block.model, paths=paths, call=call, seqs={v: paths[v].seq for v in paths},
        baseline=lambda name: B.make_path(name, setup.seq, setup.sizes, setup.offsets, setup.probs))


def moe_subject(cfg, tokens: int, module, attr: str, plan: bool, phases: str, off=False):
    """The same for a whole MoE layer of bench_moe.py (with `plan`: its twin's experts block planned, compiled and run
    once per phase with `attr` at `off`)."""
    import bench_moe as M
    from moe_paths import FusionLayer, twin_layer

    moe, x, dy = M.make_layer(cfg, tokens, M.Options())

    def call(path, phase):
        return M.phase_fn(path, phase, x, dy)

    paths = {True: FusionLayer(moe)}
    paths[False] = planned_off(module, attr, lambda: FusionLayer(twin_layer(moe)), call, phases, off) if plan \
        else paths[True]
    return types.SimpleNamespace(name=f"{cfg.model} T={tokens}", paths=paths, call=call,
                                 seqs={v: paths[v].call.experts for v in paths}, baseline=None)


def moe_configs(args) -> list:
    """bench_moe.py's configurations that --models names (an unknown name stops the run before anything is built)."""
    import bench_moe as M

    names = set(args.models.split(","))
    chosen = [c for c in M.ALL_CONFIGS if c.model in names]
    if len(chosen) != len(names):
        raise SystemExit(f"--moe: unknown models {sorted(names - {c.model for c in chosen})}")
    return chosen


def subjects(args, module, attr: str):
    """The blocks (or with --moe the MoE layers) --models names, one subject at a time (each built when reached)."""
    off = getattr(args, "off", False)
    if args.moe:
        for cfg in moe_configs(args):
            yield moe_subject(cfg, args.tokens, module, attr, args.plan, args.phases, off)
    else:
        for block in B.select_blocks(args.models):
            yield block_subject(block, module, attr, args.plan, args.phases, off, getattr(args, "path", "fusion"))


def precompile(args, module, attr: str) -> None:
    """Compile into FUSION_CACHE_DIR the kernels the subjects' plans launch with the attribute at --on and at --off
    (no GPU needed)."""
    from fusion.planner import clear_cache

    original = getattr(module, attr)
    try:
        for value in (args.on, args.off):
            setattr(module, attr, value)
            clear_cache()
            print(f"{attr} = {value!r}:", flush=True)
            if args.moe:
                import bench_moe as M

                M.precompile([(cfg, args.tokens) for cfg in moe_configs(args)])
            else:
                B.precompile(B.select_blocks(args.models), fp8=getattr(args, "path", "fusion") != "fusion")
    finally:
        setattr(module, attr, original)
        clear_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, help="module:attribute, set to --on (A) and --off (B)")
    ap.add_argument("--on", type=ast.literal_eval, default=True, help="setting A, a Python literal (default True)")
    ap.add_argument("--off", type=ast.literal_eval, default=False, help="setting B (default False)")
    ap.add_argument("--precompile", action="store_true",
                    help="no GPU: compile both settings' kernels into FUSION_CACHE_DIR, then stop")
    ap.add_argument("--models", required=True)
    ap.add_argument("--phases", default=None, help="default: training_step (--moe: moe_training_step)")
    ap.add_argument("--moe", action="store_true", help="--models are bench_moe.py's MoE layers, at --tokens")
    ap.add_argument("--path", default="fusion", choices=["fusion", "fusion_compiled", "fusion_fp8", "fusion_fp8_direct"],
                    help="the blocks' fused path to time (not with --moe)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--b2b-calls", type=int, default=B.B2B_CALLS,
                    help="calls per back-to-back window (100 since session v: the card's sustained, power-bound "
                         "clocks; 10 before)")
    ap.add_argument("--plan", action="store_true",
                    help="the switch is read when kernels are chosen: B runs a copy of the block planned with it off")
    ap.add_argument("--baseline", action="store_true", help="also time an unfused path once per block")
    ap.add_argument("--baseline-path", default="unfused_fullgraph", choices=["unfused_fullgraph", "unfused_compiled"])
    ap.add_argument("--sigma", type=float, default=B.SIGMA, help="spread of the experts' log-normal weights")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.moe and args.path != "fusion":
        ap.error("--path chooses a block's fused path; --moe times bench_moe.py's fusion layers")
    module_name, attr = args.switch.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    B.SIGMA = args.sigma
    args.phases = args.phases or ("moe_training_step" if args.moe else "training_step")
    if args.baseline and args.moe:
        ap.error("--baseline times the blocks' unfused paths; bench_moe.py times the layers' torch_compiled")
    if args.precompile:
        return precompile(args, module, attr)
    setting = {True: args.on, False: args.off}
    # --plan: every layer's own path is planned (when first run) at --on, its twin at --off (planned_off)
    resting = args.on if args.plan else original
    setattr(module, attr, resting)
    try:
        return _rounds(args, module, attr, setting, resting)
    finally:
        setattr(module, attr, original)


def _rounds(args, module, attr: str, setting: dict, resting) -> None:
    """Every subject's alternating rounds (the attribute at `resting` between them); prints and writes the rows."""
    results = []
    for subject in subjects(args, module, attr):
        name, paths, phase_call, seqs = subject.name, subject.paths, subject.call, subject.seqs
        if args.plan:
            for phase in args.phases.split(","):   # run once now, so that its tiles print next to the twin's
                call, clear = phase_call(paths[True], phase)
                clear()
                call()
            print(f"{name}: tiles on {fused_tiles(seqs[True])}\n{'':{len(name)}}  tiles off "
                  f"{fused_tiles(seqs[False])}", flush=True)
        for phase in args.phases.split(","):
            times, peaks, hosts = {True: [], False: []}, {}, {True: [], False: []}
            try:
                for r, order in enumerate(round_orders(args.rounds)):   # round 0: warm-up, not kept
                    for value in order:
                        if not args.plan:
                            setattr(module, attr, setting[value])
                        got = measure(*phase_call(paths[value], phase), b2b_calls=args.b2b_calls)
                        if r:
                            times[value].append(got["b2b_ms"])
                            hosts[value].append(got["host_us"])
                            peaks[value] = got["peak_MB"]   # one step's peak beyond what was allocated before
            finally:
                setattr(module, attr, resting)
            row = {"model": name, "phase": phase, "on": args.on, "off": args.off, "on_ms": times[True],
                   "off_ms": times[False],
                   "on_median": statistics.median(times[True]), "off_median": statistics.median(times[False]),
                   "on_peak_MB": peaks[True], "off_peak_MB": peaks[False],
                   "on_host_us": statistics.median(hosts[True]), "off_host_us": statistics.median(hosts[False])}
            if args.baseline:
                got = measure(*phase_call(subject.baseline(args.baseline_path), phase), b2b_calls=args.b2b_calls)
                row["baseline_path"] = args.baseline_path
                row["baseline_ms"], row["baseline_peak_MB"] = got["b2b_ms"], got["peak_MB"]
            results.append(row)
            print(f"{name:22s} {phase:13s} on {row['on_median']:8.3f} {times[True]}  off {row['off_median']:8.3f} "
                  f"{times[False]}  change {100 * (row['on_median'] / row['off_median'] - 1):+.1f}%  peak MB on "
                  f"{peaks[True]} off {peaks[False]}  host us on {row['on_host_us']} off {row['off_host_us']}"
                  + (f"  {args.baseline_path} {row['baseline_ms']:.3f} ({row['baseline_peak_MB']} MB)"
                     if args.baseline else ""), flush=True)
        del subject, paths, phase_call, seqs
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({**run_header(), "switch": args.switch, "sigma": args.sigma,
                                              "rounds": args.rounds, "b2b_calls": args.b2b_calls,
                                              "moe_tokens": args.tokens if args.moe else None,
                                              "rows": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
