"""Run the GPU tests (marker `gpu`) in several pytest processes at once, on the GPU machine.

Most of a GPU test run's time is compiling kernels (each process compiles the kernels its tests build, one at a
time, on one core), and the lent machine has 16 cores: 17 GPU test files took more than one 10-minute call with
four processes, each of one or two files. This collects the GPU tests, cuts their list into `--shards` runs of
consecutive tests (neighbouring tests share kernels, which a process compiles once) and runs them side by side,
each writing its own log; it prints every shard's summary line and exits non-zero when any shard failed or ran out
of time. Needs no plugin (pytest-xdist is not on the GPU machine).

Shards share one GPU's memory: a test with large operands can run out of it beside another shard's (the FP8 GEMM
tests at 32 x 8192 rows did, 2026-11-27). A shard whose only failures are `torch.OutOfMemoryError`s does not fail
the run by itself: those tests run again afterwards, alone in one process (`--retry-timeout`), and the run fails if
any of them fails there.

    python tests/gpu_shards.py --shards 12 --timeout 540 --logs $OUT/gpu-tests [tests/test_kernels_gpu.py ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def collect(paths: list[str]) -> list[str]:
    """The node ids of the GPU tests under `paths` (pytest's own collection, in file order)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *paths],
                         capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def consecutive_shards(ids: list[str], shards: int) -> list[list[str]]:
    """`ids` cut into at most `shards` runs of consecutive ids, as equal in length as can be (none empty)."""
    shards = max(1, min(shards, len(ids)))
    base, extra = divmod(len(ids), shards)
    out, start = [], 0
    for i in range(shards):
        size = base + (1 if i < extra else 0)
        out.append(ids[start:start + size])
        start += size
    return [s for s in out if s]


def files_of(shard: list[str]) -> list[str]:
    """The test files a shard's ids come from, in order, each once."""
    return list(dict.fromkeys(node.split("::")[0] for node in shard))


def summary(log: str) -> str:
    """The last line of a shard's log that pytest's summary or the timeout wrote."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if " passed" in line or " failed" in line or " error" in line or "no tests ran" in line:
            return line.strip("= ")
    return lines[-1] if lines else "(no output)"


OUT_OF_MEMORY = "OutOfMemoryError"
#: pytest's short summary: failures and errors with their messages (rerun them) and skips with their reasons
REPORT = "-rfEs"
#: the shards' environment: a wide "terminal", else pytest drops a failure's message where the test id is long
ENV = {**os.environ, "COLUMNS": "1000"}


def failures(log: str) -> list[tuple[str, str]]:
    """(node id, message) of every test pytest's short summary reports FAILED or ERROR in a shard's log."""
    out = []
    for line in log.splitlines():
        for tag in ("FAILED ", "ERROR "):
            if line.startswith(tag) and "::" in line:
                node, _, message = line[len(tag):].partition(" - ")
                out.append((node.strip(), message))
    return out


def retry_alone(rc, log: str) -> list[str] | None:
    """The tests of a finished shard to run again alone: those that ran out of GPU memory, where they are all of
    its failures; [] for a shard that passed; None where the shard failed otherwise (an assertion, a crash, a
    timeout: no rerun clears it)."""
    if rc == 0:
        return []
    found = failures(log)
    if rc == "timeout" or not found or any(OUT_OF_MEMORY not in message for _, message in found):
        return None
    return [node for node, _ in found]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["tests"])
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds each shard may run")
    ap.add_argument("--logs", default="gpu-test-logs", help="folder for the shards' logs")
    ap.add_argument("--retry-timeout", type=float, default=300.0,
                    help="seconds for the rerun, alone, of the tests that ran out of GPU memory beside other shards")
    args = ap.parse_args(argv)
    ids = collect(args.paths)
    if not ids:
        print("gpu_shards: no GPU tests collected (no CUDA device here?)")
        return 1
    os.makedirs(args.logs, exist_ok=True)
    procs = []
    for i, shard in enumerate(consecutive_shards(ids, args.shards)):
        log = open(os.path.join(args.logs, f"shard{i:02d}.log"), "w")
        procs.append((i, shard, log, subprocess.Popen([sys.executable, "-m", "pytest", "-q", REPORT, "-p",
                                                       "no:cacheprovider", *shard],
                                                      stdout=log, stderr=subprocess.STDOUT, env=ENV)))
    print(f"gpu_shards: {len(ids)} tests in {len(procs)} shards", flush=True)
    deadline, failed, again = time.monotonic() + args.timeout, False, []
    for i, shard, log, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        with open(log.name) as fh:
            text = fh.read()
        retry = retry_alone(rc, text)
        failed |= retry is None
        again += retry or []
        print(f"shard {i:2d} ({len(shard)} tests of {', '.join(files_of(shard))}): rc {rc}: {summary(text)}")
        for line in text.splitlines():
            if line.startswith(("FAILED", "ERROR", "SKIPPED")):   # skips with their reasons
                print(f"  {line[:300]}")
    if again:
        log_name = os.path.join(args.logs, "out-of-memory-rerun.log")
        with open(log_name, "w") as log:
            try:
                rc = subprocess.run([sys.executable, "-m", "pytest", "-q", REPORT, "-p", "no:cacheprovider", *again],
                                    stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                    timeout=args.retry_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        with open(log_name) as fh:
            text = fh.read()
        failed |= rc != 0
        print(f"rerun alone of the {len(again)} tests that ran out of GPU memory beside other shards: rc {rc}: "
              f"{summary(text)}")
        for line in text.splitlines():
            if line.startswith(("FAILED", "ERROR")):
                print(f"  {line[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
