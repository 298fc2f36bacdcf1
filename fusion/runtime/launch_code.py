"""Straight-line Python for a replay: the guards, allocations, launches and drops of one call shape as one generated
function, instead of a loop that interprets each launch's argument sources per call.

A replay (fusion/runtime/backward_replay.py) knows at build time every launch it will make and where each of its
pointers comes from. Interpreting that per call (a list of slots, a comprehension per launch resolving each source,
a loop per step) cost about as much host time as the launches and allocations themselves on the CPU stand-ins
(tests/test_backward_replay.py): in a host-bound training step the GPU waits for it. The generated function holds
each pointer in a local variable and passes each launch its arguments as written expressions, so a call runs only
the comparisons, allocations and launches it must.

The function is compiled from source with `exec` over a namespace of the objects it reads (launch callables, shapes,
dtypes, the op parameter dictionaries the weights are read from per call), each bound to a generated name; nothing
in the source comes from user input (names are made here, values are only referenced).
"""
from __future__ import annotations

import itertools

#: Literal constants written into the source as is; anything else is bound in the namespace under a generated name.
_LITERALS = (int, float, bool, str, type(None))


def read_switches(sources) -> tuple:
    """The values of `sources`, (module, attribute) pairs: the module switches a replay holds for, read as its
    generated guard reads them (:meth:`LaunchCode.switches`), to compare against the values it was built at."""
    return tuple(getattr(module, name) for module, name in sources)


class LaunchCode:
    """Source lines being built for one generated function, and the objects its names refer to."""

    _ids = itertools.count()

    def __init__(self, name: str, params: str):
        self.name = name
        self.lines = [f"def {name}({params}):"]
        self.namespace: dict = {}
        self._bound: dict = {}   # id(obj) -> name (one name per object)
        self.indent = 1

    def const(self, obj, hint: str = "k") -> str:
        """An expression for `obj`: its literal where it has one (ints, strings, None, tuples of those), else a name
        bound to it in the namespace (so the source never spells an object's repr)."""
        if type(obj) in _LITERALS:
            return repr(obj)
        if type(obj) is tuple and all(type(o) in _LITERALS for o in obj):
            return repr(obj)
        name = self._bound.get(id(obj))
        if name is None:
            name = self._bound[id(obj)] = f"_{hint}{len(self._bound)}"
            self.namespace[name] = obj
        return name

    def switches(self, sources) -> str:
        """A tuple expression reading each (module, attribute) of `sources` per call: the module switches a replay
        holds for, read in the guard itself (a function call assembling them cost a few microseconds per call on a
        slow host; bench/probes/replay_lines.py)."""
        return "(" + "".join(f"{self.const(module, 'mod')}.{name}, " for module, name in sources) + ")"

    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def guard(self, failed: str) -> None:
        """`return None` where the expression `failed` is true (a guard: the caller runs the interpretive path)."""
        self.line(f"if {failed}:")
        self.line("    return None")

    def compile(self):
        """The function (its source kept as `__fusion_source__`, for tests and debugging)."""
        source = "\n".join(self.lines) + "\n"
        namespace = dict(self.namespace)
        exec(compile(source, f"<fusion launch code {self.name} #{next(self._ids)}>", "exec"), namespace)
        fn = namespace[self.name]
        fn.__fusion_source__ = source
        return fn
