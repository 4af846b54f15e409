"""The sparse optimizer's state: checked against the optimizer before any maths; shared fields stay one value."""

from __future__ import annotations

import optree
import pytest
import torch

import functopk as ft
from functopk.sparse.opt_state import SparseOptState
from functopk.sparse.optimizer import sparse_optimizer


def params():
    return {"w": torch.zeros(3, 2), "b": torch.zeros(4)}


def grads(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in params().items()}


def started(opt, state=None):
    """A state after one refresh step."""
    state = opt.init(params()) if state is None else state
    return opt.update(grads(), state, params(), refresh=True)[1]


OPT = sparse_optimizer(ft.adam(0.1), k=2)


def bad_states():
    good = started(OPT)
    inner = good.inner
    return [
        ("another k", started(sparse_optimizer(ft.adam(0.1), k=3)), ValueError, r"shape \(3,\).*trains k=2 of the 10"),
        ("another density", started(sparse_optimizer(ft.adam(0.1), density=0.5)), ValueError, "trains k=2"),
        ("indices of floats", good._replace(indices=good.indices.float()), TypeError, "int32 or int64"),
        ("a float count", good._replace(count=torch.tensor(1.0)), TypeError, "0-d integer"),
        ("another optimizer", started(sparse_optimizer(ft.sgd(0.1, momentum=0.9), k=2)), ValueError, "structure"),
        (
            "a buffer of another dtype",
            good._replace(inner=optree.tree_map(lambda x: x.double() if x.is_floating_point() else x, inner)),
            ValueError,
            r"state.inner leaf at .* is torch.float64 of shape \(2,\); this optimizer keeps torch.float32",
        ),
        ("a score it does not keep", good._replace(score=params()), ValueError, "state.score must be None"),
        ("not a state", good.inner, TypeError, "SparseOptState"),
    ]


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "gather"])
@pytest.mark.parametrize("case", range(len(bad_states())), ids=[c[0] for c in bad_states()])
def test_a_state_that_does_not_fit_is_refused_before_any_maths(case, refresh):
    _, state, error, match = bad_states()[case]
    with pytest.raises(error, match=match):
        OPT.update(grads(1), state, params(), refresh=refresh)


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "gather"])
def test_indices_out_of_order_or_range_are_refused_where_they_are_read_on_the_host(refresh):
    """On CPU in eager mode the update reads indices on the host anyway: their order is checked there."""
    good = started(OPT)
    for indices, match in [(torch.tensor([5, 1]), "strictly ascending"), (torch.tensor([1, 10]), r"lie in \[0, 10\)")]:
        with pytest.raises(ValueError, match=match):
            OPT.update(grads(1), good._replace(indices=indices.to(good.indices.dtype)), params(), refresh=refresh)


def test_an_accumulated_score_shaped_like_other_params_is_refused():
    opt = sparse_optimizer(ft.adam(0.1), k=2, score="accumulated")
    state = opt.init(params())
    with pytest.raises(ValueError, match="state.score"):
        opt.update(grads(), state._replace(score={"w": torch.zeros(6), "b": torch.zeros(4)}), params(), refresh=True)
    with pytest.raises(ValueError, match="state.score"):
        opt.update(grads(), state._replace(score=None), params(), refresh=True)


def test_the_state_is_per_coordinate_but_injected_hyperparameters_are_shared():
    opt = sparse_optimizer(ft.inject_hyperparams(ft.adam)(learning_rate=0.1), k=2)
    state = opt.init(params())
    assert isinstance(state, SparseOptState)
    assert state.inner.count.shape == (2,) and state.inner.inner_state.mu[0].shape == (2,)
    assert state.inner.hyperparams["learning_rate"].shape == ()
