"""tests/gpu_shards.py (the GPU machine's test runner): how it cuts the test list and reads a shard's log."""
import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location("gpu_shards", pathlib.Path(__file__).with_name("gpu_shards.py"))
gpu_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_shards)


def test_shards_are_consecutive_runs_that_cover_every_test_once():
    ids = [f"tests/test_{i // 7}.py::t{i}" for i in range(50)]
    shards = gpu_shards.consecutive_shards(ids, 12)
    assert len(shards) == 12
    assert [i for s in shards for i in s] == ids                  # every id once, in order
    assert {len(s) for s in shards} == {4, 5}                     # as equal as can be
    assert gpu_shards.consecutive_shards(ids[:3], 12) == [[i] for i in ids[:3]]   # never an empty shard
    assert gpu_shards.consecutive_shards([], 4) == []


def test_summary_is_pytests_last_result_line():
    log = "....F.\nFAILED tests/test_a.py::t - assert 1\n===== 1 failed, 5 passed, 3 warnings in 9.1s =====\n"
    assert gpu_shards.summary(log) == "1 failed, 5 passed, 3 warnings in 9.1s"
    assert gpu_shards.summary("") == "(no output)"
    assert gpu_shards.summary("collecting ...\nKilled\n") == "Killed"


def test_a_shard_names_every_file_it_runs():
    shard = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t[x]", "tests/test_a.py::t3"]
    assert gpu_shards.files_of(shard) == ["tests/test_a.py", "tests/test_b.py"]


def test_every_gpu_test_file_carries_the_gpu_marker():
    """gpu_shards.py collects `-m gpu`: a GPU test file without the marker would never run there (two did not,
    test_moe_graph_gpu.py and test_fp8_block_gpu.py, until 2026-11-27)."""
    import pathlib

    here = pathlib.Path(__file__).parent
    unmarked = [p.name for p in sorted(here.glob("test_*_gpu.py")) if "pytest.mark.gpu" not in p.read_text()]
    assert unmarked == []
