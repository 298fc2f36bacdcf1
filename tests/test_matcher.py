"""The matcher: chain walks, optional elements, every kind of constraint failure with its words, DAGs."""
import networkx as nx
import pytest

from fusion import Clamp, GeGLU, GroupLinear, Linear, QuantizeMXFP8, Scale, SwiGLU
from fusion.graph import add_input, add_op, add_output, build_graph, connect
from fusion.matcher import arch_of, attempt, dtype_name, format_loc, match_all, resolve
from test_matcher_support import E, Pred, SourceLoc, align64, demo_block, demo_patterns, el, pat

pytestmark = pytest.mark.usefixtures("all_templates_available")

GEMM = ("GroupLinear", "Linear")


def fc1_pattern(**kw):
    return pat("fc1", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale", optional=True),
               el("quant", "quantize", optional=True), line=2, **kw)


def run(seq_or_graph, patterns, dtype="bfloat16", target="sm_90"):
    g = seq_or_graph if isinstance(seq_or_graph, nx.DiGraph) else build_graph(seq_or_graph)
    return match_all(g, patterns, dtype, target)


def at(attempts, anchor, pattern=None):
    return next(a for a in attempts if a.anchor == anchor and (pattern is None or a.pattern == pattern))


def test_normalisation():
    assert arch_of("sm_90") == 90 and arch_of("sm_90a") == 90 and arch_of("sm_100a") == 100
    assert arch_of(None) is None and arch_of("cpu") is None
    with pytest.raises(ValueError, match="sm_90"):
        arch_of("hopper")
    import torch
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name("float16") == "float16"
    assert format_loc(SourceLoc("patterns/moe.fpat", 12, 3)) == "patterns/moe.fpat:12"


def test_single_pattern_full_chain():
    attempts = run(demo_block(), [fc1_pattern()])
    a = at(attempts, 0)
    assert a.ok and a.reason is None
    assert a.match.bindings == (("gemm", 0), ("act", 1), ("scale", 2), ("quant", 3))
    assert a.match.priority == 4
    # anchored elsewhere it does not fit, with a structural reason
    assert at(attempts, 1).reason == "op 1 SwiGLU() is not GroupLinear|Linear"
    assert at(attempts, 4).reason == ("nothing after op 4 GroupLinear: the pattern needs activation (act)")


def test_optional_elements_skipped():
    # no Scale, no quantize: the optional elements are skipped
    seq = demo_block(GeGLU())
    a = at(run(seq, [fc1_pattern()]), 0)
    assert a.ok and a.match.bindings == (("gemm", 0), ("act", 1))
    # Scale present, quantize absent
    a = at(run(demo_block(SwiGLU(), Scale()), [fc1_pattern()]), 0)
    assert a.match.ops == (0, 1, 2)
    # quantize present, Scale absent: scale? is skipped, quant? binds
    a = at(run(demo_block(SwiGLU(), QuantizeMXFP8()), [fc1_pattern()]), 0)
    assert a.match.bindings == (("gemm", 0), ("act", 1), ("quant", 2))


def test_optional_element_whose_predicate_fails_is_left_out():
    per_row = Pred("per_row", lambda a: a["per_row"])
    p = pat("fc1", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale", optional=True, where=(per_row,)))
    a = at(run(demo_block(SwiGLU(), Scale(value=0.5)), [p]), 0)
    assert a.ok and a.match.ops == (0, 1)  # the constant Scale runs unfused after the kernel


def test_required_element_mismatch_names_both_ops():
    a = at(run(demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0)), [pat("p", el("gemm", *GEMM), el("act", "activation"),
                                                                  el("scale", "Scale"))]), 0)
    assert not a.ok
    assert a.reason == "op 2 Clamp(min=-1.0, max=1.0) is not Scale (scale, after op 1 SwiGLU())"


def test_op_matches_by_name_or_kind():
    by_kind = pat("k", el("gemm", "gemm"), el("act", "activation"))
    by_name = pat("n", el("gemm", "Linear"), el("act", "SwiGLU"))
    import fusion
    dense = fusion.Sequential(Linear(1024, 4096, device="meta"), SwiGLU())
    attempts = run(dense, [by_kind, by_name])
    assert at(attempts, 0, "k").ok and at(attempts, 0, "n").ok
    assert at(run(demo_block(), [by_name]), 0).reason == "op 0 GroupLinear is not Linear"


def test_dtype_failure():
    a = at(run(demo_block(), [fc1_pattern()], dtype="float32"), 0)
    assert a.reason == "dtype float32 not in (bfloat16, float16)"
    assert a.ops == (0, 1, 2, 3)  # the span it would have covered


