"""Adaptive scalings (scale_by_adam, scale_by_rms, scale_by_rss) against float64 formulas; Adam's kernel count."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import to_device
from tests.optim.common import PARAMS, grads_at


def test_scale_by_adam_against_float64_formula(device):
    b1, b2, eps, eps_root = 0.8, 0.9, 1e-3, 1e-4
    tx = ft.scale_by_adam(b1, b2, eps, eps_root)
    state = tx.init(to_device(PARAMS, device))
    mu = nu = torch.zeros(3, dtype=torch.float64)
    for t in range(1, 5):
        g = grads_at(t)
        updates, state = tx.update(to_device(g, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        g64 = g["w"].double()
        mu = b1 * mu + (1 - b1) * g64
        nu = b2 * nu + (1 - b2) * g64**2
        expected = (mu / (1 - b1**t)) / (torch.sqrt(nu / (1 - b2**t) + eps_root) + eps)
        torch.testing.assert_close(updates["w"].double(), expected, rtol=2e-6, atol=0)
    assert updates["b"].dtype == torch.float64 and int(state.count) == 4


def test_scale_by_adam_amsgrad_uses_running_max_of_raw_nu(device):
    b1, b2, eps = 0.0, 0.5, 0.0
    tx = ft.scale_by_adam(b1, b2, eps, amsgrad=True)
    params = {"w": torch.zeros(1)}
    state = tx.init(to_device(params, device))
    nu = nu_max = 0.0
    for t, g in enumerate([4.0, 0.0, 0.0], start=1):
        updates, state = tx.update(to_device({"w": torch.tensor([g if g else 1e-3])}, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        g = g if g else 1e-3
        nu = b2 * nu + (1 - b2) * g * g
        nu_max = max(nu_max, nu)
        expected = g / (nu_max / (1 - b2**t)) ** 0.5
        assert updates["w"].item() == pytest.approx(expected, rel=1e-6)
    assert state.nu_max["w"].item() == pytest.approx(8.0)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("eps_in_sqrt", [False, True])
def test_scale_by_rms_against_formula(device, centered, eps_in_sqrt):
    decay, eps, init = 0.7, 1e-2, 0.5
    tx = ft.scale_by_rms(decay, eps, initial_scale=init, centered=centered, eps_in_sqrt=eps_in_sqrt)
    state = tx.init(to_device(PARAMS, device))
    nu = torch.full((3,), init, dtype=torch.float64)
    mu = torch.zeros(3, dtype=torch.float64)
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(to_device(g, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        g64 = g["w"].double()
        nu = decay * nu + (1 - decay) * g64**2
        mu = decay * mu + (1 - decay) * g64
        sq = nu - mu**2 if centered else nu
        expected = g64 / (torch.sqrt(sq + eps) if eps_in_sqrt else torch.sqrt(sq) + eps)
        torch.testing.assert_close(updates["w"].double(), expected, rtol=2e-6, atol=0)
    assert (state.mu is None) != centered


def test_scale_by_rss_torch_form_against_formula(device):
    """eps_in_sqrt=False: torch.optim.Adagrad's g / (sqrt(sum) + eps)."""
    tx = ft.scale_by_rss(initial_accumulator_value=0.2, eps=1e-3, eps_in_sqrt=False)
    state = tx.init(to_device(PARAMS, device))
    acc = torch.full((3,), 0.2, dtype=torch.float64)
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(to_device(g, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        acc = acc + g["w"].double() ** 2
        torch.testing.assert_close(updates["w"].double(), g["w"].double() / (acc.sqrt() + 1e-3), rtol=2e-6, atol=0)


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (ft.scale_by_adam, {"b1": 1.0}, ValueError, "b1 must be < 1"),
        (ft.scale_by_adam, {"eps_root": -1.0}, ValueError, "eps_root must be >= 0"),
        (ft.scale_by_adam, {"b2": torch.ones(2)}, TypeError, "b2 must be a real number or a 0-d float tensor"),
        (ft.scale_by_adam, {"amsgrad": 1}, TypeError, "amsgrad must be a bool"),
        (ft.scale_by_rms, {"decay": 1.0}, ValueError, "decay must be < 1"),
        (ft.scale_by_rms, {"eps_in_sqrt": 0}, TypeError, "eps_in_sqrt must be a bool"),
        (ft.scale_by_rms, {"centered": None}, TypeError, "centered must be a bool"),
        (ft.scale_by_rss, {"eps": -1.0}, ValueError, "eps must be >= 0"),
        (ft.scale_by_rss, {"eps_in_sqrt": "no"}, TypeError, "eps_in_sqrt must be a bool"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


def test_scale_by_rss_optax_form_against_formula(device):
    """optax's scale_by_rss: g * rsqrt(sum + eps) where sum > 0, and 0 where sum == 0; defaults 0.1 and 1e-7."""
    tx = ft.scale_by_rss()
    params = {"w": torch.zeros(4)}
    state = tx.init(to_device(params, device))
    assert torch.equal(state.sum_of_squares["w"].cpu(), torch.full((4,), 0.1))
    acc = torch.full((4,), 0.1, dtype=torch.float64)
    for i in range(4):
        g = {"w": grads_at(i, params)["w"] * torch.tensor([1.0, 1.0, 0.0, 1.0])}
        updates, state = tx.update(to_device(g, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        acc = acc + g["w"].double() ** 2
        expected = g["w"].double() / torch.sqrt(acc + 1e-7)
        torch.testing.assert_close(updates["w"].double(), expected, rtol=2e-6, atol=0)
    # a sum that is exactly 0 (no initial value, zero gradients) gives 0, not 0 / sqrt(0) = NaN
    tx = ft.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
    updates, _ = tx.update({"w": torch.tensor([0.0, 2.0])}, tx.init({"w": torch.zeros(2)}))
    assert torch.equal(updates["w"], torch.tensor([0.0, 1.0]))


def test_scale_by_rms_optax_defaults(device):
    """decay 0.9, eps 1e-8 under the root, initial scale 0: optax's scale_by_rms()."""
    tx = ft.scale_by_rms()
    state = tx.init(to_device(PARAMS, device))
    nu = torch.zeros(3, dtype=torch.float64)
    for i in range(3):
        g = grads_at(i)
        updates, state = tx.update(to_device(g, device), state)
        updates = to_device(updates, "cpu")  # compared with CPU formulas
        nu = 0.9 * nu + 0.1 * g["w"].double() ** 2
        torch.testing.assert_close(updates["w"].double(), g["w"].double() / torch.sqrt(nu + 1e-8), rtol=2e-6, atol=0)


def test_scale_by_adam_optax_positional_order():
    """scale_by_adam(b1, b2, eps, eps_root) positionally, as optax; amsgrad is keyword-only."""
    a, b = ft.scale_by_adam(0.8, 0.9, 1e-3, 1e-4), ft.scale_by_adam(b1=0.8, b2=0.9, eps=1e-3, eps_root=1e-4)
    sa, sb = a.init(PARAMS), b.init(PARAMS)
    for i in range(3):
        ua, sa = a.update(grads_at(i), sa)
        ub, sb = b.update(grads_at(i), sb)
        assert all(torch.equal(x, y) for x, y in zip(ft.tree.leaves(ua), ft.tree.leaves(ub)))
    with pytest.raises(TypeError):
        ft.scale_by_adam(0.9, 0.999, 1e-8, 0.0, True)
    with pytest.raises(TypeError):
        ft.scale_by_rms(0.9, 1e-8, 0.0, True)


def _foreach_kernels(fn):
    """The foreach kernels ``fn()`` runs (aten overload names), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_foreach_" in func.__name__:
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return seen


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_update_is_seven_foreach_kernels(device, name):
    """The fused Adam step: lerp, mul, addcmul_ (moments), sqrt, add_, div (into the denominators), mul_.

    adamw's decoupled decay adds one more (add_ of the scaled parameters into the update). Eagerly on CPU
    the division runs as one ``div(out=)`` per leaf (``foreach.div_into``), not as a foreach kernel.
    """
    params = to_device({"w": torch.randn(3, 2), "b": torch.randn(2)}, device)
    tx = ft.adam(0.01) if name == "adam" else ft.adamw(0.01, weight_decay=0.1)
    state = tx.init(params)
    kernels = _foreach_kernels(lambda: tx.update(ft.tree.map(torch.ones_like, params), state, params))
    div = [] if device == "cpu" else ["_foreach_div"]
    expected = ["_foreach_lerp", "_foreach_mul", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_add_", *div,
                "_foreach_mul_"]
    assert [k.split(".")[0] for k in kernels] == expected + (["_foreach_add_"] if name == "adamw" else [])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def test_sqrt_floor_hand_checked_edge():
    """float32, eps=1e-8, b2=0.999, first step: c = eps * sqrt(1 - b2) = 3.16e-10 has ulp 2**-55 (2.8e-17),
    and sqrt(tiny) = 1.08e-19 is below a quarter of it, so c + sqrt(tiny) rounds back to c."""
    from functopk.optim.adaptive import adam_config, sqrt_floor

    tiny = torch.finfo(torch.float32).tiny
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-8, 0.0), [torch.zeros(1)]) == tiny
    c = torch.tensor(1e-8 * (1 - 0.999) ** 0.5, dtype=torch.float32)
    assert torch.equal(_bits(c + torch.tensor(tiny).sqrt()), _bits(c))
    assert torch.equal(_bits(c + torch.tensor(0.0).sqrt()), _bits(c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floor_zeros_changes_no_bit_of_adam_direction(dtype):
    from functopk.optim.adaptive import adam_config, adam_direction, adam_scalars, sqrt_floor

    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, fi.tiny * 2.0**-20, fi.tiny / 2, fi.tiny, fi.tiny * (1 + fi.eps), 2 * fi.tiny,
                            1e-30, 1e-20, 1e-12, 1e-8, 1.0, 3e4, float("inf"), float("nan")], dtype=dtype)  # fmt: skip
    low = -80.0 if dtype == torch.float32 else -700.0
    logs = torch.rand(2000, generator=gen, dtype=torch.float64) * (10.0 - low) + low
    nu = torch.cat([special, torch.exp(logs).to(dtype), torch.zeros(500, dtype=dtype)])
    mu = torch.randn(nu.shape, generator=gen, dtype=dtype)
    engaged = 0
    for eps in (1e-8, 1e-6, 1e-3, 1.0):
        for b2 in (0.9, 0.999, 0.99999):
            cfg = adam_config(0.9, b2, eps, 0.0)
            engaged += sqrt_floor(cfg, [nu]) is not None
            for count in (0, 1, 9, 10**6):
                scalars = adam_scalars(torch.tensor(count), cfg, 0.01, [mu])
                plain = adam_direction([mu], [nu.clone()], scalars, cfg)[0]
                floored = adam_direction([mu], [nu.clone()], scalars, cfg, floor_zeros=True)[0]
                assert torch.equal(_bits(plain), _bits(floored)), (eps, b2, count)
    assert engaged == 12  # every combination above takes the floor


def test_sqrt_floor_refuses_what_it_cannot_prove():
    from functopk.optim.adaptive import adam_config, sqrt_floor

    x32 = [torch.zeros(2)]
    assert sqrt_floor(adam_config(0.9, 0.999, 0.0, 0.0), x32) is None  # no eps: sqrt(tiny) would show
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-30, 0.0), x32) is None  # eps too small to absorb it
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-8, 1e-8), x32) is None  # eps_root
    assert sqrt_floor(adam_config(0.9, 0.999, torch.tensor(1e-8), 0.0), x32) is None  # a tensor (not read)
    assert sqrt_floor(adam_config(0.9, torch.tensor(0.999), 1e-8, 0.0), x32) is None
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-8, 0.0), [torch.zeros(2, dtype=torch.bfloat16)]) is None
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-8, 0.0), [torch.zeros(2), torch.zeros(2).double()]) is None
    assert sqrt_floor(adam_config(0.9, 0.999, 1e-8, 0.0), [torch.zeros(2).double()]) == torch.finfo(torch.float64).tiny
