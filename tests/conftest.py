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
