"""Generated epilogue sources on disk, keyed by a hash of what determines the compiled code.

Key = sha256(source, DSL version, target arch, options). The source is written once to the cache folder
(FUSION_CACHE_DIR, default ~/.cache/fusion) and imported from there, so a traceback through generated code
points at a real file a user can read, and regenerating the same plan yields the same key.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

_LOADED: dict[str, type] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    root = Path(os.environ.get("FUSION_CACHE_DIR") or Path.home() / ".cache" / "fusion")
    root.mkdir(parents=True, exist_ok=True)
    return root


def dsl_version() -> str:
    """The versions a compiled kernel depends on: the DSL's and TVM-FFI's (the launch ABI)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for package in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            parts.append(version(package))
        except PackageNotFoundError:  # pragma: no cover - both are dependencies
            parts.append("unknown")
    return "+".join(parts)


def source_key(source: str, target: str = "sm_90a", options: tuple = ()) -> str:
    h = hashlib.sha256()
    for part in (source, dsl_version(), target, repr(options)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def load_generated(source: str, class_name: str, key: str) -> type:
    """Write `source` to the cache (once) and import `class_name` from it (once per process)."""
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        path = cache_dir() / "epilogues" / f"epi_{key}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            tmp.replace(path)
        module_name = f"fusion_generated_epi_{key}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        cls = getattr(module, class_name)
        _LOADED[key] = cls
        return cls
