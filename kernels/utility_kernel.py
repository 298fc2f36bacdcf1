"""Compile-once for the small utility kernels (the bounds prologue, the MoE combine).

They hold no tile configuration and compile in a second or two, so they are compiled once per process and
kept in memory, not in the disk cache of the grouped GEMMs. Each launches through TVM-FFI with plain integer
arguments (pointers as ints, torch's stream as an int), like the GEMMs.
"""
from __future__ import annotations

import threading
from typing import Callable

_CACHE: dict = {}
_LOCK = threading.Lock()


class UtilityKernel:
    """A compiled utility kernel: `launch(...)` with the integer arguments its module documents."""

    def __init__(self, fn):
        self.launch = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else fn


def compile_once(key: tuple, compile_fn: Callable[[], object]) -> UtilityKernel:
    """The kernel for `key` (include the module's name), compiling it with `compile_fn()` the first time."""
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    kernel = UtilityKernel(compile_fn())
    with _LOCK:
        return _CACHE.setdefault(key, kernel)
