"""Text -> typed AST (patterns/ast.py). Syntax errors become PatternError with file, line, column, caret.

    parse_file(path) / parse_text(text, filename) -> PatternFile
    parse_expression(text, filename="<expr>") -> expression AST (used by tests and round trips)
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedInput, VisitError

from fusion.errors import PatternError
from fusion.patterns import ast as A
from fusion.patterns.diagnostics import make_error
from fusion.patterns.expr_ast import render_expression
from fusion.patterns.limits import MAX_EXPRESSION_DEPTH, too_deep
from fusion.patterns.syntax_errors import syntax_error

GRAMMAR_PATH = Path(__file__).with_name("fpat.lark")
BOM = "\ufeff"


class _KeywordsAreWords:
    """A no-op post-lexer whose only job is `always_accept`: NAME is in every state's lexer, so a keyword
    never matches the front of a longer word (`activations` is a NAME, not `activation` + `s`); lark turns
    a NAME that spells a keyword the state accepts into that keyword."""

    always_accept = ("NAME",)

    def process(self, stream):
        return stream


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR_PATH.read_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=False, postlex=_KeywordsAreWords())


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, filename: str, text: str):
        super().__init__()
        self.filename = filename
        self.text = text

    def _loc(self, meta_or_tok) -> A.SourceLoc:
        return A.SourceLoc(self.filename, meta_or_tok.line, meta_or_tok.column)

    def _tok_loc(self, tok: Token) -> A.SourceLoc:
        return A.SourceLoc(self.filename, tok.line, tok.column)

    # ------------------------------------------------------------ file
    def start(self, meta, children):
        return tuple(children)

    # ------------------------------------------------------------ activations
    def activation(self, meta, ch):
        name, args = ch[0], ch[1]
        rest = ch[2:]
        params = ()
        if rest and isinstance(rest[0], tuple) and rest and rest[0][:1] and isinstance(rest[0][0], A.ParamDecl):
            params, rest = rest[0], rest[1:]
        return A.ActivationDecl(str(name), args, params, tuple(rest), self._loc(meta), self._tok_loc(name))

    def arg_list(self, meta, ch):
        return tuple(A.ArgDecl(str(t), self._tok_loc(t)) for t in ch)

    def param_part(self, meta, ch):
        return tuple(ch)

    def param(self, meta, ch):
        name, typ = ch[0], ch[1]
        default = ch[2] if len(ch) > 2 else None
        return A.ParamDecl(str(name), str(typ), default, self._tok_loc(name), self._tok_loc(typ))

    def let_stmt(self, meta, ch):
        return A.LetStmt(str(ch[0]), ch[1], self._tok_loc(ch[0]))

    def forward_stmt(self, meta, ch):
        return A.ForwardStmt(ch[0], self._loc(meta))

    def grad_stmt(self, meta, ch):
        return A.GradStmt(str(ch[0]), ch[1], self._loc(meta), self._tok_loc(ch[0]))

    # ------------------------------------------------------------ fusion patterns
    def fusion(self, meta, ch):
        return A.FusionDecl(str(ch[0]), tuple(ch[1:]), self._loc(meta), self._tok_loc(ch[0]))

    def field(self, meta, ch):
        return A.FieldItem(str(ch[0]), "=", tuple(ch[1:]), self._tok_loc(ch[0]))

    def constraint_field(self, meta, ch):
        key, op, val = ch
        return A.FieldItem(str(key), str(op), (A.Value("name", str(val), self._tok_loc(val)),), self._tok_loc(key))

    def chain(self, meta, ch):
        elements = tuple(e for e, _ in ch)
        return A.ChainDecl(elements, self._loc(meta), tuple(locs for _, locs in ch))

    def chain_elem(self, meta, ch):
        label = ch[0]
        ops, op_locs, optional, pred = [], [], False, None
        for c in ch[1:]:
            if isinstance(c, Token) and c.type == "NAME":
                ops.append(str(c))
                op_locs.append(self._tok_loc(c))
            elif isinstance(c, Token) and c.type == "OPTIONAL":
                optional = True
            else:
                pred = c
        preds = tuple(self._predicates(pred)) if pred is not None else ()
        elem = A.ChainElement(str(label), tuple(ops), optional, preds, self._tok_loc(label))
        return elem, tuple(op_locs)

    def _predicates(self, expr):
        """Split a top-level `and` so explain() can say which conjunct failed."""
        if isinstance(expr, A.EBinary) and expr.op == "and":
            yield from self._predicates(expr.lhs)
            yield from self._predicates(expr.rhs)
            return
        yield A.Predicate(render_expression(expr), expr, expr.loc)


    def name_value(self, meta, ch):
        return A.Value("name", str(ch[0]), self._tok_loc(ch[0]))

    def ref_value(self, meta, ch):
        return A.Value("ref", f"{ch[0]}.{ch[1]}", self._tok_loc(ch[0]))

    def number_value(self, meta, ch):
        return A.Value("number", _field_number(ch[0]), self._tok_loc(ch[0]))

    def neg_number_value(self, meta, ch):
        return A.Value("number", -_field_number(ch[0]), self._loc(meta))

    def string_value(self, meta, ch):
        return A.Value("string", str(ch[0])[1:-1], self._tok_loc(ch[0]))

    def true_value(self, meta, ch):
        return A.Value("bool", True, self._loc(meta))

    def false_value(self, meta, ch):
        return A.Value("bool", False, self._loc(meta))

    # ------------------------------------------------------------ expressions
    def or_(self, meta, ch):
        return A.EBinary("or", ch[0], ch[1], self._loc(meta))

    def and_(self, meta, ch):
        return A.EBinary("and", ch[0], ch[1], self._loc(meta))

    def not_(self, meta, ch):
        return A.EUnary("not", ch[0], self._loc(meta))

    def compare(self, meta, ch):
        return A.EBinary(str(ch[1]), ch[0], ch[2], self._loc(meta))

    def in_(self, meta, ch):
        return A.EIn(ch[0], tuple(ch[1:]), self._loc(meta))

    def binary(self, meta, ch):
        return A.EBinary(str(ch[1]), ch[0], ch[2], self._loc(meta))

    def neg(self, meta, ch):
        operand = ch[0]
        if isinstance(operand, A.ENum):  # -2 is a number, as in Python's constant folding
            return A.ENum(-operand.value, self._loc(meta), operand.is_int)
        return A.EUnary("-", operand, self._loc(meta))

    def pos(self, meta, ch):
        return A.EUnary("+", ch[0], self._loc(meta))

    def pow(self, meta, ch):
        return A.EBinary("**", ch[0], ch[1], self._loc(meta))

    def number(self, meta, ch):
        tok = ch[0]
        try:
            value = _number(tok)
        except OverflowError:  # an integer literal too long for a float
            value = math.inf
        if not math.isfinite(value):
            raise make_error(self._tok_loc(tok), self.text, f"number {_shorten(str(tok))} overflows: it is beyond "
                             f"float64's range (about 1.8e308)")
        return A.ENum(value, self._tok_loc(tok), _is_int_literal(str(tok)))

    def string(self, meta, ch):
        return A.EStr(str(ch[0])[1:-1], self._tok_loc(ch[0]))

    def true(self, meta, ch):
        return A.EBool(True, self._loc(meta))

    def false(self, meta, ch):
        return A.EBool(False, self._loc(meta))

    def name(self, meta, ch):
        return A.EName(str(ch[0]), self._tok_loc(ch[0]))

    def call(self, meta, ch):
        return A.ECall(str(ch[0]), tuple(ch[1:]), self._tok_loc(ch[0]))


def _shorten(s: str) -> str:
    return s if len(s) <= 24 else f"{s[:10]}...{s[-10:]} ({len(s)} characters)"


def _is_int_literal(s: str) -> bool:
    return s.isdigit()


def _field_number(tok) -> int | float:
    """Field values keep integer literals as ints (priority = 7)."""
    s = str(tok)
    return int(s) if s.isdigit() else float(s)


def _number(tok) -> float:
    s = str(tok)
    return float(int(s)) if s.isdigit() else float(s)


def parse_text(text: str, filename: str = "<string>") -> A.PatternFile:
    text = text[1:] if text.startswith(BOM) else text  # a UTF-8 byte-order mark, as some editors write
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise syntax_error(e, text, filename, _lark().parse) from None
    deep = too_deep(tree)  # before the (recursive) transformer walks the tree
    if deep is not None:
        root, depth = deep
        raise make_error(A.SourceLoc(filename, root.meta.line, root.meta.column), text,
                         f"expression nested {depth} levels deep; the limit is {MAX_EXPRESSION_DEPTH} (each "
                         f"operator, call, name or number is a level: a sum of n terms is n deep)",
                         expected="a shallower expression (docs/pattern-language.md, Limits)")
    try:
        decls = _ToAst(filename, text).transform(tree)
    except VisitError as e:  # pragma: no cover - transformer bugs surface as themselves
        raise e.orig_exc
    return A.PatternFile(filename, text, tuple(decls))


def parse_file(path) -> A.PatternFile:
    """Read a .fpat file as UTF-8 (a byte-order mark is skipped); a file that is not UTF-8 is a PatternError
    naming it and where the first bad byte is."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PatternError(f"{path}: cannot read pattern file: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        err = PatternError(f"{path}:{line}:{column}: the file is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                           f"offset {e.start}: {e.reason}); pattern files are UTF-8: save it as UTF-8")
        err.file, err.line, err.column = str(path), line, column
        raise err from None
    return parse_text(text.replace("\r\n", "\n").replace("\r", "\n"), str(path))  # universal newlines


def parse_expression(text: str, filename: str = "<expr>"):
    """Parse one expression (as in `forward = ...`)."""
    prefix = "activation __expr__(__x__) { forward =\n"
    pf = parse_text(prefix + text + "\n}", filename)
    return pf.decls[0].body[0].expr


__all__ = ["parse_text", "parse_file", "parse_expression", "render_expression"]
