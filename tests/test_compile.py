"""torch.compile(fullgraph=True): equal to eager, no recompilation on later steps."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.helpers import assert_tree_close, batch, make_step, small_cnn

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_update_equals_eager_and_does_not_recompile():
    tx = ft.chain(ft.topk(7), ft.sgd(lambda c: 0.1 / (1.0 + c), momentum=0.9, nesterov=True))
    params = {"a": torch.randn(5, 4), "b": torch.randn(3), "c": (torch.randn(2, 2, dtype=torch.float64), None)}
    state_e = state_c = tx.init(params)
    update_c = torch.compile(tx.update, fullgraph=True)
    for i in range(3):
        grads = ft.tree.map(lambda p: torch.randn_like(p), params)
        u_e, state_e = tx.update(grads, state_e, params)
        if i == 0:
            u_c, state_c = update_c(grads, state_c, params)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                u_c, state_c = update_c(grads, state_c, params)
        assert_tree_close(u_c, u_e, rtol=1e-6, atol=1e-7)
        assert_tree_close(state_c, state_e, rtol=1e-6, atol=1e-7)
        # exactly the same coordinates are selected
        nz_e = [x != 0 for x in ft.tree.leaves(u_e)]
        nz_c = [x != 0 for x in ft.tree.leaves(u_c)]
        assert all(torch.equal(a, b) for a, b in zip(nz_e, nz_c))
    assert int(state_c[1][1].count) == 3


def test_compiled_training_step_with_batchnorm_equals_eager():
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)
    tx = ft.chain(ft.topk(density=0.05), ft.sgd(0.1, momentum=0.9))
    step = make_step(model_fn, tx)
    compiled = torch.compile(step, fullgraph=True)
    eager_carry = compiled_carry = (params, buffers, tx.init(params))
    for i in range(3):
        x, y = batch(seed=i)
        eager_carry = step(*eager_carry, x, y)
        if i == 0:
            compiled_carry = compiled(*compiled_carry, x, y)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled_carry = compiled(*compiled_carry, x, y)
        assert_tree_close(compiled_carry, eager_carry, rtol=1e-5, atol=1e-6)
    # the step really trained: BN statistics moved and parameters changed
    assert int(compiled_carry[1]["1.num_batches_tracked"]) == 3
    assert not torch.equal(compiled_carry[0]["7.weight"], params["7.weight"])
