"""The FP8-block quantize kernel (fusion/kernels/fp8_quantize.py) on the CPU: every variant the host API builds
compiles for sm_90a without local-memory spills, with 16-byte loads, E4M3 conversions and the stores its layout
promises; and the host API refuses what it cannot take with a FusionError naming the fix.

GPU correctness (bit for bit against fusion.quant) is tests/test_fp8_quantize_gpu.py.
"""
import os
import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fusion.errors import DeviceError, DTypeError, FusionError, GroupSizesError, ShapeError  # noqa: E402
from conftest import sass_or_skip  # noqa: E402


def _compile(dtype, K, columnwise, G=1, sizes_dtype=None, amax=False):
    from fusion.kernels.api import _cubin_nv_info, sass_opcodes, sass_text
    from fusion.kernels.fp8_quantize import build_kernel

    _, cubin, kernel = build_kernel(dtype, K, columnwise, G, sizes_dtype, amax)  # what compile_fp8_quantize builds
    info = _cubin_nv_info(cubin)
    info["min_ctas"] = kernel.min_ctas
    info["stages"] = kernel.stages
    ops = sass_opcodes(sass_or_skip(lambda: sass_text(cubin)))
    return info, ops


# every dtype x (rowwise, columnwise without groups, with int32 / int64 groups), over full and partial k-blocks; bf16
# (K, M) at G=1 with K=7168 and 2880, where the other tile order spilled at two CTAs an SM (stop 66)
VARIANTS = [
    ("bfloat16", 2048, False, 1, None), ("float16", 200, False, 1, None), ("float32", 7168, False, 1, None),
    ("bfloat16", 7168, True, 1, None), ("bfloat16", 2880, True, 1, None), ("bfloat16", 136, True, 6, "int32"),
    ("bfloat16", 1536, True, 128, "int64"),
    ("float16", 2048, True, 1024, "int32"), ("float16", 8, True, 1, None),
    ("float32", 200, True, 6, "int64"), ("float32", 2048, True, 1, None),
]


@pytest.mark.parametrize("dtype,K,columnwise,G,sizes_dtype", VARIANTS)
def test_kernel_compiles_without_spills(dtype, K, columnwise, G, sizes_dtype):
    info, ops = _compile(dtype, K, columnwise, G, sizes_dtype)
    assert info.get("frame_size", 0) == 0, f"{info.get('frame_size')}-byte stack frame (spills)"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert any(o.startswith("LDG") and ".128" in o for o in ops), "x is read in 16-byte chunks"
    assert any(o.startswith("F2FP.SATFINITE.E4M3") for o in ops), "E4M3 by the saturating pair conversion"
    rowwise_store = "STG.E.64" if dtype != "float32" else "STG.E"
    assert rowwise_store in ops, f"a thread's row chunk of codes is one {rowwise_store}"
    assert not any(o.startswith(("ATOM", "RED")) for o in ops), "no atomics without the amax"
    if columnwise:
        assert any(o.startswith("STS.") and o.split(".")[-1] in ("64", "128") for o in ops), \
            "a column's codes go to shared memory as one 8- or 16-byte store"
        assert any(o.startswith("BAR.SYNC") for o in ops)
    if sizes_dtype is not None:
        assert "SHFL.UP" in ops, "the group offsets are a warp scan on the device"
    if not columnwise:
        assert info["min_ctas"] == 2, "the rowwise kernel fits two CTAs an SM"
    if dtype == "bfloat16":
        assert info["min_ctas"] == 2, "the bf16 kernels fit two CTAs an SM"
    from fusion.kernels import fp8_quantize
    if columnwise and dtype == "bfloat16" and fp8_quantize.PIPELINED_COLUMNS:
        # the (K, M) build pipelined at two CTAs an SM: a ring of tiles loaded by cp.async
        assert info["stages"] >= 2 and any(o.startswith("LDGSTS") for o in ops), (info, "no cp.async ring")


