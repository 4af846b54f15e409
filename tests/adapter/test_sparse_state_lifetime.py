"""sparse_optimizer_from_torch's lifetime: remove(), with, deletion, one per parameter, zero_grad() skipping a batch."""

from __future__ import annotations

import copy

import pytest
import torch

import functopk as ft
from tests.helpers import bits


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def loss(net: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)
    return torch.nn.functional.mse_loss(net(x), y)


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def sparse(net: torch.nn.Module, **kwargs):
    args = {"k": 5, "refresh_every": 2, "lr": 0.05, "weight_decay": 0.1, **kwargs}
    return ft.sparse_optimizer_from_torch(torch.optim.AdamW, net.parameters(), **args)


def train(opt, net: torch.nn.Module, seeds) -> None:
    for seed in seeds:
        loss(net, seed).backward()
        opt.step()


def dense_sgd(net: torch.nn.Module, seeds) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for seed in seeds:
        opt.zero_grad()
        loss(net, seed).backward()
        assert all(p.grad is not None for p in net.parameters())
        opt.step()


def test_a_deleted_optimizer_leaves_the_model_to_a_dense_one():
    net = model()
    opt = sparse(net)
    train(opt, net, [0, 1])
    twin = copy.deepcopy(net)
    del opt  # no remove(), no gc.collect()
    dense_sgd(net, [2, 3, 4])  # every .grad there, no "second backward" error
    dense_sgd(twin, [2, 3, 4])
    assert torch.equal(flat(net), flat(twin))


def test_with_and_remove_take_the_hooks_away():
    net = model()
    with sparse(net) as opt:
        train(opt, net, [0, 1])
        count = opt.state_dict()["state"]["count"].clone()
    for call in (opt.step, opt.paused, lambda: opt.load_state_dict(opt.state_dict())):
        with pytest.raises(RuntimeError, match=r"after remove\(\): its gradient hooks are gone"):
            call()
    opt.remove()  # again: nothing
    assert torch.equal(opt.state_dict()["state"]["count"], count)
    opt.zero_grad()  # still clears .grad, as torch's
    twin = copy.deepcopy(net)
    dense_sgd(net, [2, 3])
    dense_sgd(twin, [2, 3])
    assert torch.equal(flat(net), flat(twin))


def test_a_state_dict_loads_into_a_new_optimizer_in_the_same_process():
    """The advice of the deepcopy error: save state_dict(), remove the old one (or delete it), load into a new one."""
    straight = model()
    train(sparse(straight), straight, range(7))

    net = model()
    opt = sparse(net)
    train(opt, net, range(3))  # the next step (3) gathers at the set chosen at step 2
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"params leaf at \[0\] already has the gradient hooks of a live"):
        sparse(net)
    assert net[0].weight.grad is None  # the refused one registered nothing: the live one still folds
    opt.remove()
    again = sparse(net)
    again.load_state_dict(saved)
    train(again, net, range(3, 7))
    assert torch.equal(bits(flat(net)), bits(flat(straight)))


def test_a_stream_on_a_tree_the_optimizer_holds_is_refused_until_it_is_removed():
    net = model()
    opt = sparse(net)
    params = dict(net.named_parameters())
    with pytest.raises(ValueError, match=r"params leaf at \['0.bias'\] already has the gradient hooks"):
        ft.sparse.StreamingTopK(params, k=2)
    del opt
    with ft.sparse.StreamingTopK(params, k=2) as stream:
        loss(net, 0).backward()
        assert stream.result().indices.numel() == 2


@pytest.mark.parametrize(
    "score, skipped",
    [("gradient", 2), ("gradient", 3), ("accumulated", 2)],  # (a gather step's sums stay: the next test)
    ids=["refresh-step", "gather-step", "accumulated-refresh-step"],
)
def test_zero_grad_after_backward_skips_the_batch(score, skipped):
    """backward(); zero_grad() without step(): as torch.optim, the run is the run without that batch."""
    batches = [0, 1, 2, 3, 4, 5]
    reference = model()
    train(sparse(reference, score=score), reference, batches)
    net = model()
    opt = sparse(net, score=score)
    for seed in batches:
        opt.zero_grad()
        if seed == skipped:  # a batch to skip: its backward folded, then thrown away
            loss(net, 99).backward()
            opt.zero_grad()
        loss(net, seed).backward()
        opt.step()
    assert torch.equal(bits(flat(net)), bits(flat(reference)))


def test_a_gather_step_skipped_with_the_accumulated_score_warns_that_its_sums_stay():
    net = model()
    opt = sparse(net, score="accumulated")
    train(opt, net, [0, 1, 2])  # the next step gathers
    loss(net, 3).backward()
    with pytest.warns(UserWarning, match="already added to the accumulated sums"):
        opt.zero_grad()


def test_meta_parameters_are_refused_naming_the_device():
    with pytest.raises(ValueError, match="meta device"):
        ft.sparse_optimizer_from_torch(torch.optim.SGD, torch.nn.Linear(3, 2, device="meta").parameters(), k=2)
