"""Expression IR for elementwise epilogues: nodes, torch evaluation, symbolic derivative, CSE, printers.

    from fusion.symbolic import Var, Param, Num, call, evaluate, differentiate, cse, to_source, to_cute
"""
from fusion.symbolic.expr import (
    ARITH_OPS, BINARY_OPS, COMPARE_OPS, FUNCTIONS, BinOp, Call, Expr, Neg, Num, Param, Var, as_expr, call,
    cmp, depends_on, free_params, free_vars, is_constant, postorder, size, substitute, transform, where,
)
from fusion.symbolic.simplifier import simplify
from fusion.symbolic.evaluate import TORCH_FUNCTIONS, UnboundNameError, evaluate
from fusion.symbolic.diff import UNARY_DERIVATIVES, differentiate, gradient
from fusion.symbolic.cse import cse
from fusion.symbolic.source import bindings_to_source, format_number, to_source
from fusion.symbolic.cute import CUTE_FAST, CUTE_PRECISE, to_cute

__all__ = [
    "ARITH_OPS", "BINARY_OPS", "COMPARE_OPS", "FUNCTIONS", "BinOp", "Call", "Expr", "Neg", "Num", "Param",
    "Var", "as_expr", "call", "cmp", "depends_on", "free_params", "free_vars", "is_constant", "postorder",
    "size", "substitute", "transform", "where", "simplify", "TORCH_FUNCTIONS", "UnboundNameError",
    "evaluate", "UNARY_DERIVATIVES", "differentiate", "gradient", "cse", "bindings_to_source",
    "format_number", "to_source", "CUTE_FAST", "CUTE_PRECISE", "to_cute",
]
