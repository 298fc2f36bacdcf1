"""A kernel's cache key covers the kernel template's source: editing fusion.kernels never serves a kernel compiled
from the old template."""
import dataclasses

from fusion.codegen import cache
from fusion.runtime.compile import KernelJob


def test_template_edit_changes_the_kernel_key(monkeypatch):
    job = KernelJob(step="F1", variant="train", source="x = 1", config=(128, 128, 64, 6, 1, 1, True, True, 0, True, "K"),
                    dtype="bfloat16", N=256, K=128, G=4, target="sm_90a")
    before = job.key
    monkeypatch.setattr(cache, "template_version", lambda: "edited")
    import fusion.runtime.compile as compile_mod

    monkeypatch.setattr(compile_mod, "template_version", lambda: "edited")
    assert dataclasses.replace(job).key != before
