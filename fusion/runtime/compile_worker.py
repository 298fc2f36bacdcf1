"""Parallel kernel compilation in worker programs that never import the user's script.

`Sequential.compile()` compiles a plan's kernels in several processes. A multiprocessing pool cannot start
them safely: spawn and forkserver workers first re-import the parent's `__main__` module, so a plain script
without an `if __name__ == "__main__":` guard runs again in every worker (and each of them tries to start a
pool of its own: a crash), and a script read from stdin cannot be re-imported at all; fork copies a process
whose CUDA or DSL state may already be live. So each worker is its own program,

    python -P -m fusion.runtime.compile_worker

which imports only fusion. Protocol: the parent writes one JSON request on the worker's stdin,
{"cache_dir": ..., "jobs": [KernelJob fields, ...]}; the worker compiles each job into the disk cache (the
entries it writes are the result) and prints one line per job, `PREFIX {"key": ..., "error": null | text}`.
Other stdout lines (compiler chatter) are not part of the protocol and are ignored.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

from fusion.errors import CompileError
from fusion.runtime.compile import KernelJob, compile_to_disk

PREFIX = "fusion-compile-worker:"


def job_to_json(job) -> dict:
    return dataclasses.asdict(job)


def job_from_json(fields: dict) -> KernelJob:
    return KernelJob(**(fields | {"config": tuple(fields["config"])}))


# -- the worker program -------------------------------------------------------------------------------------------
def main() -> int:
    request = json.load(sys.stdin)
    os.environ["FUSION_CACHE_DIR"] = request["cache_dir"]
    for fields in request["jobs"]:
        job = job_from_json(fields)
        try:
            compile_to_disk(job)
            error = None
        except Exception as err:  # reported to the parent, which raises CompileError naming the kernel
            error = f"{type(err).__name__}: {err}"
        print(PREFIX, json.dumps({"key": job.key, "error": error}), flush=True)
    return 0


# -- the parent side ----------------------------------------------------------------------------------------------
def _import_root() -> str:
    """The folder that holds this copy of the `fusion` package (fusion/runtime/compile_worker.py is this file):
    the workers import the same copy."""
    return str(Path(__file__).resolve().parents[2])


def _worker_env(cache_dir: Path) -> dict:
    """The parent's environment, with the import root of this `fusion` on PYTHONPATH when the workers would not
    find it by themselves (a source checkout: `-P` leaves the working directory off sys.path). An installed
    package is found as usual: its site-packages is never put in front of the standard library."""
    import site

    env = os.environ | {"FUSION_CACHE_DIR": str(cache_dir)}
    root = _import_root()
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if os.path.realpath(root) not in installed:
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    return env


def compile_in_workers(jobs: list, workers: int, cache_dir: Path, done: Callable[[str], None]) -> None:
    """Compile `jobs` into `cache_dir` in `workers` worker programs; `done(key)` is called as each finishes.
    Raises CompileError naming each kernel that failed (with the worker's stderr when it died). The jobs of a
    worker killed by a signal before it reported them (the kernel's OOM killer, a stray kill: seen once in a full
    test run on the 2-core development machine, a worker gone without a word) are compiled once more in a fresh
    worker, with a warning; lost twice, they are an error."""
    errors, lost, tails, killed = _run_workers(jobs, workers, cache_dir, done)
    if lost and killed and not errors:
        warnings.warn(f"fusion: a compile worker was killed (signal {killed}) before it finished "
                      f"{', '.join(job.name for job in lost)}; compiling them again", RuntimeWarning, stacklevel=3)
        errors, lost, tails, _ = _run_workers(lost, 1, cache_dir, done)
    if lost:
        errors.append(f"a compile worker exited before it finished {', '.join(job.name for job in lost)}"
                      + (f"; its stderr ends with:\n{tails}" if tails else ""))
    if errors:
        raise CompileError("fused kernels failed to compile:\n  " + "\n  ".join(errors))


def _run_workers(jobs: list, workers: int, cache_dir: Path, done: Callable[[str], None]):
    """One round of worker programs over `jobs`: (the kernels' compile errors, the jobs no worker reported, the
    stderr tails of the workers that failed, the signal that killed a worker or 0)."""
    chunks = [c for c in (jobs[i::workers] for i in range(workers)) if c]
    names = {job.key: job.name for job in jobs}
    lock = threading.Lock()
    errors: list[str] = []
    finished: set[str] = set()

    def read_reports(stream) -> None:
        for line in stream:
            if not line.startswith(PREFIX):
                continue  # compiler chatter
            report = json.loads(line[len(PREFIX):])
            with lock:
                finished.add(report["key"])
                if report["error"]:
                    errors.append(f"{names.get(report['key'], report['key'])}: {report['error']}")
            if not report["error"]:
                done(report["key"])

    runs = []  # (process, its stderr lines, reader threads)
    try:
        for chunk in chunks:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "fusion.runtime.compile_worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=_worker_env(cache_dir))
            stderr: list[str] = []
            readers = [threading.Thread(target=read_reports, args=(proc.stdout,), daemon=True),
                       threading.Thread(target=stderr.extend, args=(proc.stderr,), daemon=True)]
            for reader in readers:
                reader.start()
            runs.append((proc, stderr, readers))
        # Every worker is starting (importing torch and the DSL) before the first request is written: a request
        # larger than the pipe's buffer waits for its worker to read it.
        for (proc, _, _), chunk in zip(runs, chunks):
            try:
                proc.stdin.write(json.dumps({"cache_dir": str(cache_dir),
                                             "jobs": [job_to_json(j) for j in chunk]}))
                proc.stdin.close()
            except BrokenPipeError:  # the worker died at start: reported below with its stderr
                pass
        for proc, _, readers in runs:
            proc.wait()
            for reader in readers:
                reader.join()
    finally:
        for proc, _, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lost = [job for job in jobs if job.key not in finished]
    tails = "".join("".join(stderr[-20:]) for proc, stderr, _ in runs if proc.returncode)
    killed = next((-proc.returncode for proc, _, _ in runs if proc.returncode < 0), 0)
    return errors, lost, tails, killed


if __name__ == "__main__":
    sys.exit(main())
