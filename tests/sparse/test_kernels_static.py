"""functopk.sparse.kernels.static: radix select and the static top-k mask, against sorting."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functopk.sparse.kernels.base import flat_magnitudes
from functopk.sparse.kernels.static import mask_static, radix_kth_key, select_static, topk_static

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(max_examples=60)
@given(st.lists(st.integers(0, 2**31 - 1) | st.sampled_from([0, 1, 7, 2**31 - 1]), min_size=1, max_size=300), st.data())
def test_radix_kth_key_matches_sort(device, values, data):
    keys = torch.tensor(values, dtype=torch.int32, device=device)
    k = data.draw(st.integers(1, len(values)), label="k")
    expected = sorted(values, reverse=True)[k - 1]
    assert int(radix_kth_key(keys, torch.tensor(k, device=device), 31)) == expected


@pytest.mark.parametrize("dtype", FLOATS)
def test_mask_static_tensor_k_equals_int_k(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, generator=g).to(dtype)
    x[::7] = x[3]  # many ties
    x[5], x[9] = math.inf, 0.0
    cpu_mags = flat_magnitudes([x], dtype)
    mags = cpu_mags.to(device)
    for k in [1, 2, 17, 500, 2999, 3000]:
        expected = mask_static(mags, k)  # torch.topk path
        assert int(expected.sum()) == k and expected.device == mags.device
        assert torch.equal(mask_static(mags, torch.tensor(k, device=device)), expected)
        assert torch.equal(mask_static(mags, torch.tensor(k)), expected)  # a CPU k for device magnitudes
        assert torch.equal(expected.cpu(), mask_static(cpu_mags, k))  # the CPU's selection
    # out-of-range tensor k is clamped
    assert int(mask_static(mags, torch.tensor(0, device=device)).sum()) == 1
    assert bool(mask_static(mags, torch.tensor(10**9, device=device)).all())


def test_select_static_sorted_indices_and_values_with_ties_by_index(device):
    flats = [torch.tensor([1.0, -3.0, 3.0], device=device),
             torch.tensor([3.0, float("nan")], dtype=torch.float64, device=device)]
    idx, vals = select_static(flats, 3, torch.float64)
    assert idx.tolist() == [1, 2, 4] and vals.dtype == torch.float64 and vals.device == flats[0].device
    assert vals[:2].tolist() == [-3.0, 3.0] and math.isnan(vals[2])


def test_topk_static_breaks_ties_by_lowest_index(device):
    """torch.topk may pick any of the values tied with the k-th: topk_static keeps the lowest indices."""
    for values in ([2.0, 5.0, 2.0, 2.0, 7.0, 2.0, 5.0], [0.0] * 6 + [1.0], [math.inf, 1.0, math.inf, math.inf]):
        mags = torch.tensor(values, device=device)
        for k in range(1, len(values) + 1):
            expected = sorted(sorted(range(len(values)), key=lambda i: (-values[i], i))[:k])
            mask, idx = topk_static(mags, k)
            assert idx.tolist() == expected and mask.nonzero().view(-1).tolist() == expected
