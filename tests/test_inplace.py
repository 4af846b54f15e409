"""update_: the in-place twin of ``tx.update`` + ``apply_updates``, against the pure path bit for bit."""

from __future__ import annotations

from typing import NamedTuple

import optree
import pytest
import torch

import functopk as ft
from functopk.inplace import split
from functopk.tree import chunked
from tests.helpers import OpsSeen, assert_tree_bitwise_equal, clone_tree, force_accelerator_path, to_device


def tree(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "conv": torch.randn(3, 2, 2, generator=g).to(dtype),
        "block": {"bias": torch.randn(4, generator=g).to(dtype)},
        "head": torch.randn(2, 3, generator=g, dtype=torch.float64),
    }


def _no_decay(params):
    return {"conv": True, "block": {"bias": False}, "head": True}


# (transformation, how many of its flattened chain parts run in place: the rest run purely, then are copied)
CASES = {
    "sgd": (lambda: ft.sgd(0.1), 1),
    "sgd-momentum": (lambda: ft.sgd(0.1, momentum=0.9), 2),
    "sgd-nesterov-decay-maximize": (
        lambda: ft.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True), 4
    ),
    "sgd-dampening": (lambda: ft.sgd(0.1, momentum=0.9, dampening=0.3), 2),
    "adam-decay-maximize": (lambda: ft.adam(1e-2, weight_decay=0.1, maximize=True), 1),
    "adamw": (lambda: ft.adamw(1e-2, weight_decay=0.1), 1),
    "adamw-amsgrad-mask": (lambda: ft.adamw(1e-2, amsgrad=True, mask=_no_decay), 1),
    "adam-schedule": (lambda: ft.adam(ft.linear_schedule(0.1, 0.01, 3)), 1),
    "topk-sgd": (lambda: ft.chain(ft.topk(5), ft.sgd(0.1, momentum=0.9, nesterov=True)), 2),
    "topk-adam": (lambda: ft.chain(ft.topk(5), ft.adam(0.1)), 1),
    "topk-adamw": (lambda: ft.chain(ft.topk(5), ft.adamw(0.1)), 1),
    "from-torch-adamw": (lambda: ft.from_torch(torch.optim.AdamW, lr=1e-2), 1),
    "from-torch-sgd": (lambda: ft.from_torch(torch.optim.SGD, lr=1e-2, momentum=0.5), 2),
    "rmsprop-centered-momentum": (lambda: ft.rmsprop(1e-2, momentum=0.9, centered=True), 3),
    "adagrad": (lambda: ft.adagrad(1e-2, initial_accumulator_value=0.1), 2),
    "scale-by-rms-rss-optax": (lambda: ft.chain(ft.scale_by_rms(), ft.scale_by_rss(eps=0.0), ft.scale(-0.1)), 3),
    "adagrad-lr-decay": (lambda: ft.adagrad(1e-2, lr_decay=0.1), 2),
    "fallback-lion": (lambda: ft.lion(1e-3, weight_decay=0.1), 2),
    "fallback-apply-if-finite": (lambda: ft.apply_if_finite(ft.adam(1e-2), 2), 0),
    "fallback-inject-hyperparams": (lambda: ft.inject_hyperparams(ft.adam)(learning_rate=1e-2), 0),
}


