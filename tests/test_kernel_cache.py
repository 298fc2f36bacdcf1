"""The disk cache of compiled kernels: a damaged entry is rebuilt (with a warning), never served; entries are
written atomically; the tile configuration a spill fallback chose survives a reload; an unusable cache folder
is a CompileError that names it. Compiles for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import fusion
from fusion import GroupLinear, Sequential, SwiGLU

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache holding one compiled kernel, and a pristine copy of its entry."""
    from fusion.runtime import aot

    old = os.environ.get("FUSION_CACHE_DIR")
    root = tmp_path_factory.mktemp("kernel-cache")
    os.environ["FUSION_CACHE_DIR"] = str(root)
    job = aot.plan_jobs(Sequential(GroupLinear(2, 128, 256, device="meta"), SwiGLU()), torch.bfloat16)[0]
    original = aot.compile_jobs([job], parallel=1, progress=False)[0]
    pristine = tmp_path_factory.mktemp("pristine") / "entry"
    shutil.copytree(original.path, pristine)
    yield job, original, pristine
    if old is None:
        os.environ.pop("FUSION_CACHE_DIR")
    else:
        os.environ["FUSION_CACHE_DIR"] = old


@pytest.fixture
def entry(cache, monkeypatch):
    """The kernel's entry restored from the pristine copy, and no kernel held in memory."""
    from fusion.runtime import compile as kernel_compile

    job, original, pristine = cache
    shutil.rmtree(original.path, ignore_errors=True)
    shutil.copytree(pristine, original.path)
    monkeypatch.setattr(kernel_compile, "_LOADED", {})
    return job, original


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_meta(change):
    def damage(folder):
        meta = json.loads((folder / "meta.json").read_text())
        change(meta)
        (folder / "meta.json").write_text(json.dumps(meta))
    return damage


DAMAGE = {
    "truncated cubin": lambda f: truncate(f / "kernel.cubin"),
    "emptied ptx": lambda f: (f / "kernel.ptx").write_text(""),
    "emptied kernel.o": lambda f: (f / "kernel.o").write_bytes(b""),
    "truncated kernel.o": lambda f: truncate(f / "kernel.o"),
    "flipped ptx byte": lambda f: (f / "kernel.ptx").write_bytes(b"#" + (f / "kernel.ptx").read_bytes()[1:]),
    "missing cubin": lambda f: (f / "kernel.cubin").unlink(),
    "missing meta.json": lambda f: (f / "meta.json").unlink(),
    "empty meta.json": lambda f: (f / "meta.json").write_text(""),
    "bad meta.json": lambda f: (f / "meta.json").write_text("{\"name\": "),
    "meta.json is a list": lambda f: (f / "meta.json").write_text("[]"),
    "meta.json lacks a key": edit_meta(lambda meta: meta.pop("shared_memory_bytes")),
    "meta.json with a bad config": edit_meta(lambda meta: meta.update(config="fast")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_entry_is_rebuilt_by_compile(entry, damage):
    from fusion.runtime.aot import compile_jobs
    from fusion.runtime.compile import FILES

    from fusion.codegen.cache import read_entry

    job, original = entry
    DAMAGE[damage](Path(original.path))
    with pytest.warns(RuntimeWarning, match="damaged"):
        kernel = compile_jobs([job], parallel=1, progress=False)[0]
    assert (kernel.cubin, kernel.ptx, kernel.registers) == (original.cubin, original.ptx, original.registers)
    read_entry(Path(kernel.path), FILES)  # valid again: raises BadEntry otherwise


@pytest.mark.parametrize("damage", ["truncated cubin", "emptied ptx", "bad meta.json", "missing cubin"])
def test_a_damaged_entry_is_rebuilt_by_the_runtime_load(entry, damage):
    from fusion.runtime.compile import load_compiled

    job, original = entry
    DAMAGE[damage](Path(original.path))
    with pytest.warns(RuntimeWarning, match="damaged"):
        kernel = load_compiled(job)
    assert kernel.cubin == original.cubin and kernel.ptx == original.ptx


def test_the_config_a_spill_fallback_chose_survives_a_reload(entry, monkeypatch):
    """compile_grouped_gemm may build another tile than the job asked for (a pingpong tile whose epilogue
    spills is built 128 wide); the launch grid depends on it, so a reload must not forget it."""
    import fusion.kernels
    from fusion.runtime import compile as kernel_compile

    job, original = entry
    real = fusion.kernels.compile_grouped_gemm
    chosen = dataclasses.replace(fusion.kernels.GemmConfig(*job.config), stages=3)

    def with_fallback(config, *args, **kwargs):
        compiled = real(config, *args, **kwargs)
        swapped = object.__new__(type(compiled))
        swapped.__dict__.update(compiled.__dict__, config=chosen)
        return swapped

    monkeypatch.setattr(fusion.kernels, "compile_grouped_gemm", with_fallback)
    shutil.rmtree(original.path)
    kernel_compile.compile_to_disk(job)
    monkeypatch.setattr(kernel_compile, "_LOADED", {})  # a new process: the kernel comes from disk
    reloaded = kernel_compile.load_compiled(job)
    assert reloaded.config == chosen != fusion.kernels.GemmConfig(*job.config)
    assert reloaded.requested_config == fusion.kernels.GemmConfig(*job.config)
    kernel = kernel_compile.artifact(job)  # what compile() returns says both
    assert (kernel.config, kernel.requested_config) == (chosen, fusion.kernels.GemmConfig(*job.config))


def test_an_unusable_cache_folder_is_a_compile_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FUSION_CACHE_DIR", str(blocker / "cache"))
    block = Sequential(GroupLinear(2, 128, 256, device="meta"), SwiGLU())
    with pytest.raises(fusion.CompileError, match="FUSION_CACHE_DIR") as err:
        block.compile(dtype=torch.bfloat16)
    assert str(blocker / "cache") in str(err.value)


def test_a_read_only_cache_folder_is_a_compile_error(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        monkeypatch.setenv("FUSION_CACHE_DIR", str(folder))
        block = Sequential(GroupLinear(2, 128, 256, device="meta"), SwiGLU())
        with pytest.raises(fusion.CompileError, match="FUSION_CACHE_DIR") as err:
            block.compile(dtype=torch.bfloat16)
        assert str(folder) in str(err.value)
    finally:
        folder.chmod(0o755)


def test_an_interrupted_write_leaves_no_entry(tmp_path):
    from fusion.codegen.cache import BadEntry, read_entry, write_entry

    def fill(folder):
        (folder / "kernel.o").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_entry(tmp_path / "key", fill, {}, ("kernel.o",))
    assert list(tmp_path.iterdir()) == []
    write_entry(tmp_path / "key", lambda f: (f / "kernel.o").write_bytes(b"whole"), {"name": "k"}, ("kernel.o",))
    meta, files = read_entry(tmp_path / "key", ("kernel.o",), ("name",))
    assert files == {"kernel.o": b"whole"} and meta["files"]["kernel.o"]["size"] == 5
    (tmp_path / "key" / "kernel.o").write_bytes(b"wh0le")
    with pytest.raises(BadEntry, match="sha256"):
        read_entry(tmp_path / "key", ("kernel.o",))
