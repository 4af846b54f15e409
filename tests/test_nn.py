"""functionalize: pure model functions with explicit buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad

import functopk as ft
from tests.conftest import assert_tree_bitwise_equal, clone_tree
from tests.helpers import batch, small_cnn


def test_forward_matches_module_and_buffers_come_out():
    model = small_cnn()
    ref = copy.deepcopy(model)
    model_fn, params, buffers = ft.nn.functionalize(model)
    b0 = clone_tree(buffers)
    x, _ = batch()
    out, new_buffers = model_fn(params, buffers, x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    assert_tree_bitwise_equal(buffers, b0)  # inputs untouched
    for name, b in ref.named_buffers():  # running stats advanced exactly as the module's
        assert torch.equal(new_buffers[name], b)


def test_grad_through_batchnorm_in_train_mode():
    """Plain functional_call inside grad fails on BN's in-place running-stat update; ours does not."""
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)
    x, y = batch()

    def naive_loss(params):
        return F.cross_entropy(torch.func.functional_call(model, (params, buffers), (x,)), y)

    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        grad(naive_loss)(params)

    def loss_fn(params, buffers):
        out, new_buffers = model_fn(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    grads, new_buffers = grad(loss_fn, has_aux=True)(params, buffers)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)
    assert int(new_buffers["1.num_batches_tracked"]) == 1 and int(buffers["1.num_batches_tracked"]) == 0


def test_running_stats_after_training_equal_module_in_train_mode():
    model = small_cnn()
    ref = copy.deepcopy(model)
    model_fn, params, buffers = ft.nn.functionalize(model)
    for i in range(5):
        x, _ = batch(seed=i)
        _, buffers = model_fn(params, buffers, x)
        ref(x)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=0, atol=0)


def test_train_flag_is_per_call_and_restored():
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)
    x, _ = batch()
    out_eval, b_eval = model_fn(params, buffers, x, train=False)
    assert model.training
    assert_tree_bitwise_equal(b_eval, buffers)
    torch.testing.assert_close(out_eval, copy.deepcopy(model).eval()(x), rtol=0, atol=0)
    model.eval()
    _, b_train = model_fn(params, buffers, x, train=True)
    assert not model.training
    assert int(b_train["1.num_batches_tracked"]) == 1


def test_strict_keys_and_argument_types():
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)
    x, _ = batch()
    missing = {k: v for k, v in params.items() if k != "0.weight"}
    with pytest.raises(RuntimeError, match="0.weight"):
        model_fn(missing, buffers, x)
    with pytest.raises(TypeError, match="dicts of tensors"):
        model_fn(list(params.values()), buffers, x)
    with pytest.raises(TypeError, match="train must be a bool"):
        model_fn(params, buffers, x, train=1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ft.nn.functionalize(lambda x: x)


def test_params_share_storage_but_pure_updates_leave_module_alone():
    model = small_cnn()
    _, params, _ = ft.nn.functionalize(model)
    assert not any(p.requires_grad for p in params.values())
    assert params["0.weight"].data_ptr() == model[0].weight.data_ptr()
    new = ft.apply_updates(params, ft.tree_map(torch.ones_like, params))
    assert not torch.equal(new["0.weight"], model[0].weight.detach())
