"""bench/ab_trees.py: the A/B of two source trees (an old commit's code against the working tree) that alternates
the bench's processes and reports medians. No GPU: a stand-in bench script writes rows whose times say which tree
ran it."""
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab_trees  # noqa: E402

FAKE_BENCH = '''
import json, sys, time
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
tree = Path(__file__).resolve().parents[1].name
ms = 2.0 if tree == "old" else 1.0
Path(str(out) + ".order").write_text(str(time.monotonic_ns()))
rows = [{"model": "m", "phase": "forward", "path": "fusion", "b2b_ms": ms, "sync_ms": ms, "host_us": 10 * ms},
        {"model": "moe", "tokens": 1024, "phase": "moe_forward", "path": "fusion", "b2b_ms": ms, "sync_ms": None,
         "host_us": None}]
out.write_text(json.dumps({"rows": rows}))
print(f"  fusion forward b2b {ms} ms")
'''


def _tree(path: Path) -> Path:
    (path / "bench").mkdir(parents=True)
    (path / "bench" / "fake.py").write_text(FAKE_BENCH)
    return path


def test_rounds_alternate_which_tree_goes_first():
    assert ab_trees.round_orders(4) == [("old", "new"), ("new", "old"), ("old", "new"), ("new", "old")]


def test_run_alternates_the_trees_and_reports_medians(tmp_path):
    old = _tree(tmp_path / "build" / "old")
    (old / "COMMIT").write_text("0123456789abcdef\n")
    archive = tmp_path / "kc" / "old.tar.xz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(old, arcname="old")
    shutil.rmtree(tmp_path / "build")
    new = _tree(tmp_path / "new")
    out = tmp_path / "out"
    table = ab_trees.run(archive, 3, out, ["bench/fake.py"], timeout=60, new_root=new)
    files = sorted(p.name for p in out.glob("ab-*.json"))
    assert files == sorted(f"ab-{w}-{n}.json" for n in (1, 2, 3) for w in ("new", "old"))
    stamp = {p.name: int(Path(str(p) + ".order").read_text()) for p in out.glob("ab-*.json")}
    assert stamp["ab-old-1.json"] < stamp["ab-new-1.json"] and stamp["ab-new-2.json"] < stamp["ab-old-2.json"]
    row = next(line for line in table.splitlines() if line.startswith("| m |"))
    assert "| 2.000 (2.000, 20) | 1.000 (1.000, 10) | -50.0% |" in row
    assert "2.000, 2.000, 2.000 | 1.000, 1.000, 1.000 |" in row
    moe = next(line for line in table.splitlines() if line.startswith("| moe | 1024 |"))
    assert "2.000 (-, -)" in moe


def test_pack_archives_the_commit_without_results(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("pack archives a commit of this checkout: needs git and the repository")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    archive = tmp_path / "old.tar.xz"
    assert ab_trees.pack("HEAD", archive) == head.stdout.strip()
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        commit = tar.extractfile("old/COMMIT").read().decode().strip()
    assert commit == head.stdout.strip()
    assert "old/fusion/__init__.py" in names and "old/bench/ab_switch.py" in names
    assert "old/pyproject.toml" in names and not any(n.startswith("old/bench/results/") for n in names)
