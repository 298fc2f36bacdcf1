"""Shared test setup: GPU tests skip without a CUDA device; seeds are fixed per test."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def assert_same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` equals `want` bit for bit (float32 compared as their int32 bits, so NaN codes and signed zeros count),
    else an assertion naming how many elements differ and the first."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        got, want = got.view(torch.int32), want.view(torch.int32)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{name}: {bad.shape[0]} differ, first at {bad[0].tolist()}: got " \
                             f"{got[tuple(bad[0])].item():#x}, want {want[tuple(bad[0])].item():#x}"


def every_bf16_pattern() -> torch.Tensor:
    """All 65536 bf16 bit patterns as a (512, 1024) bf16 tensor (CPU): eight copies rolled by 17 each, so every pattern
    sits in both halves of a packed word and in blocks of every kind (with and without Inf, NaN of either sign,
    subnormals, zeros). What the pairwise non-finite tests (kernels/pow2_quant.py finite_abs2_bf16) are fed."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return torch.stack([patterns.roll(17 * k) for k in range(8)]).view(512, 1024).view(torch.bfloat16)


def sass_or_skip(make_sass):
    """make_sass(): nvdisasm's listing of a compiled kernel; the test is skipped where nvdisasm is missing."""
    try:
        return make_sass()
    except RuntimeError as e:  # nvdisasm missing
        pytest.skip(str(e))


@pytest.fixture
def all_templates_available(monkeypatch):
    """Matcher/planner tests exercise pattern libraries as written: every kernel template they name counts as
    runnable, whatever this build's runtime implements (tests/test_templates.py checks the real table)."""
    from fusion import kernel_templates as templates

    monkeypatch.setattr(templates, "unavailable", lambda kernel: None)


def moe_block_case(seed: int, round_to=None, E: int = 4, d: int = 256, f: int = 128, T: int = 4096, k: int = 2):
    """A bf16 MoE experts block on the GPU (Gather, FC1, SwiGLU, Scale, FC2, Combine) at 2048 routed rows per expert
    on average, its reference-backend copy, tokens, a routing and the output gradient: (block, ref, x, r, dy)."""
    import copy

    from fusion import Combine, Gather, GroupLinear, Scale, Sequential, SwiGLU
    from fusion.moe import route

    gen = torch.Generator().manual_seed(seed)
    block = Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d),
                       Combine()).to("cuda", torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=d ** -0.5)
    ref = copy.deepcopy(block)
    ref.backend = "reference"
    x = torch.randn(T, d, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(T, E, generator=gen).to("cuda", torch.bfloat16)
    r = route(logits, k, round_to=round_to)
    dy = torch.randn(T, d, generator=gen).to("cuda", torch.bfloat16)
    return block, ref, x, r, dy


def launched_f1_config(block, dtype):
    """The configuration the block's F1 (training) kernel was built at (after any spill fallback): what launched."""
    from fusion.runtime import _RUNNERS

    (runner,) = [r for r in _RUNNERS[block].values() if r.program is not None]
    (step,) = [s for s in runner.program.forward_steps if getattr(s, "label", None) == "F1"]
    return step._kernels[(dtype, "train")].compiled.config
