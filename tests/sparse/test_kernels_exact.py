"""functopk.sparse.kernels.exact: the eager exact kernel against brute force, including misleading samples."""

from __future__ import annotations

import math

import pytest
import torch

from functopk.sparse import KernelConfig
from functopk.sparse.config import DEFAULT_CONFIG
from functopk.sparse.kernels import native as native_scan
from functopk.sparse.kernels.approx import sample_stride
from functopk.sparse.kernels.exact import ExactStats, select_exact, top_k_of_candidates


def brute_topk(flats, k, dtype):
    """Reference: Python sort of (-|x| with NaN as inf, index)."""
    flat = torch.cat([f.to(dtype) for f in flats])
    mags = [math.inf if math.isnan(v) else abs(v) for v in flat.double().tolist()]
    order = sorted(range(len(mags)), key=lambda i: (-mags[i], i))[:k]
    idx = torch.tensor(sorted(order), dtype=torch.int64)
    return idx, flat[idx]


@pytest.mark.parametrize("k", [1, 10, 999, 5000, 19_999, 20_000])
def test_select_exact_on_a_real_sized_case_with_fallbacks(k):
    g = torch.Generator().manual_seed(4)
    flats = [torch.randn(s, generator=g) for s in [5000, 3, 12_000, 2997]]
    flats[0][100:200] = 0.0
    flats[2][:4000] = flats[2][0]  # a block of ties
    expected = brute_topk(flats, k, torch.float32)
    for margin in (4.0, -4.0):  # -4: the bracket is too tight and the fallback must run
        for max_fraction, native in ((0.0, False), (1.0, False), (0.0, True)):  # direct, columns, compiled
            config = KernelConfig(exact_min_numel=0, sample_size=256, margin=margin, column_max_fraction=max_fraction,
                                  native=native)
            idx, vals = select_exact(flats, k, torch.float32, config)
            assert torch.equal(idx, expected[0]) and torch.equal(vals, expected[1])


