"""functopk.sparse.kernels.approx: the systematic sample and the approximate thresholds."""

from __future__ import annotations

import math

import pytest
import torch

from functopk.sparse.kernels.approx import gaussian_threshold_flat, sample_stride, sample_threshold, systematic_sample


def test_systematic_sample_takes_every_stride_th_flat_coordinate(device):
    flats = [torch.arange(0.0, 10.0, device=device), torch.arange(10.0, 13.0, device=device),
             torch.arange(13.0, 40.0, device=device)]
    for stride in [1, 3, 7]:
        got = systematic_sample(flats, stride, torch.float32)
        assert torch.equal(got, torch.arange(stride // 2, 40, stride, dtype=torch.float32, device=device))
    assert systematic_sample([f[:0] for f in flats], 3, torch.float32).device == flats[0].device
    assert sample_stride(100, 1000) == 1
    assert sample_stride(10**6, 1000) == 1009  # the first prime >= 1000


def test_sample_threshold_int_and_tensor_k_agree_on_exactly_representable_cases(device):
    x = torch.randperm(5000).float().to(device)  # distinct magnitudes; sample = everything (n < 2**16)
    for k in [1, 50, 4999]:
        t = sample_threshold([x], k, torch.float32)
        assert int((x.abs() > t).sum()) == k and t.device == x.device
        for where in dict.fromkeys(("cpu", device)):
            t2 = sample_threshold([x], torch.tensor(k, device=where), torch.float32)
            assert int((x.abs() > t2).sum()) == k and t2.device == x.device
    assert float(sample_threshold([x], 5000, torch.float32)) < 0
    assert float(sample_threshold([x], torch.tensor(5000, device=device), torch.float32)) < 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_gaussian_threshold_flat_is_finite_for_non_finite_input(device, dtype):
    x = torch.randn(100, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    finite = gaussian_threshold_flat([x], 0.1, dtype)
    assert 0 < float(finite) < 10
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[7] = bad
        t = gaussian_threshold_flat([y], 0.1, dtype)
        assert t.dtype == dtype and float(t) == torch.finfo(dtype).max
        assert torch.equal(~(y.abs() <= t), ~torch.isfinite(y))  # keeps exactly the non-finite coordinate
    for where in dict.fromkeys(("cpu", device)):  # NaN density: 1
        assert float(gaussian_threshold_flat([x], torch.tensor(math.nan, device=where), dtype)) == 0.0
