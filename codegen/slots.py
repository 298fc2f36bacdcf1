"""Typed epilogue operands: what a generated kernel reads besides the accumulator, and what it writes.

Each slot knows three things: the name the kernel's Epilogue class declares for it (`kernel_name`), how it is
declared (`declaration`: one of the kernel protocol's RowVector / GroupVector / AuxInput / Output / MXFP8Output / FP8BlockOutput /
FP8BlockDequantOutput / RowSumOutput), and the names `apply` receives or returns for it (`values`: two for a paired (gate, up) slot).
The runtime binds tensors to slots by type (the step runners of fusion/runtime/steps.py), so no string is ever
parsed back.

Paired tensors use the canonical layout of the GroupLinear weight: gate half in columns [0, n), up half in
[n, 2n).
"""
from __future__ import annotations

from dataclasses import dataclass


def _pair(name: str, paired: bool) -> tuple[str, ...]:
    return (f"{name}_gate", f"{name}_up") if paired else (name,)


# -- inputs ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowScale:
    """The per-row scale a Scale op reads from the extra input `name`, in the block's dtype."""

    name: str

    @property
    def kernel_name(self) -> str:
        return f"scale_{self.name}"

    def declaration(self, dtype: str) -> str:
        return f'_epi.RowVector("{self.kernel_name}", dtype="{dtype}")'

    @property
    def values(self) -> tuple[str, ...]:
        return (self.kernel_name,)


@dataclass(frozen=True)
class GroupBias:
    """The bias of the op at `position` in the step's op list (0: the GEMM's own bias): a (groups, n) vector in
    the parameter's dtype, read without a copy; paired when added before a gated activation."""

    position: int
    paired: bool

    @property
    def kernel_name(self) -> str:
        return f"bias{self.position}"

    def declaration(self, dtype: str) -> str:
        return f'_epi.GroupVector("{self.kernel_name}", paired={self.paired}, dtype="{dtype}")'

    @property
    def values(self) -> tuple[str, ...]:
        return _pair(self.kernel_name, self.paired)


@dataclass(frozen=True)
class SavedIn:
    """The value the forward saved for this backward (the input of the first stage whose gradient needs it)."""

    paired: bool
    kernel_name = "saved"

    def declaration(self, dtype: str) -> str:
        return f'_epi.AuxInput("saved", paired={self.paired})'

    @property
    def values(self) -> tuple[str, ...]:
        return ("gate", "up") if self.paired else ("x",)


# -- outputs ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Out:
    """The chain's output, in the block's dtype."""

    kernel_name = "out"

    def declaration(self, dtype: str) -> str:
        return '_epi.Output("out")'

    values = ("out",)


@dataclass(frozen=True)
class Quantized:
    """The chain's output quantized to MXFP8 rowwise by the kernel's store (data + E8M0 scales)."""

    kernel_name = "out"

    def declaration(self, dtype: str) -> str:
        return '_epi.MXFP8Output("out")'

    values = ("out",)


@dataclass(frozen=True)
class QuantizedFP8Block:
    """The chain's output quantized to FP8-block rowwise by the kernel's store: e4m3 codes, float32 scales per
    1x128 block (k-block-major), the tensor's finite amax (kernels/fp8_block_store.py)."""

    kernel_name = "out"

    def declaration(self, dtype: str) -> str:
        return '_epi.FP8BlockOutput("out")'

    values = ("out",)


@dataclass(frozen=True)
class HighPrecision:
    """The quantized output's value in the block's dtype: the columnwise copy and the amax come from it."""

    kernel_name = "hp"

    def declaration(self, dtype: str) -> str:
        return '_epi.Output("hp")'

    values = ("out",)


@dataclass(frozen=True)
class SavedOut:
    """The value the pattern's `save` names, written by the training kernel for the backward (canonical halves
    when paired: a value entering a gated activation, or a bias before it)."""

    paired: bool
    kernel_name = "saved"

    def declaration(self, dtype: str) -> str:
        return f'_epi.Output("saved", paired={self.paired})'

    @property
    def values(self) -> tuple[str, ...]:
        return _pair("saved", self.paired)


@dataclass(frozen=True)
class DInput:
    """The gradient of the chain's input (canonical halves when the chain starts at a gated activation)."""

    paired: bool
    kernel_name = "dinput"

    def declaration(self, dtype: str) -> str:
        return f'_epi.Output("dinput", paired={self.paired})'

    @property
    def values(self) -> tuple[str, ...]:
        return _pair("dinput", self.paired)


@dataclass(frozen=True)
class QuantizedDInput:
    """The gradient of the chain's input also quantized FP8-block 1 x 128 rowwise (e4m3 codes, float32 scales
    k-block-major, the finite amax; kernels.epilogue.FP8BlockOutput): the operand of the FP8 dgrad of the GEMM before
    the chain, which then runs no quantize pass. Paired like :class:`DInput`, each half's blocks on their own."""

    paired: bool
    kernel_name = "dinput_q"

    def declaration(self, dtype: str) -> str:
        return f'_epi.FP8BlockOutput("dinput_q", paired={self.paired})'

    @property
    def values(self) -> tuple[str, ...]:
        return _pair("dinput_q", self.paired)


@dataclass(frozen=True)
class DScale:
    """A row scale's gradient, d scale = sum_j dy_j * y_j: the epilogue returns each term and the kernel sums them
    per row, as float32 partials per `block` columns (kernels.epilogue.RowSumOutput); the runtime adds the
    partials (an (M, n / block) tensor, not the (M, n) terms)."""

    name: str
    block: int = 32   # the declaration names it: the generated epilogue's RowSumOutput takes this, not its default

    @property
    def kernel_name(self) -> str:
        return f"dscale_{self.name}"

    def parts(self, n: int) -> int:
        """Columns of the partial-sum tensor for a logical width n."""
        return -(-n // self.block)

    def declaration(self, dtype: str) -> str:
        return f'_epi.RowSumOutput("{self.kernel_name}", block={self.block})'

    @property
    def values(self) -> tuple[str, ...]:
        return (self.kernel_name,)


@dataclass(frozen=True)
class PostAct:
    """The chain's output recomputed from the saved value (the next GEMM's weight-gradient input), so the
    forward need not keep it. `dequantized` ("fp8_block"): the chain ends in a quantize op, and what the next
    GEMM's weight gradient reads is its output dequantized: the kernel quantizes the recomputed value 1 x 128
    rowwise and writes it back dequantized (kernels.epilogue.FP8BlockDequantOutput)."""

    dequantized: str | None = None
    kernel_name = "postact"

    def declaration(self, dtype: str) -> str:
        if self.dequantized == "fp8_block":
            return '_epi.FP8BlockDequantOutput("postact")'
        assert self.dequantized is None, self.dequantized
        return '_epi.Output("postact")'

    values = ("postact",)
