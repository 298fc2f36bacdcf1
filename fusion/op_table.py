"""What a pattern can name in a chain: the op kinds, and the table of op classes by name.

Data at the bottom of the layers. The op classes fill the table as they are defined (fusion/ops/base.py) and the
pattern loader reads it (fusion/patterns/loader.py), so patterns depend on this module, not on the op classes:
an op class may then read pattern declarations (Activation(name) does).
"""
from __future__ import annotations

#: What an op is, for the pattern matcher. A chain element in a .fpat file names ops or one of these.
OP_KINDS = ("gemm", "activation", "elementwise", "quantize", "gather", "combine")

#: The op table: every op class by its name (the name its OpSpec carries) -> its kind. Filled as op classes
#: are defined, from the `kind=` of their class statement (`class Gather(Op, kind="gather")`; subclasses
#: inherit it; classes named `_...` are shared bases, not ops). Pattern files check the ops a chain element
#: names against it (fusion/patterns/loader.py): one table, so a new op is known to patterns when it exists.
#: It is complete once fusion.ops is imported, which `import fusion` does before anything can load a pattern.
OP_TABLE: dict[str, str] = {}

#: Device kernels the fused runtime runs in place of an unfused op's reference, by (op kind, part): the runtime
#: module (fusion/runtime/<name>.py: `takes(tensor)`, `run(tensor, ctx)`) with the same math in the same order
#: (each module says how it matches the reference), used on the CUDA tensors it takes, and what explain() says
#: runs there. A Gather's backward is a combine of its rows' gradients.
DEVICE_METHODS: dict[tuple[str, str], tuple[str, str]] = {
    ("combine", "forward"): ("combine", "combine kernel (fusion/kernels/combine.py: each token's rows summed in "
                                        "row order in float32, no atomics)"),
    ("gather", "backward"): ("combine", "combine kernel of the rows' gradients (fusion/kernels/combine.py)"),
}
