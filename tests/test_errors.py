"""Hardening item 8: the messages for common mistakes say what went wrong and how to fix it."""

from __future__ import annotations

import io

import pytest
import torch

import functopk as ft
from functopk.distributed import distributed_topk, fsdp_topk

NAMED = "pass dict\\(model.named_parameters\\(\\)\\)"


def model_and_params():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    return model, dict(model.named_parameters())


# ---------------------------------------------------------------- an iterator instead of a tree


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.chain(ft.topk(1), ft.sgd(0.1)),
        lambda: ft.chain(ft.identity(), ft.scale(2.0)),  # stateless members: chain itself checks
        lambda: ft.named_chain(("a", ft.identity())),
        lambda: ft.masked(ft.identity(), lambda p: ft.tree.map(lambda x: True, p)),
        lambda: ft.partition({"a": ft.identity()}, lambda p: ft.tree.map(lambda x: "a", p)),
        lambda: ft.sgd(0.1, momentum=0.9),
        lambda: distributed_topk(k=1),
        lambda: fsdp_topk(k=1),
    ],
    ids=["chain", "stateless_chain", "named_chain", "masked", "partition", "sgd", "distributed_topk", "fsdp_topk"],
)
def test_init_with_model_parameters_says_pass_named_parameters(make):
    model, _ = model_and_params()
    with pytest.raises(TypeError, match=f"params must be a pytree of tensors .*got generator.*{NAMED}"):
        make().init(model.parameters())


def all_true(tree):
    return ft.tree.map(lambda x: True, tree)


@pytest.mark.parametrize(
    ("make", "reads_params"),  # chains hand params to their members unread
    [
        (lambda: ft.chain(ft.identity()), False),
        (lambda: ft.named_chain(("a", ft.identity())), False),
        (lambda: ft.masked(ft.identity(), all_true), True),
        (lambda: ft.partition({"a": ft.identity()}, lambda p: ft.tree.map(lambda x: "a", p)), True),
    ],
    ids=["chain", "named_chain", "masked", "partition"],
)
def test_update_with_a_generator_says_pass_named_parameters(make, reads_params):
    model, params = model_and_params()
    tx = make()
    state = tx.init(params)
    grads = ft.tree.map(torch.ones_like, params)
    with pytest.raises(TypeError, match=f"updates must be a pytree of tensors .*{NAMED}"):
        tx.update(iter(grads.values()), state, params)
    if reads_params:
        with pytest.raises(TypeError, match=f"params must be a pytree of tensors .*{NAMED}"):
            tx.update(grads, state, model.parameters())


@pytest.mark.parametrize("fn", [ft.apply_updates, ft.apply_updates_], ids=["pure", "inplace"])
def test_apply_updates_with_a_generator_says_pass_named_parameters(fn):
    model, params = model_and_params()
    updates = ft.tree.map(torch.ones_like, params)
    with pytest.raises(TypeError, match=f"params must be a pytree of tensors .*got generator.*{NAMED}"):
        fn(model.parameters(), updates)
    with pytest.raises(TypeError, match=f"updates must be a pytree of tensors .*got generator.*{NAMED}"):
        fn(params, (u for u in updates.values()))


# ---------------------------------------------------------------- a state from another transformation


def test_state_of_another_transformation_is_a_type_error_naming_the_expected_state():
    _, params = model_and_params()
    grads = ft.tree.map(torch.ones_like, params)
    sgd, adam = ft.sgd(0.1, momentum=0.9), ft.adam(0.1)
    with pytest.raises(TypeError, match=r"state must be a tuple of 2 states.*chain's init.*got ScaleByAdamState"):
        sgd.update(grads, adam.init(params), params)
    chained = ft.chain(ft.topk(1), sgd)
    with pytest.raises(TypeError, match=r"state must be a tuple of 2 states.*got a tuple of 1; was it made by"):
        chained.update(grads, (chained.init(params)[0],), params)
    named = ft.named_chain(("opt", sgd))
    with pytest.raises(TypeError, match=r"a dict with keys \['opt'\] .*got tuple; was it made by a different"):
        named.update(grads, sgd.init(params), params)
    masked = ft.masked(sgd, lambda p: ft.tree.map(lambda x: True, p))
    with pytest.raises(TypeError, match=r"state must be a MaskedState \(the state masked's init returns\), got tuple"):
        masked.update(grads, sgd.init(params), params)
    part = ft.partition({"a": sgd}, lambda p: ft.tree.map(lambda x: "a", p))
    with pytest.raises(TypeError, match=r"a dict with keys \[\"'a'\"\] .*got MaskedState"):
        part.update(grads, masked.init(params), params)
    with pytest.raises(TypeError, match=r"DistributedTopKState \(the state distributed_topk's init returns\)"):
        distributed_topk(k=1).update(grads, sgd.init(params))


def test_adam_given_an_sgd_state_names_the_expected_state():
    _, params = model_and_params()
    grads = ft.tree.map(torch.ones_like, params)
    with pytest.raises(TypeError, match="state must be"):
        ft.adam(0.1).update(grads, ft.sgd(0.1).init(params), params)


# ---------------------------------------------------------------- all-None gradients


def test_all_none_gradients_say_so_in_distributed_topk():
    with pytest.raises(ValueError, match=r"has no coordinates.*were all gradients None\?"):
        distributed_topk(density=0.1).init({"w": None, "b": None})


def test_all_none_gradients_say_so_through_chain_topk_sgd():
    tx = ft.chain(ft.topk(1), ft.sgd(0.1))
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"has no coordinates.*were all gradients None\?"):
        tx.update({"w": None, "b": None}, state, params)


# ---------------------------------------------------------------- a mismatched structure on a big model


def sixty_leaves():
    params = {f"layer{i:02d}.weight": torch.zeros(2) for i in range(60)}
    renamed = dict(params)
    renamed["layer33.bias"] = renamed.pop("layer33.weight")
    return params, renamed


def structure_errors():
    params, renamed = sixty_leaves()
    tx = ft.chain(ft.topk(3), ft.sgd(0.1, momentum=0.9))
    masked = ft.masked(ft.identity(), all_true)
    sd = ft.state_to_dict(tx.init(renamed))
    named = [(name, torch.nn.Parameter(torch.zeros(2))) for name in params]
    opt = ft.TorchOptimizer(named, ft.stateless(lambda u, p: renamed))
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones(2)
    return {
        "apply_updates": lambda: ft.apply_updates(params, renamed),
        "apply_updates_": lambda: ft.apply_updates_(params, renamed),
        "chain_update": lambda: tx.update(renamed, tx.init(params), params),
        "masked": lambda: masked.update(params, masked.init(params), renamed),
        "state_from_dict": lambda: ft.state_from_dict(tx.init(params), sd),
        "load_state": lambda: ft.load_state(_saved(tx.init(renamed)), tx.init(params)),
        "torch_optimizer": opt.step,
    }


def _saved(state):
    buffer = io.BytesIO()
    ft.save_state(buffer, state)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("case", list(structure_errors()))
def test_mismatched_structure_on_a_60_leaf_model_names_the_first_differing_key(case):
    with pytest.raises(ValueError) as info:
        structure_errors()[case]()
    message = str(info.value)
    assert "layer33" in message, message
    assert len(message) < 400, message  # not both structures in full
    assert "PyTreeSpec" not in message and "layer59" not in message, message
