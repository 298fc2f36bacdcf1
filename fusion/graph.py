"""The op graph of a block: a networkx DiGraph the matcher walks.

Nodes (keys are tuples so they never collide):
  ("op", i)    one per op; attrs: type="op", index=i, spec (OpSpec), op (the module, or None for graphs built
               from specs), label (describe()), in_features, out_features (None where unknown).
  ("in", name) one per block input: "x" (the data input) and every extra input (group_sizes, scale, ...);
               attrs: type="input", name. An extra input read by several ops is one node with several edges.
  ("out", k)   one per block output; attrs: type="output", index=k.
Edges carry `operand`: 0 for the data input of an op (or of an output), the extra input's name otherwise.

A Sequential is a chain (x -> op 0 -> op 1 -> ... -> out), but nothing here or in the matcher assumes it:
tests build small DAGs (an op whose result has two consumers) with `add_op`/`add_input`/`add_output`/
`connect`.
"""
from __future__ import annotations

from typing import Any, Iterable

import networkx as nx

from fusion.shapes import feature_chain


def op_node(i: int) -> tuple:
    return ("op", i)


def input_node(name: str) -> tuple:
    return ("in", name)


def output_node(k: int = 0) -> tuple:
    return ("out", k)


def describe_spec(spec) -> str:
    """`Name(attr=value, ...)` for a spec without an op module (mirrors Op.describe)."""
    shown = ", ".join(f"{k}={v}" for k, v in spec.attrs.items() if k != "gated")
    return f"{spec.name}({shown})"


def add_op(g: nx.DiGraph, index: int, spec, op: Any = None, in_features: int | None = None,
           out_features: int | None = None) -> tuple:
    node = op_node(index)
    label = op.describe() if op is not None else describe_spec(spec)
    g.add_node(node, type="op", index=index, spec=spec, op=op, label=label, in_features=in_features,
               out_features=out_features)
    return node


def add_input(g: nx.DiGraph, name: str) -> tuple:
    node = input_node(name)
    g.add_node(node, type="input", name=name)
    return node


def add_output(g: nx.DiGraph, k: int = 0) -> tuple:
    node = output_node(k)
    g.add_node(node, type="output", index=k)
    return node


def connect(g: nx.DiGraph, src: tuple, dst: tuple, operand: int | str = 0) -> None:
    g.add_edge(src, dst, operand=operand)


def build_graph(seq_or_ops: Iterable, features: list | None = None) -> nx.DiGraph:
    """The graph of a Sequential (or of a list of ops): x -> op 0 -> ... -> out, plus extra-input edges."""
    ops = list(seq_or_ops.ops if hasattr(seq_or_ops, "ops") else seq_or_ops)
    if features is None:
        features = getattr(seq_or_ops, "features", None)
    if features is None:
        features = feature_chain(ops)
    g = nx.DiGraph()
    g.graph["features"] = list(features)
    prev = add_input(g, "x")
    for i, op in enumerate(ops):
        spec = op.spec
        node = add_op(g, i, spec, op, in_features=features[i], out_features=features[i + 1])
        connect(g, prev, node, 0)
        for name in spec.extra_inputs:
            src = input_node(name)
            if src not in g:
                add_input(g, name)
            connect(g, src, node, name)
        prev = node
    connect(g, prev, add_output(g, 0), 0)
    return g


# -- queries the matcher and explain() use ---------------------------------------------------------------
def op_nodes(g: nx.DiGraph) -> list[tuple]:
    """Op nodes in index order (deterministic)."""
    return sorted((n for n, d in g.nodes(data=True) if d.get("type") == "op"), key=lambda n: g.nodes[n]["index"])


def data_successors(g: nx.DiGraph, node: tuple) -> list[tuple]:
    """Ops that read `node`'s result as their data input (operand 0), in index order."""
    out = [s for s in g.successors(node)
           if g.nodes[s].get("type") == "op" and g.edges[node, s].get("operand") == 0]
    return sorted(out, key=lambda n: g.nodes[n]["index"])


def consumers(g: nx.DiGraph, node: tuple) -> list[tuple]:
    """Every node that uses `node`'s result (ops through any operand, and block outputs), sorted."""
    return sorted(g.successors(node), key=_node_sort_key)


def _node_sort_key(n: tuple):
    return (0 if n[0] == "op" else 1, n[1] if isinstance(n[1], int) else 0, str(n[1]))


def node_text(g: nx.DiGraph, node: tuple) -> str:
    """How a node is named in messages: `op 3 Clamp(min=-1.0, max=1.0)` (just `op 0 GroupLinear` where the
    description is long: explain() prints it in full elsewhere), `the block output`, `input x`."""
    d = g.nodes[node]
    if d["type"] == "op":
        label = d["label"] if len(d["label"]) <= 32 else d["spec"].name
        return f"op {d['index']} {label}"
    if d["type"] == "output":
        return "the block output" if d["index"] == 0 else f"block output {d['index']}"
    return f"input {d['name']}"
