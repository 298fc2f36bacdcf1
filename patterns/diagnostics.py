"""PatternError construction: file:line:col, the offending line with a caret, and what was expected.

    my_acts.fpat:3:22: unknown function 'tahn'
        forward = gate * tahn(softplus(gate)) * up
                         ^
    expected: a function (did you mean 'tanh'?) ...
"""
from __future__ import annotations

import difflib

from fusion.errors import PatternError
from fusion.patterns.ast import SourceLoc


def source_line(source: str, line: int) -> str:
    lines = source.splitlines()
    return lines[line - 1] if 1 <= line <= len(lines) else ""


def caret_line(text: str, column: int) -> str:
    prefix = text[: max(column - 1, 0)]
    return "".join(c if c == "\t" else " " for c in prefix) + "^"


def format_message(file: str, source: str, line: int, column: int, message: str,
                   expected: str | None = None) -> str:
    text = source_line(source, line)
    parts = [f"{file}:{line}:{column}: {message}", f"    {text}", f"    {caret_line(text, column)}"]
    if expected:
        parts.append(f"expected: {expected}")
    return "\n".join(parts)


def make_error(loc: SourceLoc, source: str, message: str, expected: str | None = None) -> PatternError:
    err = PatternError(format_message(loc.file, source, loc.line, loc.column, message, expected))
    err.file, err.line, err.column = loc.file, loc.line, loc.column
    err.reason, err.expected = message, expected
    return err


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class SourceContext:
    """The file being loaded, so a semantic check can raise a PatternError pointing into its source."""

    def __init__(self, pf):
        self.pf = pf

    def error(self, loc: SourceLoc, message: str, expected: str | None = None) -> PatternError:
        return make_error(loc, self.pf.source, message, expected)
