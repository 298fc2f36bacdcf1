"""`python -m fusion`: a mistake on the command line is one clear line on stderr and exit code 2, before any
work starts; never a traceback, never silently ignored."""
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "fusion", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def one_clear_line(out, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert out.stdout == ""


@pytest.mark.parametrize("target", ["sm_9x", "sm_100a", ""])
def test_bad_target(target):
    one_clear_line(cli("compile", "--target", target), "--target", "sm_90a")


def test_out_pointing_at_a_file(tmp_path):
    file = tmp_path / "kernels.txt"
    file.write_text("not a folder")
    one_clear_line(cli("compile", "--out", str(file)), "--out", "is a file")


def test_empty_out():
    one_clear_line(cli("compile", "--out", ""), "--out", "empty")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda():
    one_clear_line(cli("demo", "--device", "cuda"), "--device", "cuda is not available", "--device cpu")


def test_unknown_device():
    one_clear_line(cli("demo", "--device", "tpu"), "--device", "cpu or cuda")


def test_help_advertises_only_options_that_exist():
    for command in ([], ["compile"], ["demo"]):
        out = cli(*command, "--help")
        assert out.returncode == 0 and "--block" not in out.stdout, out.stdout
    one_clear_line(cli("compile", "--block", "x"), "unrecognized arguments")
