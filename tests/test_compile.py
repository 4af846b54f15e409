"""torch.compile(fullgraph=True): equal to eager, no recompilation on later steps."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.helpers import (
    assert_steps_compile_like_eager,
    assert_tree_close,
    assert_updates_compile_like_eager,
    batch,
    make_step,
    small_cnn,
)

pytestmark = [pytest.mark.slow, pytest.mark.compile]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_update_equals_eager_and_does_not_recompile():
    tx = ft.chain(ft.topk(7), ft.sgd(lambda c: 0.1 / (1.0 + c), momentum=0.9, nesterov=True))
    params = {"a": torch.randn(5, 4), "b": torch.randn(3), "c": (torch.randn(2, 2, dtype=torch.float64), None)}
    grads = [ft.tree.map(lambda p: torch.randn_like(p), params) for _ in range(3)]

    def close_and_same_selection(got, expected):
        assert_tree_close(got, expected, rtol=1e-6, atol=1e-7)
        # exactly the same coordinates are selected
        (u_c,), (u_e,) = got[1], expected[1]
        assert all(torch.equal(a != 0, b != 0) for a, b in zip(ft.tree.leaves(u_c), ft.tree.leaves(u_e)))

    (state,) = assert_updates_compile_like_eager(
        [tx], params, grads.__getitem__, backend="inductor", compare=close_and_same_selection
    )
    assert int(state[1][1].count) == 3


def test_compiled_training_step_with_batchnorm_equals_eager():
    model = small_cnn()
    model_fn, params, buffers = ft.nn.functionalize(model)
    tx = ft.chain(ft.topk(density=0.05), ft.sgd(0.1, momentum=0.9))
    compiled_carry = assert_steps_compile_like_eager(
        make_step(model_fn, tx), (params, buffers, tx.init(params)), [batch(seed=i) for i in range(3)],
        compare=lambda got, expected: assert_tree_close(got, expected, rtol=1e-5, atol=1e-6),
    )
    # the step really trained: BN statistics moved and parameters changed
    assert int(compiled_carry[1]["1.num_batches_tracked"]) == 3
    assert not torch.equal(compiled_carry[0]["7.weight"], params["7.weight"])


def _linear_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    return model, torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_compiled_torch_optimizer_step_equals_eager_with_a_scheduled_tensor_lr():
    """As documented: a compiled caller runs the step eagerly (the in-place engine is eager), so it is bitwise
    the eager step and nothing recompiles."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, x = _linear_and_batch()
        make = lambda lr: ft.chain(ft.topk(5), ft.sgd(lr, momentum=0.9))  # noqa: E731
        opt = ft.TorchOptimizer(model.parameters(), make, lr=torch.tensor(0.1, dtype=torch.float64))
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for i in range(4):
            opt.zero_grad()
            model(x).square().sum().backward()
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):  # steps 0 and 1 compile (state made)
                step()
            scheduler.step()
        runs.append([p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_from_torch_step_is_refused_and_changes_nothing(fullgraph):
    model, x = _linear_and_batch()
    opt = ft.optimizer_from_torch(torch.optim.Adam, model.parameters(), ft.topk(3), lr=0.1)
    model(x).square().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    # without fullgraph, the caller gets the NotImplementedError; with it, dynamo's error carries the message
    with pytest.raises(Exception, match="not supported for optimizer_from_torch.*functional step") as err:
        torch.compile(opt.step, backend="eager", fullgraph=fullgraph)()
    assert fullgraph or err.type is NotImplementedError
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    opt.step()  # eager still steps
    assert len(opt.state) == 2