def pure_steps(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = ft.apply_updates(params, updates)
    return params, state


def assert_update_matches_pure(tx, grads, dtype=torch.float32):
    """``ft.update_`` over ``grads`` from ``tree(0, dtype)`` ends where the pure steps do, bit for bit."""
    expected_params, expected_state = pure_steps(tx, tree(0, dtype), grads)
    params = tree(0, dtype)
    state = tx.init(params)
    for g in grads:
        ft.update_(tx, g, state, params)
    assert_tree_bitwise_equal(params, expected_params)
    assert_tree_bitwise_equal(state, expected_state)


@pytest.mark.parametrize("name", list(CASES))
def test_update_matches_pure_bitwise_and_writes_in_place(device, name):
    make, in_place = CASES[name]
    tx = make()
    grads = [tree(s) for s in (1, 2, 3)]
    grads[1]["conv"][0, 0, 0] = float("nan")  # NaN and Inf go where the pure step sends them
    grads[2]["block"]["bias"][1] = float("inf")
    grads = [to_device(g, device) for g in grads]
    expected_params, expected_state = pure_steps(tx, to_device(tree(0), device), grads)
    params = to_device(tree(0), device)
    state = tx.init(params)
    leaves, treedef = optree.tree_flatten(params)
    assert len(split(tx, state, optree.tree_leaves(grads[0]), leaves, treedef)[1]) == in_place
    given = clone_tree(grads)
    ptrs = [t.data_ptr() for t in optree.tree_leaves((params, state))]
    for g in grads:
        out = ft.update_(tx, g, state, params)
        assert out[0] is params and out[1] is state
    assert [t.data_ptr() for t in optree.tree_leaves((params, state))] == ptrs
    assert_tree_bitwise_equal(params, expected_params)
    assert_tree_bitwise_equal(state, expected_state)
    assert_tree_bitwise_equal(grads, given)  # never written


@pytest.mark.parametrize("name", list(CASES))
def test_the_accelerator_path_matches_pure_bitwise_too(name, monkeypatch):
    """The kernels functopk picks eagerly off the CPU (a foreach kernel per operation, a momentum written in
    place), forced on CPU tensors: the in-place step still gives the pure step's bits."""
    force_accelerator_path(monkeypatch)
    grads = [tree(s) for s in (1, 2, 3)]
    grads[1]["conv"][0, 0, 0] = float("nan")
    assert_update_matches_pure(CASES[name][0](), grads)


def test_narrow_dtypes_fall_back_to_the_pure_step():
    assert_update_matches_pure(ft.adam(1e-2), [tree(s, torch.bfloat16) for s in (1, 2)], torch.bfloat16)


def test_module_parameters_that_require_grad():
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    tx = ft.sgd(0.1, momentum=0.9)
    state = tx.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    expected = ft.apply_updates({k: v.detach().clone() for k, v in params.items()}, tx.update(grads, state, params)[0])
    ft.update_(tx, grads, state, params)
    assert model.weight is params["weight"] and torch.equal(model.weight.detach(), expected["weight"].detach())


def _unchanged_after(error, call, params, state, match):
    p0, s0 = clone_tree(params), clone_tree(state)
    with pytest.raises(error, match=match):
        call()
    assert_tree_bitwise_equal(params, p0)
    assert_tree_bitwise_equal(state, s0)


def test_params_aliasing_state_raises_and_writes_nothing():
    tx = ft.chain(ft.topk(2), ft.sgd(0.1, momentum=0.9))
    params = tree(0)
    state = tx.init(params)
    state[1][0].trace["head"] = params["head"]  # a state tensor that is a parameter
    grads = tree(1)
    _unchanged_after(ValueError, lambda: ft.update_(tx, grads, state, params), params, state, r"params\['head'\]")


def test_grads_aliasing_params_raises_and_writes_nothing():
    tx = ft.adamw(0.1)
    params = tree(0)
    state = tx.init(params)
    _unchanged_after(ValueError, lambda: ft.update_(tx, params, state, params), params, state, "grads")


def test_bad_grads_raise_and_write_nothing():
    tx = ft.adam(0.1)
    params = tree(0)
    state = tx.init(params)
    grads = tree(1)
    grads["conv"] = torch.ones(5)
    _unchanged_after(ValueError, lambda: ft.update_(tx, grads, state, params), params, state, r"\['conv'\]")


def _fails(updates, params):
    raise RuntimeError("a later part fails")


def test_a_failing_part_after_an_in_place_one_writes_nothing():
    tx = ft.chain(ft.adam(0.1), ft.stateless(_fails))  # the pure update runs (and fails) before any write
    params = tree(0)
    state = tx.init(params)
    _unchanged_after(RuntimeError, lambda: ft.update_(tx, tree(1), state, params), params, state, "later part")


def test_not_a_transformation():
    with pytest.raises(TypeError, match="tx must be"):
        ft.update_(object(), {}, (), {})


def _counting():
    def init(params):
        return {"steps": 0}

    def update(updates, state, params=None):
        return updates, {"steps": state["steps"] + 1}

    return ft.GradientTransformation(init, update)


def test_a_state_that_cannot_be_written_in_place_raises_and_writes_nothing():
    tx = ft.chain(_counting(), ft.sgd(0.1, momentum=0.9))  # a Python int in the state, changed by each update
    params = tree(0)
    state = tx.init(params)
    p0, s0 = clone_tree(params), clone_tree(state[1])
    with pytest.raises(ValueError, match=r"opt_state\[0\]\['steps'\] \(0\) is no tensor"):
        ft.update_(tx, tree(1), state, params)
    assert state[0] == {"steps": 0}
    assert_tree_bitwise_equal(params, p0)
    assert_tree_bitwise_equal(state[1], s0)


class _Pair(NamedTuple):
    x: torch.Tensor
    tree: dict


def _replacing(new_state):
    """A transformation whose update returns ``new_state(old state)``, a :class:`_Pair`."""

    def init(params):
        return _Pair(torch.zeros(2), {"a": torch.zeros(3)})

    def update(updates, state, params=None):
        return updates, new_state(state)

    return ft.GradientTransformation(init, update)


@pytest.mark.parametrize(
    "new_state, match",
    [
        (lambda s: s._replace(tree={"a": s.tree["a"], "b": torch.zeros(1)}), r"new state at \[0\]\[1\] has another"),
        (lambda s: s._replace(x=torch.zeros(3)), r"leaf at opt_state\[0\]\[0\] \(\(3,\) torch.float32 on cpu\)"),
        (lambda s: s._replace(tree={"a": s.tree["a"].double()}), r"opt_state\[0\]\[1\]\['a'\] \(\(3,\) torch.float64"),
        (lambda s: s._replace(x=s.x + 1, tree=[s.tree["a"]]), r"new state at \[0\]\[1\] has another"),
    ],
    ids=["structure", "shape", "dtype", "structure-after-a-change"],
)
def test_a_new_state_that_does_not_fit_the_old_raises_naming_it_and_writes_nothing(new_state, match):
    tx = ft.chain(_replacing(new_state), ft.sgd(0.1, momentum=0.9))
    params = tree(0)
    state = tx.init(params)
    p0, s0 = clone_tree(params), clone_tree(state)
    with pytest.raises(ValueError, match=match):
        ft.update_(tx, tree(1), state, params)
    assert_tree_bitwise_equal(params, p0)
    assert_tree_bitwise_equal(state, s0)
    fits = ft.chain(_replacing(lambda s: s._replace(x=s.x + 1)), ft.sgd(0.1, momentum=0.9))  # the state fits
    assert ft.update_(fits, tree(1), state, params)[1][0].x.tolist() == [1.0, 1.0]


SGD_OPTIONS = [
    {"momentum": 0.9, "nesterov": n, "dampening": d, "weight_decay": w, "maximize": m}
    for n in (False, True) for d in (0.0, 0.3) if not (n and d) for w in (0.0, 0.1) for m in (False, True)
] + [{}]  # fmt: skip


@pytest.mark.parametrize("options", SGD_OPTIONS)
def test_sgd_fuses_its_learning_rate_into_the_parameters_add_bit_for_bit(options, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 5)  # the conv leaf (12 elements) in three slices
    calls = []
    add_ = chunked.add_
    monkeypatch.setattr(chunked, "add_", lambda *a, **k: calls.append(1) or add_(*a, **k))
    assert_update_matches_pure(ft.sgd(0.1, **options), [tree(s) for s in (1, 2, 3)])
    assert len(calls) == 3  # the last scale, fused into the add at every step


def test_sgd_momentum_allocates_no_update_tree(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 256)
    tx = ft.sgd(0.1, momentum=0.9)
    params = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    state = tx.init(params)
    grads = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    ft.update_(tx, grads, state, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        ft.update_(tx, grads, state, params)
    assert max(e.cpu_memory_usage for e in prof.events()) <= 256 * 4 < 64 * 64 * 4  # one scratch row


def test_disjoint_interleaved_views_of_one_buffer_step_in_place_as_the_pure_step():
    base = torch.arange(12.0)
    params = {"even": base[::2], "odd": base[1::2], "cols": torch.arange(20.0).view(4, 5)[:, 1:3]}
    tx = ft.sgd(0.1, momentum=0.9)
    grads = {k: torch.full_like(v, 1.0 + i) for i, (k, v) in enumerate(params.items())}
    pure, _ = tx.update(grads, tx.init(params), params)
    expected = ft.apply_updates(params, pure)
    new, _ = ft.update_(tx, grads, tx.init(params), params)
    assert new["even"].data_ptr() == base.data_ptr()  # written where they live
    assert_tree_bitwise_equal(new, expected)
    assert torch.equal(base, torch.stack([expected["even"], expected["odd"]], 1).reshape(-1))
    # views that do share an element are still refused, naming both
    overlapping = {"a": base[::2], "b": base[::3]}
    state = tx.init(overlapping)
    g = {k: torch.ones_like(v) for k, v in overlapping.items()}
    _unchanged_after(ValueError, lambda: ft.update_(tx, g, state, overlapping), overlapping, state,
                     r"params\['[ab]'\] and params\['[ab]'\] share memory")  # fmt: skip


@pytest.mark.parametrize(("make", "in_place"), [(lambda: ft.chain(ft.topk(5), ft.sgd(0.1, momentum=0.9)), 3),
                                                (lambda: ft.chain(ft.topk(density=0.2), ft.adam(0.1)), 2)])  # fmt: skip
def test_a_constant_topk_writes_into_its_kept_buffer_and_tells_adam_the_gradient_is_mostly_zero(
    make, in_place, monkeypatch
):
    """update_ runs the user's top-k as it is: its in-place form keeps one flat buffer, re-zeroed at the last
    step's indices, instead of a dense tree per step; the parts after it see a mostly-zero input."""
    from functopk.sparse.selection import Indices

    tx = make()
    grads = [tree(s, torch.float64) for s in (1, 2, 3)]  # one dtype: what the buffer serves
    expected_params, expected_state = pure_steps(tx, tree(0, torch.float64), grads)
    params = tree(0, torch.float64)
    state = tx.init(params)
    leaves, treedef = optree.tree_flatten(params)
    assert len(split(tx, state, optree.tree_leaves(grads[0]), leaves, treedef)[1]) == in_place

    def no_dense_tree(self, leaves):
        raise AssertionError("a dense tree was built")

    monkeypatch.setattr(Indices, "dense", no_dense_tree)
    for g in grads:
        with OpsSeen() as seen:
            ft.update_(tx, g, state, params)
    assert_tree_bitwise_equal(params, expected_params)
    assert_tree_bitwise_equal(state, expected_state)
    assert ("_foreach_clamp_min" in seen.names) == (in_place == 2)  # Adam's floor of nu before sqrt
