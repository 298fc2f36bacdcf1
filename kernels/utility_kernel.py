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
    """A compiled utility kernel: `launch(...)` with the integer arguments its module documents; `ctas_per_sm`: the
    launch bound it was built for (what a persistent kernel's grid is sized by)."""

    def __init__(self, fn, ctas_per_sm: int = 1):
        self.launch = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else fn
        self.ctas_per_sm = ctas_per_sm


def compile_once(key: tuple, compile_fn: Callable[[], object]) -> UtilityKernel:
    """The kernel for `key` (include the module's name), compiling it with `compile_fn()` the first time (a
    compiled function, or a UtilityKernel)."""
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    built = compile_fn()
    kernel = built if isinstance(built, UtilityKernel) else UtilityKernel(built)
    with _LOCK:
        return _CACHE.setdefault(key, kernel)