def test_select_exact_adversarial_sample_misses_the_large_values():
    # The large values sit exactly where the systematic sample does not look.
    n = 1 << 17
    stride = sample_stride(n, DEFAULT_CONFIG.sample_size)
    x = torch.ones(n)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[stride // 2 :: stride] = True
    big = (~sampled).nonzero().view(-1)[:5000]
    x[big] = 100.0 + torch.arange(5000.0)
    for k in [10, 4000, 6000]:
        idx, vals = select_exact([x], k, torch.float32)
        ref = brute_topk([x], k, torch.float32)
        assert torch.equal(idx, ref[0]) and torch.equal(vals, ref[1])


@pytest.mark.parametrize("scan", ["direct", "columns", "native"])
def test_misleading_sample_abandons_the_scan_early_and_stays_exact(scan):
    """A misleading sample (seen on 25M fp32 at k=1000: 94% of coordinates candidates), scaled down.

    Large values fill every position the systematic sample skips, so the sampled
    bracket predicts a handful of candidates and nearly every coordinate is one.
    The scan must stop once it has found far more than predicted (the limit) and
    run the static kernel instead: the result stays exact and the scan never
    gathers the huge candidate set.
    """
    n = 1 << 17
    config = KernelConfig(exact_min_numel=0, sample_size=1 << 10, segment=4096, abandon_min=1000,
                          column_max_fraction=1.0 if scan == "columns" else 0.0, native=scan == "native")
    stride = sample_stride(n, config.sample_size)
    g = torch.Generator().manual_seed(0)
    x = 100.0 + torch.rand(n, generator=g)  # the large values
    x[stride // 2 :: stride] = torch.randn(len(range(stride // 2, n, stride)), generator=g)  # what the sample sees
    for k in (10, 300):
        stats = ExactStats()
        idx, vals = select_exact([x[: n // 2], x[n // 2 :]], k, torch.float32, config, stats=stats)
        ref = brute_topk([x], k, torch.float32)
        assert torch.equal(idx, ref[0]) and torch.equal(vals, ref[1])
        assert stats.path == "abandoned", stats
        assert stats.limit < stats.candidates < 0.5 * n  # stopped early: ~99% of n are candidates
        if scan != "columns":
            assert stats.candidates <= stats.limit + config.segment


def test_stats_name_the_paths():
    g = torch.Generator().manual_seed(1)
    flats = [torch.randn(50_000, generator=g)]
    config = KernelConfig(exact_min_numel=0, sample_size=1024)
    for cfg, k, path in [(config, 50, "scan"), (KernelConfig(), 50, "static"), (config, 50_000, "static"),
                         (KernelConfig(exact_min_numel=0, sample_size=1024, margin=-4.0), 500, "too-few")]:
        stats = ExactStats()
        idx, _ = select_exact(flats, k, torch.float32, cfg, stats=stats)
        assert stats.path == path and idx.numel() == k
        assert torch.equal(idx, brute_topk(flats, k, torch.float32)[0])


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_eager_exact_kernel_does_not_compile():
    # why "exact" switches to the static kernel under compile: the eager one branches on data
    big = torch.randn(1 << 17)
    kernel = torch.compile(lambda x: select_exact([x], 10, torch.float32), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="data-dependent"):
        kernel(big)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_select_exact_narrow_and_wide_dtypes_with_ties_nan_inf_and_tiny_leaves(dtype):
    # many tiny leaves and one big one; ties at the k-th magnitude (narrow dtypes have few values);
    # NaN and +-inf rank first. The scan's words hold 4 (16-bit) or 1 (float64) values.
    g = torch.Generator().manual_seed(11)
    flats = [torch.randn(s, generator=g).to(dtype) for s in [1, 2, 3] * 20 + [9000]]
    flats[-1][[5, 4000]] = math.nan
    flats[-1][77], flats[7][0] = -math.inf, math.inf
    flats[-1][100:600] = flats[-1][99]  # a block of ties
    n = sum(f.numel() for f in flats)
    bits = torch.int64 if dtype == torch.float64 else torch.int16
    for k in (1, 3, 40, 300, 2000, n - 1, n):
        expected = brute_topk(flats, k, dtype)
        for native in (False, True):  # the ATen scan and the compiled one
            config = KernelConfig(exact_min_numel=0, sample_size=256, segment=1024, native=native)
            idx, vals = select_exact(flats, k, dtype, config)
            assert torch.equal(idx, expected[0]), (k, native)
            assert torch.equal(vals.view(bits), expected[1].view(bits)), (k, native)


@pytest.mark.skipif(native_scan.library() is None, reason="the compiled scan could not be built")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_top_k_of_candidates_compiled_equals_aten(dtype):
    # candidates as the scan gives them (all above t_lo = 0.5): NaN, inf, ties that straddle the cut or not,
    # and upper bracket ends that leave fewer or more than k above them (the band and the full selection)
    g = torch.Generator().manual_seed(2)
    vals = (0.5 + torch.rand(3000, generator=g) * 4).to(dtype) * torch.where(torch.rand(3000, generator=g) < 0.5, -1, 1)
    vals[[3, 700]] = math.nan
    vals[[5, 1500]] = torch.tensor([math.inf, -math.inf], dtype=dtype)
    vals[2000:2100] = 3.0  # ties
    idx = torch.arange(3000) * 7 + 11
    lib = native_scan.library()
    bits = {torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    for k in (1, 4, 5, 100, 700, 1200, 2999):
        for t_hi in (None, 1.0, 3.0, 4.4, math.inf):
            ref = top_k_of_candidates(idx, vals, k, t_hi, 16)
            got = top_k_of_candidates(idx, vals, k, t_hi, 16, lib)
            assert torch.equal(got[0], ref[0]), (k, t_hi)
            assert torch.equal(got[1].view(bits), ref[1].view(bits)), (k, t_hi)
            assert torch.equal(ref[0], brute_topk([vals], k, dtype)[0] * 7 + 11), (k, t_hi)