@pytest.mark.parametrize("dtype,K,columnwise,G,sizes_dtype", [VARIANTS[0], VARIANTS[4], VARIANTS[8]])
def test_amax_variant_adds_one_atomic_max_and_no_spills(dtype, K, columnwise, G, sizes_dtype):
    """QuantizeFP8Block's amax from the same pass: an integer max of float32 bits per warp (order-free)."""
    info, ops = _compile(dtype, K, columnwise, G, sizes_dtype, amax=True)
    assert info.get("frame_size", 0) == 0 and not any(o.startswith(("LDL", "STL")) for o in ops)
    atomics = [o for o in ops if o.startswith(("ATOM", "RED"))]
    assert atomics and all(".MAX" in o and ".S32" in o for o in atomics), atomics


def test_kernel_refuses_rows_of_partial_chunks_and_too_many_groups():
    from fusion.kernels.fp8_quantize import MAX_GROUPS, FP8QuantizeKernel

    with pytest.raises(ValueError, match="multiple of 8"):
        FP8QuantizeKernel("bfloat16", 2044, False)
    with pytest.raises(ValueError, match="multiple of 4"):
        FP8QuantizeKernel("float32", 2046, False)
    with pytest.raises(ValueError, match="groups"):
        FP8QuantizeKernel("bfloat16", 2048, True, MAX_GROUPS + 1, "int32")


@pytest.mark.parametrize("x,columnwise,sizes,cls,match", [
    (torch.zeros(4, 16, dtype=torch.float64), False, None, DTypeError, "bfloat16, float16 or float32"),
    (torch.zeros(4, 16, dtype=torch.int32), False, None, DTypeError, "cast the input"),
    (torch.zeros(2, 4, 16), False, None, ShapeError, "reshape"),
    (torch.zeros(4, 16, dtype=torch.bfloat16), False, None, DeviceError, r"\.cuda\(\)"),
])
def test_host_api_refuses_with_a_fusion_error(x, columnwise, sizes, cls, match):
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device, unsupported_reason

    with pytest.raises(cls, match=match) as err:
        quantize_fp8_block_device(x, columnwise, sizes)
    assert isinstance(err.value, FusionError)
    assert unsupported_reason(x, columnwise, sizes) is not None


def test_group_sizes_problems_are_named():
    from fusion.kernels import fp8_quantize_api as api

    class FakeCuda(torch.Tensor):  # the checks after the device check, without a GPU
        is_cuda = True

    x = torch.zeros(4, 16, dtype=torch.bfloat16).as_subclass(FakeCuda)
    assert api._problem(x, True, torch.zeros(2, dtype=torch.float32))[0] is GroupSizesError
    assert api._problem(x, True, torch.zeros(2000, dtype=torch.int32))[0] is GroupSizesError
    assert api._problem(x, False, torch.zeros(2000, dtype=torch.int32)) is None   # rowwise ignores the groups
    assert api._problem(x[:, :12], False, None)[0] is ShapeError                 # K=12: not 16-byte rows
    square = torch.zeros(16, 16, dtype=torch.bfloat16).as_subclass(FakeCuda)
    assert "contiguous" in api._problem(square.t(), False, None)[1]


