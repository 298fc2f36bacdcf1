"""fusion.patterns: the .fpat pattern language.

    patterns/fpat.lark    grammar (lark, LALR)
    parser.py             text -> typed AST (ast.py); syntax errors as PatternError with file:line:col
    loader.py             a parsed file -> ActivationDef + FusionPattern (names global across files), through
    activation_semantics.py, fusion_semantics.py    the semantic checks of each kind of declaration
    syntax_errors.py      lark syntax errors in a user's words
    registry.py           the global activation registry and pattern library (built-ins, user files)
    predicates.py         the evaluator of chain `where` predicates
    activations.fpat, moe.fpat    the built-in declarations, read like any user file

Reference: docs/pattern-language.md.
"""
from fusion.patterns.activation import ActivationDef
from fusion.patterns.ast import ChainElement, FusionPattern, Predicate, SourceLoc
from fusion.patterns.parser import parse_expression, parse_file, parse_text
from fusion.patterns.predicates import UnknownAttributeError, evaluate_predicate
from fusion.patterns.registry import (
    activations, fusion_patterns, get_activation, load_patterns, loaded_files, register_activation,
    reset_to_builtins,
)

__all__ = [
    "ActivationDef", "ChainElement", "FusionPattern", "Predicate", "SourceLoc", "parse_expression", "parse_file",
    "parse_text", "UnknownAttributeError", "evaluate_predicate", "activations", "fusion_patterns",
    "get_activation", "load_patterns", "loaded_files", "register_activation", "reset_to_builtins",
]
