"""lark's syntax errors in a user's words: the tables and the function that explain them.

Why its own module: these are data (typical mistakes by parser state, terminal names, retired words) and one
function over them; the parser (patterns/parser.py) only builds the AST.
"""
from __future__ import annotations

from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from fusion.errors import PatternError
from fusion.patterns.diagnostics import format_message

# Terminal names lark shows in `expected` sets -> what a user reads.
_TERMINALS = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "COMPARE": "a comparison (< <= > >= == !=)",
    "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/' or '%'", "OPTIONAL": "'?'", "LPAR": "'('", "RPAR": "')'",
    "LBRACE": "'{'", "RBRACE": "'}'", "COMMA": "','", "SEMICOLON": "';'", "COLON": "':'", "EQUAL": "'='",
    "VBAR": "'|'", "DOT": "'.'", "MINUS": "'-'", "PLUS": "'+'", "__ANON_0": "'**'", "$END": "end of file",
    "ACTIVATION": "'activation'", "FUSION": "'fusion'", "LET": "'let'", "FORWARD": "'forward'",
    "GRAD": "'grad'", "CHAIN": "'chain'", "WHERE": "'where'", "AND": "'and'",
    "OR": "'or'", "NOT": "'not'", "IN": "'in'", "TRUE": "'true'", "FALSE": "'false'",
}

#: Typical mistakes -> friendly messages, matched by parser state with lark's match_examples.
#: Each example is a whole file that fails at the mistake.
ERROR_EXAMPLES: dict[str, list[str]] = {
    "activation parameters come after ';' (write `activation name(gate, up; limit: float = 7.0)`)": [
        "activation a(x, limit: float = 1.0) { forward = x }",
        "activation a(x, y, limit: float) { forward = x }",
    ],
    "missing '=' after 'forward'": [
        "activation a(x) { forward x }",
        "activation a(x) { forward(x) }",
    ],
    "missing '=' after the let name": [
        "activation a(x) { let y x }",
        "activation a(x) { let y }",
    ],
    "an activation body holds only `let NAME = ...`, `forward = ...` and `grad(ARG) = ...` statements": [
        "activation a(x) { y = x }",
        "activation a(x) { forward = x y = x }",
        "activation a(x) { return x }",
    ],
    "an expression is missing (or is incomplete) here": [
        "activation a(x) { forward = }",
        "activation a(x) { forward = x * }",
        "activation a(x) { forward = x + }",
        "activation a(x) { forward = (x }",
        "activation a(x) { let y = }",
        "activation a(x) { forward = f(x, ) }",
    ],
    "comparisons do not chain: write `a < b and b < c`": [
        "fusion f { chain { g: GroupLinear where 1 < in_features < 9 } }",
        "activation a(x) { forward = where(0 < x < 1, x, 0) }",
    ],
    "'=' assigns; compare with '=='": [
        "fusion f { chain { g: GroupLinear where bias = true } }",
        "fusion f { chain { g: GroupLinear where in_features % 8 = 0 } }",
    ],
    "a chain element is `label: OpName | OpName [?] [where predicate]`": [
        "fusion f { chain { GroupLinear } }",
        "fusion f { chain { g GroupLinear } }",
        "fusion f { chain { g: } }",
        "fusion f { chain { g: GroupLinear | } }",
    ],
    "a fusion field is `name = value, ...`, `arch >= sm_90` or `chain { ... }`": [
        "fusion f { kernel grouped_gemm }",
        "fusion f { kernel: grouped_gemm }",
        "fusion f { = grouped_gemm }",
    ],
    "a declaration starts with `activation NAME(...)` or `fusion NAME {`": [
        "forward = x",
        "activations a(x) { forward = x }",
        "activation a(x) { forward = x } }",
    ],
    "missing '{' after the declaration header": [
        "activation a(x) forward = x }",
        "fusion f kernel = k }",
    ],
    "a '}' is missing (end of file inside a declaration)": [
        "activation a(x) { forward = x",
        "fusion f { kernel = k",
        "fusion f { chain { g: GroupLinear }",
    ],
}


#: Words that were once part of the language: a syntax error right after one says so, and what to do.
RETIRED_WORDS = {
    "option": "`option NAME = value` is not part of the language (it configured nothing in any kernel "
              "template): remove the line",
}


def _friendly_expected(names) -> str:
    shown = sorted({_TERMINALS.get(n, f"'{n}'" if not n.isupper() else n.lower()) for n in names})
    return ", ".join(shown)


def syntax_error(e: UnexpectedInput, text: str, filename: str, parse) -> PatternError:
    """lark's exception `e` on `text` as a PatternError: where, what was found, what a typical mistake there
    means (ERROR_EXAMPLES, matched by re-parsing them with `parse`), and what was expected."""
    label = None
    if not isinstance(e, UnexpectedCharacters):  # a bad character is its own explanation
        try:
            label = e.match_examples(parse, ERROR_EXAMPLES, use_accepts=True)
        except Exception:  # pragma: no cover - match_examples is best effort
            label = None
    if isinstance(e, UnexpectedCharacters):
        got = f"unexpected character {text[e.pos_in_stream]!r}" if e.pos_in_stream < len(text) else "unexpected input"
        expected = _friendly_expected(e.allowed or ())
    elif isinstance(e, UnexpectedEOF):
        got = "unexpected end of file"
        expected = _friendly_expected(e.expected or ())
    else:
        tok = e.token
        got = "unexpected end of file" if tok.type == "$END" else f"unexpected {tok.value!r}"
        expected = _friendly_expected(getattr(e, "accepts", None) or e.expected or ())
    line, column = e.line, e.column
    at_end = isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END")
    if at_end or line is None or line < 1:  # end of file: point just after the last character
        lines = text.rstrip().splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
    retired = _retired_word(text, line, column) if isinstance(e, UnexpectedToken) and not at_end else None
    label = retired or label
    message = got if label is None else f"{got}: {label}"
    err = PatternError(format_message(filename, text, line, column, message, expected))
    err.file, err.line, err.column, err.reason, err.expected = filename, line, column, message, expected
    return err


def _retired_word(text: str, line: int, column: int) -> str | None:
    """The explanation of the retired word right before (line, column), or None when the word there is not one."""
    lines = text.splitlines()
    before = lines[line - 1][:column - 1].split() if 1 <= line <= len(lines) else []
    return RETIRED_WORDS.get(before[-1]) if before else None
