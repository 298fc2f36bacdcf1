"""Hand-computed cases for the E4M3 / E8M0 / E2M1 codecs of fusion.quant.formats."""

import math

import pytest
import torch

from fusion.quant.formats import (decode_e2m1, decode_e4m3, decode_e8m0, encode_e2m1, encode_e4m3,
                                  encode_e8m0, pack_fp4, unpack_fp4)

NAN = float("nan")
INF = float("inf")
S = 2.0 ** -9  # smallest E4M3 subnormal


def enc(values, **kw):
    return encode_e4m3(torch.tensor(values, dtype=torch.float32), **kw).tolist()


@pytest.mark.parametrize("value,code", [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.0, 0xB8), (1.125, 0x39), (448.0, 0x7E),
    (-448.0, 0xFE), (2.0 ** -6, 0x08), (S, 0x01), (7 * S, 0x07), (240.0, 0x77), (224.0, 0x76),
    (2.0 ** 8, 0x78), (0.5, 0x30),
])
def test_e4m3_exact_values(value, code):
    assert enc([value]) == [code]
    assert decode_e4m3(torch.tensor([code], dtype=torch.uint8)).item() == value


@pytest.mark.parametrize("value,code", [
    (1.0625, 0x38),        # halfway 1.0 (0x38) / 1.125 (0x39) -> even 0x38
    (1.1875, 0x3A),        # halfway 1.125 (0x39) / 1.25 (0x3A) -> even 0x3A
    (232.0, 0x76),         # halfway 224 (0x76) / 240 (0x77) -> 224
    (248.0, 0x78),         # halfway 240 (0x77) / 256 (0x78) -> 256 (carry into the exponent)
    (464.0, 0x7E),         # halfway 448 / (480) -> 448, not NaN
    (0.5 * S, 0x00),       # subnormal tie 0 / S -> 0
    (1.5 * S, 0x02),       # subnormal tie S / 2S -> 2S
    (2.5 * S, 0x02),       # subnormal tie 2S / 3S -> 2S
    (7.5 * S, 0x08),       # tie largest subnormal / smallest normal -> 2^-6 (even code 0x08)
    (6.5 * S, 0x06),
    (-1.0625, 0xB8),
    (-0.5 * S, 0x80),      # negative tie to zero keeps the sign
])
def test_e4m3_ties_to_even(value, code):
    assert enc([value]) == [code]


def test_e4m3_just_off_ties_round_to_nearest():
    up = torch.nextafter(torch.tensor([1.0625, 0.5 * S, 464.0]), torch.tensor(INF))
    down = torch.nextafter(torch.tensor([1.1875, 1.5 * S]), torch.tensor(0.0))
    assert encode_e4m3(up).tolist() == [0x39, 0x01, 0x7F]  # > 464 overflows -> NaN
    assert encode_e4m3(down).tolist() == [0x39, 0x01]


def test_e4m3_special_values():
    assert enc([NAN, -NAN, INF, -INF, 500.0, -1e30]) == [0x7F] * 6
    assert enc([NAN, -NAN, INF, -INF, 500.0, -1e30], saturate=True) == [0x7F, 0x7F, 0x7E, 0xFE, 0x7E, 0xFE]
    # tiny values (including float32 subnormals) round to signed zero
    assert enc([1e-45, -1e-45, 1e-10, -1e-10]) == [0x00, 0x80, 0x00, 0x80]
    d = decode_e4m3(torch.tensor([0x7F, 0xFF, 0x80], dtype=torch.uint8))
    assert math.isnan(d[0]) and math.isnan(d[1])
    assert d[2].item() == 0.0 and math.copysign(1.0, d[2].item()) == -1.0


def test_e4m3_decode_table_matches_torch():
    c = torch.arange(256, dtype=torch.uint8)
    a = decode_e4m3(c)
    b = c.view(torch.float8_e4m3fn).float()
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a[~a.isnan()], b[~b.isnan()])
    assert torch.equal(decode_e4m3(c.view(torch.float8_e4m3fn)).nan_to_num(), a.nan_to_num())


def test_e4m3_encode_matches_torch_cast_sweep():
    # a stride through every float32 bit pattern, plus a dense sweep of E4M3's range
    bits = torch.arange(0, 2 ** 32, 65537 * 7, dtype=torch.int64) - 2 ** 31
    dense = torch.arange(0x3A000000, 0x43F00000, 97, dtype=torch.int64)
    x = torch.cat([bits, dense, dense | (1 << 31) - 2 ** 32]).to(torch.int32).view(torch.float32)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)
    # torch's cast is RNE; whether it saturates on overflow / Inf depends on the torch version
    # (2.13 CPU saturates, 2.11 gives NaN): compare with the matching mode of ours.
    torch_saturates = torch.tensor([500.0]).to(torch.float8_e4m3fn).view(torch.uint8).item() != 0x7F
    ours = encode_e4m3(x, saturate=torch_saturates)
    nan = decode_e4m3(ref).isnan()
    assert torch.equal(ours[~nan], ref[~nan])
    assert (ours[nan] == 0x7F).all()
    # the two modes differ only where |x| > 464 or x is infinite
    diff = encode_e4m3(x) != encode_e4m3(x, saturate=True)
    assert (x[diff].abs() > 464).all()
    assert not diff[x.abs() <= 464].any()


def test_e4m3_accepts_bf16_fp16():
    x = torch.tensor([1.0625, 3.0, -0.0, 2.0 ** -7])
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(encode_e4m3(x.to(dt)), encode_e4m3(x))


def test_e8m0():
    c = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    d = decode_e8m0(c)
    assert d[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(d[6])
    assert torch.equal(d.nan_to_num(), c.view(torch.float8_e8m0fnu).float().nan_to_num())
    e = torch.tensor([-200, -127, -1, 0, 5, 127, 300])
    assert encode_e8m0(e).tolist() == [0, 0, 126, 127, 132, 254, 254]


@pytest.mark.parametrize("value,code", [
    (0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7),
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),   # ties -> even code
    (0.26, 1), (0.74, 1), (1.3, 3), (2.6, 5), (5.01, 7), (4.9, 6),
    (7.0, 7), (1e30, 7), (INF, 7),                                               # saturating
    (-0.0, 8), (-0.25, 8), (-0.1, 8), (-0.75, 10), (-5.0, 14), (-6.0, 15), (-INF, 15),
    (NAN, 0), (-NAN, 0),
])
def test_e2m1_encode(value, code):
    assert encode_e2m1(torch.tensor([value])).tolist() == [code]


def test_e2m1_decode_and_packing():
    c = torch.arange(16, dtype=torch.uint8)
    d = decode_e2m1(c)
    assert d.tolist()[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert d.tolist()[8:] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1.0, d[8].item()) == -1.0
    assert torch.equal(encode_e2m1(d), c)  # round trip of every code
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]  # element 2j in the low nibble
    assert torch.equal(unpack_fp4(packed), codes)
