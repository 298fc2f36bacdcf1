"""bench/bench_quantize.py on the CPU: its --dry-run times clone and the reference on tiny shapes and writes the
JSON rows (so the script cannot rot between GPU runs)."""
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_quantize  # noqa: E402


def test_dry_run_writes_rows(tmp_path):
    out = tmp_path / "quantize.json"
    result = bench_quantize.main(["--dry-run", "--json", str(out), "--groups", "3"])
    assert json.loads(out.read_text()) == result
    assert result["gpu"] == "cpu" and result["groups"] == 3
    paths = {(r["M"], r["K"], r["path"]) for r in result["rows"]}
    for M, K in [(256, 256), (130, 200)]:
        assert {(M, K, p) for p in ("clone", "reference_rowwise", "reference_rowwise_cw", "reference_slots")} <= paths
    assert all(r["ms"] > 0 and r["GBps"] >= 0 for r in result["rows"])


def test_bytes_count_every_buffer():
    # bf16 (M, K) = (130, 200): x 2 B, codes 1 B, ceil(200/128)=2 row scales; columnwise: codes, (2 + G) x K scales
    assert bench_quantize._bytes(130, 200, 2, False, 3) == 130 * 200 * 3 + 4 * 2 * 130
    assert bench_quantize._bytes(130, 200, 2, True, 3) == 130 * 200 * 4 + 4 * 2 * 130 + 4 * (2 + 3) * 200


def test_slot_bytes_count_the_padding():
    # bf16 (130, 200), 3 groups: capacity ceil(130/128) + 3 = 5 slots of 128 rows per column, (5, 200) scales
    assert bench_quantize._slot_bytes(130, 200, 2, 3, False) == 130 * 200 * 2 + 200 * 128 * 5 + 4 * 5 * 200
    assert bench_quantize._slot_bytes(130, 200, 2, 3, True) == (130 * 200 * 2 + 200 * 128 * 5 + 4 * 5 * 200
                                                               + 130 * 200 + 4 * 2 * 130)


def test_group_sizes_sum_to_the_rows():
    sizes = bench_quantize._sizes(1000, 7, "cpu")
    assert int(sizes.sum()) == 1000 and len(sizes) == 7 and (sizes >= 0).all() and (sizes == 0).any()