def _funnel_lanes():
    """The 32 lanes' ``funnel_word`` of store_columns, compiled by the DSL for the host (no GPU):
    ``f(words, out, sh)`` writes each lane's stored word to ``out[lane]`` and its spill to ``out[32 + lane]``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    from fusion.kernels.fp8_quantize import funnel_word

    @cute.jit
    def lanes(words: cute.Tensor, out: cute.Tensor, sh: Int32):
        for lane in cutlass.range(32):
            val, spill = funnel_word(words[cutlass.max(lane - 1, Int32(0))], words[lane], sh, lane == 0)
            out[lane] = Int32(val)
            out[32 + lane] = Int32(spill)

    words, out = torch.zeros(32, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    compiled = cute.compile(lanes, from_dlpack(words), from_dlpack(out), Int32(0))
    return lambda w, o, sh: compiled(from_dlpack(w), from_dlpack(o), Int32(sh))


def test_columnwise_words_carry_the_column_bytes_at_every_alignment():
    """A column's 128 codes (as the shared tile holds them, 32 little-endian words) land at byte ``sh`` of
    aligned words: lane ``w`` stores bytes ``4w - sh ..``, lane 31 spills the last ``sh``. Codes >= 0x80
    (negative values, -0.0) sit in every position: an arithmetic shift would turn the bytes above them into
    0xFF (the bug behind every columnwise mismatch on the GPU)."""
    run = _funnel_lanes()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (128,), dtype=torch.uint8, generator=g)
    codes[3::4] = torch.tensor([0x80, 0xFF, 0xFE, 0x7F], dtype=torch.uint8).repeat(8)   # every top byte signed
    codes[:4] = torch.tensor([0x80, 0x00, 0x81, 0xC0], dtype=torch.uint8)
    for sh in range(4):
        out = torch.zeros(64, dtype=torch.int32)
        run(codes.view(torch.int32).clone(), out, sh)
        stored = torch.cat([out[:32].view(torch.uint8), out[32 + 31:].view(torch.uint8)])  # words, then the spill
        assert torch.equal(stored[sh:sh + 128], codes), (
            f"sh={sh}: bytes {(stored[sh:sh + 128] != codes).nonzero().flatten()[:8].tolist()} differ")


def test_column_edge_bytes_and_whole_words_store_every_row_once():
    """store_column's rows as the kernel computes them (whole_word_rows, edge_byte_row; compiled by the DSL for
    the host): for every start alignment ``sh`` and column length ``nrows`` (1..128), the lanes' whole words and
    their edge bytes together write each row of ``[0, nrows)`` exactly once, and nothing outside it."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    from fusion.kernels.fp8_quantize import edge_byte_row, whole_word_rows

    @cute.jit
    def rows(out: cute.Tensor, sh: Int32, nrows: Int32):
        for lane in cutlass.range(32):
            p, whole = whole_word_rows(lane, sh, nrows)
            r, edge = edge_byte_row(lane, sh, nrows)
            out[4 * lane] = p
            out[4 * lane + 1] = Int32(whole)
            out[4 * lane + 2] = r
            out[4 * lane + 3] = Int32(edge)

    out = torch.zeros(128, dtype=torch.int32)
    compiled = cute.compile(rows, from_dlpack(out), Int32(0), Int32(1))
    for sh in range(4):
        for nrows in range(1, 129):
            compiled(from_dlpack(out), Int32(sh), Int32(nrows))
            lanes = out.view(32, 4).tolist()
            written = [p + j for p, whole, _, _ in lanes if whole for j in range(4)]
            written += [r for _, _, r, edge in lanes if edge]
            assert sorted(written) == list(range(nrows)), (sh, nrows, sorted(written))
            assert all(r < 0 or not edge or lane < 6 for lane, (_, _, r, edge) in enumerate(lanes))


def test_columnwise_store_shifts_are_logical(tmp_path):
    """In the compiled kernel, no right shift by a register amount is arithmetic (``shr.s32``): the funnel
    shifts of the columnwise store move raw code bytes (constant shifts, e.g. of signed divisions, may be)."""
    import re

    from fusion.kernels.fp8_quantize import FP8QuantizeKernel, compile_kernel

    compile_kernel(FP8QuantizeKernel("bfloat16", 200, True, 6, "int32"),
                   f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp_path}")
    ptx = "\n".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert re.search(r"\bshr\.u32\s+%r\d+, %r\d+, %r\d+;", ptx), "the funnel shift is in the PTX"
    signed = re.findall(r"\bshr\.s32\s+%r\d+, %r\d+, %r\d+;", ptx)
    assert not signed, f"arithmetic right shifts by a register amount: {signed[:4]}"


