"""ft.sparse.grad_at: torch.func.grad at fixed coordinates, against torch.func.grad itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functopk as ft
from tests.sparse.helpers import WeightShaped, tiny_gpt2, weights_of


def cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.Flatten(), nn.Linear(16, 3),
    ).double().eval()  # fmt: skip  # batch-norm statistics frozen: a pure loss


def gpt2_loss(model):
    def loss_fn(params, ids):
        return torch.func.functional_call(model, params, (ids,), {"labels": ids}).loss

    return loss_fn, torch.randint(0, 29, (3, 12), generator=torch.Generator().manual_seed(2))


def cnn_loss(model):
    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,)).square().mean()

    return loss_fn, torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


@pytest.mark.parametrize(
    "make, make_loss",
    [
        pytest.param(tiny_gpt2, gpt2_loss, id="gpt2", marks=pytest.mark.integrations),
        pytest.param(cnn, cnn_loss, id="cnn"),
    ],
)
def test_equals_torch_func_grad_at_the_indices_without_a_dense_weight_gradient(make, make_loss):
    model = make()
    loss_fn, data = make_loss(model)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    before = {name: p.clone() for name, p in params.items()}
    dense = torch.func.grad(loss_fn)(params, data)
    flat = torch.cat([g.reshape(-1) for g in ft.tree.leaves(dense)])  # optree's order: keys sorted
    indices = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(4))[:300].sort().values
    with WeightShaped(weights_of(model)) as watch:
        got = ft.sparse.grad_at(loss_fn, indices)(params, data)
    assert watch.seen == []
    assert torch.equal(got.indices, indices) and got.numel == flat.numel()
    torch.testing.assert_close(got.values, flat[indices], rtol=1e-12, atol=1e-14)
    assert all(torch.equal(params[name], before[name]) and params[name].grad is None for name in params)  # pure


def test_has_aux_leaves_without_indices_and_a_sparse_optimizer_step():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(5, 3, dtype=torch.float64)

    def loss_fn(p, x):
        out = torch.func.functional_call(model, p, (x,))
        return out.square().sum(), out.detach()

    # flat order: 0.bias (4), 0.weight (12), 2.bias (2), 2.weight (8): only 0.weight has indices
    got, aux = ft.sparse.grad_at(loss_fn, torch.tensor([4, 9, 15]), has_aux=True)(params, x)
    dense = torch.func.grad(loss_fn, has_aux=True)(params, x)[0]["0.weight"].reshape(-1)
    assert aux.shape == (5, 2)
    torch.testing.assert_close(got.values, dense[[0, 5, 11]], rtol=1e-12, atol=1e-14)
    opt = ft.sparse.sparse_optimizer(ft.sgd(0.1), k=3)
    state = opt.init(params)._replace(indices=torch.tensor([4, 9, 15], dtype=torch.int32))
    updates, _ = opt.update(got, state, params, refresh=False)
    assert torch.equal(updates.indices, torch.tensor([4, 9, 15]))


def test_bad_input_raises_clearly():
    params = {"w": torch.zeros(3)}
    with pytest.raises(TypeError, match="fn must be callable"):
        ft.sparse.grad_at(3, torch.tensor([0]))
    with pytest.raises(TypeError, match="indices must be an int64 or int32 tensor"):
        ft.sparse.grad_at(lambda p: p["w"].sum(), [0])(params)
    with pytest.raises(ValueError, match="ascending"):
        ft.sparse.grad_at(lambda p: p["w"].sum(), torch.tensor([2, 1]))(params)
    with pytest.raises(ValueError, match="0-d tensor"):
        ft.sparse.grad_at(lambda p: p["w"] * 2, torch.tensor([1]))(params)
