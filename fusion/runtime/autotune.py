"""Autotune mode: time a few tile configurations of a fused kernel on the real inputs, keep the fastest.

Off by default (the tile policy, fusion/kernels/tile_policy.py, decides). With `FUSION_AUTOTUNE=1` the first
launch of each fused kernel (per epilogue, dtype, weight shape and GPU model) compiles and times the tile
policy's `candidates` and records the winner in `$FUSION_CACHE_DIR/autotune.json`; later launches, in this
process or another, read the choice from there. Kernels never depend on the row count, so the choice is made once, on the first batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from typing import Callable

from fusion.codegen.cache import cache_dir
from fusion.kernels.tile_policy import GemmConfig, candidates

log = logging.getLogger("fusion.autotune")
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("FUSION_AUTOTUNE") == "1"


def _table_path():
    return cache_dir() / "autotune.json"


def _load() -> dict:
    try:
        return json.loads(_table_path().read_text())
    except (OSError, ValueError):
        return {}


def tuning_key(job, device_name: str) -> str:
    """Identity of a tuning problem: the job without its configuration, on one GPU model."""
    h = hashlib.sha256(json.dumps([job.source, job.dtype, job.N, job.K, job.G, job.target, device_name]).encode())
    return h.hexdigest()[:24]


def recorded(job, device_name: str):
    """The configuration recorded for `job` on this GPU model, or None."""
    entry = _load().get(tuning_key(job, device_name))
    return GemmConfig(**entry["config"]) if entry else None


def tune(job, device_name: str, time_config: Callable[[object], float]):
    """Time every candidate with `time_config(config) -> seconds` (a failing one is skipped, and logged), record
    the fastest and return it."""
    base = GemmConfig(*job.config)
    results = []
    for cfg in candidates(base, job.N):
        try:
            results.append((time_config(cfg), cfg))
        except Exception as err:  # noqa: BLE001 - a configuration the template rejects is just not a candidate
            log.info("fusion autotune: %s skipped (%s)", cfg, err)
    if not results:
        return base
    best_time, best = min(results, key=lambda r: r[0])
    with _LOCK:
        table = _load()
        table[tuning_key(job, device_name)] = {
            "config": dataclasses.asdict(best), "seconds": best_time, "kernel": job.name,
            "tried": [[dataclasses.asdict(c), t] for t, c in results]}
        tmp = _table_path().with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(_table_path())
    log.info("fusion autotune: %s -> %s (%.3f ms)", job.name, best, best_time * 1e3)
    return best
