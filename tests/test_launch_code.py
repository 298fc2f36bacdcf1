"""fusion/runtime/launch_code.py: the generated straight-line functions the replays run (no GPU)."""
import torch

import test_backward_replay as stand_in   # (tests/ is on sys.path, as for test_backward_replay_gpu's import)
from fusion.runtime.launch_code import LaunchCode


def test_literals_are_written_and_objects_bound_once():
    code = LaunchCode("f", "a")
    marker = object()
    assert code.const(3) == "3" and code.const("name") == "'name'" and code.const(None) == "None"
    assert code.const((4, 5)) == "(4, 5)"
    first, again = code.const(marker, "m"), code.const(marker, "m")
    assert first == again and code.namespace[first] is marker and len(code.namespace) == 1
    shape_of_objects = (marker,)
    assert code.namespace[code.const(shape_of_objects)] is shape_of_objects   # a tuple holding an object: bound


def test_the_function_runs_its_guards_and_lines():
    code = LaunchCode("f", "a, b")
    seen = []
    code.guard("a < 0")
    code.line(f"{code.const(seen.append, 'append')}(a + b)")
    code.line("return a * b")
    fn = code.compile()
    assert fn(-1, 2) is None and seen == []
    assert fn(3, 4) == 12 and seen == [7]
    assert fn.__fusion_source__.startswith("def f(a, b):")


def test_a_backward_replay_is_straight_line(monkeypatch):
    """The generated backward has no loop: each launch is one call with its arguments written out."""
    s = stand_in._setup(monkeypatch)
    source = s.replay._run.__fusion_source__
    assert " for " not in source and "while" not in source
    launches = [line for line in source.splitlines() if line.strip().startswith("_launch") and "count" not in line]
    assert len(launches) == 5
    dy, pre, x = stand_in._call_inputs()
    dx, grads, extra = s.replay([dy], [pre, x], s.ctx())
    assert [label for label, _ in s.log] == ["B1", "rows", "B2", "B3", "B4"]
    assert isinstance(dx, torch.Tensor) and len(grads) == 2 and len(extra) == 1
