"""A/B of two source trees on one machine: an older commit's code against the working tree, the same bench run by
each in alternating processes, medians per row. For a change no runtime switch can turn off (bench/ab_switch.py
flips a switch inside one process; this compares code).

    python bench/ab_trees.py pack 8af7b2e                         # here (git needed): .kc/old.tar.xz, to carry
    python bench/ab_trees.py run --rounds 3 --out $OUT/ab -- bench/bench_training_step.py \
        --models small-batch --paths fusion_compiled --phases forward,training_step --compiled-models small-batch
    python bench/ab_trees.py summary $OUT/ab                      # again, from the JSON files

Why: host times move 1.4-2x between machine starts and by tens of per cent within one (docs/benchmarks.md), so
one run of each tree tells nothing; rounds alternate which tree goes first after the first, and only medians are
reported. The device machine has no git history, so `pack` archives the old commit here (the code, the bench and
pyproject.toml, no bench/results) with its hash in COMMIT; `run` unpacks it beside the working tree (.kc/old) and
runs the bench script from each tree's root, FUSION_COMMIT set to each tree's commit. Both trees read the same
FUSION_CACHE_DIR: a kernel's cache key holds the kernel sources' hash, so trees whose kernels/ differ compile their
own entries and never share a stale one. Each run writes <out>/ab-<old|new>-<round>.json (the bench's --out); the
summary reads the benches' "rows" (bench_training_step.py, bench_moe.py) and prints, per (model, tokens, phase,
path), the median back-to-back ms, sync ms and host µs of each tree, the change, and every round's value.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What an old tree needs to run the benches: the package's sources, the bench scripts, the project file.
TREE_PARTS = ("fusion", "kernels", "codegen", "patterns", "bench", "pyproject.toml")
DEFAULT_ARCHIVE = ROOT / ".kc" / "old.tar.xz"


def pack(commit: str, archive: Path = DEFAULT_ARCHIVE) -> str:
    """Archive `commit`'s TREE_PARTS (without bench/results) into `archive` (xz), with the full hash in COMMIT;
    returns the hash."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "old"
        tree.mkdir()
        raw = subprocess.run(["git", "archive", full, *TREE_PARTS], cwd=ROOT, check=True, capture_output=True).stdout
        (Path(tmp) / "old.tar").write_bytes(raw)
        with tarfile.open(Path(tmp) / "old.tar") as tar:
            _extract(tar, tree)
        shutil.rmtree(tree / "bench" / "results", ignore_errors=True)
        (tree / "COMMIT").write_text(full + "\n")
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            tar.add(tree, arcname="old")
    return full


