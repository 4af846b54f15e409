"""``TopKHookState(selection="threshold")``: the same coordinates as the exact selection, found faster.

The selection function alone is checked here against a brute-force top-k;
the hook on 3 gloo ranks reads the spawned run of ``conftest.py`` (phase
``threshold`` in ``workers.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from functopk.distributed import TopKHookState
from functopk.distributed.threshold import threshold_select
from tests.distributed.common import THRESHOLD_SCALES, WORLD, phase
from tests.helpers import bits


def brute_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest magnitudes first (NaN as infinite), ties to the lower index; ascending indices."""
    mags = torch.nan_to_num(x.abs().double(), nan=math.inf, posinf=math.inf)
    order = torch.sort(mags, descending=True, stable=True).indices[:k]  # stable: ties keep index order
    idx = order.sort().values
    return idx, x[idx]


def ties(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return (g * 4).round() / 4 * scale  # a coarse grid: many coordinates share each magnitude


def check_same(x, k, got) -> None:
    idx, vals = brute_topk(x, k)
    assert torch.equal(got[0], idx)
    assert torch.equal(bits(got[1]), bits(vals))


@pytest.mark.parametrize("k", [1, 37, 1000, 5000])
def test_threshold_select_equals_brute_force_with_ties_over_steps(k):
    n = 1 << 17  # above the exact kernel's scan size, so candidates are gathered by threshold
    threshold, paths = None, []
    for step, scale in enumerate([1.0, 1.02, 0.99, 16.0, 16.1, 0.001, 0.00101]):
        x = ties(n, 0, scale)  # slow drift: the same base, rescaled, partly redrawn
        x[1000 * step : 1000 * step + 500] = ties(500, step + 1, scale / 2)
        x[step * 7] = -x[step * 7]  # the sign never matters, the bits of the value do
        idx, vals, threshold, fell_back = threshold_select(x, k, threshold)
        check_same(x, k, (idx, vals))
        paths.append(fell_back)
    # First step, the x16 jump (too few candidates) and the drop (too many): fallbacks; the others reuse.
    assert paths == [True, False, False, True, False, True, False]


def test_threshold_select_nan_inf_zero_and_small_inputs():
    n = 1 << 17
    x = ties(n, 1)
    _, _, t, _ = threshold_select(x, 50, None)
    y = x.clone()
    y[[5, 900, 70_000]] = torch.tensor([math.nan, -math.inf, math.nan])
    idx, vals, t2, fell_back = threshold_select(y, 50, t)  # NaN ranks as infinite and is a candidate
    check_same(y, 50, (idx, vals))
    assert not fell_back and t2 is not None
    inf_k = torch.zeros(n)
    inf_k[:60] = math.inf
    idx, vals, t3, _ = threshold_select(inf_k, 50, t)
    check_same(inf_k, 50, (idx, vals))
    assert t3 is None  # an infinite k-th magnitude gives no threshold: the next step ranks everything
    zeros = torch.zeros(n)
    idx, vals, t4, fell_back = threshold_select(zeros, 50, t)
    check_same(zeros, 50, (idx, vals))
    assert fell_back and t4 is None
    small = ties(1000, 2)  # below the scan size: the exact kernel, whatever the threshold
    check_same(small, 10, threshold_select(small, 10, 0.5)[:2])
    assert torch.equal(x, ties(n, 1))  # the input is not modified


def test_threshold_select_float64_and_float16():
    for dtype in (torch.float64, torch.float16):
        x = ties(1 << 17, 3).to(dtype)
        _, _, t, _ = threshold_select(x, 500, None)
        got = threshold_select(x * 1.01, 500, t)
        check_same(x * 1.01, 500, got[:2])
        assert not got[3] and got[1].dtype == dtype


def test_selection_argument():
    assert TopKHookState(density=0.1).selection == "exact"
    assert TopKHookState(density=0.1, selection="threshold").selection == "threshold"
    with pytest.raises(ValueError, match="selection"):
        TopKHookState(density=0.1, selection="approx")
    with pytest.raises(TypeError, match="selection"):
        TopKHookState(density=0.1, selection=1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the hook on gloo


def test_hook_threshold_mode_is_bitwise_the_exact_mode(run):
    for r in range(WORLD):
        got = phase(run, "threshold", r)
        exact, thr = got["exact"], got["threshold"]
        assert len(exact) == len(thr) == len(THRESHOLD_SCALES)
        for it, (a, b) in enumerate(zip(exact, thr)):
            for x, y in zip(a["buckets"], b["buckets"]):
                assert torch.equal(bits(x), bits(y)), f"rank {r}, iteration {it}: averaged bucket differs"
            assert a["residuals"].keys() == b["residuals"].keys()
            for name in a["residuals"]:
                assert torch.equal(bits(a["residuals"][name]), bits(b["residuals"][name])), (r, it, name)
        fallbacks = [s["fallbacks"] for s in thr]
        steps = [b - a for a, b in zip([0] + fallbacks, fallbacks)]  # fallbacks per iteration (2 buckets)
        assert exact[-1]["fallbacks"] == 0
        assert steps[0] == 2 and steps[3] >= 1 and steps[5] >= 1, steps  # first step, the jump, the drop
        assert sum(steps) < 2 * len(steps) - 2, steps  # most buckets reuse the threshold
