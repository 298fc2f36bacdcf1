"""A parsed .fpat file -> its activation definitions and fusion patterns, with names global across files.

    load_ast(pf, known_activations, known_patterns, builtin=False) -> (list[ActivationDef], list[FusionPattern])

`known_*` are what is already registered (name -> definition/pattern): activations may call activations
declared earlier (in this file or a file loaded before); a name declared twice is an error. This module is
only the file level; what one declaration means is checked in activation_semantics.py (activations) and
fusion_semantics.py (fusion patterns), each error at its source location.
"""
from __future__ import annotations

from pathlib import Path

from fusion.patterns import ast as A
from fusion.patterns.activation import ActivationDef
from fusion.patterns.activation_semantics import activation_def
from fusion.patterns.diagnostics import SourceContext
from fusion.patterns.files import BUILTIN_DIR
from fusion.patterns.fusion_semantics import fusion_pattern


def load_ast(pf: A.PatternFile, known_activations: dict | None = None, known_patterns: dict | None = None,
             builtin: bool = False) -> tuple[list[ActivationDef], list[A.FusionPattern]]:
    ctx = SourceContext(pf)
    acts = dict(known_activations or {})
    pats = dict(known_patterns or {})
    new_acts: list[ActivationDef] = []
    new_pats: list[A.FusionPattern] = []
    for decl in pf.decls:
        name_loc = decl.name_loc or decl.loc
        if isinstance(decl, A.ActivationDecl):
            if decl.name in acts:
                raise ctx.error(name_loc, _redefined("activation", decl.name, acts[decl.name].loc,
                                                     is_builtin_file(acts[decl.name].loc.file)))
            d = activation_def(decl, ctx, acts, builtin)
            acts[d.name] = d
            new_acts.append(d)
        else:
            if decl.name in pats:
                p = pats[decl.name]
                raise ctx.error(name_loc, _redefined("fusion pattern", decl.name, p.loc,
                                                     is_builtin_file(p.loc.file)))
            p = fusion_pattern(decl, ctx)
            pats[p.name] = p
            new_pats.append(p)
    return new_acts, new_pats


def is_builtin_file(path: str) -> bool:
    try:
        return Path(path).resolve().parent == BUILTIN_DIR
    except (OSError, ValueError):  # pragma: no cover
        return False


def _redefined(what: str, name: str, loc: A.SourceLoc, builtin: bool) -> str:
    origin = "a built-in, " if builtin else ""
    return (f"{what} '{name}' is already defined ({origin}at {loc.file}:{loc.line}:{loc.column}); "
            f"names are global across loaded files: pick another name")
