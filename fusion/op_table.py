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

#: Where a lone bf16/fp16 GroupLinear GEMM (forward, dgrad) runs our varlen-M kernel rather than torch._grouped_mm,
#: per call: the GEMM has at least `min_groups` groups (one group is a dense GEMM: cuBLAS measured faster), the routed
#: rows average at most `max_rows_per_group[part]` per group, and at most `max_outputs_per_group[part]` / N unless the
#: tile runs as dynamic CTA pairs (a group's output of rows x N elements: cuBLAS's kernels win on large groups of
#: wide GEMMs), and the GEMM's output width is a multiple of one of `n_multiples` (whole n-tiles of the kernel's 128-
#: or 192-column tile; measured: fusion/runtime/lone_gemm.py).
LONE_GEMM_RULE = {"min_groups": 2, "max_rows_per_group": {"forward": 1024, "dgrad": 512}, "n_multiples": (128, 192),
                  "max_outputs_per_group": {"forward": 2 ** 21, "dgrad": 3 * 2 ** 19},
                  # the wide tile (kernels/tile_policy.lone_tile: 128x256 dynamic CTA pairs) where its n-tiles pair
                  # up and N >= min_n or K >= min_k: this rows cap alone, no output budget; the cap by the output
                  # width, ((at N >=, rows per group), ...), first match
                  "wide": {"min_n": 2560, "min_k": 1280,
                           "max_rows_per_group": {"forward": ((0, 2048),), "dgrad": ((4096, 4096), (0, 512))}},
                  # a forward of K >= this goes to torch (cuBLAS led at every tile measured)
                  "max_k": {"forward": 6144, "dgrad": None},
                  # a one-group (dense) GEMM's dgrad: at >= this many rows, N a multiple of 256 (128x256 tiles)
                  "dense_dgrad_min_rows": 8192, "dense_dgrad_n_multiple": 256}


#: Where a GroupLinear's bf16/fp16 weight gradient runs our varlen-K kernel: at least this many groups. One group is a
#: dense GEMM, where torch's matmul (cuBLAS) measured faster (H200, torch 2.11, Llama-3-8B's step -1.8%); on groups of
#: large weights torch._grouped_mm did not (Mixtral +0.4%, DBRX +1.4%, Phi-3.5-MoE +2.0%, Llama-4-Scout +4.9% with
#: it; docs/benchmarks.md, session u). fusion/runtime/wgrad_gemm.py reads it.
WGRAD_RULE = {"min_groups": 2}


def _lone_rule_text(part: str) -> str:
    rule, wide = LONE_GEMM_RULE, LONE_GEMM_RULE["wide"]
    dense = (f"; one group: at >= {rule['dense_dgrad_min_rows']} rows with N a multiple of "
             f"{rule['dense_dgrad_n_multiple']}" if part == "dgrad" else "")
    caps = ", else ".join(f"<= {cap} at N >= {min_n}" if min_n else f"<= {cap}"
                          for min_n, cap in wide["max_rows_per_group"][part])
    long_k = f"; never at K >= {rule['max_k'][part]}" if rule["max_k"][part] is not None else ""
    return (f"where the GEMM has >= {rule['min_groups']} groups, rows per group average <= "
            f"{rule['max_rows_per_group'][part]} and <= {rule['max_outputs_per_group'][part]} / N "
            f"(unless its tile runs as dynamic CTA pairs) and N is a multiple of "
            f"{' or '.join(str(m) for m in rule['n_multiples'])}; or as 128x256 dynamic CTA pairs where those "
            f"n-tiles pair up and N >= {wide['min_n']} or K >= {wide['min_k']}, rows per group average {caps}"
            f"{long_k}{dense}, else torch._grouped_mm (fusion/runtime/lone_gemm.py)")

