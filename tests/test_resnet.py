"""A few steps of torchvision's resnet18 with chain(topk(k), sgd(lr))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functopk as ft

torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.slow


def test_resnet18_topk_sgd_trains_and_changes_exactly_k_coordinates():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model_fn, params, buffers = ft.nn.functionalize(model)
    k = 1000
    tx = ft.chain(ft.topk(k), ft.sgd(0.05))
    state = tx.init(params)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)

    def loss_fn(params, buffers):
        out, new_buffers = model_fn(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    losses = []
    for _ in range(8):
        grads, (loss, buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, buffers)
        losses.append(loss.item())
        updates, state = tx.update(grads, state, params)
        new_params = ft.apply_updates(params, updates)
        changed = sum(int((new_params[n] != params[n]).sum()) for n in params)
        assert changed == k
        params = new_params
    assert losses[-1] < 0.8 * losses[0], losses
