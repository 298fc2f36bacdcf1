"""What the profiling scripts (profile_step.py, profile_host.py, profile_moe.py) print: a call's CUDA kernels by
GPU time (torch.profiler) and its Python functions by host time (cProfile), each over back-to-back calls."""
from __future__ import annotations

import cProfile
import io
import pstats

import torch


def _calls(call, clear, n: int) -> None:
    for _ in range(n):
        clear()
        call()


def print_kernels(call, clear, calls: int, top: int, title: str) -> None:
    """torch.profiler over `calls` back-to-back calls: total kernel ms per call, then the `top` kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _calls(call, clear, calls)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / calls
    span = _busy_span_us(prof) / calls
    print(f"== {title}: {total / 1000:.3f} ms of kernels per call; first kernel start to last kernel end "
          f"{span / 1000:.3f} ms per call (the GPU idle between kernels {(span - total) / 1000:.3f} ms per call)")
    for e in events[:top]:
        per = e.device_time_total / calls
        print(f"  {per / 1000:8.3f} ms {100 * per / total:5.1f}%  x{e.count // calls:<3d} {e.key[:110]}")


def _busy_span_us(prof) -> float:
    """µs from the first profiled kernel's start to the last one's end: with the kernels' sum, how long the GPU sat
    idle between them (launch gaps, or a host that did not keep ahead)."""
    spans = [e.time_range for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return max(r.end for r in spans) - min(r.start for r in spans) if spans else 0.0


def print_timeline(call, clear, title: str, warm: int = 2) -> None:
    """The kernels of one call in launch order, each with its GPU time: which GEMM is which (our kernels share
    one name) follows from the order the plan launches them in."""
    _calls(call, clear, warm)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _calls(call, clear, 1)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    print(f"== {title}: kernels of one call in launch order")
    for e in kernels:
        print(f"  {e.device_time_total / 1000:8.3f} ms  {e.name[:110]}")


def export_trace(call, clear, path, calls: int = 3) -> None:
    """A chrome trace (chrome://tracing, ui.perfetto.dev) of `calls` back-to-back calls, host and kernels: where
    the kernels' timeline has holes, the host rows above them say what the CPU was doing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _calls(call, clear, calls)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    print(f"   trace: {path}")


def print_host(call, clear, calls: int, top: int, title: str, keys=("tottime", "cumulative")) -> None:
    """cProfile over `calls` back-to-back calls (the GPU keeps up or not: only Python's time is attributed): the
    `top` functions by each of `keys`, in µs per measured call (the profiler's own cost per function call inflates
    every row alike), and how many times each runs per call."""
    prof = cProfile.Profile()
    prof.enable()
    _calls(call, clear, calls)
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    total_calls = sum(nc for _, nc, _, _, _ in stats.values())
    for key in keys:
        column = 2 if key == "tottime" else 3
        rows = sorted(stats.items(), key=lambda kv: -kv[1][column])[:top]
        print(f"== {title}: host, {calls} calls, by {key} ({total_calls / calls:.0f} Python calls per call)")
        print(f"  {'own µs':>8} {'cum µs':>8} {'per call':>8}  function")
        for (file, line, name), (_, nc, tt, ct, _) in rows:
            where = f"{file.split('/work/main/')[-1].split('site-packages/')[-1]}:{line}({name})"
            print(f"  {tt / calls * 1e6:8.2f} {ct / calls * 1e6:8.2f} {nc / calls:8.1f}  {where[:110]}")


def print_ops(call, clear, calls: int, title: str) -> None:
    """Host µs per call (perf_counter over `calls` back-to-back calls, no sync inside) and the aten ops one call
    dispatches, by count: each costs host time (a dispatch, often a launch), so the count says where to cut."""
    import collections
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    _calls(call, clear, calls)
    host = (time.perf_counter() - start) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    counter = _Count()
    with counter:
        _calls(call, clear, 1)
    ops = sorted(counter.ops.items(), key=lambda kv: -kv[1])
    print(f"== {title}: {host:.0f} µs of host per call; {sum(counter.ops.values())} aten ops per call")
    print("  " + " ".join(f"{name}:{n}" for name, n in ops))
