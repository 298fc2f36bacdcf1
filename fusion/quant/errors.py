"""Errors of :mod:`fusion.quant` (no dependency on the rest of ``fusion``)."""


class QuantizationError(ValueError):
    """A tensor cannot be quantized as asked (block-size divisibility, dtype, rank).

    A ``ValueError`` subclass; the message names the op, the offending dimension, its size, the
    block size and the fix.
    """
