"""The epilogue protocol of the grouped GEMM kernel.

An epilogue is a plain Python object the kernel calls *at trace time*, once per accumulator element
(or per gate/up pair), on fp32 values.  It declares, as class attributes:

- ``gated``   : bool.  When True B is a canonical gated weight (G, N, K): gate rows [0, N/2), up rows
                 [N/2, N); ``apply`` receives ``(gate, up)`` of one logical column and the logical output
                 width is N/2.  When False ``apply`` receives ``(acc,)`` and the logical width is N.
- ``inputs``  : tuple of :class:`RowVector`, :class:`GroupVector`, :class:`AuxInput` (in call order).
- ``outputs`` : tuple of :class:`Output` / :class:`MXFP8Output` / :class:`FP8BlockOutput` /
                 :class:`FP8BlockDequantOutput` / :class:`RowSumOutput` (at least one).

and a method ``apply(self, *values)``: positional arguments are the accumulator value(s) followed by
one value per unpaired input and two values (gate-half, up-half) per ``paired`` input, in declaration
order.  It returns one value per unpaired output and two per paired output (a bare value when the
total is one, else a tuple).  Values are ``cutlass.Float32`` scalars; use :mod:`kernels.epi_math`
(silu, sigmoid, exp, ...) and ordinary ``+ - * /`` on them.

Logical columns: column ``j`` of the epilogue's output space, ``j`` in [0, n).  ``gated``: the kernel
feeds gate = (A @ B[g].T)[:, j] and up = (A @ B[g].T)[:, n + j] (n = N/2).  ``paired`` inputs/outputs
(width ``2n``) use the same canonical split layout: the gate half in columns [0, n), the up half in
[n, 2n), so ``torch.chunk(x, 2, -1)`` gives (gate half, up half) without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "Epilogue", "RowVector", "GroupVector", "AuxInput", "Output", "MXFP8Output", "FP8BlockOutput",
    "FP8BlockDequantOutput", "RowSumOutput",
    "extra_tensors", "IdentityEpilogue", "SwiGLUScaleEpilogue", "DSwiGLUEpilogue", "SwiGLUScaleMXFP8Epilogue",
]


@dataclass(frozen=True)
class RowVector:
    """One value per row of A: a (M,) tensor (e.g. router probabilities).  dtype: torch dtype name."""
    name: str
    dtype: str = "float32"
    paired = False


@dataclass(frozen=True)
class GroupVector:
    """One value per (group, logical column): a (G, n) tensor (per-expert bias). ``paired``: (G, 2n), gate
    value of column j at j, up value at n + j (a gated layer's bias as stored)."""
    name: str
    paired: bool = False
    dtype: str = "float32"


@dataclass(frozen=True)
class AuxInput:
    """An auxiliary (M, n) matrix read at the output coordinates (e.g. the saved pre-activation in a
    backward).  ``paired``: (M, 2n), gate half [0, n), up half [n, 2n).  dtype None: the GEMM's input
    dtype."""
    name: str
    paired: bool = False
    dtype: Optional[str] = None


@dataclass(frozen=True)
class Output:
    """An (M, n) output (``paired``: (M, 2n), gate half [0, n), up half [n, 2n)).  dtype None: the GEMM's
    input dtype."""
    name: str
    paired: bool = False
    dtype: Optional[str] = None


@dataclass(frozen=True)
class MXFP8Output:
    """An MXFP8-quantized (M, n) output: e4m3 values (torch.float8_e4m3fn) plus one E8M0 scale (uint8)
    per 32 consecutive logical columns, tensor (M, n // 32).  scale = 2**ceil(log2(amax / 448))
    (clamped to the E8M0 range), value = x / scale rounded to e4m3 with saturation."""
    name: str
    paired = False
    dtype: str = "float8_e4m3fn"
    #: the tensors besides the data, by name suffix and dtype (kernels/api.py passes their addresses after it)
    extras = (("_scale", "uint8"),)

    @property
    def scale_name(self) -> str:
        return self.name + "_scale"


@dataclass(frozen=True)
class FP8BlockOutput:
    """An FP8-block-quantized (M, n) output (docs/quantization.md, "FP8-block"): e4m3 values, one float32
    power-of-two scale per row and 128 consecutive logical columns (the last block partial), k-block-major:
    scales (ceil(n / 128), M); and the tensor's finite amax as float32 bits, one int32 the caller zeroes (atomic
    max per warp). The logical tile must be one 128-column block wide: a row's block is whole in one thread quad.
    Rowwise only: the columnwise copy is not written (the pattern fuses ``QuantizeFP8Block(columnwise=False)``).
    ``paired``: (M, 2n), gate half [0, n), up half [n, 2n), each half's 128-column blocks quantized on their own
    (scales (ceil(2n / 128), M): the up half's block b at n / 128 + b). That is the 2n-wide tensor's own 1 x 128
    quantization when n % 128 == 0, which the caller must see to (a dgrad writing d(gate, up) for FC1's FP8 dgrad:
    codegen/spec.py)."""
    name: str
    paired: bool = False
    dtype: str = "float8_e4m3fn"
    block = 128
    extras = (("_scale", "float32"), ("_amax", "int32"))

    @property
    def scale_name(self) -> str:
        return self.name + "_scale"

    @property
    def amax_name(self) -> str:
        return self.name + "_amax"


@dataclass(frozen=True)
class FP8BlockDequantOutput(Output):
    """An (M, n) output in the GEMM dtype holding the value FP8-block quantized 1 x 128 rowwise and dequantized
    again: ``dequantize(fp8_block_quantize(x))`` of the value rounded to the GEMM dtype, bit for bit what a
    QuantizedTensor's dequantize into that dtype gives. For a consumer that reads a quantized tensor's dequantized
    value (FC2's bf16 weight gradient after a QuantizeFP8Block(columnwise=False)): the FP8 dgrad recomputes it from
    the saved pre-activation, so the forward need not keep the codes. The logical tile must be one 128-column
    block wide, as for :class:`FP8BlockOutput` (a row's block amax is a reduction over one thread quad)."""
    block = 128


def is_fp8_block(spec) -> bool:
    """Whether an output quantizes 1 x 128 rowwise blocks in the epilogue (its logical tile must be one block)."""
    return isinstance(spec, (FP8BlockOutput, FP8BlockDequantOutput))


def extra_tensors(spec) -> tuple:
    """``(suffix, dtype)`` of the tensors an output spec has besides its data (a quantized output's scales...)."""
    return getattr(spec, "extras", ())


@dataclass(frozen=True)
class RowSumOutput:
    """The sum of a value over each row's logical columns, as float32 partial sums: one per row and block of
    ``block`` consecutive columns, an (M, ceil(n / block)) tensor the caller sums over its columns (a fixed order:
    deterministic). A row scale's gradient (d scale = sum_j dy_j * y_j) needs only the sums: an (M, n) 16-bit
    tensor of the terms, written by the kernel and read back by a reduction, moved 4 * M * n bytes more (GPT-OSS-120B's
    MoE step on an H100: 1-2% faster without it; docs/benchmarks.md). ``block`` divides every tile's logical
    width (32: the MXFP8 rule's too), so the partials do not depend on the tile the kernel runs."""
    name: str
    block: int = 32
    paired = False
    dtype: str = "float32"

    def parts(self, n: int) -> int:
        """Columns of the partial-sum tensor for a logical width n."""
        return -(-n // self.block)


class Epilogue:
    """Base class.  Subclasses set ``gated``, ``inputs``, ``outputs`` and define ``apply``."""

    gated: bool = False
    inputs: tuple = ()
    outputs: tuple = (Output("out"),)

    def apply(self, *values):  # pragma: no cover - abstract
        raise NotImplementedError

    # --- helpers used by the kernel and host wrapper ---
    def cache_key(self) -> Any:
        """Identity of the generated code.  Override when instances of one class differ (parameters)."""
        params = tuple(sorted((k, repr(v)) for k, v in vars(self).items())) if hasattr(self, "__dict__") else ()
        return (type(self).__module__, type(self).__qualname__, self.gated, self.inputs, self.outputs, params)

    def num_apply_results(self) -> int:
        return sum(2 if getattr(o, "paired", False) else 1 for o in self.outputs)


# ---------------------------------------------------------------- hand-written epilogues
class IdentityEpilogue(Epilogue):
    """Plain grouped GEMM: D = A @ B[g].T in the input dtype (or ``out_dtype``)."""

    gated = False
    inputs = ()

    def __init__(self, out_dtype: Optional[str] = None):
        self.outputs = (Output("out", dtype=out_dtype),)

    def apply(self, acc):
        return acc


class SwiGLUScaleEpilogue(Epilogue):
    """out[:, j] = silu(gate_j) * up_j * scale[row]  (FC1 of an MoE MLP, router prob fused)."""

    gated = True
    inputs = (RowVector("scale"),)
    outputs = (Output("out"),)

    def apply(self, gate, up, scale):
        from . import epi_math as em
        return em.silu(gate) * up * scale


class DSwiGLUEpilogue(Epilogue):
    """Backward of silu(g)*u*s fused in the dgrad GEMM dH = dY @ W2 (acc = dH, logical width f).

    Reads the saved pre-activation ``pre`` (M, 2f) = [gate | up] and the row scale; writes ``dpre`` (M, 2f)
    = [d_gate | d_up]: d_gate = dH*s*u*dsilu(g), d_up = dH*s*silu(g).  Run it with ``b_major="MN"`` and
    B = W2 (G, d, f) as stored.
    """

    gated = False
    inputs = (AuxInput("pre", paired=True), RowVector("scale"))
    outputs = (Output("dpre", paired=True),)

    def apply(self, dh, g, u, scale):
        from . import epi_math as em
        sig = em.sigmoid(g)
        silu_g = g * sig
        dhs = dh * scale
        d_gate = dhs * u * (sig + silu_g * (1.0 - sig))
        d_up = dhs * silu_g
        return d_gate, d_up


class SwiGLUScaleMXFP8Epilogue(SwiGLUScaleEpilogue):
    """SwiGLU * scale, quantized to MXFP8 rowwise (e4m3 values + E8M0 scales per 32 columns)."""

    outputs = (MXFP8Output("out"),)
