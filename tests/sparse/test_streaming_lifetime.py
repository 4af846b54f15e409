"""StreamingTopK's lifetime and discarded steps: remove(), weak hooks, one stream per parameter, discard()."""

from __future__ import annotations

import copy

import pytest
import torch

import functopk as ft
from functopk.sparse import StreamingTopK


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x, y = batch(seed)
    return (model(x) - y).square().mean()


def sgd_steps(model: torch.nn.Module, seeds) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in seeds:
        opt.zero_grad()
        loss(model, seed).backward()
        opt.step()


def test_a_deleted_stream_leaves_the_model_to_a_dense_optimizer():
    model = mlp()
    stream = StreamingTopK(dict(model.named_parameters()), k=3)
    loss(model, 0).backward()
    sparse = stream.result()
    ft.apply_sparse_updates_(stream.selected_from, sparse, -0.1)
    twin = copy.deepcopy(model)
    del stream  # no remove(), no gc.collect()
    sgd_steps(model, [1, 2])  # a second backward too: no error, every .grad as autograd writes it
    sgd_steps(twin, [1, 2])
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_one_stream_per_parameter_and_remove_frees_them():
    model = mlp()
    params = dict(model.named_parameters())
    first = StreamingTopK(params, k=3)
    with pytest.raises(ValueError, match=r"params leaf at \['0.bias'\] already has the gradient hooks of a live"):
        StreamingTopK(params, k=3)
    loss(model, 0).backward()  # the refused stream registered nothing: the first folds everything
    assert all(p.grad is None for p in params.values()) and first.started
    first.remove()
    assert not first.started  # the unfinished step is discarded
    first.remove()  # again: nothing
    for method, call in [("result", first.result), ("gather", lambda: first.gather(torch.tensor([0])))]:
        with pytest.raises(RuntimeError, match=rf"StreamingTopK.{method}\(\) after remove\(\)"):
            call()
    with StreamingTopK(params, k=3) as second:  # free again
        loss(model, 1).backward()
        assert second.result().indices.numel() == 3
    loss(model, 2).backward()
    assert all(p.grad is not None for p in params.values())


def test_meta_parameters_are_refused_naming_the_device():
    with pytest.raises(ValueError, match="meta device"):
        StreamingTopK(dict(torch.nn.Linear(3, 2, device="meta").named_parameters()), k=2)


@pytest.mark.parametrize("gathering,sampled", [(False, True), (True, False), (True, True)],
                         ids=["selecting", "gathering", "gathering-sampled"])  # fmt: skip
def test_discard_skips_a_batch(gathering, sampled):
    """backward(); discard(): the next step is the step of the next batch alone, and a gather stays armed (the
    sampled layers' coordinate leaves are cleared too; their values equal the dense gradient's within rounding)."""
    model = mlp()
    params = dict(model.named_parameters())
    stream = StreamingTopK(params, k=4, sampled=sampled)
    indices = torch.tensor([0, 5, 7, 30])
    if gathering:
        stream.gather(indices)
    loss(model, 0).backward()  # the batch to skip
    stream.discard()
    with stream.paused():
        loss(model, 1).backward()  # a paused micro-batch: discard() clears its .grad too
    stream.discard()
    loss(model, 2).backward()
    got = stream.result()
    stream.remove()
    grads = dict(zip(params, torch.autograd.grad(loss(model, 2), list(params.values()))))
    if gathering:
        flat = torch.cat([g.reshape(-1) for g in ft.tree.leaves(grads)])
        assert torch.equal(got.indices, indices)
        if sampled:
            torch.testing.assert_close(got.values, flat[indices], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(got.values, flat[indices])
    else:
        expected = ft.topk_indices(grads, 4)
        assert torch.equal(got.indices, expected.indices) and torch.equal(got.values, expected.values)


def accumulated_topk(grads: list[torch.Tensor], k: int) -> torch.Tensor:
    """The top k of |g| summed over ``grads`` (dense reference of the accumulated score)."""
    return ft.topk_indices([sum(g.abs() for g in grads)], k).indices


def test_a_selecting_step_that_fails_adds_nothing_to_the_accumulated_sums():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    stream = StreamingTopK([a, b], k=3, score="accumulated")
    (a * torch.tensor([100.0, 100.0])).sum().backward()  # only a: k=3 exceeds its 2 coordinates
    with pytest.raises(ValueError, match="k=3 exceeds"):
        stream.result()
    g = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    (torch.cat([a, b]) * g).sum().backward()
    assert torch.equal(stream.result().indices, torch.tensor([2, 3, 4]))  # |g| of this step alone
    assert all(not x.any() for x in stream.scores)  # a selecting step restarts the sums
    stream.remove()


def test_a_second_backward_in_a_selecting_step_adds_nothing_to_the_accumulated_sums():
    w = torch.zeros(4, requires_grad=True)
    stream = StreamingTopK([w], k=1, score="accumulated")
    (w * torch.tensor([0.0, 0.0, 0.0, 9.0])).sum().backward()
    with pytest.raises(RuntimeError, match="a second gradient of \\[0\\]"):
        (w * torch.tensor([0.0, 0.0, 0.0, 9.0])).sum().backward()
    w.grad = None  # the second gradient, left there
    (w * torch.tensor([0.0, 1.0, 0.0, 0.5])).sum().backward()
    assert torch.equal(stream.result().indices, torch.tensor([1]))
    stream.remove()


def test_a_discarded_gathering_step_keeps_its_sums_and_says_so():
    """What cannot be taken back without n more numbers: documented, and warned about."""
    w = torch.zeros(4, requires_grad=True)
    stream = StreamingTopK([w], k=1, score="accumulated")
    g1, g2 = torch.tensor([0.0, 0.0, 0.0, 2.0]), torch.tensor([0.0, 3.0, 0.0, 0.0])
    g3 = g1
    stream.gather(torch.tensor([0]))
    (w * g1).sum().backward()
    _ = stream.result()  # a completed gathering step: its |g| count
    stream.gather(torch.tensor([0]))
    (w * g2).sum().backward()
    with pytest.warns(UserWarning, match="already added to the accumulated sums"):
        stream.discard()
    with pytest.raises(RuntimeError, match="stay in the accumulated sums"):  # the second-backward error says it too
        (w * g2).sum().backward()
        (w * g2).sum().backward()
    stream.discard()  # (the error has said it); the gather stays armed
    (w * g3).sum().backward()
    assert torch.equal(stream.result().indices, torch.tensor([0]))  # gathered
    w.sum().mul(0.0).backward()  # a selecting step
    assert torch.equal(stream.result().indices, torch.tensor([1]))  # 3 + 3 (kept) > 2 + 2
    assert torch.equal(accumulated_topk([g1, g2, g2, g3], 1), torch.tensor([1]))
    stream.remove()
