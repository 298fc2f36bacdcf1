"""FC2's fused FP8 dgrad (B1) also writes d(pre-activation) quantized 1x128 rowwise, the operand FC1's FP8 dgrad
reads, so that dgrad runs no quantize pass, where the rule is on (FUSION_QUANTIZED_DGRAD_OPERAND=1: off by default,
measured slower; fusion/dataflow.py `quantizes_dgrad_operand`; the output is
kernels.epilogue.FP8BlockOutput, paired: each gated half's blocks on their own). The plan says so, the generated
epilogue declares it, and the emulated program's FC1 dgrad reads the kernel's codes (corrupting them moves dX) and
gives, bit for bit, what quantizing B1's gradient again gave. Where a gated half is not whole 128-column blocks (a
block would straddle gate and up), before a bf16 FC1, or with the switch off, FC1's dgrad quantizes as before."""
import pytest
import torch

from fusion import Activation, GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU
from fusion import dataflow
from fusion.planner import clear_cache, plan_for
from test_fp8_dequant_recompute import D, E, _inputs, _run   # the same block widths, inputs and step


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    """Fresh plans with the rule on (off by default: measured slower, test_it_is_off_by_default)."""
    from fusion.patterns.registry import reset_to_builtins

    reset_to_builtins()
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", True)
    clear_cache()
    yield
    clear_cache()


def test_it_is_off_by_default():
    """On an H200 the dgrad's epilogue spent more on the quantization than the quantize kernel it replaces
    (docs/benchmarks.md), so a plan takes it only with FUSION_QUANTIZED_DGRAD_OPERAND=1 (read at import)."""
    import os
    import subprocess
    import sys

    def setting(**env):
        code = "import fusion.dataflow as d; print(d.QUANTIZES_DGRAD_OPERAND)"
        base = {k: v for k, v in os.environ.items() if k != "FUSION_QUANTIZED_DGRAD_OPERAND"}
        return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert setting() == "False" and setting(FUSION_QUANTIZED_DGRAD_OPERAND="1") == "True"


def block(f=256, quant=True, fmt1="fp8_block", act=None, backend="auto", dtype=torch.float32):
    torch.manual_seed(0)
    gated = act is None
    ops = [GroupLinear(E, D, (2 if gated else 1) * f, weight_format=fmt1), SwiGLU() if gated else act, Scale()]
    ops += [QuantizeFP8Block(columnwise=False)] if quant else []
    ops += [GroupLinear(E, f, D, weight_format="fp8_block")]
    return Sequential(*ops, backend=backend).to(dtype)


def _steps(plan):
    (b1,) = [s for s in plan.backward if s.fused]
    (dgrad,) = [s for s in plan.backward if s.parts == ((0, "dgrad"),)]
    return b1, dgrad


@pytest.mark.parametrize("quant", [True, False], ids=["quantize-op", "direct"])
def test_the_plan_has_b1_write_fc1s_dgrad_operand(quant):
    seq = block(quant=quant)
    plan = plan_for(seq, dtype=torch.bfloat16, target="sm_90")
    b1, dgrad = _steps(plan)
    assert b1.writes[0] == "g1" and b1.writes[-1] == "qg1", b1.writes
    assert dgrad.reads == ("g1", "qg1"), dgrad.reads
    text = seq.explain(dtype=torch.bfloat16, target="sm_90")
    assert "also writes qg1 (g1 quantized 1x128 rowwise" in text and "op 0's FP8 dgrad reads it" in text, text


@pytest.mark.parametrize("why, make", [
    ("a gated half of 160 columns: its last block would straddle gate and up", lambda: block(f=160)),
    ("a bf16 FC1 reads dY in bf16", lambda: block(fmt1="bf16")),
])
def test_elsewhere_fc1s_dgrad_quantizes_itself(why, make):
    plan = plan_for(make(), dtype=torch.bfloat16, target="sm_90")
    b1 = next(s for s in plan.backward if s.fused)
    assert not any(w.startswith("qg") for w in b1.writes), (why, b1.writes)
    assert not any(r.startswith("qg") for s in plan.backward for r in s.reads), why


def test_a_plain_activation_takes_any_width():
    """Not gated, the gradient's last block may be partial: the kernel's tile masks it as the quantizer does."""
    plan = plan_for(block(f=160, act=Activation("gelu_tanh")), dtype=torch.bfloat16, target="sm_90")
    b1, dgrad = _steps(plan)
    assert "qg1" in b1.writes and dgrad.reads == ("g1", "qg1")


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", False)
    plan = plan_for(block(), dtype=torch.bfloat16, target="sm_90")
    b1, dgrad = _steps(plan)
    assert "qg1" not in b1.writes and dgrad.reads == ("g1",)


def test_the_generated_epilogue_declares_the_quantized_gradient():
    from fusion.runtime.program import BlockProgram

    seq = block(dtype=torch.bfloat16)
    program = BlockProgram(seq, plan_for(seq, dtype=torch.bfloat16, target="sm_90"), "cute")
    (b1,) = [r for r in program.backward_steps if type(r).__name__ == "FusedDgrad"]
    job = b1.job(torch.bfloat16)
    assert '_epi.FP8BlockOutput("dinput_q", paired=True)' in job.source, job.source
    assert job.config[:2] == (128, 128), job.config   # (tile_m, tile_n): a row's block whole in the tile


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", [True, False], ids=["quantize-op", "direct"])
def test_fc1s_dgrad_gives_what_it_gave_quantizing_itself(dtype, quant, monkeypatch):
    """Emulated, the block with B1 writing the operand equals the same block with the switch off, bit for bit: the
    kernel's codes and scales are the ones FC1's dgrad made itself from B1's gradient."""
    from fusion.runtime.kernel import LAUNCHES

    x, sizes, probs = _inputs(dtype)
    LAUNCHES.reset()
    got = _run(block(quant=quant, backend="emulate", dtype=dtype), x, sizes, probs)
    assert dict(LAUNCHES.by_step) == {"F1": 1, "B1": 1}, LAUNCHES.by_step
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", False)
    clear_cache()
    kept = _run(block(quant=quant, backend="emulate", dtype=dtype), x, sizes, probs)
    for name, a, b in zip(["y", "dx", "dprobs", "dW0", "dW4"], got, kept):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3e}"


def test_fc1s_dgrad_reads_the_kernels_codes(monkeypatch):
    """Corrupt the emulated kernel's quantized gradient (one code per row flipped): FC1's input gradient moves and
    nothing else does, so the dgrad reads B1's output and does not quantize again."""
    from fusion.runtime import emulate

    x, sizes, probs = _inputs(torch.float32)
    clean = _run(block(backend="emulate"), x, sizes, probs)
    store = emulate.EmulatedKernel._store_fp8_block

    def corrupt(value, tensors, slot, start, end):
        store(value, tensors, slot, start, end)
        if slot.name == "dinput_q":
            codes = tensors[slot.name].view(torch.uint8)
            codes[start:end, 0] ^= 0x08   # the exponent's low bit of column 0
    monkeypatch.setattr(emulate.EmulatedKernel, "_store_fp8_block", staticmethod(corrupt))
    clear_cache()
    bad = _run(block(backend="emulate"), x, sizes, probs)
    names = ["y", "dx", "dprobs", "dW0", "dW4"]
    for name, a, b in zip(names, clean, bad):
        assert torch.equal(a, b) != (name == "dx"), name
