"""bench_common.run_header's commit: git's HEAD, marked "+modified" when tracked files differ from it (the lent GPU
machine's tree copy can carry an older .git than its files), FUSION_COMMIT where given, "unknown" without history."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_common  # noqa: E402


def _repo(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()


def test_clean_tree_names_head(tmp_path):
    head = _repo(tmp_path)
    assert bench_common.git_commit(tmp_path) == head


def test_modified_tracked_file_is_marked(tmp_path):
    head = _repo(tmp_path)
    (tmp_path / "a.txt").write_text("two\n")
    assert bench_common.git_commit(tmp_path) == head + "+modified"
    (tmp_path / "b.txt").write_text("untracked\n")          # untracked files alone do not mark it
    (tmp_path / "a.txt").write_text("one\n")
    assert bench_common.git_commit(tmp_path) == head


def test_no_history_and_the_override(tmp_path, monkeypatch):
    assert bench_common.git_commit(tmp_path) == "unknown"
    monkeypatch.setenv("FUSION_COMMIT", "abc1234")
    assert bench_common.run_header("cpu")["commit"] == "abc1234"
