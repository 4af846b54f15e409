"""A few steps of torchvision's resnet18 with chain(topk(k), sgd(lr)), eager and compiled as one graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functopk as ft
from tests.helpers import assert_steps_compile_like_eager, assert_tree_close, make_step

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


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_resnet18_topk_step_is_one_graph_that_compiles_once_and_follows_eager():
    """The whole step (grad, top-k, momentum, apply) with fullgraph=True; step 2 and 3 must not recompile.

    aot_eager: dynamo's capture and AOT autograd, the part that depends on the torch release; inductor's code
    generation of the same graph is benchmarks/compiled_step.py's (a minute per cold compile here).
    """
    torch.manual_seed(0)
    model_fn, params, buffers = ft.nn.functionalize(torchvision.models.resnet18(num_classes=10))
    tx = ft.chain(ft.topk(1000), ft.sgd(0.05, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
    new_params, _, state = assert_steps_compile_like_eager(
        make_step(model_fn, tx), (params, buffers, tx.init(params)), batches, backend="aot_eager",
        compare=lambda got, expected: assert_tree_close(got, expected, rtol=1e-5, atol=1e-6),
    )
    assert int(state[1][0].count) == 3
    changed = sum(int((new_params[n] != params[n]).sum()) for n in params)
    assert 1000 <= changed <= 3000  # each step moves the 1000 coordinates its momentum reaches
