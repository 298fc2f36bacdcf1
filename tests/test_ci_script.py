""".ci/run: a test command that collected no test (pytest exit 5) fails CI instead of passing."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "run"


def _exit_handling() -> str:
    """The part of .ci/run after the test command: it maps pytest's exit code to CI's."""
    text = SCRIPT.read_text()
    return text[text.index("rc=$?") + len("rc=$?"):]


@pytest.mark.parametrize("pytest_rc, ci_fails", [(0, False), (1, True), (5, True)])
def test_exit_code_mapping(pytest_rc, ci_fails):
    run = subprocess.run(["bash", "-c", f"set -euo pipefail; (exit {pytest_rc}) || true; rc={pytest_rc}"
                          + _exit_handling()], capture_output=True, text=True)
    assert (run.returncode != 0) == ci_fails, run.stderr
