"""inject_hyperparams: hyperparameters as tensors in the state."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, assert_tree_close, clone_tree, real_device, to_device

PARAMS = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}


def grads_at(i):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g), PARAMS)


def test_equals_plain_transformation(device):
    params = to_device(PARAMS, device)
    plain = ft.sgd(0.1, momentum=0.9, nesterov=True)
    injected = ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9, nesterov=True)
    s1, s2 = plain.init(params), injected.init(params)
    assert set(s2.hyperparams) == {"learning_rate", "momentum"}
    for i in range(5):
        u1, s1 = plain.update(to_device(grads_at(i), device), s1, params)
        u2, s2 = injected.update(to_device(grads_at(i), device), s2, params)
        assert_tree_close(u2, u1, rtol=1e-6, atol=0)
    assert int(s2.count) == 5


def test_schedule_hyperparams_follow_the_count_and_pure(device):
    params = to_device(PARAMS, device)
    tx = ft.inject_hyperparams(ft.sgd)(learning_rate=ft.exponential_decay(1.0, 1, 0.5))
    state = tx.init(params)
    g = to_device({"w": torch.ones(3), "b": torch.ones(1)}, device)
    seen = []
    for _ in range(3):
        before = clone_tree(state)
        updates, new_state = tx.update(g, state, params)
        assert_tree_bitwise_equal(state, before)
        seen.append(float(-updates["b"][0]))
        state = new_state
    assert seen == [1.0, 0.5, 0.25]
    assert float(state.hyperparams["learning_rate"]) == 0.25


@pytest.mark.compile
def test_changed_hyperparameter_is_used_and_compiled_step_does_not_recompile():
    torch._dynamo.reset()
    tx = ft.inject_hyperparams(ft.sgd)(learning_rate=0.1)
    update = torch.compile(tx.update, fullgraph=True)
    state = tx.init(PARAMS)
    g = {"w": torch.ones(3), "b": torch.ones(1)}
    u, state = update(g, state, PARAMS)
    assert torch.allclose(u["b"], torch.tensor([-0.1]))
    state = state._replace(hyperparams={"learning_rate": torch.tensor(0.02)})
    with torch._dynamo.config.patch(error_on_recompile=True):
        u, state = update(g, state, PARAMS)
    assert torch.allclose(u["b"], torch.tensor([-0.02]))
    torch._dynamo.reset()


def test_static_args_and_passthrough():
    def factory(k, learning_rate):
        return ft.chain(ft.topk(k), ft.sgd(learning_rate))

    tx = ft.inject_hyperparams(factory, static_args=("k",))(k=1, learning_rate=1.0)
    state = tx.init(PARAMS)
    assert set(state.hyperparams) == {"learning_rate"}
    u, _ = tx.update(PARAMS, state, PARAMS)
    assert torch.equal(u["w"], torch.tensor([0.0, 0.0, -3.0]))


def test_errors():
    with pytest.raises(TypeError, match="factory must be a callable"):
        ft.inject_hyperparams(3)
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=-1.0)
    tx = ft.inject_hyperparams(ft.sgd)(learning_rate=0.1)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="hyperparams has keys"):
        tx.update(PARAMS, state._replace(hyperparams={}), PARAMS)
    with pytest.raises(TypeError, match=r"state must be a InjectHyperparamsState \(the state inject_hyperparams"):
        tx.update(PARAMS, (), PARAMS)
    with pytest.raises(TypeError, match="0-d float tensor"):
        ft.sgd(torch.ones(2))


def test_integer_hyperparameters_are_stored_exactly():
    """A count injected as an int is an int64 tensor: 2**24 + 1 (not a float32) reaches the factory exactly."""
    K = 2**24 + 1
    assert float(torch.tensor(K, dtype=torch.float32)) != K  # what float32 storage would lose
    seen = []

    def factory(k, learning_rate):
        seen.append(k)
        return ft.sgd(learning_rate)

    tx = ft.inject_hyperparams(factory)(k=K, learning_rate=0.5)
    state = tx.init(PARAMS)
    assert state.hyperparams["k"].dtype == torch.int64 and int(state.hyperparams["k"]) == K
    assert state.hyperparams["learning_rate"].dtype == torch.float32
    tx.update(grads_at(0), state, PARAMS)
    assert seen[0] == K and all(int(k) == K and k.dtype == torch.int64 for k in seen[1:]) and len(seen) == 3
    # integer tensors too; bools are passed through
    tx = ft.inject_hyperparams(lambda k, flag: ft.identity())(k=torch.tensor(K, dtype=torch.int32), flag=True)
    assert set(tx.init(PARAMS).hyperparams) == {"k"} and tx.init(PARAMS).hyperparams["k"].dtype == torch.int64


def test_injected_topk_keeps_k_exact(device):
    """inject_hyperparams(ft.topk)(k=K) stores K as int64 and selects exactly K coordinates."""
    params = to_device(PARAMS, device)
    K = 2**24 + 1
    tx = ft.inject_hyperparams(ft.topk)(k=K)
    assert int(tx.init(params).hyperparams["k"]) == K  # stored exactly (no selection run at this size)
    tx = ft.inject_hyperparams(ft.topk)(k=2)
    state = tx.init(params)
    assert state.hyperparams["k"].dtype == torch.int64
    u, _ = tx.update(params, state, params)
    assert state.hyperparams["k"].device == real_device(device)
    assert torch.equal(u["w"].cpu(), torch.tensor([0.0, -2.0, 3.0])) and torch.equal(u["b"].cpu(), torch.zeros(1))


def test_int_given_for_a_real_hyperparameter_works(device):
    """weight_decay=0, momentum=1-style ints become int64 tensors; the optimizers use them as the floats they are."""
    params = to_device(PARAMS, device)
    plain = ft.adamw(1, weight_decay=0, b1=0)
    injected = ft.inject_hyperparams(ft.adamw)(learning_rate=1, weight_decay=0, b1=0)
    s1, s2 = plain.init(params), injected.init(params)
    assert all(v.dtype == torch.int64 for v in s2.hyperparams.values())
    for i in range(3):
        u1, s1 = plain.update(to_device(grads_at(i), device), s1, params)
        u2, s2 = injected.update(to_device(grads_at(i), device), s2, params)
        assert_tree_close(u2, u1, rtol=1e-6, atol=0)


def test_a_float64_tensor_hyperparameter_stays_float64():
    tx = ft.inject_hyperparams(ft.sgd)(learning_rate=torch.tensor(0.1, dtype=torch.float64), momentum=0.5)
    state = tx.init({"w": torch.zeros(2, dtype=torch.float64)})
    assert state.hyperparams["learning_rate"].dtype == torch.float64
    assert state.hyperparams["momentum"].dtype == torch.float32
    updates, _ = tx.update({"w": torch.ones(2, dtype=torch.float64)}, state)
    assert torch.equal(updates["w"], torch.full((2,), -0.1, dtype=torch.float64))
