"""The shape rule of a chain of ops: the features entering each op, checked op by op.

Low in the layers: the graph, the planner, the input checks and Sequential all use it.
"""
from __future__ import annotations

from fusion.errors import ShapeError


def _fixed_in_features(op) -> int | None:
    """The input features an op pins (GEMMs, biases), or None when it takes any width."""
    for attr in ("in_features", "features"):
        if attr in op.spec.attrs and op.spec.attrs[attr] is not None:
            return int(op.spec.attrs[attr])
    return None


def feature_chain(ops: list, in_features: int | None = None) -> list[int | None]:
    """Features entering each op and leaving the last: [in_0, in_1, ..., out]; raises ShapeError naming
    both ops and both shapes at the first mismatch."""
    feats = [in_features]
    feat = in_features
    for i, op in enumerate(ops):
        if feat is None:
            feat = _fixed_in_features(op)
            feats[-1] = feat
        if feat is not None:
            try:
                op.check_input(feat)
            except ShapeError as err:
                if i == 0:
                    raise ShapeError(f"input x has shape (M, {feat}) but op 0 {err}") from None
                raise ShapeError(f"shape mismatch: op {i - 1} {ops[i - 1].describe()} outputs (M, {feat}), "
                                 f"but op {i} {err}") from None
            feat = op.output_features(feat)
        feats.append(feat)
    return feats
