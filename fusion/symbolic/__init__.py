"""Expression IR for elementwise epilogues: nodes, torch evaluation, symbolic derivative, CSE, printers.

    from fusion.symbolic import Var, Param, Num, call, evaluate, differentiate, cse, to_source, to_cute

The language's functions are one registry, FUNCTIONS (fusion/symbolic/functions.py): name, arity, torch
implementation, derivative and kernel function of each.
"""
from fusion.symbolic.functions import FUNCTIONS, Function
from fusion.symbolic.expr import (
    ARITH_OPS, BINARY_OPS, COMPARE_OPS, BinOp, Call, Expr, Neg, Num, Param, Var, as_expr, call,
    cmp, depends_on, free_params, free_vars, is_constant, postorder, size, substitute, transform, where,
)
from fusion.symbolic.simplifier import simplify
from fusion.symbolic.evaluate import UnboundNameError, evaluate
from fusion.symbolic.diff import differentiate, gradient
from fusion.symbolic.cse import cse
from fusion.symbolic.source import bindings_to_source, format_number, to_source
from fusion.symbolic.cute import to_cute

__all__ = [
    "ARITH_OPS", "BINARY_OPS", "COMPARE_OPS", "FUNCTIONS", "Function", "BinOp", "Call", "Expr", "Neg", "Num",
    "Param", "Var", "as_expr", "call", "cmp", "depends_on", "free_params", "free_vars", "is_constant",
    "postorder", "size", "substitute", "transform", "where", "simplify", "UnboundNameError", "evaluate",
    "differentiate", "gradient", "cse", "bindings_to_source", "format_number", "to_source", "to_cute",
]
