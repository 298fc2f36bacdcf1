"""Errors of :mod:`fusion.quant` (it depends only on ``fusion.errors``, a leaf module, of the rest of
``fusion``)."""
from fusion.errors import FusionError


class QuantizationError(FusionError, ValueError):
    """A tensor cannot be quantized as asked (block-size divisibility, dtype, rank).

    A FusionError (every error fusion raises on purpose is one) and a ``ValueError``; the message names the
    op, the offending dimension, its size, the block size and the fix.
    """
