"""The FP8-block quantize kernel on the GPU (fusion/kernels/fp8_quantize.py; needs sm_90, else skipped).

Bit for bit against the reference quantizer (fusion.quant.fp8_block_quantize_2d / _columnwise): codes AND
scales, rowwise and columnwise, on random, structured and adversarial data, partial k-blocks, partial and
empty groups, M = 0 and 1, every input dtype; outputs are poisoned first (every byte must be written); and no
host synchronisation (the call is captured in a CUDA graph and replayed).

    python3 -m pytest -q -p no:cacheprovider tests/test_fp8_quantize_gpu.py
"""
import pytest
import torch
from conftest import assert_same_bits, every_bf16_pattern, hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device  # noqa: E402
from fusion.quant.fp8_block import fp8_block_quantize_2d, fp8_block_quantize_columnwise  # noqa: E402

DEV = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _reference(x, columnwise, group_sizes):
    data, scale = fp8_block_quantize_2d(x.float())
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = fp8_block_quantize_columnwise(x.float(), group_sizes)
    return data, scale, cw_data, cw_scale


_same_bits = assert_same_bits


def _check(x, columnwise=True, group_sizes=None):
    got = quantize_fp8_block_device(x, columnwise, group_sizes)
    want = _reference(x, columnwise, group_sizes)
    for name, g, w in zip(("data", "scale", "cw_data", "cw_scale"), got, want):
        if w is None:
            assert g is None
        else:
            _same_bits(name, g, w)
    return got


def _random(M, K, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g)
    # rows and 128-blocks of very different magnitudes (a scale applied to the wrong block shows)
    x = x * torch.exp2(torch.randint(-20, 20, (M, 1), device=DEV, generator=g).float())
    x = x * torch.exp2(torch.randint(-6, 6, (1, K), device=DEV, generator=g).float())
    return x.to(dtype)


def _adversarial(M, K, dtype):
    """All-zero blocks, huge and tiny (subnormal) values, +-Inf, NaN, -0.0, each in some blocks."""
    x = _random(M, K, torch.float32, seed=1)
    r = torch.arange(M, device=DEV).unsqueeze(1)
    c = torch.arange(K, device=DEV).unsqueeze(0)
    big = torch.finfo(dtype).max / 2 if dtype != torch.float32 else 3e38
    tiny = torch.finfo(dtype).smallest_normal / 4 if dtype != torch.float32 else 1e-40   # subnormal
    x = torch.where((r % 7 == 0) & (c < 128), torch.zeros_like(x), x)                    # zero row blocks
    x = torch.where((c % 131 == 5) & (r % 3 == 0), torch.full_like(x, big), x)
    x = torch.where((c % 97 == 3) & (r % 5 == 1), torch.full_like(x, tiny), x)
    x = torch.where((r % 11 == 2) & (c >= 128), torch.full_like(x, tiny) * (c % 2 * 2 - 1), x)  # tiny-only blocks
    x = torch.where((c % 53 == 7) & (r % 4 == 2), torch.full_like(x, float("inf")), x)
    x = torch.where((c % 59 == 11) & (r % 4 == 3), torch.full_like(x, -float("inf")), x)
    x = torch.where((c % 61 == 13) & (r % 2 == 0), torch.full_like(x, float("nan")), x)
    x = torch.where((c % 17 == 1) & (r % 6 == 4), torch.full_like(x, -0.0), x)
    x = torch.where((r % 13 == 6), torch.full_like(x, -0.0), x)                          # -0.0-only rows
    x[:, -1] = float("nan")                                                             # NaN in every row
    x = x.to(dtype)
    # NaN with its sign bit set (torch's conversions make every NaN +NaN): 0xFFC0 / 0xFE00 / 0xFFC00000
    ints = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
    neg_nan = {torch.bfloat16: -64, torch.float16: -512, torch.float32: -4194304}[dtype]
    ints[((c % 67 == 19) & (r % 3 == 1)).expand_as(ints)] = neg_nan
    return x


