"""The .fpat language: parser (every construct), syntax and semantic errors (exact messages), predicates."""
from __future__ import annotations

import pytest

from fusion.errors import PatternError
from fusion.patterns import ast as A
from fusion.patterns.loader import load_ast
from fusion.patterns.parser import parse_text
from fusion.patterns.predicates import UnknownAttributeError, evaluate_predicate
from fusion.patterns.registry import activations, fusion_patterns, reset_to_builtins
from fusion.symbolic import BinOp, Call, Neg, Num, Param, Var


@pytest.fixture(autouse=True)
def _builtins_only():
    reset_to_builtins()
    yield
    reset_to_builtins()


def load(src: str, name: str = "u.fpat"):
    return load_ast(parse_text(src, name), activations(), {p.name: p for p in fusion_patterns()})


def error_of(src: str, name: str = "u.fpat") -> PatternError:
    with pytest.raises(PatternError) as info:
        load(src, name)
    return info.value


# ================================================================================================ constructs
FULL = '''\
# a comment line
activation clamped_swiglu(gate, up; limit: float = 7.0, alpha: float = 1.702) {
    let g = min(gate, limit)     # trailing comment
    let u = clamp(up, -limit, limit)
    forward = g * sigmoid(alpha * g) * (u + 1)
}

activation scaled(x; k: float = -2 * 0.5) {
    forward = k * x ** 2 + where(x > 0, x, 0) / 3
    grad(x) = dy * (2 * k * x + where(x > 0, 1, 0) / 3)
}

fusion my_pattern {
    kernel    = grouped_gemm
    direction = backward
    arch      >= sm_90
    arch      <= sm_100a
    dtype     = bfloat16
    priority  = 7
    export    = act.out
    # (a backward pattern has no `save`: its kernel reads what its chain's gradients need)
    chain {
        bias:  Bias?
        act:   activation | SwiGLU   where gated and activation in ("swiglu", 'geglu') or not gated
        scale: Scale ?               where per_row == true and -value < 1
        gemm:  GroupLinear | Linear  where in_features % 8 == 0 and out_features / 2 >= 4 * 2 - 1
    }
}
'''


def test_every_construct_parses_to_the_ast():
    pf = parse_text(FULL, "full.fpat")
    assert [type(d).__name__ for d in pf.decls] == ["ActivationDecl", "ActivationDecl", "FusionDecl"]
    act = pf.decls[0]
    assert act.name == "clamped_swiglu" and [a.name for a in act.args] == ["gate", "up"]
    assert [(p.name, p.type) for p in act.params] == [("limit", "float"), ("alpha", "float")]
    assert [type(s).__name__ for s in act.body] == ["LetStmt", "LetStmt", "ForwardStmt"]
    assert act.loc == A.SourceLoc("full.fpat", 2, 1) and act.body[0].loc == A.SourceLoc("full.fpat", 3, 9)
    assert isinstance(act.body[1].expr.args[1], A.EUnary)  # -limit
    grad = pf.decls[1].body[1]
    assert isinstance(grad, A.GradStmt) and grad.arg == "x"


def test_activation_loads_with_lets_inlined_and_grads():
    acts, pats = load(FULL)
    a, s = acts
    assert a.gated and a.args == ("gate", "up") and a.params == (("limit", 7.0), ("alpha", 1.702))
    limit = Param("limit", 7.0)
    g = Call("min", (Var("gate"), limit))
    assert a.lets[0] == ("g", g)
    assert a.forward_expr == BinOp("*", BinOp("*", g, Call("sigmoid", (BinOp("*", Param("alpha", 1.702), g),))),
                                   BinOp("+", Call("clamp", (Var("up"), Neg(limit), limit)), Num(1)))
    assert a.grad_given == {"gate": False, "up": False}
    assert not s.gated and s.params == (("k", -1.0),) and s.grad_given == {"x": True}


def test_fusion_pattern_fields():
    _, (p,) = load(FULL)
    assert isinstance(p, A.FusionPattern)
    assert (p.name, p.kernel, p.direction) == ("my_pattern", "grouped_gemm", "backward")
    assert (p.arch_min, p.arch_max, p.dtypes, p.priority) == (90, 100, ("bfloat16",), 7)
    assert [(e.label, e.ops, e.optional) for e in p.chain] == [
        ("bias", ("Bias",), True), ("act", ("activation", "SwiGLU"), False), ("scale", ("Scale",), True),
        ("gemm", ("GroupLinear", "Linear"), False)]
    # the epilogue is derived from the chain: a backward kernel applies the elements before its GEMM in reverse
    assert p.epilogue == ("scale", "act", "bias") and p.save == () and p.export == ("act.out",)
    # a top-level `and` splits into separate predicates (explain() names the one that failed)
    assert [w.text for w in p.chain[3].where] == ["in_features % 8 == 0", "out_features / 2 >= 4 * 2 - 1"]
    assert [w.text for w in p.chain[1].where] == ['gated and activation in ("swiglu", "geglu") or not gated']
    assert p.chain[3].where[0].loc == A.SourceLoc("u.fpat", 26, 44)
    assert p.loc == A.SourceLoc("u.fpat", 13, 1) and p.chain[0].loc == A.SourceLoc("u.fpat", 23, 9)


