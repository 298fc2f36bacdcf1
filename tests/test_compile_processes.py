"""Sequential.compile() from a user's program as users write them: a plain script without an
`if __name__ == "__main__":` guard (the README's example) and a script piped to `python -`, compiling in two
worker processes; and the working directory stays clean (cute.compile's --keep-ptx/--keep-cubin files go to a
temporary folder). Each runs in a fresh interpreter with a fresh kernel cache, so kernels really compile."""
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """\
import torch
from fusion import GroupLinear, Sequential, SwiGLU
from fusion.runtime import aot
from fusion.runtime import compile as kernel_compile

print("SCRIPT-BODY-RAN", flush=True)
mlp = Sequential(GroupLinear(2, 128, 256, device="meta"), SwiGLU())
kernels = aot.compile_plan(mlp, dtype=torch.bfloat16, target="sm_90a", parallel={parallel}, progress=False)
# FC1's training and inference variants, its lone dgrad's varlen-M kernel (in_features 128: a multiple of 128,
# fusion/runtime/lone_gemm.py) and its weight gradient's varlen-K kernels (the shape's tile and the store-bound one
# of few rows per group, kernels/tile_policy.py)
assert len(kernels) == 5 and all(k.cubin and k.ptx for k in kernels)
print("COMPILED-IN-THIS-PROCESS", len(kernel_compile._LOADED), flush=True)
"""


def run_user_program(tmp_path, parallel: int, stdin: bool):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = os.environ | {"FUSION_CACHE_DIR": str(tmp_path / "cache"),
                        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    source = SCRIPT.format(parallel=parallel)
    if stdin:
        args, feed = [sys.executable, "-"], source
    else:
        script = tmp_path / "user_script.py"
        script.write_text(source)
        args, feed = [sys.executable, str(script)], None
    out = subprocess.run(args, input=feed, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert out.stdout.count("SCRIPT-BODY-RAN") == 1, out.stdout  # the user's program ran once, not per worker
    assert list(cwd.iterdir()) == [], "compiling left files in the working directory"
    return out.stdout


def test_compile_in_workers_from_a_script_without_a_main_guard(tmp_path):
    stdout = run_user_program(tmp_path, parallel=2, stdin=False)
    assert "COMPILED-IN-THIS-PROCESS 0" in stdout  # the workers compiled


def test_compile_in_workers_from_stdin(tmp_path):
    stdout = run_user_program(tmp_path, parallel=2, stdin=True)
    assert "COMPILED-IN-THIS-PROCESS 0" in stdout


def test_compile_in_one_process_leaves_the_working_directory_clean(tmp_path):
    stdout = run_user_program(tmp_path, parallel=1, stdin=True)
    assert "COMPILED-IN-THIS-PROCESS 5" in stdout


def _fake_rounds(monkeypatch, rounds):
    """compile_worker._run_workers replaced by `rounds` (one result per call); returns the calls' job lists."""
    from fusion.runtime import compile_worker

    calls = []

    def fake(jobs, workers, cache_dir, done):
        calls.append([job.name for job in jobs])
        return rounds[len(calls) - 1](jobs)

    monkeypatch.setattr(compile_worker, "_run_workers", fake)
    return calls


def _jobs():
    from fusion.runtime.compile import KernelJob

    return [KernelJob(step=f"F{i}", variant="train", source="", config=(), dtype="bfloat16", N=128, K=128, G=1,
                      target="sm_90a") for i in range(3)]


def test_jobs_of_a_killed_worker_compile_once_more(monkeypatch, tmp_path):
    """A worker killed by a signal before it reported its jobs: they run again in one fresh worker, with a
    warning naming them; killed again, a CompileError names them."""
    from fusion.errors import CompileError
    from fusion.runtime.compile_worker import compile_in_workers

    jobs = _jobs()
    killed_then_fine = [lambda js: ([], js[1:], "", 9), lambda js: ([], [], "", 0)]
    calls = _fake_rounds(monkeypatch, killed_then_fine)
    with pytest.warns(RuntimeWarning, match=r"killed \(signal 9\) before it finished fused_F1_train.*compiling them"):
        compile_in_workers(jobs, 2, tmp_path, lambda key: None)
    assert calls == [[j.name for j in jobs], [j.name for j in jobs[1:]]]

    calls = _fake_rounds(monkeypatch, [lambda js: ([], js, "", 9), lambda js: ([], js[:1], "", 9)])
    with pytest.warns(RuntimeWarning), pytest.raises(CompileError, match="exited before it finished fused_F0_train"):
        compile_in_workers(jobs, 2, tmp_path, lambda key: None)
    assert len(calls) == 2


def test_a_worker_that_failed_without_a_signal_is_not_retried(monkeypatch, tmp_path):
    """A worker that exited with an error (a traceback in its stderr) or a kernel that failed to compile is an
    error at once: compiling it again would fail the same way."""
    from fusion.errors import CompileError
    from fusion.runtime.compile_worker import compile_in_workers

    calls = _fake_rounds(monkeypatch, [lambda js: ([], js, "Traceback: ImportError\n", 0)])
    with pytest.raises(CompileError, match="its stderr ends with:\nTraceback: ImportError"):
        compile_in_workers(_jobs(), 2, tmp_path, lambda key: None)
    calls = _fake_rounds(monkeypatch, [lambda js: (["fused_F0_train: DSLError: no"], js[:1], "", 9)])
    with pytest.raises(CompileError, match="DSLError"):
        compile_in_workers(_jobs(), 2, tmp_path, lambda key: None)
    assert len(calls) == 1
