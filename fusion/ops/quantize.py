"""Quantize ops: the output is a QuantizedTensor (data, scales, amax) that the next GroupLinear consumes."""
from __future__ import annotations

from fusion.ops.args import flag
from fusion.ops.base import Op, OpSpec, shape_error


class _QuantizeOp(Op, kind="quantize"):
    format: str = ""
    block: int = 0
    #: rows must split into whole blocks of `block` features (MXFP8, NVFP4); FP8-block rows may end partial
    whole_blocks: bool = True

    def __init__(self, columnwise: bool = True):
        super().__init__()
        self.columnwise = flag(type(self).__name__, "columnwise", columnwise)

    @property
    def spec(self) -> OpSpec:
        # group_sizes is not a declared extra input: a dense block has none. The reference reads it from the
        # run context when the block has one (columnwise blocks run per group).
        return OpSpec(name=type(self).__name__, kind="quantize",
                      attrs={"format": self.format, "columnwise": self.columnwise, "block": self.block})

    def check_input(self, in_features: int) -> None:
        if self.whole_blocks and in_features % self.block:
            raise shape_error(self, f"last dim {in_features} is not divisible by the {self.format.upper()} "
                                    f"block size {self.block}; make the previous op's features a multiple "
                                    f"of {self.block}, or drop the quantize op")

    def describe(self) -> str:
        return f"{type(self).__name__}(columnwise={self.columnwise})"

    def reference(self, x, ctx=None):
        from fusion.quant import quantize

        group_sizes = getattr(ctx, "group_sizes", None) if self.columnwise else None
        return quantize(x, self.format, columnwise=self.columnwise, group_sizes=group_sizes)


class QuantizeMXFP8(_QuantizeOp):
    """MXFP8: E4M3 elements, one E8M0 scale per 32 elements (rounded up: nothing saturates)."""

    format, block = "mxfp8", 32


class QuantizeNVFP4(_QuantizeOp):
    """NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one FP32 per-tensor scale from amax."""

    format, block = "nvfp4", 16


class QuantizeFP8Block(_QuantizeOp):
    """FP8-block (Hopper): E4M3 elements, one FP32 power-of-two scale per 1x128 block of a row (the last one
    may be partial); with `columnwise`, also 128-row blocks per group of the transposed tensor for wgrad."""

    format, block, whole_blocks = "fp8_block", 128, False