def test_defaults_of_a_minimal_pattern():
    _, (p,) = load("fusion f {\n  kernel = k\n  chain {\n    g: gemm\n  }\n}\n")
    assert (p.direction, p.arch_min, p.arch_max, p.dtypes, p.priority, p.epilogue, p.save, p.export) == \
        ("forward", 90, None, ("bfloat16", "float16"), None, (), (), ())


def test_arch_forms():
    def arch(line):
        _, (p,) = load(f"fusion f {{\n  kernel = k\n  {line}\n  chain {{\n    g: gemm\n  }}\n}}\n")
        return p.arch_min, p.arch_max
    assert arch("arch == sm_90") == (90, 90)
    assert arch("arch = sm_90a") == (90, 90)
    assert arch("arch > sm_89") == (90, None)
    assert arch("arch < sm_100") == (0, 99)


# ================================================================================================ predicates
def test_predicates_evaluate_without_python_eval():
    _, (p,) = load(FULL)
    act, scale, gemm = p.chain[1], p.chain[2], p.chain[3]
    assert act.where[0].holds({"gated": True, "activation": "geglu"})
    assert not act.where[0].holds({"gated": True, "activation": "relu"})
    assert act.where[0].holds({"gated": False})  # `or not gated`: activation never read (short-circuit)
    assert scale.where[0].holds({"per_row": True, "value": 0.5})
    assert not scale.where[0].holds({"per_row": False, "value": 0.5})
    assert all(w.holds({"in_features": 64, "out_features": 14}) for w in gemm.where)
    assert not gemm.where[0].holds({"in_features": 60, "out_features": 14})
    assert not gemm.where[1].holds({"in_features": 64, "out_features": 12})


def test_unknown_attribute_is_a_key_error_naming_it():
    _, (p,) = load(FULL)
    with pytest.raises(KeyError) as info:
        p.chain[3].where[0].holds({"out_features": 8})
    assert isinstance(info.value, UnknownAttributeError)
    assert str(info.value) == "unknown attribute 'in_features'; this op has: out_features"


def test_predicate_operators():
    from fusion.patterns.parser import parse_expression

    def ev(text, **attrs):
        return evaluate_predicate(parse_expression(text), attrs)
    assert ev("7 % 3 == 1") and ev("7 / 2 == 3.5") and ev("2 ** 3 == 8") and ev("-a == -1", a=1)
    assert ev("name == 'x' and not flag", name="x", flag=False)
    assert ev("a in (1, 2, 3)", a=2) and not ev("a in (1, 2, 3)", a=4)
    assert ev("true") and not ev("false") and ev("s < 't'", s="a")
    from fusion.patterns.predicates import PredicateTypeError
    with pytest.raises(PredicateTypeError):
        ev("a + 1 > 0", a="text")
    with pytest.raises(PredicateTypeError):
        ev("a % 0 == 0", a=3)


