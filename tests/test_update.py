"""apply_updates (pure) and apply_updates_ (in place)."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import UNWRITABLE, assert_tree_bitwise_equal, clone_tree, real_device, to_device, unwritable_params


def make(device="cpu"):
    params = {"w": torch.tensor([1.0, 2.0]), "h": torch.ones(2, dtype=torch.bfloat16), "frozen": torch.tensor([7.0])}
    updates = {"w": torch.tensor([0.5, -1.0]), "h": torch.tensor([0.5, 0.25]), "frozen": None}
    return to_device(params, device), to_device(updates, device)


def test_apply_updates_pure_and_correct(device):
    params, updates = make(device)
    p0, u0 = clone_tree(params), clone_tree(updates)
    out = ft.apply_updates(params, updates)
    assert_tree_bitwise_equal(params, p0)
    assert_tree_bitwise_equal(updates, u0)
    assert out["w"].device == real_device(device) and torch.equal(out["w"].cpu(), torch.tensor([1.5, 1.0]))
    expected_h = torch.tensor([1.5, 1.25], dtype=torch.bfloat16)
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"].cpu(), expected_h)
    assert out["frozen"] is params["frozen"]
    assert out["w"].data_ptr() != params["w"].data_ptr()


def test_apply_updates_inplace_matches_pure(device):
    params, updates = make(device)
    expected = ft.apply_updates(params, updates)
    ptr = params["w"].data_ptr()
    out = ft.apply_updates_(params, updates)
    assert out is params and params["w"].data_ptr() == ptr
    assert_tree_bitwise_equal(params, expected)


def test_apply_updates_inplace_on_module_parameters(device):
    lin = torch.nn.Linear(2, 1).to(device)
    params = dict(lin.named_parameters())
    updates = ft.tree.map(torch.ones_like, params)
    before = lin.weight.detach().clone()
    ft.apply_updates_(params, updates)
    assert torch.equal(lin.weight.detach(), before + 1)


@pytest.mark.parametrize("fn", [ft.apply_updates, ft.apply_updates_], ids=["pure", "inplace"])
def test_apply_updates_errors_leave_params_untouched(device, fn):
    params, updates = make(device)
    p0 = clone_tree(params)
    with pytest.raises(ValueError, match="tree structure"):
        fn(params, {"w": updates["w"]})
    bad = dict(updates, h=torch.ones(3, device=device))  # every shape is checked before anything is written
    with pytest.raises(ValueError, match=r"\['h'\] has shape \(3,\)"):
        fn(params, bad)
    with pytest.raises(ValueError, match="where params has None"):
        fn(dict(params, frozen=None), dict(updates, frozen=torch.ones(1, device=device)))
    assert_tree_bitwise_equal(params, p0)


@pytest.mark.parametrize("fn", [ft.apply_updates, ft.apply_updates_], ids=["pure", "inplace"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_and_bool_params_are_an_error_not_a_truncation(device, fn, dtype):
    params = {"a": torch.ones(2, device=device), "n": torch.ones(2, dtype=dtype, device=device)}
    p0 = clone_tree(params)
    with pytest.raises(TypeError, match=r"params leaf at \['n'\] has dtype .*floating-point parameters only"):
        fn(params, {"a": torch.ones(2, device=device), "n": torch.full((2,), 0.4, device=device)})
    assert_tree_bitwise_equal(params, p0)
    out = fn(params, {"a": torch.ones(2, device=device), "n": None})  # a frozen integer leaf is left alone
    assert out["n"] is params["n"] and torch.equal(out["a"], torch.full((2,), 2.0, device=device))


@pytest.mark.parametrize("fn", [ft.apply_updates, ft.apply_updates_], ids=["pure", "inplace"])
def test_non_floating_updates_and_non_tensor_leaves_are_rejected(device, fn):
    params = {"a": torch.ones(2, device=device), "b": torch.ones(2, device=device)}
    p0 = clone_tree(params)
    a = torch.ones(2, device=device)
    with pytest.raises(TypeError, match=r"updates leaf at \['b'\] has dtype torch.int64; expected a floating"):
        fn(params, {"a": a, "b": torch.ones(2, dtype=torch.int64, device=device)})
    with pytest.raises(TypeError, match=r"updates leaf at \['b'\] is float 1.0; expected a torch.Tensor or None"):
        fn(params, {"a": a, "b": 1.0})
    with pytest.raises(TypeError, match=r"params leaf at \['b'\] is int 3; expected a torch.Tensor"):
        fn({"a": params["a"], "b": 3}, {"a": a, "b": torch.ones(2, device=device)})
    other = "meta" if device == "cpu" else "cpu"
    where = params["b"].device
    with pytest.raises(ValueError, match=rf"updates leaf at \['b'\] is on {other}, but the parameter is on {where}"):
        fn(params, {"a": a, "b": torch.ones(2, device=other)})
    assert_tree_bitwise_equal(params, p0)


@pytest.mark.parametrize("case", UNWRITABLE)
def test_apply_updates_inplace_is_all_or_nothing(case):
    """A leaf that cannot take the write, last in flat order: no leaf before it is written."""
    params, message = unwritable_params(case)
    updates = ft.tree.map(lambda p: torch.ones(p.shape), params)
    p0 = clone_tree(params)
    with pytest.raises(ValueError, match=message):
        ft.apply_updates_(params, updates)
    assert_tree_bitwise_equal(params, p0)
    if case != "inference":  # the pure twin writes nothing, so any layout is fine
        out = ft.apply_updates(params, updates)
        assert torch.equal(out["z"], params["z"] + 1)


def test_apply_updates_inplace_accepts_strided_and_disjoint_views(device):
    flat = torch.zeros(10, device=device)
    params = {"a": flat[:4].view(2, 2), "b": flat[4:], "t": torch.arange(6.0, device=device).reshape(2, 3).t(),
              "s": torch.arange(8.0, device=device)[::2]}
    updates = ft.tree.map(lambda p: torch.full(p.shape, 0.5, device=p.device), params)
    expected = ft.apply_updates(params, updates)
    ft.apply_updates_(params, updates)
    assert_tree_bitwise_equal(params, expected)
    assert torch.equal(flat, torch.full((10,), 0.5, device=device))
