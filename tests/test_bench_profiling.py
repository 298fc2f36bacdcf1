"""bench/profiling.py, what the profiling scripts print: the host half runs anywhere (cProfile)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import torch  # noqa: E402

from profiling import print_host, print_ops  # noqa: E402


def test_print_host_lists_the_calls_functions_by_each_key(capsys):
    cleared = []

    def work_we_look_for():
        return sum(i * i for i in range(2000))

    print_host(work_we_look_for, lambda: cleared.append(1), calls=3, top=10, title="toy")
    out = capsys.readouterr().out
    assert len(cleared) == 3
    assert "== toy: host, 3 calls, by tottime" in out and "== toy: host, 3 calls, by cumulative" in out
    assert out.count("work_we_look_for") == 2   # once in each listing


def test_print_ops_counts_the_aten_ops_of_one_call(capsys):
    x = torch.randn(4, 4, requires_grad=True)

    def step():
        (x * 2).sum().backward()

    print_ops(step, lambda: setattr(x, "grad", None), calls=3, title="toy")
    out = capsys.readouterr().out
    assert "== toy:" in out and "µs of host per call" in out
    assert "mul:" in out and "sum:1" in out   # the forward's ops and the backward's, dispatched once each call


def test_host_threads_placement_pins_every_thread_and_moves_the_backward_to_the_calling_thread():
    import os
    import threading

    from host_threads import Placement

    place = Placement()
    parked = threading.Event()
    helper = threading.Thread(target=parked.wait)   # a second thread of the process: it must be pinned too
    helper.start()
    try:
        place("one-core+calling")
        assert not torch._C._is_multithreading_enabled()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert len(tids) >= 2 and all(os.sched_getaffinity(t) == {place.core} for t in tids)
        place("device-thread")
        assert torch._C._is_multithreading_enabled()
        assert all(os.sched_getaffinity(t) == place.all_cpus for t in tids)
    finally:
        place("device-thread")
        parked.set()
        helper.join()
