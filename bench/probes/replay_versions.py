"""An A/B switch for bench/ab_switch.py between this tree's replays (fusion/runtime/replay.py and backward_replay.py,
run as generated functions) and the replays of an earlier commit (interpretive: each launch's arguments resolved per
call), in one process:

    git show 6169ee5:fusion/runtime/replay.py > .kc/old/replay.py
    git show 6169ee5:fusion/runtime/backward_replay.py > .kc/old/backward_replay.py
    FUSION_OLD_REPLAY_DIR=.kc/old python bench/ab_switch.py --switch probes.replay_versions:GENERATED \
        --models small-batch --rounds 5

Setting GENERATED installs that version's ForwardReplay and BackwardReplay classes in the runtime's modules (their
`build` functions construct whichever is installed) and empties every block's replay caches, so the next call at
each shape builds a replay of the installed version (the measurement's warm-up calls do).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

GENERATED = True
_CLASSES: dict = {}


def _old_module(name: str):
    folder = Path(os.environ.get("FUSION_OLD_REPLAY_DIR", Path(__file__).resolve().parents[2] / ".kc" / "old"))
    spec = importlib.util.spec_from_file_location(f"fusion.runtime._old_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install(generated: bool) -> None:
    from fusion.runtime import _RUNNERS
    from fusion.runtime import backward_replay, replay

    if not _CLASSES:
        _CLASSES[True] = (replay.ForwardReplay, backward_replay.BackwardReplay)
        _CLASSES[False] = (_old_module("replay").ForwardReplay, _old_module("backward_replay").BackwardReplay)
    replay.ForwardReplay, backward_replay.BackwardReplay = _CLASSES[bool(generated)]
    for runners in list(_RUNNERS.values()):
        for runner in runners.values():
            for cache in (runner.replays, runner.train_replays, runner.backward_replays):
                if cache is not None:
                    cache.clear()


class _Switch(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "GENERATED":
            _install(value)


sys.modules[__name__].__class__ = _Switch
