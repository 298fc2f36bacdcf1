"""backend="emulate": a fused kernel executed in torch, exactly as the GPU template would run it.

Only the mainloop is replaced: each group's GEMM is one torch matmul in the compute dtype (float32, float64 for
float64 blocks; the tensor cores accumulate bf16/fp16 products in fp32). Everything else is the kernel's: the
same generated Epilogue class (its source executed with fusion.runtime.torch_math as `em`), the same operand
protocol (RowVector / GroupVector / AuxInput inputs, Output / MXFP8Output / FP8BlockOutput / FP8BlockDequantOutput
/ RowSumOutput outputs, canonical (gate, up) halves for paired tensors and gated accumulators), the same B layouts
(K-major (G, N, K) or MN-major (G, K, N)), rows written only inside the groups' ranges, quantized stores on the
value rounded to the GEMM dtype, row sums as per-block partials.

Reading the group bounds takes one host copy per launch: emulate is for tests and CPUs, not for speed.
"""
from __future__ import annotations

import torch

from fusion.codegen.emit import IMPORTS
from fusion.runtime import torch_math

_CLASSES: dict[str, type] = {}


def _kernel_protocol():
    import fusion.kernels.epilogue as protocol

    return protocol


def epilogue_class(source: str, class_name: str = "GeneratedEpilogue") -> type:
    """The generated Epilogue class with torch math in place of the kernel's (cached per source)."""
    cls = _CLASSES.get(source)
    if cls is None:
        body = "\n".join(line for line in source.splitlines() if line.strip() not in IMPORTS)
        namespace = {"_f32": torch_math.as_value, "em": _Math(), "_epi": _kernel_protocol()}
        exec(compile(body, f"<generated epilogue {class_name}>", "exec"), namespace)
        cls = _CLASSES[source] = namespace[class_name]
    return cls


class _Math:
    """`em` for generated code: attribute access to torch_math's functions."""

    def __getattr__(self, name):
        return torch_math.functions()[name]


def _halves(t: torch.Tensor, paired: bool) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(2, -1)) if paired else (t,)