def test_arch_failures():
    assert at(run(demo_block(), [fc1_pattern()], target="sm_80"), 0).reason == "arch sm_80 < sm_90"
    capped = fc1_pattern(arch_max=90)
    assert at(run(demo_block(), [capped], target="sm_90a"), 0).ok
    assert at(run(demo_block(), [capped], target="sm_100"), 0).reason == \
        "arch sm_100 > sm_90 (the pattern's arch_max)"


def test_predicate_failure_shows_values_and_location():
    p = pat("fc1", el("gemm", *GEMM, where=(align64(12),)), el("act", "activation"))
    a = at(run(demo_block(SwiGLU(), d=100), [p]), 0)
    assert a.reason == ("predicate `in_features % 64 == 0` is false (in_features=100) on op 0 GroupLinear "
                        "[patterns/test.fpat:12]")


def test_predicate_sees_dtype_op_kind_and_derived_features():
    seen = {}
    spy = Pred("dtype == 'bfloat16'", lambda a: seen.update(a) or a["dtype"] == "bfloat16")
    p = pat("p", el("gemm", *GEMM), el("act", "activation", where=(spy,)))
    assert at(run(demo_block(SwiGLU()), [p]), 0).ok
    assert seen["dtype"] == "bfloat16" and seen["op"] == "SwiGLU" and seen["kind"] == "activation"
    assert seen["activation"] == "swiglu" and seen["in_features"] == 4096 and seen["out_features"] == 2048
    a = at(run(demo_block(SwiGLU()), [p], dtype="float16"), 0)
    assert a.reason == ("predicate `dtype == 'bfloat16'` is false (dtype='float16') on op 1 SwiGLU() "
                        "[patterns/test.fpat:99]")


def test_predicate_that_raises_is_a_reason():
    bad = Pred("nope > 1", lambda a: a["nope"] > 1)
    a = at(run(demo_block(), [pat("p", el("gemm", *GEMM, where=(bad,)))]), 0)
    assert a.reason.startswith("predicate `nope > 1` could not be evaluated on op 0 GroupLinear: KeyError")


def test_real_predicate_class_is_used_through_holds():
    # the AST's Predicate delegates to fusion.patterns.predicates; a subclass shows the matcher only calls holds()
    from test_matcher_support import ast

    class P(ast.Predicate):
        def holds(self, attrs):
            return attrs["num_groups"] == E

    pr = P("num_groups == 8", None, SourceLoc("x.fpat", 1, 1))
    assert at(run(demo_block(), [pat("p", el("gemm", *GEMM, where=(pr,)))]), 0).ok


def _dag(export=()):
    """x -> FC1 -> SwiGLU -> Scale -> out0, and SwiGLU -> Clamp -> out1 (SwiGLU's result used twice)."""
    ops = [GroupLinear(2, 64, 256, device="meta"), SwiGLU(), Scale(value=2.0), Clamp(max=1.0)]
    feats = [(64, 256), (256, 128), (128, 128), (128, 128)]
    g = nx.DiGraph()
    x = add_input(g, "x")
    n = [add_op(g, i, op.spec, op, *feats[i]) for i, op in enumerate(ops)]
    connect(g, x, n[0])
    connect(g, add_input(g, "group_sizes"), n[0], "group_sizes")
    connect(g, n[0], n[1])
    connect(g, n[1], n[2])
    connect(g, n[1], n[3])
    connect(g, n[2], add_output(g, 0))
    connect(g, n[3], add_output(g, 1))
    return g


