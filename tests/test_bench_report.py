"""bench/report.py: the tables compare fusion with the faster of the unfused paths measured (unfused_compiled or
unfused_fullgraph, the block compiled whole), never with a slower one."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import report  # noqa: E402


def _row(path, b2b, peak=100.0, phase="training_step"):
    return {"model": "m", "E": 8, "rows": 4096, "d": 64, "f2": 128, "phase": phase, "path": path, "b2b_ms": b2b,
            "sync_ms": b2b, "host_us": 10.0, "peak_MB": peak}


def _speedup_cell(rows) -> str:
    text = report.tables({"gpu": "g", "date": "d", "commit": "c", "rows": rows})
    line = next(ln for ln in text.splitlines() if ln.startswith("| m ("))
    return line.split(" | ")[-3]


def test_fusion_is_compared_with_the_faster_unfused_path():
    rows = [_row("fusion", 1.0, 80.0), _row("unfused_compiled", 1.5, 100.0), _row("unfused_fullgraph", 1.2, 120.0)]
    assert _speedup_cell(rows) == "1.20x (unfused_fullgraph)"
    rows[1]["b2b_ms"] = 1.1   # now unfused_compiled is the faster
    assert _speedup_cell(rows) == "1.10x (unfused_compiled)"
    text = report.tables({"gpu": "g", "date": "d", "commit": "c", "rows": rows})
    line = next(ln for ln in text.splitlines() if ln.startswith("| m ("))
    assert line.endswith("| 0.80 |")   # the peak against that same path


def test_one_unfused_path_measured():
    assert _speedup_cell([_row("fusion", 2.0), _row("unfused_compiled", 3.0)]) == "1.50x (unfused_compiled)"
    assert _speedup_cell([_row("fusion", 2.0)]) == "-"