def _gathered(A: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A's rows through `index` as the gather producers read them: a padding row (-1) zero-filled."""
    rows = A.index_select(0, index.long().clamp_min(0))
    return rows.masked_fill((index < 0)[:, None], 0)


class EmulatedKernel:
    """Runs one generated grouped-GEMM kernel in torch; `run` has the launcher's signature."""

    def __init__(self, source: str, gated: bool, b_major: str = "K"):
        self.epilogue = epilogue_class(source)()
        self.gated = gated
        self.b_major = b_major

    def run(self, A: torch.Tensor, B: torch.Tensor, bounds: torch.Tensor, tensors: dict,
            index: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> None:
        """A (M, K); B (G, N, K) for b_major "K" or (G, K, N) for "MN"; bounds (G+1,) row offsets; tensors: the
        epilogue's inputs and outputs by name (MXFP8 outputs: data under the name, scales under name_scale).
        `index` (M,): a gathering kernel's, row r of the GEMM reads A[index[r]] (A is then (T, K); zeros where
        index[r] is -1).
        `out_dtype`: the dtype the epilogue works in (default A's; an FP8 kernel's A arrives dequantized in
        float32)."""
        epi = self.epilogue
        out_dtype = out_dtype or A.dtype
        compute = torch.float64 if out_dtype == torch.float64 else torch.float32
        edges = bounds.tolist()
        for g in range(len(edges) - 1):
            start, end = edges[g], edges[g + 1]
            if end <= start:
                continue
            a = (A[start:end] if index is None else _gathered(A, index[start:end])).to(compute)
            b = B[g].to(compute)
            acc = a @ (b.t() if self.b_major == "K" else b)
            args = list(_halves(acc, self.gated))
            for slot in epi.inputs:
                t = tensors[slot.name]
                if isinstance(slot, _kernel_protocol().RowVector):
                    args.append(t[start:end].to(compute)[:, None])
                elif isinstance(slot, _kernel_protocol().GroupVector):
                    args.extend(h[None, :] for h in _halves(t[g].to(compute), slot.paired))
                else:
                    args.extend(_halves(t[start:end].to(compute), slot.paired))
            results = epi.apply(*args)
            results = list(results) if isinstance(results, (tuple, list)) else [results]
            rows = end - start
            n_log = acc.shape[-1] // (2 if self.gated else 1)   # the logical width (a row sum's columns)
            for slot in epi.outputs:
                parts = [results.pop(0) for _ in range(2 if slot.paired else 1)]
                row_sum = isinstance(slot, _kernel_protocol().RowSumOutput)
                width = n_log if row_sum else tensors[slot.name].shape[-1] // len(parts)
                parts = [torch.as_tensor(p, dtype=compute, device=A.device).expand(rows, width) for p in parts]
                value = torch.cat(parts, -1) if slot.paired else parts[0]
                if isinstance(slot, _kernel_protocol().MXFP8Output):
                    self._store_mxfp8(value.to(out_dtype), tensors, slot, start, end)
                elif isinstance(slot, _kernel_protocol().FP8BlockOutput):
                    self._store_fp8_block(value.to(out_dtype), tensors, slot, start, end)
                elif isinstance(slot, _kernel_protocol().FP8BlockDequantOutput):
                    tensors[slot.name][start:end] = self._fp8_block_round_trip(value.to(out_dtype))
                elif row_sum:
                    tensors[slot.name][start:end] = self._block_sums(value, slot.block).to(tensors[slot.name].dtype)
                else:
                    tensors[slot.name][start:end] = value.to(tensors[slot.name].dtype)

    @staticmethod
    def _block_sums(value: torch.Tensor, block: int) -> torch.Tensor:
        """A RowSumOutput's partials: each row's sum over every `block` consecutive columns (the last block
        partial), as the kernel stores them (its summation order within a block differs)."""
        rows, n = value.shape
        pad = -n % block
        if pad:
            value = torch.cat([value, value.new_zeros(rows, pad)], -1)
        return value.view(rows, -1, block).sum(-1)

    @staticmethod
    def _store_fp8_block(value: torch.Tensor, tensors: dict, slot, start: int, end: int) -> None:
        """The FP8 kernel's FP8-block store: 1 x 128 rowwise blocks of the value rounded to the GEMM dtype, their
        scales k-block-major, and the running finite amax (float32 bits in the int32 the kernel's atomics use)."""
        from fusion.quant._common import finite_amax
        from fusion.quant.fp8_block import fp8_block_quantize_2d

        data, scale = fp8_block_quantize_2d(value)
        tensors[slot.name][start:end] = data.view(torch.float8_e4m3fn)
        tensors[slot.scale_name][:, start:end] = scale
        amax = tensors[slot.amax_name]
        amax.copy_(torch.maximum(amax, finite_amax(value).view(torch.int32)))

    @staticmethod
    def _fp8_block_round_trip(value: torch.Tensor) -> torch.Tensor:
        """The kernel's dequantized FP8-block output: the value (rounded to the GEMM dtype) quantized 1 x 128
        rowwise and dequantized again in float32, in its dtype (what QuantizedTensor.dequantize gives)."""
        from fusion.quant.fp8_block import fp8_block_dequantize_2d, fp8_block_quantize_2d

        return fp8_block_dequantize_2d(*fp8_block_quantize_2d(value), dtype=value.dtype)

    @staticmethod
    def _store_mxfp8(value: torch.Tensor, tensors: dict, slot, start: int, end: int) -> None:
        """The kernel's MXFP8 store: rowwise blocks of 32 of the value rounded to the GEMM dtype."""
        from fusion.quant.mxfp8 import mxfp8_quantize_2d

        data, scale = mxfp8_quantize_2d(value.float())
        tensors[slot.name][start:end] = data.view(torch.float8_e4m3fn)
        tensors[slot.scale_name][start:end] = scale
