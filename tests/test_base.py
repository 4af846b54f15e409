"""GradientTransformation, identity, stateless, chain, named_chain."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal

PARAMS = {"w": torch.tensor([1.0, -2.0, 3.0])}
GRADS = {"w": torch.tensor([0.5, 4.0, -1.0])}


def test_identity():
    tx = ft.identity()
    state = tx.init(PARAMS)
    assert state == ft.EmptyState()
    updates, new_state = tx.update(GRADS, state)
    assert updates is GRADS and new_state == state


def test_stateless_receives_params():
    tx = ft.stateless(lambda u, p: ft.tree.add(u, p))
    updates, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS)
    assert torch.equal(updates["w"], torch.tensor([1.5, 2.0, 2.0]))
    with pytest.raises(TypeError, match="fn must be callable"):
        ft.stateless(3)


def test_chain_composes_in_order_and_threads_state():
    tx = ft.chain(ft.topk(1), ft.sgd(0.5, momentum=0.5))
    state = tx.init(PARAMS)
    assert isinstance(state, tuple) and len(state) == 2
    u1, state = tx.update(GRADS, state, PARAMS)
    assert torch.equal(u1["w"], torch.tensor([0.0, -2.0, 0.0]))
    u2, state = tx.update(GRADS, state, PARAMS)
    assert torch.equal(u2["w"], torch.tensor([0.0, -3.0, 0.0]))  # -(4 + 0.5*4) * 0.5
    # the reverse order differs: momentum before selection
    tx2 = ft.chain(ft.sgd(0.5, momentum=0.5), ft.topk(1))
    s2 = tx2.init(PARAMS)
    _, s2 = tx2.update(GRADS, s2, PARAMS)
    assert torch.equal(s2[0][0].trace["w"], GRADS["w"])


def test_named_chain_equals_chain():
    a = ft.chain(ft.topk(2), ft.sgd(0.1, momentum=0.9))
    b = ft.named_chain(("sparsify", ft.topk(2)), ("opt", ft.sgd(0.1, momentum=0.9)))
    sa, sb = a.init(PARAMS), b.init(PARAMS)
    for _ in range(3):
        ua, sa = a.update(GRADS, sa, PARAMS)
        ub, sb = b.update(GRADS, sb, PARAMS)
        assert_tree_bitwise_equal(ua, ub)
    assert_tree_bitwise_equal(sa[1], sb["opt"])


def test_combinator_argument_errors():
    with pytest.raises(TypeError, match=r"transforms\[1\] must be a functopk.GradientTransformation"):
        ft.chain(ft.identity(), lambda u: u)
    with pytest.raises(TypeError, match=r"\(name: str, transformation\) pair"):
        ft.named_chain(ft.identity())
    with pytest.raises(ValueError, match="distinct"):
        ft.named_chain(("a", ft.identity()), ("a", ft.identity()))
    tx = ft.named_chain(("a", ft.identity()))
    with pytest.raises(TypeError, match=r"state must be a dict with keys \['a'\] .* got a dict with keys \['b'\]"):
        tx.update(GRADS, {"b": ft.EmptyState()})
    chained = ft.chain(ft.identity(), ft.identity())
    with pytest.raises(TypeError, match=r"state must be a tuple of 2 states, .* got a tuple of 1"):
        chained.update(GRADS, (ft.EmptyState(),))
    with pytest.raises(TypeError, match=r"state must be a tuple of 2 states, .* got EmptyState"):
        chained.update(GRADS, ft.EmptyState())