# ================================================================================================ syntax errors
SYNTAX = [
    ("activation a(x, limit: float = 1.0) {\n  forward = x\n}\n", 1, 22,
     "unexpected ':': activation parameters come after ';' (write `activation name(gate, up; limit: float = 7.0)`)",
     "    activation a(x, limit: float = 1.0) {\n                         ^"),
    ("activation a(x) {\n  forward x\n}\n", 2, 11, "unexpected 'x': missing '=' after 'forward'",
     "      forward x\n              ^"),
    ("activation a(x) {\n  forward = x *\n}\n", 3, 1,
     "unexpected '}': an expression is missing (or is incomplete) here", "    }\n    ^"),
    ("activation a(x) {\n  y = x\n}\n", 2, 3,
     "unexpected 'y': an activation body holds only `let NAME = ...`, `forward = ...` and `grad(ARG) = ...` "
     "statements", "      y = x\n      ^"),
    ("fusion f {\n  chain {\n    g: GroupLinear where bias = true\n  }\n}\n", 3, 31,
     "unexpected '=': '=' assigns; compare with '=='", None),
    ("fusion f {\n  kernel grouped\n}\n", 2, 10,
     "unexpected 'grouped': a fusion field is `name = value, ...`, `arch >= sm_90` or `chain { ... }`", None),
    ("fusion f {\n  option tile_n = 128\n}\n", 2, 10,
     "unexpected 'tile_n': `option NAME = value` is not part of the language (it configured nothing in any kernel "
     "template): remove the line", None),
    ("activation a(x) {\n  forward = x\n", 2, 14,
     "unexpected end of file: a '}' is missing (end of file inside a declaration)", "      forward = x\n"
     "                 ^"),
    ("activation a(x) {\n  forward = x $ 2\n}\n", 2, 15, "unexpected character '$'", None),
    ("activation a(x) {\n  forward = where(0 < x < 1, x, 0)\n}\n", 2, 25,
     "unexpected '<': comparisons do not chain: write `a < b and b < c`", None),
    ("fusion f {\n  chain {\n    GroupLinear\n  }\n}\n", 4, 3,
     "unexpected '}': a chain element is `label: OpName | OpName [?] [where predicate]`", None),
    ("activations a(x) {\n  forward = x\n}\n", 1, 1,
     "unexpected 'activations': a declaration starts with `activation NAME(...)` or `fusion NAME {`", None),
    ("activation a(x)\n  forward = x\n}\n", 2, 3,
     "unexpected 'forward': missing '{' after the declaration header", None),
]


@pytest.mark.parametrize("src,line,col,reason,excerpt", SYNTAX)
def test_syntax_errors(src, line, col, reason, excerpt):
    e = error_of(src, "bad.fpat")
    assert (e.file, e.line, e.column, e.reason) == ("bad.fpat", line, col, reason)
    text = str(e)
    assert text.startswith(f"bad.fpat:{line}:{col}: {reason}\n")
    shown, caret = text.splitlines()[1:3]
    assert shown == "    " + src.splitlines()[line - 1] and caret == " " * (col + 3) + "^"
    assert text.splitlines()[3].startswith("expected: ")
    if excerpt:
        assert excerpt in text


def test_syntax_error_full_message():
    e = error_of("activation a(x) {\n  forward x\n}\n", "my_acts.fpat")
    assert str(e) == ("my_acts.fpat:2:11: unexpected 'x': missing '=' after 'forward'\n"
                      "      forward x\n"
                      "              ^\n"
                      "expected: '='")


