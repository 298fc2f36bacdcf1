"""MoE ops in the pattern library and in explain(): Gather and Combine are known to pattern files (one op table,
fusion.ops), listed unfused with the reason, rows counted as tokens (T) or routed rows (M), and the saves given
per token. Uses the built-in library as this build has it (no template switched on for the test)."""
import json

import pytest
import torch

import fusion
from fusion import Combine, Gather, GroupLinear, Linear, Scale, Sequential, SwiGLU
from fusion.dataflow import row_symbols
from fusion.planner import clear_cache, plan_for

E, D, F = 8, 256, 512


@pytest.fixture(autouse=True)
def _builtins():
    from fusion.patterns.registry import reset_to_builtins

    reset_to_builtins()
    clear_cache()
    yield
    clear_cache()


def moe_block():
    return Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine())


# -- the op table ---------------------------------------------------------------------------------------------------
def test_the_loader_reads_the_op_table_of_fusion_ops():
    from fusion.ops.base import OP_TABLE
    from fusion.patterns.fusion_semantics import op_names, ops_of_kind

    for name in fusion.ops.__all__:
        cls = getattr(fusion.ops, name)
        if isinstance(cls, type) and issubclass(cls, fusion.ops.Op) and cls is not fusion.ops.Op:
            assert OP_TABLE[name] == cls.op_kind, name
    assert {"Gather", "Combine", "QuantizeFP8Block"} <= set(op_names())
    assert ops_of_kind("gemm") == ("GroupLinear", "Linear", "gemm")
    assert [op.spec.kind for op in moe_block().ops] == [OP_TABLE[op.spec.name] for op in moe_block().ops]


def test_pattern_files_may_name_moe_ops_and_fp8_block():
    from fusion.patterns.loader import load_ast
    from fusion.patterns.parser import parse_text

    src = """
fusion g {
    kernel = grouped_gemm
    chain {
        gather: Gather
        gemm:   GroupLinear   where weight_format == "bf16"
        quant:  QuantizeFP8Block?
        comb:   combine?
    }
}
"""
    _, (p,) = load_ast(parse_text(src, "moe_ops.fpat"))
    assert [e.ops for e in p.chain] == [("Gather",), ("GroupLinear",), ("QuantizeFP8Block",), ("combine",)]


def test_only_a_gather_may_precede_the_gemm():
    from fusion.errors import PatternError
    from fusion.patterns.loader import load_ast
    from fusion.patterns.parser import parse_text

    src = "fusion f {\n  kernel = k\n  chain {\n    c: Combine\n    gemm: GroupLinear\n  }\n}\n"
    with pytest.raises(PatternError, match="only Gather elements may precede it"):
        load_ast(parse_text(src, "bad.fpat"))


# -- explain --------------------------------------------------------------------------------------------------------
def test_gather_fuses_into_fc1_and_combine_is_unfused_with_the_reason():
    plan = plan_for(moe_block(), dtype=torch.bfloat16, target="sm_90")
    forward = {fb.op: fb for fb in plan.fallbacks if fb.part == "forward"}
    assert set(forward) == {5}
    assert any(r.startswith("gemm_combine [patterns/moe.fpat:") and "fuses a combine into the GEMM's epilogue" in r
               for r in forward[5].reasons), forward[5].reasons
    text = moe_block().explain()
    assert "no kernel on this target fuses a combine into the GEMM's epilogue yet" in text
    # Gather (FC1's A loads) + FC1 + SwiGLU + Scale run as one kernel
    assert [(s.pattern, s.kernel, s.ops) for s in plan.forward if s.fused] == \
        [("gather_gemm_act", "grouped_gemm_gather", (0, 1, 2, 3))]
    assert "gather (A loads)" in text and "gemm (mainloop)" in text
    # the gathered rows are recomputed for FC1's wgrad, from x, which the forward keeps
    assert plan.recomputed == ("v1",) and "v0" in plan.saves


def test_rows_are_tokens_before_gather_and_after_combine():
    assert row_symbols(["gemm", "activation", "gemm"]) == ("M",) * 4
    assert row_symbols(["gather", "gemm", "combine"]) == ("T", "M", "M", "T")
    assert row_symbols(["gemm", "combine"]) == ("M", "M", "T")  # a block fed routed rows
    text = moe_block().explain()
    assert "ops (T = tokens" in text and "M = routed rows" in text
    lines = {int(line.split()[1]): line for line in text.splitlines() if line.startswith("  op ") and "->" in line}
    assert "Gather()" in lines[0] and "(T, ?) -> (M, 256)" in lines[0]
    assert "(M, 256) -> (M, 1024)" in lines[1] and "(M, 512) -> (M, 256)" in lines[4]
    assert "Combine()" in lines[5] and "(M, 256) -> (T, 256)" in lines[5]
    dot = moe_block().explain(format="dot")
    assert 'label="y (T, 256)"' in dot and 'op4 -> op5 [label="(M, 256)"]' in dot
    data = json.loads(moe_block().explain(format="json"))
    rows = [(o["in_rows"], o["out_rows"]) for o in data["plan"]["ops"]]
    assert rows == [("T", "M")] + [("M", "M")] * 4 + [("M", "T")]


def test_dense_blocks_keep_one_row_symbol():
    text = Sequential(Linear(D, 2 * F), SwiGLU(), Linear(F, D)).explain()
    assert "ops (M = rows of x):" in text and "(T," not in text and "B per row" in text


def test_saved_bytes_per_token():
    text = moe_block().explain(dtype=torch.bfloat16)
    # FC1's output (2F bf16) per routed row; k routed rows per token. The gathered x (FC1's input) is never
    # kept: the Gather runs in FC1's A loads, and FC1's wgrad regathers the rows from x (or, at many rows per group,
    # reads x through the index itself)
    per_routed = 2 * 2 * F
    assert (f"saved for backward (besides x): {per_routed} B per routed row + 0 B per token = {per_routed}·k B per "
            f"token") in text
    assert f"v2: output of op 1 GroupLinear, {2 * 2 * F} B per routed row" in text
    assert (f"v1: output of op 0 Gather(), {2 * D} B per routed row (recomputed in backward: the forward does not "
            f"keep it; an MoE FC1's weight gradient reads x through the index instead at many rows per group)") in text
    assert "  v0: x (the block input)\n" in text


def test_moe_layer_experts_explain():
    moe = fusion.MoE.swiglu(D, E, F, k=2)
    text = moe.experts.explain()
    assert "(M, 256) -> (T, 256)" in text and "B per routed row" in text