def test_intermediate_used_twice_blocks_interior_but_shorter_match_applies():
    p = pat("p", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale", optional=True))
    g = _dag()
    a = at(match_all(g, [p], "bfloat16", "sm_90"), 0)
    # the largest binding (0, 1, 2) is blocked; (0, 1) ends at SwiGLU, whose output may have many users
    assert a.ok and a.match.ops == (0, 1)
    # with the Scale required, the failure says who else reads the intermediate
    q = pat("q", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale"))
    a = at(match_all(g, [q], "bfloat16", "sm_90"), 0)
    assert a.reason == ("op 1 SwiGLU's output (act.out) is also used by op 3 Clamp(min=None, max=1.0) "
                        "(not exported)")


def test_exported_intermediate_allowed():
    q = pat("q", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale"), export=("act.out",))
    a = at(match_all(_dag(), [q], "bfloat16", "sm_90"), 0)
    assert a.ok and a.match.ops == (0, 1, 2)


def test_dag_walk_branches_over_consumers():
    # act -> Clamp exists along the second branch: the walk tries both consumers of SwiGLU
    q = pat("q", el("gemm", *GEMM), el("act", "activation"), el("clamp", "Clamp"), export=("act.out",))
    a = at(match_all(_dag(), [q], "bfloat16", "sm_90"), 0)
    assert a.ok and a.match.ops == (0, 1, 3)


def test_intermediate_that_is_a_block_output():
    g = _dag()
    g.remove_node(("op", 3))
    connect(g, ("op", 1), ("out", 1))  # SwiGLU's result is itself a block output
    q = pat("q", el("gemm", *GEMM), el("act", "activation"), el("scale", "Scale"))
    a = at(match_all(g, [q], "bfloat16", "sm_90"), 0)
    assert a.reason == "op 1 SwiGLU's output (act.out) is also used by block output 1 (not exported)"


def test_first_failing_check_order():
    # dtype is checked before arch, arch before predicates
    p = pat("p", el("gemm", *GEMM, where=(align64(),)))
    seq = demo_block(d=100)
    assert at(run(seq, [p], dtype="float32", target="sm_80"), 0).reason.startswith("dtype float32")
    assert at(run(seq, [p], target="sm_80"), 0).reason == "arch sm_80 < sm_90"
    assert at(run(seq, [p]), 0).reason.startswith("predicate")


def test_resolve_priority_then_file_order_then_position():
    big, plain, bwd = demo_patterns()
    attempts = run(demo_block(), [plain, big])  # plain first in the library, but covers fewer ops
    chosen, losses = resolve(a.match for a in attempts if a.ok)
    assert [(m.pattern.name, m.ops) for m in chosen] == [("gemm_act_scale_quant", (0, 1, 2, 3)), ("gemm", (4,))]
    assert [(lo.match.pattern.name, lo.match.ops) for lo in losses] == [("gemm", (0,))]
    assert "higher priority" in losses[0].reason()
    # explicit priority beats the number of ops
    urgent = pat("urgent_gemm", el("gemm", *GEMM), priority=10)
    chosen, losses = resolve(a.match for a in run(demo_block(), [big, urgent]) if a.ok)
    assert [(m.pattern.name, m.ops) for m in chosen] == [("urgent_gemm", (0,)), ("urgent_gemm", (4,))]
    assert losses[0].match.pattern.name == "gemm_act_scale_quant"
    # equal priority: library order decides
    a1 = pat("first", el("gemm", *GEMM), el("act", "activation"))
    a2 = pat("second", el("gemm", *GEMM), el("act", "activation"))
    chosen, losses = resolve(a.match for a in run(demo_block(SwiGLU()), [a2, a1]) if a.ok)
    assert [m.pattern.name for m in chosen] == ["second"]
    assert "earlier in the pattern library" in losses[0].reason()


def test_resolve_overlap_by_position():
    # act+Scale-only pattern could match at 1 (SwiGLU, Scale) and at... overlapping same-pattern matches:
    p = pat("elt", el("a", "activation", "elementwise"), el("b", "activation", "elementwise"))
    seq = demo_block(SwiGLU(), Scale(), Clamp(max=1.0))
    chosen, losses = resolve(a.match for a in run(seq, [p]) if a.ok)
    assert [m.ops for m in chosen] == [(1, 2)]
    assert [lo.match.ops for lo in losses] == [(2, 3)]
    assert "earlier position" in losses[0].reason()


def test_backward_covers_dgrad_of_last_gemm_and_elementwise_backward():
    bwd = demo_patterns()[2]
    a = at(run(demo_block(), [bwd]), 1)
    assert a.ok and a.match.ops == (1, 2, 3, 4)
    assert a.match.covers == {(4, "dgrad"), (2, "backward"), (1, "backward")}
    # forward and backward matches may overlap: resolved separately by the planner
    fwd = demo_patterns()[0]
    ms = [a.match for a in run(demo_block(), [fwd, bwd]) if a.ok]
    chosen_f, _ = resolve(m for m in ms if m.direction == "forward")
    chosen_b, _ = resolve(m for m in ms if m.direction == "backward")
    assert chosen_f[0].ops == (0, 1, 2, 3) and chosen_b[0].ops == (1, 2, 3, 4)


def test_deterministic():
    seq = demo_block()
    r1 = run(seq, demo_patterns())
    r2 = run(seq, demo_patterns())
    assert [(a.pattern, a.anchor, a.ops, a.reason) for a in r1] == [(a.pattern, a.anchor, a.ops, a.reason) for a in r2]
