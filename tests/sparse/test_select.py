"""The selection kernels of functopk.sparse.select, each against an independent reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import select

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}


# --------------------------------------------------------------------------- nonzero_1d


@pytest.mark.parametrize("n", [0, 5, 4095, 4096, 4099, 10_007])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_nonzero_1d_matches_nonzero(n, density):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < density
    for hint in (0.0, 0.5):  # word path and plain path
        assert torch.equal(select.nonzero_1d(mask, hint), mask.nonzero().view(-1))
    # an unaligned view falls back to the plain path
    if n > 3:
        assert torch.equal(select.nonzero_1d(mask[3:]), mask[3:].nonzero().view(-1))


# --------------------------------------------------------------------------- radix select


@settings(max_examples=60)
@given(st.lists(st.integers(0, 2**31 - 1) | st.sampled_from([0, 1, 7, 2**31 - 1]), min_size=1, max_size=300), st.data())
def test_radix_kth_key_matches_sort(values, data):
    keys = torch.tensor(values, dtype=torch.int32)
    k = data.draw(st.integers(1, len(values)), label="k")
    expected = sorted(values, reverse=True)[k - 1]
    assert int(select.radix_kth_key(keys, torch.tensor(k), 31)) == expected


@pytest.mark.parametrize("dtype", FLOATS)
def test_mask_static_tensor_k_equals_int_k(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g).to(dtype)
    x[::7] = x[3]  # many ties
    x[5], x[9] = math.inf, 0.0
    mags = select.flat_magnitudes([x], dtype)
    for k in [1, 2, 17, 500, 2999, 3000]:
        expected = select.mask_static(mags, k)  # torch.topk path
        assert int(expected.sum()) == k
        assert torch.equal(select.mask_static(mags, torch.tensor(k)), expected)
    # out-of-range tensor k is clamped
    assert int(select.mask_static(mags, torch.tensor(0)).sum()) == 1
    assert bool(select.mask_static(mags, torch.tensor(10**9)).all())


# --------------------------------------------------------------------------- thresholds in narrower dtypes


@pytest.mark.parametrize("leaf_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_down_is_the_largest_value_not_above_t(leaf_dtype):
    # every non-negative finite value of the narrow dtype, compared exactly in float64
    if leaf_dtype == torch.float32:
        values = torch.randn(20_000, generator=torch.Generator().manual_seed(0)).abs().to(torch.float32)
    else:
        bits = torch.arange(0, 0x7C00 if leaf_dtype == torch.float16 else 0x7F80, dtype=torch.int16)
        values = bits.view(leaf_dtype)
    exact = values.to(torch.float64)
    g = torch.Generator().manual_seed(2)
    for t in [0.0, 1.0, 1.0006, 3.3e-5, 65504.5, 1e30, *torch.rand(20, generator=g, dtype=torch.float64).tolist()]:
        limit = select._round_down(t, leaf_dtype, torch.float64)
        assert limit <= t
        assert torch.equal(exact > t, exact > limit)


# --------------------------------------------------------------------------- the eager exact kernel


def brute_topk(flats, k, dtype):
    """Reference: Python sort of (-|x| with NaN as inf, index)."""
    flat = torch.cat([f.to(dtype) for f in flats])
    mags = [math.inf if math.isnan(v) else abs(v) for v in flat.double().tolist()]
    order = sorted(range(len(mags)), key=lambda i: (-mags[i], i))[:k]
    idx = torch.tensor(sorted(order), dtype=torch.int64)
    return idx, flat[idx]


@pytest.mark.parametrize("fraction", [0.0, 1.0], ids=["direct", "columns"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scanner_finds_exactly_the_coordinates_above_t(fraction, dtype):
    g = torch.Generator().manual_seed(3)
    sizes = [1, 3, 50, 1000, 4099, 7, 20_000, 64]
    flats = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    flats[3][10], flats[5][2], flats[6][-1] = math.nan, -math.inf, math.nan
    t = 1.7
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(select, "SEGMENT", 512)
        mp.setattr(select, "MIN_COLUMNS", 16)
        mp.setattr(select, "COLUMN_MAX_FRACTION", fraction)  # 1.0: every leaf >= rows * 16 goes through columns
        idx, vals = select._Scanner(t, dtype, torch.device("cpu"), 0.01).run(flats)
    flat = torch.cat(flats)
    expected = ((flat.to(torch.float64).abs() > t) | flat.isnan()).nonzero().view(-1)
    assert torch.equal(idx, expected)
    assert torch.equal(vals.view(INT_OF[dtype]), flat[expected].view(INT_OF[dtype]))


def test_scanner_mixed_dtypes_compares_exactly_in_the_wide_dtype():
    t = 1.0006  # between two float16 neighbours: 1.0 and 1.0009765625
    half = torch.tensor([1.0, 1.0009765625, -1.0009765625] * 500, dtype=torch.float16)
    wide = torch.tensor([1.0005, 1.0007] * 500, dtype=torch.float64)
    idx, vals = select._Scanner(t, torch.float64, torch.device("cpu"), 0.5).run([half, wide])
    flat = torch.cat([half.double(), wide])
    assert torch.equal(idx, (flat.abs() > t).nonzero().view(-1))
    assert vals.dtype == torch.float64


@pytest.mark.parametrize("k", [1, 10, 999, 5000, 19_999, 20_000])
def test_select_exact_on_a_real_sized_case_with_fallbacks(k):
    g = torch.Generator().manual_seed(4)
    flats = [torch.randn(s, generator=g) for s in [5000, 3, 12_000, 2997]]
    flats[0][100:200] = 0.0
    flats[2][:4000] = flats[2][0]  # a block of ties
    expected = brute_topk(flats, k, torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(select, "EXACT_MIN_NUMEL", 0)
        mp.setattr(select, "SAMPLE_SIZE", 256)
        for margin in (4.0, -4.0):  # -4: the bracket is too tight and the fallback must run
            mp.setattr(select, "MARGIN", margin)
            for max_fraction in (0.0, 1.0):
                mp.setattr(select, "COLUMN_MAX_FRACTION", max_fraction)
                idx, vals = select.select_exact(flats, k, torch.float32)
                assert torch.equal(idx, expected[0]) and torch.equal(vals, expected[1])


def test_select_exact_adversarial_sample_misses_the_large_values():
    # The large values sit exactly where the systematic sample does not look.
    n = 1 << 17
    stride = select.sample_stride(n, select.SAMPLE_SIZE)
    x = torch.ones(n)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[stride // 2 :: stride] = True
    big = (~sampled).nonzero().view(-1)[:5000]
    x[big] = 100.0 + torch.arange(5000.0)
    for k in [10, 4000, 6000]:
        idx, vals = select.select_exact([x], k, torch.float32)
        ref = brute_topk([x], k, torch.float32)
        assert torch.equal(idx, ref[0]) and torch.equal(vals, ref[1])


# --------------------------------------------------------------------------- sampling and approximate thresholds


def test_systematic_sample_takes_every_stride_th_flat_coordinate():
    flats = [torch.arange(0.0, 10.0), torch.arange(10.0, 13.0), torch.arange(13.0, 40.0)]
    for stride in [1, 3, 7]:
        got = select.systematic_sample(flats, stride, torch.float32)
        assert torch.equal(got, torch.arange(stride // 2, 40, stride, dtype=torch.float32))
    assert select.sample_stride(100, 1000) == 1
    assert select.sample_stride(10**6, 1000) == 1009  # the first prime >= 1000


def test_sample_threshold_int_and_tensor_k_agree_on_exactly_representable_cases():
    x = torch.randperm(5000).float()  # distinct magnitudes; sample = everything (n < 2**16)
    for k in [1, 50, 4999]:
        t = select.sample_threshold([x], k, torch.float32)
        assert int((x.abs() > t).sum()) == k
        t2 = select.sample_threshold([x], torch.tensor(k), torch.float32)
        assert int((x.abs() > t2).sum()) == k
    assert float(select.sample_threshold([x], 5000, torch.float32)) < 0
    assert float(select.sample_threshold([x], torch.tensor(5000), torch.float32)) < 0


def test_gaussian_threshold_on_gaussian_data():
    g = {"a": torch.randn(400_000, generator=torch.Generator().manual_seed(5)) * 0.01}
    for density in [0.001, 0.01, 0.1]:
        t = ft.sparse.gaussian_threshold(g, density=density)
        count = int((g["a"].abs() > t).sum())
        assert abs(count - density * 400_000) < 5 * math.sqrt(density * 400_000) + 5
    k = ft.sparse.k_from_density(0.01, 400_000)
    assert torch.equal(ft.sparse.gaussian_threshold(g, k), ft.sparse.gaussian_threshold(g, density=0.01))
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.sparse.gaussian_threshold(g)
    g16 = {"a": (torch.randn(1000) * 300).half()}  # sum of squares overflows float16: accumulated in float32
    assert torch.isfinite(ft.sparse.gaussian_threshold(g16, density=0.1))
