"""A whole top-k training step that a CUDA graph can capture (docs/capture.md).

Without a GPU, the step dispatches nothing a capture refuses (:class:`tests.helpers.CaptureBlockers`):
the forward pass, the update and the apply on fake CUDA tensors, which show host reads, data-dependent
shapes and host tensors meeting the device; and the whole step, backward pass included, on CPU tensors.
The Triton kernel's step is checked the same way under Triton's interpreter
(``tests/sparse/triton_interpreted.py``). On a GPU (``make gpu-check`` runs these first): a step captured
by ``torch.cuda.graph`` replays the eager steps bit for bit, and ``torch.compile(mode="reduce-overhead",
fullgraph=True)`` follows them without recompiling.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import functopk as ft
from tests.helpers import (
    TOPK_STEPS,
    CaptureBlockers,
    assert_tree_bitwise_equal,
    assert_tree_close,
    batch,
    captured_step,
    make_step,
    small_cnn,
    to_device,
)

ATEN = ft.sparse.KernelConfig(backend="aten")
K = 20  # of the small CNN's 315 parameters


@pytest.fixture
def fake_cuda():
    """Fake CUDA tensors as the default device; skips where this torch cannot make them without a driver.

    torch 2.9.1's CUDA build initialises CUDA for a fake tensor's random fill (an ``AcceleratorError`` on a
    machine with no or an old driver); the pinned torch's CPU build, which ``make test`` runs, needs none.
    """
    try:
        with FakeTensorMode(), torch.device("cuda"):
            torch.nn.Linear(2, 2)
    except RuntimeError as error:
        pytest.skip(f"fake CUDA tensors need a CUDA driver on this torch build: {str(error).splitlines()[0]}")
    with FakeTensorMode(), torch.device("cuda"):
        yield


def test_the_check_sees_what_a_capture_refuses(fake_cuda):
    x = torch.randn(5)
    refused = {
        "a host read": lambda: x.sum().item(),
        "a branch on a value": lambda: bool(x.sum() > 0),
        "a data-dependent shape": lambda: x[x > 0],
        "a host tensor moved to the device": lambda: torch.tensor(2.0, device="cuda"),
        "a host tensor in a device op": lambda: x + torch.tensor(2.0, device="cpu"),
        "a copy to the host": lambda: x.cpu(),
        "a tensor scalar bound to a Scalar overload": lambda: torch._foreach_add([x], x.sum()),
    }
    for what, fn in refused.items():
        with pytest.raises(AssertionError), CaptureBlockers():
            fn()
            pytest.fail(f"not seen: {what}")
    with CaptureBlockers():  # what a capture takes
        torch.where(x > 0, x, torch.full((), 2.0)).sum()


UPDATES = {
    **{name: lambda make=make: make(ft.topk(K, config=ATEN)) for name, make in TOPK_STEPS.items()},
    "scheduled-k": lambda: ft.chain(ft.topk(lambda count: K + count, config=ATEN), ft.sgd(0.1, momentum=0.9)),
    "from_torch-sgd": lambda: ft.chain(ft.topk(K, config=ATEN), ft.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)),
}


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_forward_update_and_apply_on_cuda_tensors_dispatch_nothing_a_capture_refuses(name, fake_cuda):
    """Fake CUDA tensors, the static kernel (the Triton kernel's launches read real memory)."""
    model_fn, params, buffers = ft.nn.functionalize(small_cnn())
    tx = UPDATES[name]()
    state = tx.init(params)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    with CaptureBlockers():
        for _ in range(2):
            _, buffers = model_fn(params, buffers, x)
            grads = {key: torch.randn_like(p) for key, p in params.items()}
            updates, state = tx.update(grads, state, params)
            params = ft.apply_updates(params, updates)
    assert {p.device.type for p in params.values()} == {"cuda"} and y.device.type == "cuda"


def test_the_whole_step_dispatches_nothing_a_capture_refuses():
    """CPU tensors, backward pass included; ``method="torch"`` is the static kernel, as on CUDA with ATen."""
    model_fn, params, buffers = ft.nn.functionalize(small_cnn())
    for make in TOPK_STEPS.values():
        tx = make(ft.topk(K, method="torch"))
        step, carry = make_step(model_fn, tx), (params, buffers, tx.init(params))
        with CaptureBlockers():
            for i in range(2):
                carry = step(*carry, *batch(seed=i))
        assert sum(int((carry[0][key] != params[key]).sum()) for key in params) >= K


# --------------------------------------------------------------------------- on a GPU


@pytest.fixture()
def deterministic_cudnn(monkeypatch):
    """The same convolution kernels in eager steps and in the captured graph (bitwise comparisons)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def _cuda_start(seed: int = 0):
    torch.manual_seed(seed)
    model_fn, params, buffers = ft.nn.functionalize(small_cnn().cuda())
    return model_fn, params, buffers, [to_device(batch(seed=i), "cuda") for i in range(4)]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("backend", ["auto", "aten"])
@pytest.mark.parametrize("name", sorted(TOPK_STEPS))
@pytest.mark.usefixtures("deterministic_cudnn")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_captured_step_replays_the_eager_steps_bit_for_bit(name, backend, autocast):
    """``auto``: the Triton kernel where Triton imports; ``aten``: the static kernel."""
    model_fn, params, buffers, batches = _cuda_start()
    tx = TOPK_STEPS[name](ft.topk(K, config=ft.sparse.KernelConfig(backend=backend)))
    step = make_step(model_fn, tx, autocast=autocast)
    eager = (params, buffers, tx.init(params))
    graph, carry, static_batch = captured_step(step, eager, batches[0])
    for x, y in batches:
        eager = step(*eager, x, y)
        static_batch[0].copy_(x)
        static_batch[1].copy_(y)
        graph.replay()
        assert_tree_bitwise_equal(carry, eager)
    assert int(carry[1]["1.num_batches_tracked"]) == len(batches)


@pytest.mark.parametrize("backend", ["auto", "aten"])
@pytest.mark.usefixtures("deterministic_cudnn")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_scheduled_k_is_read_on_the_device_at_each_replay(backend):
    model_fn, params, buffers, batches = _cuda_start()
    topk = ft.topk(lambda count: K + 10 * count, config=ft.sparse.KernelConfig(backend=backend))
    step = make_step(model_fn, ft.chain(topk, ft.sgd(0.1)))
    eager = (params, buffers, ft.chain(topk, ft.sgd(0.1)).init(params))
    graph, carry, static_batch = captured_step(step, eager, batches[0])
    for i, (x, y) in enumerate(batches):
        before = {key: p.clone() for key, p in carry[0].items()}
        eager = step(*eager, x, y)
        static_batch[0].copy_(x)
        static_batch[1].copy_(y)
        graph.replay()
        assert_tree_bitwise_equal(carry, eager)
        assert sum(int((carry[0][key] != before[key]).sum()) for key in before) == K + 10 * i  # plain SGD


@pytest.mark.usefixtures("deterministic_cudnn")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_device_tensor_learning_rate_changed_between_replays_is_read_by_the_graph():
    model_fn, params, buffers, batches = _cuda_start()
    lr = torch.tensor(0.1, device="cuda")
    tx = ft.chain(ft.topk(K), ft.sgd(lr, momentum=0.9))
    step = make_step(model_fn, tx)
    eager = (params, buffers, tx.init(params))
    graph, carry, static_batch = captured_step(step, eager, batches[0])
    for i, (x, y) in enumerate(batches):
        lr.fill_(0.1 / (1 + i))  # as a scheduler would, between steps
        eager = step(*eager, x, y)
        static_batch[0].copy_(x)
        static_batch[1].copy_(y)
        graph.replay()
        assert_tree_bitwise_equal(carry, eager)
    lr.fill_(0.0)
    before = {key: p.clone() for key, p in carry[0].items()}
    graph.replay()
    assert all(torch.equal(carry[0][key], before[key]) for key in before)  # the new lr, not the captured one


@pytest.mark.parametrize("name", ["topk-sgd-momentum", "topk-adamw"])
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.compile
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_reduce_overhead_compiles_the_step_once_and_follows_eager(name):
    """Inductor rounds some sums otherwise than eager (1e-5 here); the selected coordinates are the same."""
    model_fn, params, buffers, batches = _cuda_start()
    tx = TOPK_STEPS[name](ft.topk(K))
    step = make_step(model_fn, tx)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    skips = counters["inductor"]["cudagraph_skips"]
    eager = comp = (params, buffers, tx.init(params))
    for i, (x, y) in enumerate(batches):
        moved_eager = step(*eager, x, y)
        before = {key: p.clone() for key, p in comp[0].items()}  # (the next replay overwrites the graph's outputs)
        torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            moved = compiled(*comp, x, y)
        assert_tree_close(moved, moved_eager, rtol=1e-5, atol=1e-6)
        for key in params:  # the same coordinates moved
            assert torch.equal(moved[0][key] != before[key], moved_eager[0][key] != eager[0][key]), key
        eager, comp = moved_eager, moved
    assert counters["inductor"]["cudagraph_skips"] == skips  # replayed as a CUDA graph, not run without one
