import networkx as nx

from fusion import Clamp, GroupLinear, Scale, SwiGLU
from fusion.graph import (add_input, add_op, add_output, build_graph, connect, consumers, data_successors,
                          input_node, node_text, op_node, op_nodes, output_node)
from test_matcher_support import demo_block


def test_demo_block_graph():
    seq = demo_block()
    g = build_graph(seq)
    assert isinstance(g, nx.DiGraph)
    assert op_nodes(g) == [op_node(i) for i in range(5)]
    # x -> op0 -> ... -> op4 -> out along operand-0 edges
    path = [input_node("x")] + [op_node(i) for i in range(5)] + [output_node(0)]
    for u, v in zip(path, path[1:]):
        assert g.edges[u, v]["operand"] == 0
    # one group_sizes node read by both GEMMs; scale read by Scale
    assert sorted(g.successors(input_node("group_sizes"))) == [op_node(0), op_node(4)]
    assert g.edges[input_node("group_sizes"), op_node(4)]["operand"] == "group_sizes"
    assert list(g.successors(input_node("scale"))) == [op_node(2)]
    n0 = g.nodes[op_node(0)]
    assert n0["index"] == 0 and n0["spec"].name == "GroupLinear" and n0["op"] is seq[0]
    assert (n0["in_features"], n0["out_features"]) == (1024, 4096)
    assert g.nodes[op_node(1)]["out_features"] == 2048
    assert g.graph["features"] == [1024, 4096, 2048, 2048, 2048, 1024]


def test_node_queries():
    g = build_graph(demo_block())
    assert data_successors(g, op_node(1)) == [op_node(2)]
    assert data_successors(g, op_node(4)) == []  # the output is not an op
    assert consumers(g, op_node(4)) == [output_node(0)]
    assert node_text(g, op_node(1)) == "op 1 SwiGLU()"
    assert node_text(g, op_node(0)) == "op 0 GroupLinear"  # long descriptions shortened to the name
    assert node_text(g, output_node(0)) == "the block output"


def test_build_from_op_list_and_scale_name():
    ops = [GroupLinear(2, 64, 128, device="meta"), SwiGLU(), Scale(name="probs"), Clamp(max=1.0)]
    g = build_graph(ops)
    assert input_node("probs") in g and input_node("scale") not in g
    assert g.nodes[op_node(3)]["label"] == "Clamp(min=None, max=1.0)"


def test_hand_built_dag():
    ops = [GroupLinear(2, 64, 128, device="meta"), SwiGLU(), Scale(value=2.0), Clamp(max=1.0)]
    g = nx.DiGraph()
    x = add_input(g, "x")
    nodes = [add_op(g, i, op.spec, op) for i, op in enumerate(ops)]
    connect(g, x, nodes[0])
    connect(g, nodes[0], nodes[1])
    connect(g, nodes[1], nodes[2])
    connect(g, nodes[1], nodes[3])  # SwiGLU's output has two consumers
    connect(g, nodes[2], add_output(g, 0))
    connect(g, nodes[3], add_output(g, 1))
    assert data_successors(g, nodes[1]) == [nodes[2], nodes[3]]
    assert node_text(g, output_node(1)) == "block output 1"
