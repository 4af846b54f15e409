"""functopk.sparse.kernels.scan: the candidate scan finds exactly |x| > t (and NaN), and stops at its limit."""

from __future__ import annotations

import math

import pytest
import torch

from functopk.sparse import KernelConfig
from functopk.sparse.kernels.scan import Abandoned, Scanner, column_rows, scan_above

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}
CPU = torch.device("cpu")


@pytest.mark.parametrize("fraction, native", [(0.0, False), (1.0, False), (0.0, True)],
                         ids=["direct", "columns", "native"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scanner_finds_exactly_the_coordinates_above_t(fraction, native, dtype):
    g = torch.Generator().manual_seed(3)
    sizes = [1, 3, 50, 1000, 4099, 7, 20_000, 64]
    flats = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    flats[3][10], flats[5][2], flats[6][-1] = math.nan, -math.inf, math.nan
    t = 1.7
    # column_max_fraction 1.0: every leaf >= rows * 16 goes through columns
    config = KernelConfig(segment=512, min_columns=16, column_max_fraction=fraction, native=native)
    idx, vals = Scanner(t, dtype, CPU, 0.01, config).run(flats)
    flat = torch.cat(flats)
    expected = ((flat.to(torch.float64).abs() > t) | flat.isnan()).nonzero().view(-1)
    assert torch.equal(idx, expected)
    assert torch.equal(vals.view(INT_OF[dtype]), flat[expected].view(INT_OF[dtype]))


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
def test_scanner_mixed_dtypes_compares_exactly_in_the_wide_dtype(native):
    t = 1.0006  # between two float16 neighbours: 1.0 and 1.0009765625
    half = torch.tensor([1.0, 1.0009765625, -1.0009765625] * 500, dtype=torch.float16)
    wide = torch.tensor([1.0005, 1.0007] * 500, dtype=torch.float64)
    idx, vals = Scanner(t, torch.float64, CPU, 0.5, KernelConfig(native=native)).run([half, wide])
    flat = torch.cat([half.double(), wide])
    assert torch.equal(idx, (flat.abs() > t).nonzero().view(-1))
    assert vals.dtype == torch.float64
    assert torch.equal(scan_above([half, wide], t, torch.float64, 0.5, KernelConfig(native=native))[0], idx)


@pytest.mark.parametrize("fraction, native", [(0.0, False), (0.01, False), (0.5, False), (1.0, False), (0.01, True)],
                         ids=["direct-words", "direct-words-2", "direct-dense", "columns", "native"])
def test_scanner_abandons_above_its_limit_and_only_then(fraction, native):
    g = torch.Generator().manual_seed(5)
    flats = [torch.randn(30_000, generator=g), torch.randn(5000, generator=g)]
    t = 1.0  # about 32% of the coordinates are above
    count = int(sum((f.abs() > t).sum() for f in flats))
    config = KernelConfig(segment=1024, min_columns=16, column_max_fraction=1.0 if fraction == 1.0 else 0.0,
                          native=native)
    idx, _ = Scanner(t, torch.float32, CPU, fraction, config, limit=count).run(flats)  # exactly at the limit: kept
    assert idx.numel() == count
    scanner = Scanner(t, torch.float32, CPU, fraction, config, limit=count // 10)
    with pytest.raises(Abandoned):
        scanner.run(flats)
    assert count // 10 < scanner.found
    if native:  # the compiled scan stops right past the limit
        assert scanner.found == count // 10 + 1
    elif fraction != 1.0:  # the direct scan stops within a segment of the limit, long before the end
        assert scanner.found <= count // 10 + config.segment


def test_column_rows():
    assert column_rows(0.01) == 1  # above column_max_fraction: direct
    assert column_rows(1e-4) == 64
    assert column_rows(1e-9) == 256  # max_rows
    assert column_rows(1e-9, KernelConfig(max_rows=16)) == 16
