"""The global registry: activations by name, and the fusion-pattern library.

    register_activation(defn, replace=False)
    get_activation(name) -> ActivationDef          (KeyError listing the known names)
    activations() -> dict[str, ActivationDef]      (load order)
    fusion_patterns() -> list[FusionPattern]       (built-ins first, then user files in load order)
    load_patterns(path_or_folder) -> list[str]     (the files loaded; a folder: its *.fpat, sorted)
    loaded_files() -> list[str]
    reset_to_builtins(read_env=False)

At first use the built-in .fpat files of this package are loaded (through exactly the code user files go
through), then every path of the environment variable FUSION_PATTERNS (path1:path2, os.pathsep-separated).
A load is atomic: a file (or folder) with a mistake leaves the registry as it was. Loading a file again
replaces that file's own declarations (handy while editing one); any other clash of names is an error.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from fusion.errors import FusionError, PatternError
from fusion.patterns.activation import ActivationDef
from fusion.patterns.ast import FusionPattern
from fusion.patterns.files import BUILTIN_DIR
from fusion.patterns.loader import load_ast
from fusion.patterns.parser import parse_file

ENV_VAR = "FUSION_PATTERNS"


class UnknownActivationError(FusionError, KeyError):
    """Activation(name) or get_activation(name) for a name no loaded .fpat file declares. A FusionError, and a
    KeyError as a failed registry lookup always was."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _State:
    def __init__(self):
        self.activations: dict[str, ActivationDef] = {}
        self.patterns: list[FusionPattern] = []
        self.files: list[str] = []  # resolved paths, load order

    def copy(self) -> "_State":
        s = _State()
        s.activations = dict(self.activations)
        s.patterns = list(self.patterns)
        s.files = list(self.files)
        return s


_lock = threading.RLock()
_state: _State | None = None


def builtin_files() -> list[Path]:
    return sorted(BUILTIN_DIR.glob("*.fpat"))


def _files_of(path) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.glob("*.fpat") if f.is_file())
        if not files:
            raise PatternError(f"{p}: the folder has no .fpat files")
        return files
    if not p.exists():
        raise PatternError(f"{p}: no such pattern file or folder")
    return [p]


def _load_into(state: _State, files: list[Path]) -> None:
    for f in files:
        resolved = str(f.resolve())
        builtin = f.resolve().parent == BUILTIN_DIR
        if resolved in state.files:  # reload: drop this file's own declarations first
            state.activations = {k: v for k, v in state.activations.items()
                                 if str(Path(v.loc.file).resolve()) != resolved}
            state.patterns = [p for p in state.patterns if str(Path(p.loc.file).resolve()) != resolved]
            state.files.remove(resolved)
        pf = parse_file(f)
        acts, pats = load_ast(pf, state.activations, {p.name: p for p in state.patterns}, builtin=builtin)
        for a in acts:
            state.activations[a.name] = a
        state.patterns.extend(pats)
        state.files.append(resolved)


def _env_paths() -> list[str]:
    return [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip()]


def _init(read_env: bool) -> _State:
    state = _State()
    _load_into(state, builtin_files())
    if read_env:
        for p in _env_paths():
            try:
                _load_into(state, _files_of(p))
            except PatternError as e:
                raise PatternError(f"while loading {ENV_VAR}={os.environ.get(ENV_VAR)!r}:\n{e}") from None
    return state


def _current() -> _State:
    global _state
    with _lock:
        if _state is None:
            _state = _init(read_env=True)
        return _state


def load_patterns(path) -> list[str]:
    """Load a .fpat file or every .fpat file of a folder. Returns the files loaded (resolved paths)."""
    global _state
    with _lock:
        files = _files_of(path)
        new = _current().copy()
        _load_into(new, files)
        _state = new
        return [str(f.resolve()) for f in files]


def register_activation(defn: ActivationDef, replace: bool = False) -> None:
    """Add an ActivationDef built in Python (tests, tools). Pattern files are the usual way."""
    global _state
    with _lock:
        state = _current()
        if defn.name in state.activations and not replace:
            old = state.activations[defn.name]
            raise PatternError(f"activation '{defn.name}' is already defined at {old.loc}; pass replace=True "
                               f"to replace it")
        new = state.copy()
        new.activations[defn.name] = defn
        _state = new


def get_activation(name: str) -> ActivationDef:
    state = _current()
    try:
        return state.activations[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(state.activations), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownActivationError(
            f"unknown activation {name!r}{hint}; known: {', '.join(state.activations)}. Declare it in a .fpat "
            f"file and load it with fusion.load_patterns(path)") from None


def activations() -> dict[str, ActivationDef]:
    return dict(_current().activations)


def fusion_patterns() -> list[FusionPattern]:
    return list(_current().patterns)


def loaded_files() -> list[str]:
    return list(_current().files)


def reset_to_builtins(read_env: bool = False) -> None:
    """Forget user files: only the built-ins (and FUSION_PATTERNS when read_env) stay loaded."""
    global _state
    with _lock:
        _state = _init(read_env=read_env)


def library() -> object:
    """The current library as one object (activations and patterns): a load replaces it, so callers that
    cached something made with it compare identities to know it is still current."""
    return _current()
