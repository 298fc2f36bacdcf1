"""Generated epilogue sources on disk, keyed by a hash of what determines the compiled code.

Key = sha256(source, DSL version, target arch, options). The source is written once to the cache folder
(FUSION_CACHE_DIR, default ~/.cache/fusion) and imported from there, so a traceback through generated code
points at a real file a user can read, and regenerating the same plan yields the same key.

Compiled kernels are cache *entries*: a folder of files plus a meta.json that records each file's size and
sha256. An entry is written in a temporary folder and moved into place with one rename, so a reader never
sees half an entry; a reader checks every file against meta.json, so a truncated, emptied or missing file (a
full disk, an interrupted copy, a hand edit) is reported as `BadEntry` and rebuilt, never served.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Callable

from fusion.errors import CacheDirError

_LOADED: dict[str, type] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """The cache root (FUSION_CACHE_DIR, default ~/.cache/fusion), created if missing; CacheDirError if it
    cannot be."""
    root = Path(os.environ.get("FUSION_CACHE_DIR") or Path.home() / ".cache" / "fusion")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise unusable_dir(root, err) from None
    return root


def writable_cache_dir() -> Path:
    """cache_dir(), checked by writing a probe file in it: CacheDirError now, before any compile work."""
    root = cache_dir()
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise unusable_dir(root, err) from None
    return root


def unusable_dir(folder: Path, err: OSError) -> CacheDirError:
    """The error for a cache folder that cannot be created or written (read-only, a file in the way, full)."""
    why = err.strerror or type(err).__name__
    return CacheDirError(f"the fusion kernel cache folder {str(folder)!r} cannot be written ({why}): make it "
                         f"writable, or set FUSION_CACHE_DIR to a writable folder")


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


@functools.lru_cache(maxsize=None)
def template_version() -> str:
    """A hash of the kernel template's source (fusion.kernels): a compiled kernel depends on it as much as on
    its generated epilogue, so editing the template must not serve kernels compiled from the old one."""
    spec = importlib.util.find_spec("fusion.kernels")  # its folder, without importing it (and cutlass)
    h = hashlib.sha256()
    for path in sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


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
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_bytes() != source.encode():
                tmp = path.with_suffix(f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_text(source)
                tmp.replace(path)
        except OSError as err:
            raise unusable_dir(path.parent, err) from None
        module_name = f"fusion_generated_epi_{key}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        cls = getattr(module, class_name)
        _LOADED[key] = cls
        return cls


# -- entries: a folder of files whose sizes and hashes meta.json records ----------------------------------------
class BadEntry(Exception):
    """A cache entry that fails validation; str() says what is wrong with it."""


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_entry(folder: Path, files: tuple[str, ...], keys: tuple[str, ...] = ()) -> tuple[dict, dict] | None:
    """(meta, {file name: bytes}) of the entry in `folder`; None if there is none; BadEntry if meta.json is
    unreadable, lacks one of `keys`, or one of `files` is missing, empty, or differs from its recorded size or
    sha256."""
    if not folder.is_dir():
        return None
    try:
        meta = json.loads((folder / "meta.json").read_bytes())
    except FileNotFoundError:
        raise BadEntry("meta.json is missing") from None
    except (OSError, ValueError) as err:
        raise BadEntry(f"meta.json is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise BadEntry("meta.json has no file list (an older cache format, or a damaged file)")
    missing = [k for k in keys if k not in meta]
    if missing:
        raise BadEntry(f"meta.json lacks {', '.join(missing)}")
    data = {}
    for name in files:
        recorded = meta["files"].get(name)
        try:
            content = (folder / name).read_bytes()
        except OSError as err:
            raise BadEntry(f"{name} cannot be read ({err.strerror or type(err).__name__})") from None
        if not content:
            raise BadEntry(f"{name} is empty")
        if recorded != _digest(content):
            raise BadEntry(f"{name} ({len(content)} B) does not match the size and sha256 meta.json records")
        data[name] = content
    return meta, data


def discard_entry(folder: Path) -> None:
    """Remove an entry (a bad one, before it is rebuilt): renamed aside first, so a reader never sees a part."""
    aside = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.old")
    try:
        os.replace(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def write_entry(folder: Path, fill: Callable[[Path], None], meta: dict, files: tuple[str, ...]) -> None:
    """Write an entry atomically: `fill(tmp)` writes `files` into a temporary folder next to `folder`, meta.json
    records their sizes and hashes, then one rename moves the folder into place. A valid entry another
    process installed meanwhile is kept (it is the same kernel); a bad one is replaced."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as err:
        raise unusable_dir(folder.parent, err) from None
    try:
        fill(tmp)
        digests = {name: _digest((tmp / name).read_bytes()) for name in files}
        (tmp / "meta.json").write_text(json.dumps(meta | {"files": digests}, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            try:
                read_entry(folder, files)
                return  # another process installed the same kernel first
            except BadEntry:
                discard_entry(folder)
            os.replace(tmp, folder)
    except OSError as err:
        raise unusable_dir(folder.parent, err) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
