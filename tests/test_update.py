"""apply_updates (pure) and apply_updates_ (in place)."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree


def make():
    params = {"w": torch.tensor([1.0, 2.0]), "h": torch.ones(2, dtype=torch.bfloat16), "frozen": torch.tensor([7.0])}
    updates = {"w": torch.tensor([0.5, -1.0]), "h": torch.tensor([0.5, 0.25]), "frozen": None}
    return params, updates


def test_apply_updates_pure_and_correct():
    params, updates = make()
    p0, u0 = clone_tree(params), clone_tree(updates)
    out = ft.apply_updates(params, updates)
    assert_tree_bitwise_equal(params, p0)
    assert_tree_bitwise_equal(updates, u0)
    assert torch.equal(out["w"], torch.tensor([1.5, 1.0]))
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"], torch.tensor([1.5, 1.25], dtype=torch.bfloat16))
    assert out["frozen"] is params["frozen"]
    assert out["w"].data_ptr() != params["w"].data_ptr()


def test_apply_updates_inplace_matches_pure():
    params, updates = make()
    expected = ft.apply_updates(params, updates)
    ptr = params["w"].data_ptr()
    out = ft.apply_updates_(params, updates)
    assert out is params and params["w"].data_ptr() == ptr
    assert_tree_bitwise_equal(params, expected)


def test_apply_updates_inplace_on_module_parameters():
    lin = torch.nn.Linear(2, 1)
    params = dict(lin.named_parameters())
    updates = ft.tree.map(torch.ones_like, params)
    before = lin.weight.detach().clone()
    ft.apply_updates_(params, updates)
    assert torch.equal(lin.weight.detach(), before + 1)


@pytest.mark.parametrize("fn", [ft.apply_updates, ft.apply_updates_], ids=["pure", "inplace"])
def test_apply_updates_errors_leave_params_untouched(fn):
    params, updates = make()
    p0 = clone_tree(params)
    with pytest.raises(ValueError, match="tree structure"):
        fn(params, {"w": updates["w"]})
    bad = dict(updates, h=torch.ones(3))  # every shape is checked before anything is written
    with pytest.raises(ValueError, match=r"\['h'\] has shape \(3,\)"):
        fn(params, bad)
    with pytest.raises(ValueError, match="where params has None"):
        fn(dict(params, frozen=None), dict(updates, frozen=torch.ones(1)))
    assert_tree_bitwise_equal(params, p0)