@pytest.mark.parametrize("amax", [False, True])
def test_bf16_rowwise_kernel_tests_packed_pairs(amax):
    """The bf16 rowwise kernel (what quantizes x, dY and dH in a training step) tests its values a packed pair at a
    time (fp8_quantize.PAIRS, pow2_quant.finite_abs2_bf16): no per-value NaN select (``FSEL ... +QNAN``), a halfwise
    max, fewer instructions than the value-at-a-time build, no spills, and still two CTAs an SM."""
    import collections
    import re

    from fusion.kernels.api import _cubin_nv_info, sass_text
    from fusion.kernels.fp8_quantize import build_kernel

    sass, ops = {}, {}
    for pairs in (True, False):
        _, cubin, kernel = build_kernel("bfloat16", 2048, False, amax=amax, pairs=pairs)
        assert _cubin_nv_info(cubin).get("frame_size", 0) == 0 and kernel.min_ctas == 2
        sass[pairs] = sass_or_skip(lambda: sass_text(cubin))
        from fusion.kernels.api import sass_opcodes
        ops[pairs] = collections.Counter(sass_opcodes(sass[pairs]))
    assert not re.search(r"\bFSEL\b[^;]*\+QNAN", sass[True]) and re.search(r"\bFSEL\b[^;]*\+QNAN", sass[False])
    assert ops[True]["VIMNMX3.U16"] + ops[True]["VIMNMX.U16"] > 0, ops[True]
    assert sum(ops[True].values()) < 0.9 * sum(ops[False].values()), (sum(ops[True].values()),
                                                                      sum(ops[False].values()))


def test_rowwise_slots_build_forced_to_two_ctas_an_sm():
    """The bf16 rowwise + slots build (one read of dY for both backward copies: fusion.runtime.fp8_gemm
    ONE_PASS_DY_CTAS). Testing its values a packed pair at a time (COLUMN_PAIRS) it fits two CTAs an SM by its
    no-spill rule; value at a time it needs more than 128 registers, so the rule builds it for one, and ``min_ctas =
    2`` builds it for two whatever it spills: at most 128 registers a thread."""
    from fusion.kernels.api import _cubin_nv_info
    from fusion.kernels.fp8_quantize import build_kernel

    # Mixtral's FC1 dY (K = 28672)
    _, cubin, kernel = build_kernel("bfloat16", 28672, True, 8, "int32", slots=True, rowwise=True, column_pairs=True)
    assert kernel.min_ctas == 2 and _cubin_nv_info(cubin).get("frame_size", 0) == 0
    _, cubin, kernel = build_kernel("bfloat16", 28672, True, 8, "int32", slots=True, rowwise=True, column_pairs=False)
    assert kernel.min_ctas == 1 and _cubin_nv_info(cubin).get("frame_size", 0) == 0
    _, cubin, kernel = build_kernel("bfloat16", 28672, True, 8, "int32", slots=True, rowwise=True, min_ctas=2,
                                    column_pairs=False)
    info = _cubin_nv_info(cubin)
    assert kernel.min_ctas == 2 and info["registers"] <= 128


@pytest.mark.parametrize("rowwise", [False, True], ids=["slots", "rowwise-slots"])
def test_bf16_columnwise_builds_test_packed_pairs(rowwise):
    """COLUMN_PAIRS: a bf16 columnwise build folds a word's two magnitudes with one max.u16x2 (VIMNMX.U16 /
    VIMNMX3.U16 in SASS) and scales the parked clean words with no per-value test: fewer instructions than the
    value-at-a-time build, no spills, two CTAs an SM; and the pipelined slot build loads by cp.async (LDGSTS)."""
    from fusion.kernels.api import _cubin_nv_info, sass_opcodes, sass_text
    from fusion.kernels.fp8_quantize import build_kernel

    counts = {}
    for column_pairs in (False, True):
        _, cubin, kernel = build_kernel("bfloat16", 2048, True, 64, "int32", slots=True, rowwise=rowwise,
                                        pipelined=True, column_pairs=column_pairs)
        ops = sass_opcodes(sass_or_skip(lambda: sass_text(cubin)))
        counts[column_pairs] = len(ops)
        if column_pairs:
            assert kernel.column_pairs and kernel.stages >= 2
            assert _cubin_nv_info(cubin).get("frame_size", 0) == 0 and kernel.min_ctas == 2
            assert any(o.startswith("LDGSTS") for o in ops), "the pipelined build loads by cp.async"
            assert any(o in ("VIMNMX.U16", "VIMNMX3.U16") for o in ops), "no packed 16-bit max"
    assert counts[True] < 0.9 * counts[False], f"{counts[True]} instructions with pairs, {counts[False]} without"


