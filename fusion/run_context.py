"""The run context: the extra inputs of one block call, validated, as every op and runtime step reads them.

A plain dataclass at the bottom of the layers: the ops (fusion/ops/), the input checks that build it
(fusion/inputs.py) and the runtime (fusion/runtime/) all share it, so it depends on none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Keyword inputs with a fixed meaning in a block call; an op may not read a float input of these names.
#: "x" is the data input and "self" the module's own parameter of `forward`, so neither can be a keyword.
#: (Here, below the ops that check their names and the input checks that read them.)
INT_INPUTS = ("group_sizes", "index")
RESERVED_INPUTS = INT_INPUTS + ("x", "self")


@dataclass
class RunContext:
    """The extra inputs of one Sequential call, validated, shared by every op of that call."""

    group_sizes: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Cumulative group offsets (o_1..o_G), computed once per call on the device (see fusion.grouped): set by the
    #: input checks, else read through `offsets`, a view of the fused program's bounds buffer made when first read.
    _offsets: torch.Tensor | None = None
    #: MoE blocks (a Gather first): the token of each routed row (M,), -1 for padding rows; the block input's
    #: row count T (Combine's output rows); and group_sizes as the caller gave them (they may sum to less
    #: than M). `group_sizes` above then has the padding rows added to its last group, so it sums to exactly
    #: M and every grouped op sees all rows; a fused runtime may use `routed_group_sizes` to skip them.
    index: torch.Tensor | None = None
    tokens: int | None = None
    routed_group_sizes: torch.Tensor | None = None
    #: Set by a fused program's forward (fusion/runtime/bounds.py): the int32 buffer of the call's `groups` + 1
    #: row bounds, then the forward's and the backward's zeroed tile counters.
    counters: torch.Tensor | None = None
    groups: int = 0
    backward_counters_used: bool = False
    #: Values derived from the inputs once per call, by name, for the ops and steps that share them: the int32
    #: index a gathering kernel loads through (fusion/runtime/steps.py), the token layout a Combine and a
    #: Gather's backward sum by (fusion/ops/routing.py).
    derived: dict[str, object] = field(default_factory=dict)

    #: Where a routed forward's replay left the group sizes with the padding absorbed: (buffer, element, count), or
    #: None. `group_sizes` makes their view when first read (see below).
    sizes_at: tuple | None = None

    @property
    def offsets(self) -> torch.Tensor | None:
        """The cumulative group offsets o_1..o_G (what torch._grouped_mm reads as `offs`), None for a dense block. A
        fused program's device prologue writes them into its bounds buffer (`counters`); the view is made only
        when a torch op asks for it (a view costs host time, and a call whose GEMMs are all our kernels needs
        none)."""
        grouped = self._group_sizes is not None or self.sizes_at is not None   # (without making the sizes' view)
        if self._offsets is None and self.counters is not None and grouped:
            self._offsets = self.counters[1:self.groups + 1]
        return self._offsets

    @offsets.setter
    def offsets(self, value: torch.Tensor | None) -> None:
        self._offsets = value

    def absorb_sizes_at(self, buffer: torch.Tensor, position: int, count: int) -> None:
        """The group sizes with the padding absorbed are buffer[position:position + count] (what a routed prologue
        writes after the bounds and tile counters): `group_sizes` reads them from there, as a view made when first
        read. A routed forward's replay sets this instead of making the view: the view costs 5-15 µs of host per
        call, and a replayed step reads only the buffer's address."""
        self._group_sizes, self.sizes_at = None, (buffer, position, count)

    def derive(self, name: str, make):
        """The value `name` derived from this call's inputs: `make()` the first time it is asked for, then kept."""
        value = self.derived.get(name)
        if value is None:
            value = self.derived[name] = make()
        return value


def _group_sizes(self) -> torch.Tensor | None:
    """The call's group sizes (G,), None for a dense block; after a Gather, with the padding rows absorbed into the
    last group once the program's routed prologue has run (see RunContext.index)."""
    sizes = self._group_sizes
    if sizes is None and self.sizes_at is not None:
        buffer, position, count = self.sizes_at
        sizes = self._group_sizes = buffer.narrow(0, position, count)
        self.sizes_at = None
    return sizes


def _set_group_sizes(self, value: torch.Tensor | None) -> None:
    self._group_sizes, self.sizes_at = value, None


# `group_sizes` stays a dataclass field (the constructor's keyword, repr, eq) and reads through this property: the
# generated __init__ assigns through the setter.
RunContext.group_sizes = property(_group_sizes, _set_group_sizes)
