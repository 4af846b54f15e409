"""functionalize: pure model functions with explicit buffers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.func import grad, vmap

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, batch, clone_tree, make_step, small_cnn


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
        torch.testing.assert_close(buffers[name], b, rtol=1e-6, atol=1e-7)


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
    new = ft.apply_updates(params, ft.tree.map(torch.ones_like, params))
    assert not torch.equal(new["0.weight"], model[0].weight.detach())


def test_batchnorm_running_stats_after_functional_training_equal_module_training():
    """N functional training steps (grad + sgd) give the plain module's parameters and BN statistics."""
    model = small_cnn()
    ref = copy.deepcopy(model)
    model_fn, params, buffers = ft.nn.functionalize(model)
    tx = ft.sgd(0.1)
    opt_state = tx.init(params)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = make_step(model_fn, tx)
    for i in range(6):
        x, y = batch(seed=i)
        params, buffers, opt_state = step(params, buffers, opt_state, x, y)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    assert int(buffers["1.num_batches_tracked"]) == 6
    for name, b in ref.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=1e-6, atol=1e-7)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-6, atol=1e-7)
    # the module itself was never written: functional training is pure
    assert int(model[1].num_batches_tracked) == 0


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("make_model", [mlp, small_cnn], ids=["mlp", "cnn_bn_eval"])
def test_per_example_gradients_through_vmap_equal_a_per_sample_loop(make_model):
    model = make_model()
    model_fn, params, buffers = ft.nn.functionalize(model)
    if make_model is mlp:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)
    else:  # give BN non-trivial running statistics first
        for i in range(3):
            _, buffers = model_fn(params, buffers, batch(seed=10 + i)[0], train=True)
        x, y = batch(n=7)

    def loss_fn(params, buffers, x, y):  # one example: add a batch dimension of 1
        out, _ = model_fn(params, buffers, x.unsqueeze(0), train=False)
        return F.cross_entropy(out, y.unsqueeze(0))

    per_example = vmap(grad(loss_fn), in_dims=(None, None, 0, 0))(params, buffers, x, y)
    for i in range(len(x)):
        single = grad(loss_fn)(params, buffers, x[i], y[i])
        for name in params:
            torch.testing.assert_close(per_example[name][i], single[name], rtol=1e-5, atol=1e-7)
    # and their mean is the batch gradient (eval mode: examples are independent)
    def batch_loss(params):
        return F.cross_entropy(model_fn(params, buffers, x, train=False)[0], y)

    full = grad(batch_loss)(params)
    for name in params:
        torch.testing.assert_close(per_example[name].mean(0), full[name], rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@pytest.mark.slow
def test_model_function_compiles_fullgraph_with_per_call_mode():
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)

    def both_modes(params, buffers, x):
        out_eval, _ = model_fn(params, buffers, x, train=False)
        out_train, new_buffers = model_fn(params, buffers, x, train=True)
        return out_eval, out_train, new_buffers

    torch._dynamo.reset()
    compiled = torch.compile(both_modes, fullgraph=True, backend="aot_eager")
    x, _ = batch()
    got = compiled(params, buffers, x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled(params, buffers, batch(seed=1)[0])
    want = both_modes(params, buffers, batch(seed=1)[0])
    assert model.training
    assert_tree_bitwise_equal(got, want)
    torch._dynamo.reset()


def test_load_into_module_writes_trained_values_back():
    model = small_cnn()
    ref = copy.deepcopy(model)
    model_fn, params, buffers = ft.nn.functionalize(model)
    step = make_step(model_fn, ft.sgd(0.1))
    state = ft.sgd(0.1).init(params)
    for i in range(2):
        params, buffers, state = step(params, buffers, state, *batch(seed=i))
    trained = clone_tree((params, buffers))
    assert ft.nn.load_into_module_(model, params, buffers) is model
    assert_tree_bitwise_equal((params, buffers), trained)  # inputs only read
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), params[name]) and p.requires_grad
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name])
    x, _ = batch(seed=5)
    torch.testing.assert_close(model.eval()(x), model_fn(params, buffers, x, train=False)[0], rtol=0, atol=0)
    # buffers only; parameters left alone
    ft.nn.load_into_module_(ref, buffers=buffers)
    assert torch.equal(ref[1].running_mean, buffers["1.running_mean"])
    assert not torch.equal(ref[0].weight.detach(), params["0.weight"])


def test_load_into_module_checks_everything_before_writing():
    model = small_cnn()
    _, params, buffers = ft.nn.functionalize(model)
    before = clone_tree(dict(model.state_dict()))
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    cases = [
        ({k: v for k, v in zeros.items() if k != "7.bias"}, ValueError, r"missing \['7.bias'\]"),
        ({**zeros, "extra": torch.zeros(1)}, ValueError, r"unexpected \['extra'\]"),
        ({**zeros, "7.bias": torch.zeros(4)}, ValueError, r"params\['7.bias'\] has shape \(4,\)"),
        ({**zeros, "7.bias": torch.zeros(3, dtype=torch.float64)}, ValueError, "dtype torch.float64"),
        ({**zeros, "7.bias": [0.0, 0.0, 0.0]}, TypeError, "must be a tensor"),
        (list(zeros.values()), TypeError, "params must be a dict"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            ft.nn.load_into_module_(model, bad, buffers)
        assert_tree_bitwise_equal(dict(model.state_dict()), before)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ft.nn.load_into_module_(params, params)


def test_tied_parameters_appear_once_and_stay_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    model_fn, params, buffers = ft.nn.functionalize(model)
    assert list(params) == ["0.weight"]
    tokens = torch.tensor([1, 3])
    grads = grad(lambda p: model_fn(p, buffers, tokens)[0].square().sum())(params)
    ref = copy.deepcopy(model)
    ref(tokens).square().sum().backward()
    torch.testing.assert_close(grads["0.weight"], ref[0].weight.grad)  # both uses contribute
    ft.nn.load_into_module_(model, {"0.weight": torch.ones(5, 3)})
    assert torch.equal(model[1].weight, torch.ones(5, 3))