def test_pipelined_rowwise_build_compiles_with_its_ring_and_a_closing_barrier():
    """PIPELINED_ROWWISE (off by default): the rowwise-only build as persistent CTAs loading their next tiles by
    cp.async into a ring of shared tiles. It compiles without spills at two CTAs an SM with three stages, loads by
    LDGSTS, and each tile ends with a barrier (the next tile's row scales go through the same shared tile)."""
    from fusion.kernels.api import _cubin_nv_info, sass_opcodes, sass_text
    from fusion.kernels.fp8_quantize import build_kernel

    _, cubin, kernel = build_kernel("bfloat16", 2048, False, pipelined=True)
    _, plain_cubin, _ = build_kernel("bfloat16", 2048, False, pipelined=False)
    ops = sass_opcodes(sass_or_skip(lambda: sass_text(cubin)))
    plain = sass_opcodes(sass_text(plain_cubin))
    assert kernel.stages == 3 and kernel.min_ctas == 2 and _cubin_nv_info(cubin).get("frame_size", 0) == 0
    assert any(o.startswith("LDGSTS") for o in ops) and not any(o.startswith("LDGSTS") for o in plain)
    bars = lambda codes: sum(o.startswith("BAR.SYNC") for o in codes)  # noqa: E731
    assert bars(ops) == bars(plain) + 1, (bars(ops), bars(plain))


def test_pipelined_loads_zero_fill_what_they_mask(tmp_path):
    """The pipelined builds' cp.async loads carry a source size (``cp.async.cg.shared.global [dst], [src], 16, n``):
    a masked row or chunk is zero-filled (n = 0) rather than skipped, so a ring stage never hands a tile the rows an
    earlier tile left there (the slot layout's zeros past a block's rows and the amaxes depend on it)."""
    import re

    from fusion.kernels.fp8_quantize import FP8QuantizeKernel, compile_kernel

    kernel = FP8QuantizeKernel("bfloat16", 1032, True, 8, "int32", 2, False, True, False, True, True, True)
    assert kernel.stages >= 2
    compile_kernel(kernel, f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp_path}")
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx"))
    loads = re.findall(r"cp\.async\.cg\.shared\.global\s+\[[^]]+\],\s*\[[^]]+\],\s*16(,\s*%r\d+)?;", ptx)
    assert loads, "no 16-byte cp.async in the pipelined slot build"
    assert all(size for size in loads), "a cp.async without a source size: masked rows would keep stale data"


def test_bound_rowwise_quantization_on_the_cpu_is_the_checked_path():
    """quantize_fp8_block_rowwise_bound binds CUDA launches only: a CPU tensor takes the checked path, which
    declines it (the runtime then runs the reference), and nothing is bound."""
    from fusion.kernels import fp8_quantize_api as api
    from fusion.runtime import fp8_gemm
    from fusion.quant.fp8_block import fp8_block_quantize_2d

    x = torch.randn(300, 256, dtype=torch.bfloat16)
    before = dict(api._ROWWISE)
    assert api.quantize_fp8_block_rowwise_bound(x) is None
    assert api._ROWWISE == before
    got, want = fp8_gemm._rowwise(x), fp8_block_quantize_2d(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
