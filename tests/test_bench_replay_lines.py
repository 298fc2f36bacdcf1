"""bench/probes/replay_lines.py: the generated replays compiled with a timing mark before each top-level line still
run as before, and the report charges each line the time up to the next mark."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench" / "probes"), str(ROOT / "tests")]

import replay_lines  # noqa: E402
import test_replay  # noqa: E402

from fusion.runtime import launch_code  # noqa: E402


def test_a_mark_goes_before_each_top_level_statement_only():
    lines = ["def f(a):", "    if a:", "        return None", "    b = a + 1", "    return b"]
    marked = replay_lines._marked_source(lines)
    assert marked == ["def f(a):", "    _mark(0)", "    _mark(1)", "    if a:", "        return None",
                      "    _mark(3)", "    b = a + 1", "    _mark(4)", "    return b"]


def test_a_marked_replay_launches_the_same_and_reports_each_line(monkeypatch, capsys):
    monkeypatch.setattr(replay_lines, "MARKS", {})
    monkeypatch.setattr(replay_lines, "SOURCES", {})
    monkeypatch.setattr(launch_code.LaunchCode, "compile", replay_lines._patched_compile)
    replay, x, extra, _, log = test_replay._fp8_made(monkeypatch, False)
    assert replay(x, extra) is not None and replay(x, extra) is not None
    assert [label for label, _ in log] == ["prologue", "quantize", "F1", "F2"] * 2   # the marks change no launch
    replay_lines.report(2)
    out = capsys.readouterr().out
    assert "forward_replay #0: 2 runs timed" in out
    charged = [line for line in out.splitlines()[1:] if line.strip()]
    assert any(line.split()[3].startswith("_quantize") for line in charged)   # the quantize launch has its line
    for line in charged:   # mean, median, 90th percentile
        mean, median, p90 = (float(v) for v in line.split()[:3])
        assert mean >= 0 and 0 <= median <= p90


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