def _structured(M, K, dtype):
    """Ramps, powers of two, and block maxima exactly at and one ulp around 448 * 2^k (the scale's steps)."""
    r = torch.arange(M, device=DEV, dtype=torch.float32).unsqueeze(1)
    c = torch.arange(K, device=DEV, dtype=torch.float32).unsqueeze(0)
    x = (c - K / 2) * (r + 1) / 64                                                      # ramps
    pow2 = torch.exp2((c % 40) - 20) * torch.where(r % 2 == 0, 1.0, -1.0)
    x = torch.where(r % 3 == 1, pow2.expand_as(x), x)
    k = ((r % 9) - 4) * 3
    edge = 448.0 * torch.exp2(k)
    ulp = torch.where(r % 4 == 0, 1.0, torch.where(r % 4 == 1, 1.0 + 2.0 ** -7, 1.0 - 2.0 ** -8))
    x = torch.where((r % 3 == 2) & (c % 128 == 17), (edge * ulp).expand_as(x), x)
    x = torch.where((r % 3 == 2) & (c % 128 != 17), (edge * torch.sin(c)).expand_as(x) / 3, x)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(256, 2048), (300, 200), (129, 136), (1, 128), (1, 8), (1000, 1536),
                                 (77, 7168)])
def test_random_rowwise_and_columnwise(dtype, M, K):
    _check(_random(M, K, dtype), columnwise=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(260, 512), (131, 200)])
def test_rowwise_only(dtype, M, K):
    data, scale, cw_data, cw_scale = _check(_random(M, K, dtype), columnwise=False)
    assert cw_data is None and cw_scale is None


@pytest.mark.parametrize("columnwise", [True, False], ids=["cw", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(384, 256), (200, 136)])
def test_structured(dtype, M, K, columnwise):
    _check(_structured(M, K, dtype), columnwise=columnwise)


