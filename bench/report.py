"""Markdown tables from a bench_training_step.py JSON (docs/benchmarks.md is made with it).

    python bench/report.py bench/results/H100-2026-11-23.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

PATHS = ["fusion", "fusion_compiled", "unfused_compiled", "unfused_fullgraph", "quack", "reference"]
#: The unfused paths a user could run (bench_training_step.py): fusion is compared with the faster of those measured.
UNFUSED = ("unfused_compiled", "unfused_fullgraph")


def best_unfused(cells: dict):
    """(path name, row) of the faster unfused path measured for a (block, phase), or (None, None)."""
    measured = [(cells[p]["b2b_ms"], p) for p in UNFUSED if cells.get(p)]
    if not measured:
        return None, None
    _, name = min(measured)
    return name, cells[name]


def tables(data: dict) -> str:
    rows = defaultdict(dict)
    blocks = []
    for r in data["rows"]:
        key = (r["model"], r["E"], r["rows"], r["d"], r["f2"])
        if key not in blocks:
            blocks.append(key)
        rows[(key, r["phase"])][r["path"]] = r
    out = [f"GPU: {data['gpu']}, {data['date']}, commit {data['commit']}.", ""]
    for phase in ("forward", "training_step"):
        out += [f"### {phase.replace('_', ' ')}: back-to-back ms (sync ms), host µs per call, peak MB", "",
                "| block (E, rows, d, 2f) | " + " | ".join(PATHS) + " | fusion vs the faster unfused path | "
                "fusion vs quack | peak fusion / that path |",
                "|---" * (len(PATHS) + 4) + "|"]
        for key in blocks:
            cells = rows.get((key, phase), {})
            if not cells:
                continue
            fmt = []
            for p in PATHS:
                c = cells.get(p)
                fmt.append("-" if c is None else
                           f"{c['b2b_ms']:.3f} ({c['sync_ms']:.3f}); {c['host_us']:.0f} µs; {c['peak_MB']:.0f} MB")
            f, q = cells.get("fusion"), cells.get("quack")
            u_name, u = best_unfused(cells)
            speed_u = f"{u['b2b_ms'] / f['b2b_ms']:.2f}x ({u_name})" if f and u else "-"
            speed_q = f"{q['b2b_ms'] / f['b2b_ms']:.2f}x" if f and q else "-"
            mem = f"{f['peak_MB'] / u['peak_MB']:.2f}" if f and u and u["peak_MB"] else "-"
            model, E, n, d, f2 = key
            out.append(f"| {model} ({E}, {n}, {d}, {f2}) | " + " | ".join(fmt) + f" | {speed_u} | {speed_q} | {mem} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(json.loads(open(sys.argv[1]).read())))
