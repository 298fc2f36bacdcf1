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


OOM_LOG = """..F.E
FAILED tests/test_fp8_gemm_gpu.py::test_identity[G32-M8192-N4096-K7168-{}] - torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB.
ERROR tests/test_fp8_gemm_gpu.py::test_256[G16-M2500-N768-K1024-{'tile_m': 128, 'tile_n': 64}] - torch.OutOfMemoryError: CUDA out of memory.
===== 1 failed, 3 passed, 1 error in 9.1s =====
"""


def test_a_shard_that_only_ran_out_of_memory_has_those_tests_rerun_alone():
    """Shards share one GPU: tests that ran out of its memory beside another shard run again alone (their ids as
    pytest's short summary prints them, spaces in a parameter included); a shard with any other failure, a timeout,
    or a failure without a summary line (a crash) fails the run; a passing shard reruns nothing."""
    assert gpu_shards.retry_alone(0, "....\n===== 4 passed in 1s =====\n") == []
    assert gpu_shards.retry_alone(1, OOM_LOG) == [
        "tests/test_fp8_gemm_gpu.py::test_identity[G32-M8192-N4096-K7168-{}]",
        "tests/test_fp8_gemm_gpu.py::test_256[G16-M2500-N768-K1024-{'tile_m': 128, 'tile_n': 64}]"]
    mixed = OOM_LOG.replace("=====", "FAILED tests/test_a.py::t - assert 1 == 2\n=====", 1)
    assert gpu_shards.retry_alone(1, mixed) is None
    assert gpu_shards.retry_alone("timeout", OOM_LOG) is None
    assert gpu_shards.retry_alone(1, "..F\nSegmentation fault\n") is None


def test_shards_report_failures_with_their_messages():
    """The shards run with pytest's -rfEs and a wide COLUMNS: without it pytest drops the message of a failure
    whose test id is long, and the out-of-memory failures could not be told from the others."""
    assert "f" in gpu_shards.REPORT and "E" in gpu_shards.REPORT and "s" in gpu_shards.REPORT
    assert int(gpu_shards.ENV["COLUMNS"]) >= 500


FAKE_GPU_TESTS = '''
import pathlib
import pytest

pytestmark = pytest.mark.gpu


class OutOfMemoryError(RuntimeError):
    pass


def test_big():
    flag = pathlib.Path(__file__).with_name("ran_once")
    if not flag.exists():            # out of memory beside the other shard, fine alone
        flag.write_text("x")
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB")


def test_small():
    assert {verdict}
'''


def test_the_run_passes_when_the_out_of_memory_tests_pass_alone(tmp_path, monkeypatch, capsys):
    """End to end, two shards of a fake GPU test file: the test that ran out of memory passes alone, so the run
    passes; with an assertion failing in the other shard it fails."""
    monkeypatch.chdir(tmp_path)
    for verdict, expect in (("True", 0), ("False", 1)):
        (tmp_path / "ran_once").unlink(missing_ok=True)
        (tmp_path / "test_fake_gpu.py").write_text(FAKE_GPU_TESTS.replace("{verdict}", verdict))
        rc = gpu_shards.main(["test_fake_gpu.py", "--shards", "2", "--timeout", "120", "--logs", "logs"])
        out = capsys.readouterr().out
        assert rc == expect, out
        rerun = [line for line in out.splitlines() if line.startswith("rerun alone of the 1 tests")]
        assert len(rerun) == 1 and "rc 0" in rerun[0] and "1 passed" in rerun[0], out
        assert ("FAILED test_fake_gpu.py::test_small" in out) == (expect == 1)