@pytest.mark.parametrize("columnwise", [True, False], ids=["cw", "rowwise"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K", [(390, 384), (129, 200)])
def test_adversarial(dtype, M, K, columnwise):
    """Rowwise only too: the bf16 rowwise-only kernel tests its values a packed pair at a time (fp8_quantize.PAIRS),
    the others one at a time; the same bytes either way."""
    _check(_adversarial(M, K, dtype), columnwise=columnwise)


@pytest.mark.parametrize("columnwise", [True, False], ids=["cw", "rowwise"])
def test_every_bf16_bit_pattern(columnwise):
    """Every one of the 65536 bf16 bit patterns, each next to each of a block's magnitudes: the rowwise-only kernel
    tests them a packed pair at a time (pow2_quant.finite_abs2_bf16's carry into each half's top bit: the boundary is
    0x7F7F, the largest finite magnitude, against 0x7F80, Inf), the columnwise one a value at a time; both bit for bit
    the reference. Rows are rolled copies of all patterns, so every pattern meets both halves of a word and blocks of
    every kind (with and without Inf, NaN of either sign, subnormals, zeros)."""
    _check(every_bf16_pattern().to(DEV), columnwise=columnwise)


@pytest.mark.parametrize("sizes_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sizes", [[5, 0, 3, 300, 0, 129], [0, 0, 437], [437, 0], [128, 128, 1, 127, 53, 0],
                                   [1] * 37 + [400]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups(sizes, sizes_dtype, dtype):
    """Partial and empty groups (blocks per group, unused capacity 0.0), group starts at every alignment."""
    M = sum(sizes)
    x = _adversarial(M, 200, dtype) if sizes_dtype == torch.int32 else _random(M, 2048, dtype)
    _check(x, columnwise=True, group_sizes=torch.tensor(sizes, dtype=sizes_dtype, device=DEV))


def test_many_groups():
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 40, (1024,), generator=g)
    sizes[::7] = 0
    x = _random(int(sizes.sum()), 136, torch.bfloat16)
    _check(x, columnwise=True, group_sizes=sizes.to(DEV))


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("group_sizes", [None, [0, 0, 0]])
def test_no_rows(columnwise, group_sizes):
    sizes = None if group_sizes is None else torch.tensor(group_sizes, device=DEV)
    _check(torch.empty(0, 256, device=DEV, dtype=torch.bfloat16), columnwise, sizes)


def test_every_byte_is_written():
    """Outputs come from torch.empty: run once over memory full of a poison pattern, compare."""
    x = _adversarial(333, 264, torch.bfloat16)
    sizes = torch.tensor([100, 0, 33, 200], device=DEV)
    for _ in range(3):
        junk = torch.full((64 << 20,), 0x55, dtype=torch.uint8, device=DEV)
        del junk
        _check(x, columnwise=True, group_sizes=sizes)


def test_no_host_sync_and_graph_capture():
    """The call neither synchronises (sync debug mode "error" raises on any) nor breaks CUDA-graph capture: the
    captured graph, replayed on new data and new group sizes, matches the reference."""
    x = _random(500, 2048, torch.bfloat16)
    sizes = torch.tensor([100, 0, 250, 150], device=DEV)
    quantize_fp8_block_device(x, True, sizes)          # compile outside the checks
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantize_fp8_block_device(x, True, sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = quantize_fp8_block_device(x, True, sizes)
    x.copy_(_adversarial(500, 2048, torch.bfloat16))
    sizes.copy_(torch.tensor([1, 300, 0, 199], device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(x, True, sizes)
    for name, g, w in zip(("data", "scale", "cw_data", "cw_scale"), out, want):
        _same_bits(name, g, w)


def test_runs_on_the_current_stream():
    x = _random(1024, 4096, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = quantize_fp8_block_device(x, True)
        ref = _reference(x, True, None)
        for name, g, w in zip(("data", "scale", "cw_data", "cw_scale"), out, ref):
            _same_bits(name, g, w)


@pytest.mark.parametrize("blocks_fastest", [True, False], ids=["blocks-fastest", "columns-fastest"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pipelined_columns_over_many_tiles_a_cta_match_the_reference(dtype, blocks_fastest, monkeypatch):
    """PIPELINED_COLUMNS (kernels/fp8_quantize.py): the bf16 (K, M) columnwise + rowwise build as persistent CTAs over
    ~13 or more tiles each, ring stages refilled many times, in either tile order (BLOCKS_FASTEST), with ragged groups
    (group starts at every byte alignment of a column, partial blocks zero-filled over a stage's previous tile, empty
    groups, unused capacity), Inf/NaN, a partial last column block: every byte the one-tile-a-CTA build's and the
    reference's, and the tensor's amax (the try_ entry point) the same. fp16 and fp32 stay one tile a CTA (pipelined
    they ran one CTA an SM, 21-25% slower in fp16): the same bytes either way."""
    from fusion.kernels import fp8_quantize
    from fusion.kernels.fp8_quantize_api import try_quantize_fp8_block_device

    monkeypatch.setattr(fp8_quantize, "BLOCKS_FASTEST", blocks_fastest)
    gen = torch.Generator().manual_seed(7)
    sizes = (torch.rand(64, generator=gen) * 1400).long()
    sizes[::9] = 0
    sizes[5], sizes[6] = 1, 3
    sizes = sizes.to(DEV, torch.int32)
    M, K = int(sizes.sum()), 1032
    x = _adversarial(M, K, dtype)

    def run():
        amax = torch.zeros((), dtype=torch.int32, device=DEV)
        return (*try_quantize_fp8_block_device(x, True, sizes, amax), amax)

    monkeypatch.setattr(fp8_quantize, "PIPELINED_COLUMNS", False)
    want = run()
    monkeypatch.setattr(fp8_quantize, "PIPELINED_COLUMNS", True)
    got = run()
    tiles = (-(-M // 128) + 64) * -(-K // 128)
    assert tiles > 10 * 2 * torch.cuda.get_device_properties(0).multi_processor_count, "too few tiles a CTA"
    for name, g, w in zip(("data", "scale", "cw_data", "cw_scale", "amax"), got, want):
        _same_bits(name, g, w)
    for name, g, w in zip(("data", "scale", "cw_data", "cw_scale"), got, _reference(x, True, sizes)):
        _same_bits(name, g, w)


@pytest.mark.parametrize("edge_lanes", [True, False], ids=["edge-lanes", "edge-loops"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_edge_bytes_by_lanes_or_loops_match_the_reference(dtype, edge_lanes, monkeypatch):
    """EDGE_BYTES_BY_LANES (kernels/fp8_quantize.py): a (K, M) column's head and tail bytes stored one by each of six
    lanes, or by the byte loops of lanes 0 and 31: groups of every length 0..131 (starts at every byte alignment,
    columns shorter than their head, partial blocks), over memory full of a poison pattern: every byte the
    reference's."""
    from fusion.kernels import fp8_quantize

    monkeypatch.setattr(fp8_quantize, "EDGE_BYTES_BY_LANES", edge_lanes)
    gen = torch.Generator().manual_seed(11)
    sizes = torch.cat([torch.arange(0, 132), torch.randint(0, 300, (40,), generator=gen)])
    sizes = sizes[torch.randperm(len(sizes), generator=gen)].to(DEV, torch.int32)
    x = _adversarial(int(sizes.sum()), 264, dtype)
    junk = torch.full((64 << 20,), 0x55, dtype=torch.uint8, device=DEV)
    del junk
    _check(x, columnwise=True, group_sizes=sizes)


@pytest.mark.parametrize("skip", [True, False], ids=["skip-empty", "encode-empty"])
@pytest.mark.parametrize("build", ["columns", "slots", "rowwise-slots"])
def test_tiles_of_unused_capacity_skipped_or_encoded_match_the_reference(build, skip, monkeypatch):
    """SKIP_EMPTY_TILES (kernels/fp8_quantize.py): a pipelined columnwise build's tiles past every group's blocks
    (unused capacity: ``ceil(M / 128) + G`` row blocks are launched) take only their zero writes, after the used
    tiles, or are encoded like the others. 128 groups, most empty, so the unused tiles outnumber the CTAs several
    times over and the trailing loop runs many rounds; over memory full of a poison pattern (every zero scale and
    slot code must be written): every byte the reference's, in the (K, M) layout and the slot layouts."""
    from fusion.kernels import fp8_quantize
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_rowwise_slots, quantize_fp8_block_slots
    from fusion.quant.fp8_block import fp8_block_columnwise_slots

    monkeypatch.setattr(fp8_quantize, "SKIP_EMPTY_TILES", skip)
    gen = torch.Generator().manual_seed(13)
    sizes = torch.zeros(128, dtype=torch.int64)
    used = torch.randperm(128, generator=gen)[:24]
    sizes[used] = torch.randint(1, 700, (24,), generator=gen)
    sizes[used[0]] = 128
    sizes = sizes.to(DEV, torch.int32)
    M, K = int(sizes.sum()), 1032
    x = _adversarial(M, K, torch.bfloat16)
    empty_tiles = (-(-M // 128) + 128 - int((sizes.long() + 127).div(128, rounding_mode="floor").sum())) * -(-K // 128)
    assert empty_tiles > 2 * 2 * torch.cuda.get_device_properties(0).multi_processor_count, "too few unused tiles"
    junk = torch.full((64 << 20,), 0x55, dtype=torch.uint8, device=DEV)
    del junk
    data, scale, ref_cw, ref_cw_scale = _reference(x, True, sizes)
    if build == "columns":
        got = quantize_fp8_block_device(x, True, sizes)
        want = (data, scale, ref_cw, ref_cw_scale)
    elif build == "slots":
        got = quantize_fp8_block_slots(x, sizes)
        want = (fp8_block_columnwise_slots(ref_cw, sizes), ref_cw_scale)
    else:
        got = quantize_fp8_block_rowwise_slots(x, sizes, 0)
        want = (data, scale, fp8_block_columnwise_slots(ref_cw, sizes), ref_cw_scale)
    for i, (g, w) in enumerate(zip(got, want)):
        _same_bits(f"output {i}", g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rowwise_launch_bound_per_shape(dtype, monkeypatch):
    """The training step's rowwise quantizations launch through a binding made once per call shape
    (fp8_quantize_api.quantize_fp8_block_rowwise_bound): the same bits as the checked launch at every call, a new
    binding for a new shape, the checked path (and its refusal) for what the binding cannot take."""
    from fusion.kernels import fp8_quantize_api as api

    monkeypatch.setattr(api, "_ROWWISE", {})
    for M, K in ((300, 256), (300, 256), (4096, 2048), (1, 1536), (300, 256)):
        x = torch.randn(M, K, device=DEV, dtype=dtype) * 3
        got = api.quantize_fp8_block_rowwise_bound(x)
        want = fp8_block_quantize_2d(x.float())
        _same_bits("data", got[0], want[0])
        _same_bits("scale", got[1], want[1])
    assert len(api._ROWWISE) == 3
    wide = torch.randn(64, 512, device=DEV, dtype=dtype)
    got = api.quantize_fp8_block_rowwise_bound(wide[:, :256])   # a strided view: the checked path declines it
    assert got is None
    got = api.quantize_fp8_block_rowwise_bound(wide[1:, :].contiguous()[:, :256].contiguous())
    _same_bits("data", got[0], fp8_block_quantize_2d(wide[1:, :256].float())[0])
    monkeypatch.setattr(api, "BOUND_ROWWISE", False)
    x = torch.randn(300, 256, device=DEV, dtype=dtype)
    _same_bits("data", api.quantize_fp8_block_rowwise_bound(x)[0], fp8_block_quantize_2d(x.float())[0])
