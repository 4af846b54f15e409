"""functopk.sparse.kernels.base: nonzero_1d and exact thresholds in narrower dtypes."""

from __future__ import annotations

import pytest
import torch

from functopk.sparse.kernels.base import common_dtype, flat_magnitudes, nonzero_1d, round_down


@pytest.mark.parametrize("n", [0, 5, 4095, 4096, 4099, 10_007])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_nonzero_1d_matches_nonzero(device, n, density):
    g = torch.Generator().manual_seed(n)
    mask = (torch.rand(n, generator=g) < density).to(device)
    for hint in (0.0, 0.5):  # word path and plain path
        assert torch.equal(nonzero_1d(mask, hint), mask.nonzero().view(-1))
    # an unaligned view falls back to the plain path
    if n > 3:
        assert torch.equal(nonzero_1d(mask[3:]), mask[3:].nonzero().view(-1))


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
        limit = round_down(t, leaf_dtype, torch.float64)
        assert limit <= t
        assert torch.equal(exact > t, exact > limit)


def test_common_dtype_and_magnitudes(device):
    half = torch.tensor([-1.0], dtype=torch.float16, device=device)
    bf = torch.tensor([float("nan")], dtype=torch.bfloat16, device=device)
    assert common_dtype([half, bf]) == torch.float32
    assert torch.equal(flat_magnitudes([half, bf], torch.float32), torch.tensor([1.0, float("inf")], device=device))
