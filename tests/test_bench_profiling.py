"""bench/profiling.py, what the profiling scripts print: the host half runs anywhere (cProfile)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from profiling import print_host  # noqa: E402


def test_print_host_lists_the_calls_functions_by_each_key(capsys):
    cleared = []

    def work_we_look_for():
        return sum(i * i for i in range(2000))

    print_host(work_we_look_for, lambda: cleared.append(1), calls=3, top=10, title="toy")
    out = capsys.readouterr().out
    assert len(cleared) == 3
    assert "== toy: host, 3 calls, by tottime" in out and "== toy: host, 3 calls, by cumulative" in out
    assert out.count("work_we_look_for") == 2   # once in each listing