def _extract(tar: tarfile.TarFile, to: Path) -> None:
    """extractall with the "data" filter where this Python has it (3.11.4 and later)."""
    try:
        tar.extractall(to, filter="data")
    except TypeError:
        tar.extractall(to)


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which tree runs first in each round: old first, then new first, and so on."""
    return [("old", "new") if r % 2 == 0 else ("new", "old") for r in range(rounds)]


def unpack(archive: Path) -> Path:
    """The old tree beside the archive (`<archive's folder>/old`), unpacked once."""
    tree = archive.parent / "old"
    if not tree.exists():
        with tarfile.open(archive) as tar:
            _extract(tar, archive.parent)
    return tree


def _commit_here() -> str:
    found = os.environ.get("FUSION_COMMIT")
    if found:
        return found
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "working tree"


def run(archive: Path, rounds: int, out: Path, bench: list[str], timeout: float, new_root: Path = ROOT) -> str:
    """`rounds` alternating runs of the bench command `bench` (a script path relative to a tree's root, then its
    arguments) from the old tree and from `new_root`; prints and returns the summary."""
    old = unpack(archive)
    trees = {"old": (old, (old / "COMMIT").read_text().strip()[:7]),
             "new": (new_root, _commit_here() if new_root == ROOT else "new")}
    out.mkdir(parents=True, exist_ok=True)
    for n, order in enumerate(round_orders(rounds), 1):
        for which in order:
            root, commit = trees[which]
            target = out / f"ab-{which}-{n}.json"
            env = {**os.environ, "FUSION_COMMIT": commit}
            print(f"=== round {n}: {which} ({commit})", flush=True)
            try:
                done = subprocess.run([sys.executable, *bench, "--out", str(target)], cwd=root, env=env,
                                      timeout=timeout, capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if "b2b" in line]
                print("\n".join(lines) if lines else (done.stdout + done.stderr)[-2000:], flush=True)
            except subprocess.TimeoutExpired:
                print(f"  timed out after {timeout:.0f} s", flush=True)
    table = summary(out)
    print(table)
    return table


def _key(row: dict) -> tuple:
    return (row["model"], row.get("tokens"), row["phase"], row["path"])


def collect(folder: Path) -> dict:
    """{(model, tokens, phase, path): {"old"/"new": [(round, b2b ms, sync ms, host µs), ...]}} from the folder's
    ab-<which>-<round>.json files."""
    found: dict = {}
    for name in sorted(glob.glob(str(folder / "ab-*-*.json"))):
        match = re.fullmatch(r"ab-(old|new)-(\d+)\.json", Path(name).name)
        if match is None:
            continue
        which, n = match.group(1), int(match.group(2))
        for row in json.loads(Path(name).read_text())["rows"]:
            if row.get("b2b_ms") is None:
                continue
            found.setdefault(_key(row), {}).setdefault(which, []).append(
                (n, row["b2b_ms"], row.get("sync_ms"), row.get("host_us")))
    return found


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(folder: Path) -> str:
    """The table of medians, old against new, per row."""
    lines = [f"# {folder}: medians over rounds; b2b ms (sync ms, host µs); change of the b2b median",
             "| model | tokens | phase | path | old | new | change | old by round | new by round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, by_tree in sorted(collect(folder).items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        cells, medians = [], {}
        for which in ("old", "new"):
            runs = sorted(by_tree.get(which, []))
            b2b, sync, host = (_median(r[i] for r in runs) for i in (1, 2, 3))
            medians[which] = b2b
            cells.append("-" if b2b is None else f"{b2b:.3f} ({'-' if sync is None else f'{sync:.3f}'}, "
                                                 f"{'-' if host is None else f'{host:.0f}'})")
        old, new = medians["old"], medians["new"]
        change = f"{(new / old - 1) * 100:+.1f}%" if old and new else "-"
        rounds = [", ".join(f"{r[1]:.3f}" for r in sorted(by_tree.get(w, []))) or "-" for w in ("old", "new")]
        model, tokens, phase, path = key
        lines.append(f"| {model} | {tokens if tokens is not None else '-'} | {phase} | {path} | {cells[0]} | "
                     f"{cells[1]} | {change} | {rounds[0]} | {rounds[1]} |")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = []
    if "--" in argv:
        at = argv.index("--")
        argv, bench = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="archive an old commit's tree (here, with git)")
    p.add_argument("commit")
    p.add_argument("--to", type=Path, default=DEFAULT_ARCHIVE)
    r = sub.add_parser("run", help="alternate the old tree and the working tree: ... run [options] -- SCRIPT ARGS")
    r.add_argument("--tree", type=Path, default=DEFAULT_ARCHIVE, help="the archive `pack` wrote")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--timeout", type=float, default=300, help="seconds per bench process")
    s = sub.add_parser("summary", help="the medians of a run's JSON files")
    s.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.command == "pack":
        print(f"{args.to}: {pack(args.commit, args.to)}")
    elif args.command == "run":
        if not bench:
            ap.error("run needs the bench command after --, e.g. -- bench/bench_training_step.py --models small-batch")
        run(args.tree, args.rounds, args.out.resolve(), bench, args.timeout)
    else:
        print(summary(args.folder))


if __name__ == "__main__":
    main()