#: Device kernels the fused runtime runs in place of an unfused op's reference, by (op variant, part): the runtime
#: module (fusion/runtime/<name>.py: `takes(op, value)`, and `run(op, value, ctx)` for a forward or a backward
#: part, `dgrad(op, dy, ctx)` / `wgrad(op, x, dy, ctx)` for a GEMM's; a module whose dgrad rule differs from its
#: forward's also defines `takes_dgrad(op, dy)`, which the dgrad step asks instead) with the same math in the same order
#: (each module says how it matches the reference), used on the CUDA tensors it takes, and what explain() says
#: runs there. The variant is the op's kind, or kind:format for a GEMM whose weights are not the parameter as is
#: (its weight_format) and for a quantize op (the format it writes). A Gather's backward is a combine of its
#: rows' gradients, a Combine's backward a gather of the tokens'.
DEVICE_METHODS: dict[tuple[str, str], tuple[str, str]] = {
    ("combine", "forward"): ("combine", "combine kernel (fusion/kernels/combine.py: each token's rows summed in "
                                        "row order in float32, no atomics)"),
    ("gather", "backward"): ("combine", "combine kernel of the rows' gradients (fusion/kernels/combine.py)"),
    ("gather", "forward"): ("gather", "gather kernel (fusion/kernels/gather_rows.py: each routed row copies its "
                                      "token's row, a padding row zeros; no copy of the tokens)"),
    ("combine", "backward"): ("gather", "gather kernel of the tokens' gradients (fusion/kernels/gather_rows.py); "
                                        "skipped where the GEMM before the Combine reads them through the routing "
                                        "index in its fused dgrad and weight gradient (>= 1024 routed rows per "
                                        "group, in_features <= 1024)"),
    ("quantize:fp8_block", "forward"): ("fp8_quantize", "FP8-block quantize kernel (fusion/kernels/fp8_quantize.py: "
                                                        "rowwise and per-group columnwise in one pass)"),
    ("gemm:fp8_block", "forward"): ("fp8_gemm", "FP8 block-scaled grouped GEMM (fusion/kernels/fp8_gemm.py), the "
                                                "input quantized 1x128 unless it already is"),
    ("gemm:fp8_block", "dgrad"): ("fp8_gemm", "FP8 block-scaled grouped GEMM of dY (quantized 1x128) and the "
                                              "weight's transposed blocks (fusion/kernels/fp8_gemm.py)"),
    ("gemm:fp8_block", "wgrad"): ("fp8_gemm", "FP8 varlen-K grouped GEMM (fusion/kernels/fp8_wgrad.py) of the "
                                              "per-group columnwise FP8 copies of dY and X, which the quantize "
                                              "kernel writes in its slot layout, where fp8_linear.WGRAD_IN_BF16's "
                                              "rule takes FP8; otherwise the bf16 varlen-K grouped GEMM of the "
                                              "high-precision dY and X (a Linear: torch's matmul)"),
    ("gemm", "forward"): ("lone_gemm", "varlen-M grouped GEMM " + _lone_rule_text("forward")),
    ("gemm", "dgrad"): ("lone_gemm", "varlen-M grouped GEMM of dY and the weight as stored "
                                     + _lone_rule_text("dgrad")),
    ("gemm", "wgrad"): ("wgrad_gemm", "varlen-K grouped GEMM (fusion/kernels/varlen_k_gemm.py: every group's "
                                      "dY_g.T @ X_g in one launch, TMA with X's tile multicast to a CTA pair; "
                                      "128x192 pingpong tiles at 192-1535 rows per group, wider ones elsewhere; "
                                      "after a Gather, at >= 1024 rows per group with in_features a multiple of "
                                      "256, X's rows read through the routing index, no regathered copy; before a "
                                      "Combine, at >= 1024 rows per group with in_features <= 1024, dY's rows "
                                      f"through it), at >= {WGRAD_RULE['min_groups']} groups; one group: torch's "
                                      "matmul (cuBLAS)"),
}

#: What a device method's kernel takes, by variant (the runtime module's `takes` checks the same at run time):
#: the dtypes, and the multiple both feature widths must be (16-byte rows of one-byte FP8 codes).
DEVICE_METHOD_LIMITS: dict[str, dict] = {
    "combine": {"dtypes": ("bfloat16", "float16", "float32")},
    "gather": {"dtypes": ("bfloat16", "float16", "float32")},
    "gemm:fp8_block": {"dtypes": ("bfloat16", "float16"), "feature_multiple": 16},
    "gemm": {"dtypes": ("bfloat16", "float16"), "feature_multiple": 8, "ops": ("GroupLinear",)},
    "quantize:fp8_block": {"dtypes": ("bfloat16", "float16", "float32"), "feature_multiple": 8},
}


def _variant(kind: str, weight_format: str | None) -> str:
    return kind if weight_format in (None, "bf16") else f"{kind}:{weight_format}"


def device_method(kind: str, part: str, weight_format: str | None = None) -> tuple[str, str] | None:
    """The DEVICE_METHODS entry of an op of `kind` (a GEMM's `weight_format`, a quantize op's format) for
    `part`, or None."""
    return DEVICE_METHODS.get((_variant(kind, weight_format), part))


def device_method_refusal(kind: str, weight_format: str | None, dtype: str, widths,
                          op_name: str | None = None) -> str | None:
    """Why the device method's kernel cannot take this op (named `op_name`; None: not checked) at `dtype` with
    these feature `widths` (None ones are unknown, not checked), or None when it can."""
    limits = DEVICE_METHOD_LIMITS.get(_variant(kind, weight_format), {})
    ops = limits.get("ops")
    if ops and op_name is not None and op_name not in ops:
        return f"its kernel runs {'/'.join(ops)} only"
    if dtype and dtype not in limits.get("dtypes", (dtype,)):
        return f"its kernel runs {'/'.join(limits['dtypes'])}, the dtype is {dtype}"
    multiple = limits.get("feature_multiple")
    bad = [w for w in widths if multiple and w is not None and w % multiple]
    if bad:
        return f"its kernel needs feature widths that are multiples of {multiple}, got {bad[0]}"
    return None


_GEMM_REFUSALS: dict = {}


def dtype_name(dtype) -> str:
    """A torch dtype's name without "torch." (what gemm_refusal takes), kept per dtype: str() of a dtype costs host
    time, and device methods' `takes` asks on every call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict = {}


def gemm_refusal(op, dtype: str) -> str | None:
    """device_method_refusal("gemm", None, dtype, (op.in_features, op.out_features), op.spec.name), kept per
    (op class, widths, dtype): the lone GEMM's and the weight gradient's `takes` ask it on every call, where
    building the op's spec and checking the table cost several microseconds of host time each."""
    key = (type(op), op.in_features, op.out_features, dtype)
    if key not in _GEMM_REFUSALS:
        _GEMM_REFUSALS[key] = device_method_refusal("gemm", None, dtype, (op.in_features, op.out_features),
                                                    op.spec.name)
    return _GEMM_REFUSALS[key]


def op_device_method(op, part: str) -> tuple[str, str] | None:
    """The DEVICE_METHODS entry of an op object for `part` (its variant: kind, and a GEMM's weight_format or a
    quantize op's format), or None."""
    spec = op.spec
    fmt = spec.attrs.get("weight_format") if spec.kind == "gemm" else spec.attrs.get("format")
    return device_method(spec.kind, part, fmt)
