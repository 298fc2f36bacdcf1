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
# fusion/runtime/lone_gemm.py) and its weight gradient's varlen-K kernel
assert len(kernels) == 4 and all(k.cubin and k.ptx for k in kernels)
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
    assert "COMPILED-IN-THIS-PROCESS 4" in stdout