# ================================================================================================ semantic errors
FUS = "fusion f {\n  kernel = grouped_gemm\n  chain {\n    gemm: GroupLinear\n    act: activation\n  }\n%s}\n"
SEMANTIC = [
    ("activation a(x) {\n  forward = tahn(x)\n}\n", 2, 13, "unknown function 'tahn' (did you mean 'tanh'?)"),
    ("activation a(gate, up) {\n  forward = gate * upp\n}\n", 2, 20, "unknown name 'upp' (did you mean 'up'?)"),
    ("activation a(x) {\n  forward = clamp(x, 1)\n}\n", 2, 13, "clamp() takes 3 arguments, got 2"),
    ("activation a(x) {\n  forward = exp(x, 1)\n}\n", 2, 13, "exp() takes 1 argument, got 2"),
    ("activation a(x) {\n  forward = swiglu(x)\n}\n", 2, 13,
     "activation swiglu() takes 2 arguments (gate, up), got 1"),
    ("activation a(x, y, z) {\n  forward = x\n}\n", 1, 12,
     "activation 'a' has 3 arguments; an activation takes 1 (x) or 2 (gate, up: gated)"),
    ("activation a(gate, up) {\n  forward = gate * up\n  grad(x) = dy\n}\n", 3, 8,
     "grad(x): 'x' is not an argument of 'a'"),
    ("activation a(x) {\n  forward = x\n  grad(x) = dy\n  grad(x) = dy\n}\n", 4, 3, "a second grad(x) in activation 'a'"),
    ("activation a(x) {\n  forward = x\n}\nactivation a(x) {\n  forward = x\n}\n", 4, 12,
     "activation 'a' is already defined (at u.fpat:1:1); names are global across loaded files: pick another name"),
    ("activation swiglu(x) {\n  forward = x\n}\n", 1, 12, "activation 'swiglu' is already defined (a built-in, at "),
    (FUS % "" + FUS % "", 8, 8,
     "fusion pattern 'f' is already defined (at u.fpat:1:1); names are global across loaded files: pick another name"),
    (FUS % "  epilogue = act\n", 7, 3,
     "`epilogue` is not a field: the epilogue is the chain itself (every element after the GEMM, in chain order; in "
     "a backward pattern every element before it, applied in reverse): remove the line"),
    (FUS % "  save = gemm.out, actt.in\n", 7, 20, "save: 'actt' is not a label of the chain (did you mean 'act'?)"),
    (FUS % "  save = gemm.in\n", 7, 10,
     "save: 'gemm.in' is the kernel's input, not a value it computes (the plan keeps the step's input by itself "
     "when the backward reads it): remove it"),
    (FUS % "  save = act.out\n", 7, 10,
     "save: 'act.out' is the chain's output, which the kernel writes anyway (and the plan keeps when the backward "
     "reads it): remove it"),
    (FUS % "  save = act.in, act.in\n", 7, 18, "save: 'act.in' is named twice"),
    (FUS % "  save = gemm.out, act.in\n", 7, 20,
     "save names 2 values but kernel template 'grouped_gemm' writes 1 for the backward: keep the one the backward "
     "reads (the input of the first op whose gradient needs it, e.g. act.in)"),
    ("fusion f {\n  kernel = grouped_gemm_dgrad\n  direction = backward\n  chain {\n    act: activation\n"
     "    gemm: GroupLinear\n  }\n  save = act.in\n}\n", 8, 3,
     "a backward pattern has no `save`: its kernel reads the value its chain's gradients need (the input of the "
     "first op whose gradient reads it), which the forward pattern's `save` keeps: remove the line"),
    (FUS % "  export = gemm.output\n", 7, 12, "export: 'gemm.output': a port is 'in' or 'out'"),
    (FUS % "  save = gemm\n", 7, 10, "save takes label.in or label.out, got 'gemm'"),
    ("activation a(x) {\n  let u = v + 1\n  let v = x\n  forward = u\n}\n", 2, 11,
     "'v' is used before its definition (let at line 3); a let may use only names defined above it, so lets "
     "cannot be cyclic"),
    ("activation a(x) {\n  let u = v\n  let v = u\n  forward = u\n}\n", 2, 11,
     "'v' is used before its definition (let at line 3); a let may use only names defined above it, so lets "
     "cannot be cyclic"),
    ("activation a(x) {\n  let u = u + 1\n  forward = u\n}\n", 2, 11, "'u' is defined in terms of itself"),
    ("activation a(x) {\n  let x = 1\n  forward = x\n}\n", 2, 7, "'x' is already defined (line 1, column 14)"),
    ("activation a(x, x) {\n  forward = x\n}\n", 1, 17, "'x' is already defined (line 1, column 14)"),
    ("activation a(x) {\n  let y = x\n}\n", 1, 12, "activation 'a' has no `forward = ...`"),
    ("activation a(x) {\n  forward = x\n  forward = x\n}\n", 3, 3,
     "activation 'a' has a second `forward = ...` (the first is at line 2)"),
    ("activation a(x) {\n  forward = 2 ** x\n}\n", 2, 18,
     "the exponent of '**' must be constant (numbers and parameters); for a variable exponent write "
     "exp(b * log(a))"),
    ("activation a(x; k: float) {\n  forward = k * x\n}\n", 1, 17, "parameter 'k' needs a default: `k: float = 1.0`"),
    ("activation a(x; k: int = 1) {\n  forward = k * x\n}\n", 1, 20, "unknown parameter type 'int'"),
    ("activation a(x; dy: float = 1) {\n  forward = x\n}\n", 1, 17,
     "'dy' is reserved for the incoming gradient; name the parameter differently"),
    ("activation a(x) {\n  forward = dy * x\n}\n", 2, 13,
     "'dy' (the incoming gradient) exists only in `grad(arg) = ...`"),
    ("activation a(x) {\n  forward = tanh * x\n}\n", 2, 13, "'tanh' is a function; call it: tanh(...)"),
    ("activation a(x) {\n  forward = where(x > 0 and x < 1, x, 0)\n}\n", 2, 19,
     "'and' is for chain predicates; in an activation nest where(...) conditions instead"),
    ("activation a(x) {\n  forward = where(not x > 0, x, 0)\n}\n", 2, 19,
     "'not' is for chain predicates; in an activation use where(cond, a, b)"),
    ("activation a(x) {\n  forward = x % 2\n}\n", 2, 13, "'%' is for chain predicates, not activation expressions"),
    ("activation a(x) {\n  forward = \"x\"\n}\n", 2, 13, "strings are for chain predicates, not activation expressions"),
    ("activation a(x) {\n  forward = true\n}\n", 2, 13, "true/false are for chain predicates; in an activation use 1 and 0"),
    ("activation a(x) {\n  forward = x in (1, 2)\n}\n", 2, 13, "'in' is for chain predicates, not activation expressions"),
    ("fusion f {\n  kernel = k\n  chain {\n    gemm: GroupLinear | Lienar\n  }\n}\n", 4, 25,
     "unknown op 'Lienar' (did you mean 'Linear'?)"),
    ("fusion f {\n  kernal = k\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 2, 3,
     "unknown field 'kernal' (did you mean 'kernel'?)"),
    ("fusion f {\n  kernel = k\n  chain {\n    gemm: GroupLinear where exp(in_features) > 1\n  }\n}\n", 4, 29,
     "predicates cannot call functions ('exp'); use attributes, numbers, strings, booleans, arithmetic, "
     "comparisons, and/or/not and `in (...)`"),
    ("fusion f {\n  kernel = k\n  chain {\n    act: activation\n    gemm: GroupLinear\n  }\n}\n", 4, 5,
     "a forward fusion's chain has exactly one GEMM element (GroupLinear, Linear or gemm), not optional, and it "
     "comes first (only Gather elements may precede it: the GEMM loads its A rows through their index): the kernel "
     "is a GEMM with an epilogue"),
    ("fusion f {\n  kernel = k\n  dtype = bf16\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 3, 11,
     "unknown dtype 'bf16' (did you mean 'bfloat16'?)"),
    ("fusion f {\n  kernel = k\n  direction = sideways\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 3, 15,
     "direction must be forward or backward, got 'sideways'"),
    ("fusion f {\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 1, 8, "fusion 'f' needs `kernel = NAME` (the kernel template)"),
    ("fusion f {\n  kernel = k\n}\n", 1, 8, "fusion 'f' needs a non-empty `chain { label: Op ... }`"),
    ("fusion f {\n  kernel = k\n  kernel = j\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 3, 3,
     "field 'kernel' is given twice (first at line 2)"),
    ("fusion f {\n  kernel = k\n  arch >= hopper\n  chain {\n    gemm: GroupLinear\n  }\n}\n", 3, 11,
     "arch takes one architecture like sm_90, got 'hopper'"),
    ("fusion f {\n  kernel = k\n  arch >= sm_100\n  arch <= sm_90\n  chain {\n    g: gemm\n  }\n}\n", 4, 3,
     "the arch constraints leave no architecture (sm_100 .. sm_90)"),
    ("fusion f {\n  kernel = k\n  priority = high\n  chain {\n    g: gemm\n  }\n}\n", 3, 14,
     "priority takes one integer, got 'high'"),
    ("fusion f {\n  kernel = k\n  chain {\n    gemm: GroupLinear\n    gemm: Bias\n  }\n}\n", 5, 5,
     "label 'gemm' is used twice in the chain"),
]


@pytest.mark.parametrize("src,line,col,reason", SEMANTIC)
def test_semantic_errors(src, line, col, reason):
    e = error_of(src)
    assert (e.file, e.line, e.column) == ("u.fpat", line, col)
    assert e.reason.startswith(reason)
    text = str(e).splitlines()
    assert text[0] == f"u.fpat:{line}:{col}: {e.reason}"
    assert text[1] == "    " + src.splitlines()[line - 1] and text[2] == " " * (col + 3) + "^"


def test_semantic_error_full_message():
    e = error_of("activation mish_glu(gate, up) {\n    forward = gate * tahn(softplus(gate)) * up\n}\n", "my_acts.fpat")
    assert str(e).splitlines()[:3] == [
        "my_acts.fpat:2:22: unknown function 'tahn' (did you mean 'tanh'?)",
        "        forward = gate * tahn(softplus(gate)) * up",
        "                         ^"]
    assert str(e).splitlines()[3].startswith("expected: a function (min, max, clamp, abs, exp, log, sqrt, sigmoid, "
                                             "tanh, softplus, erf, relu, gelu_tanh, silu, where) or a declared "
                                             "activation (swiglu, geglu,")


def test_pattern_files_are_data_not_python():
    e = error_of("activation a(x) {\n  forward = eval('x')\n}\n")
    assert e.reason.startswith("unknown function 'eval'")
    e = error_of("activation a(x) {\n  forward = __import__('os').system('true')\n}\n")
    assert e.reason == "unexpected '.'"


def test_activation_calls_inline_earlier_activations():
    (a,), _ = load("activation a(gate, up) {\n  forward = 2 * swiglu(gate, up)\n}\n")
    import torch
    g, u = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(a.forward(g, u), 2 * torch.nn.functional.silu(g) * u)
