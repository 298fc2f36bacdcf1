""".ci/run: a test command that ran no test fails CI instead of passing: none collected (pytest exit 5), or
every collected test skipped (counted from pytest's junit report)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "run"

_REPORT = '<testsuites><testsuite name="pytest" tests="{tests}" skipped="{skipped}" errors="0" failures="0"/>' \
          '</testsuites>'


def _exit_handling() -> str:
    """The part of .ci/run after the test command: it maps pytest's exit code (and report) to CI's."""
    text = SCRIPT.read_text()
    return text[text.index("rc=$?") + len("rc=$?"):]


@pytest.mark.parametrize("pytest_rc, report, ci_fails", [
    (0, (3, 1), False),   # tests ran
    (0, (4, 4), True),    # every test skipped: nothing ran
    (0, None, True),      # no report: nothing shows that anything ran
    (1, (3, 0), True),    # a failure
    (5, (0, 0), True),    # nothing collected
])
def test_exit_code_mapping(tmp_path, pytest_rc, report, ci_fails):
    if report is not None:
        (tmp_path / ".ci-report.xml").write_text(_REPORT.format(tests=report[0], skipped=report[1]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # the script runs `python`, as in its virtual environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-c", f"set -euo pipefail; rc={pytest_rc}" + _exit_handling()],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    assert (run.returncode != 0) == ci_fails, run.stderr
