"""functopk.sparse.k: what k is, from k, density or a schedule to what each kernel takes."""

from __future__ import annotations

import math

import pytest
import torch

import functopk as ft
from functopk.sparse import k as K
from functopk.sparse.k import clamp_k
from tests.helpers import real_device


def test_k_lives_in_one_module():
    for fn in (ft.sparse.k_from_density, ft.sparse.resolve_k):
        assert fn.__module__ == "functopk.sparse.k", fn


def test_k_from_density(device):
    assert ft.sparse.k_from_density(0.01, 25600) == 256
    assert ft.sparse.k_from_density(1.0, 7) == 7
    assert ft.sparse.k_from_density(1e-12, 7) == 1
    assert ft.sparse.k_from_density(0.5, 7) == 4  # round half up: floor(3.5 + 0.5)
    k = ft.sparse.k_from_density(torch.tensor(0.5, device=device), 7)
    assert k.dtype == torch.int64 and int(k) == 4 and k.device == real_device(device)
    with pytest.raises(ValueError, match="numel must be >= 1"):
        ft.sparse.k_from_density(0.5, 0)


def test_resolve_k():
    assert ft.sparse.resolve_k(3, None, 10) == 3
    assert ft.sparse.resolve_k(None, 0.25, 10) == 3  # floor(2.5 + 0.5)
    k = torch.tensor(99.0)
    assert ft.sparse.resolve_k(k, None, 10) is k  # a tensor k is clamped by the selection, not here
    with pytest.raises(ValueError, match=r"k=11 exceeds the number of coordinates in grads \(10\)"):
        ft.sparse.resolve_k(11, None, 10, name="grads")
    with pytest.raises(ValueError, match="grads has no coordinates.*were all gradients None"):
        ft.sparse.resolve_k(1, None, 0, name="grads")


def test_tensor_density_nan_inf_or_huge_gives_n_not_1(device):
    for value in (math.nan, math.inf, 1e30):
        k = ft.sparse.k_from_density(torch.tensor(value, dtype=torch.float64, device=device), 1000)
        assert k.dtype == torch.int64 and int(k) == 1000
    assert int(ft.sparse.k_from_density(torch.tensor(-math.inf, device=device), 1000)) == 1
    assert int(ft.sparse.k_from_density(torch.tensor(1e-9, device=device), 1000)) == 1


def test_clamp_k():
    n = 10
    cases = {2.4: 2, 2.5: 2, 3.5: 4, 0.0: 1, -5.0: 1, 99.0: 10, math.inf: 10, -math.inf: 1, 1e30: 10, 2.0**63: 10,
             math.nan: 10}
    for value, expected in cases.items():
        for dtype in (torch.float16, torch.float32, torch.float64):
            if abs(value) > 6e4 and not math.isinf(value) and dtype == torch.float16:
                continue
            got = clamp_k(torch.tensor(value, dtype=dtype), n)
            assert got.dtype == torch.int64 and int(got) == expected, (value, dtype)
    for value, expected in {-(2**62): 1, 2**62: 10, 3: 3}.items():
        assert int(clamp_k(torch.tensor(value), n)) == expected
    assert int(clamp_k(torch.tensor(7, dtype=torch.uint8), n)) == 7


def test_k_on_device_never_reads_and_k_on_host_reads_once():
    assert K.k_on_device(7, 10) == 7
    for value, expected in ((2.5, 2), (1e30, 10), (math.nan, 10)):
        got = K.k_on_device(torch.tensor(value), 10)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and int(got) == expected
    assert K.k_on_host(7, 10) == 7
    assert K.k_on_host(torch.tensor(2.5), 10) == 2 and K.k_on_host(torch.tensor(99), 10) == 10
    assert type(K.k_on_host(torch.tensor(3), 10)) is int
    with pytest.raises(ValueError, match=r"k is NaN; expected a count in \[1, 10\]"):
        K.k_on_host(torch.tensor(math.nan), 10)


def test_k_at_step_calls_a_schedule_with_the_step_and_checks_its_value():
    step = torch.tensor(3)
    assert int(K.k_at_step(lambda s: 1 + s, None, step, 10)) == 4
    assert K.k_at_step(None, lambda s: 0.5, step, 10) == 5
    assert K.k_at_step(2, None, None, 10) == 2  # constants as they are
    with pytest.raises(TypeError, match="the k schedule must return a number or a 0-d tensor, got str"):
        K.k_at_step(lambda s: "3", None, step, 10)
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 2.0"):
        K.k_at_step(None, lambda s: 2.0, step, 10)
    with pytest.raises(ValueError, match=r"k=11 exceeds the number of coordinates in params \(10\)"):
        K.k_at_step(lambda s: 11, None, step, 10, name="params")
