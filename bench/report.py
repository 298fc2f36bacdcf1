"""Markdown tables from a bench_training_step.py JSON (docs/benchmarks.md is made with it).

    python bench/report.py bench/results/H100-2026-11-23.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

PATHS = ["fusion", "fusion_compiled", "unfused_compiled", "quack", "reference"]


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
                "| block (E, rows, d, 2f) | " + " | ".join(PATHS) + " | fusion vs unfused_compiled | "
                "fusion vs quack | peak fusion / unfused |",
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
            f, u, q = (cells.get(p) for p in ("fusion", "unfused_compiled", "quack"))
            speed_u = f"{u['b2b_ms'] / f['b2b_ms']:.2f}x" if f and u else "-"
            speed_q = f"{q['b2b_ms'] / f['b2b_ms']:.2f}x" if f and q else "-"
            mem = f"{f['peak_MB'] / u['peak_MB']:.2f}" if f and u and u["peak_MB"] else "-"
            model, E, n, d, f2 = key
            out.append(f"| {model} ({E}, {n}, {d}, {f2}) | " + " | ".join(fmt) + f" | {speed_u} | {speed_q} | {mem} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(json.loads(open(sys.argv[1]).read())))
