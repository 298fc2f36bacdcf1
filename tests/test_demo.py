"""The demo's blocks: explaining and compiling read shapes only, so the full-size blocks are built on the meta
device without first initialising gigabytes of CPU weights."""
import torch

from fusion.demo import DEEPSEEK_LIKE, GPT_OSS_LIKE, build_block


def test_meta_blocks_initialise_no_cpu_weights(monkeypatch):
    initialised = []
    real = torch.nn.init.kaiming_uniform_

    def recording(tensor, *args, **kwargs):
        initialised.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", recording)
    for shape in (GPT_OSS_LIKE, DEEPSEEK_LIKE):
        block = build_block(shape, torch.bfloat16, "meta")
        assert {(p.device.type, p.dtype) for p in block.parameters()} == {("meta", torch.bfloat16)}
        assert "[F1] fused" in block.explain()
    assert set(initialised) <= {"meta"}, f"weights initialised on {sorted(set(initialised))}"


def test_a_runnable_block_has_real_weights():
    block = build_block(GPT_OSS_LIKE.scaled(8), torch.float32, "cpu")
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() and p.abs().sum() > 0 for p in block.parameters())
