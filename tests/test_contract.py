"""The table of every transformation (optimizers, compressors, combinators): purity, stable states and
dtypes, injected hyperparameters, compilation without recompiling, and the inputs every one of them must
reject (mismatched shapes, integer gradients, a state from another transformation)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.helpers import (
    MIXED,
    assert_tree_bitwise_equal,
    assert_updates_compile_like_eager,
    clone_tree,
    mixed_grads,
    real_device,
    to_device,
)

TRANSFORMS = [
    ("scale", ft.scale, {"step_size": -0.5}, ()),
    ("scale_by_learning_rate", ft.scale_by_learning_rate, {"learning_rate": 0.1}, ()),
    ("scale_by_schedule", ft.scale_by_schedule, {"schedule": ft.exponential_decay(1.0, 1, 0.5)}, ("schedule",)),
    ("trace_nesterov", ft.trace, {"decay": 0.9, "nesterov": True}, ()),
    ("trace_dampening", ft.trace, {"decay": 0.9, "dampening": 0.5}, ()),
    ("add_decayed_weights", ft.add_decayed_weights,
     {"weight_decay": 0.1, "mask": {"w": True, "h": False, "s": True, "frozen": None}}, ()),
    ("scale_by_adam", ft.scale_by_adam, {"b1": 0.8, "b2": 0.9, "eps": 1e-6, "eps_root": 1e-8, "amsgrad": True}, ()),
    ("scale_by_rms", ft.scale_by_rms, {"decay": 0.9, "eps": 1e-6, "initial_scale": 0.1, "centered": True}, ()),
    ("scale_by_rss", ft.scale_by_rss, {"initial_accumulator_value": 0.1, "eps": 1e-8}, ()),
    ("clip", ft.clip, {"max_delta": 0.3}, ()),
    ("clip_by_global_norm", ft.clip_by_global_norm, {"max_norm": 0.5}, ()),
    ("zero_nans", ft.zero_nans, {}, ()),
    ("sgd", ft.sgd,
     {"learning_rate": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "maximize": True}, ()),
    ("adam", ft.adam, {"learning_rate": 0.01, "weight_decay": 0.01, "amsgrad": True}, ()),
    ("adamw", ft.adamw,
     {"learning_rate": 0.01, "weight_decay": 0.1, "mask": lambda p: ft.tree.map(lambda x: x.dim() > 1, p)}, ("mask",)),
    ("rmsprop", ft.rmsprop, {"learning_rate": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}, ()),
    ("adagrad", ft.adagrad, {"learning_rate": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.1}, ()),
    ("apply_if_finite", ft.apply_if_finite, {"inner": ft.adam(0.1), "max_consecutive_errors": 2}, ()),
    ("multi_steps", ft.multi_steps, {"inner": ft.sgd(0.1, momentum=0.9), "every_k": 2}, ()),
    ("masked", ft.masked, {"inner": ft.adam(0.1), "mask": {"w": True, "h": False, "s": True, "frozen": None}}, ()),
    ("partition", ft.partition, {"transforms": {"a": ft.adamw(0.1), "b": ft.sgd(0.1, momentum=0.5)},
                                 "param_labels": {"w": "a", "h": "b", "s": "a", "frozen": None}}, ()),
    # compressors (MIXED has 9 coordinates)
    ("topk", ft.topk, {"k": 3}, ()),
    ("topk_density", ft.topk, {"density": 0.4}, ()),
    ("topk_schedule", ft.topk, {"k": lambda count: 2 + count % 2}, ("k",)),
    ("layerwise_topk", ft.layerwise_topk, {"k": 1, "min_size": 2}, ("k", "min_size")),
    ("randk", ft.randk, {"k": 3, "seed": 1}, ("k", "seed")),
    ("threshold", ft.threshold, {"v": 0.5}, ()),
    ("compression_stats", ft.compress.compression_stats, {"inner": ft.topk(3)}, ()),
    ("error_feedback", ft.error_feedback, {"inner": ft.topk(3)}, ()),
    ("momentum_correction", ft.momentum_correction, {"inner": ft.topk(3), "momentum": 0.9, "min_size": 2},
     ("min_size",)),
    ("dgc_local_clipping", ft.dgc_local_clipping, {"max_norm": 1.0, "num_workers": 4}, ("num_workers",)),
    ("dgc", ft.dgc, {"learning_rate": 0.1, "momentum": 0.9, "density": 0.4, "max_norm": 1.0, "num_workers": 2,
                     "weight_decay": 1e-4}, ("num_workers",)),
    # combinators around them
    ("chain_topk_sgd", lambda k, learning_rate: ft.chain(ft.topk(k), ft.sgd(learning_rate, momentum=0.9)),
     {"k": 3, "learning_rate": 0.1}, ()),
    ("named_chain_ef_sgd",
     lambda learning_rate: ft.named_chain(("ef", ft.error_feedback(ft.topk(2))),
                                          ("sgd", ft.sgd(learning_rate, momentum=0.9))),
     {"learning_rate": 0.1}, ()),
]


IDS = [t[0] for t in TRANSFORMS]


def shapes_dtypes(tree):
    return ft.tree.map(lambda a: (a.shape, a.dtype, a.device), tree)


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_pure_with_stable_state_and_leaf_dtypes(device, name, factory, kwargs, static):
    """On every device; the state lives on the parameters' device (counters included)."""
    params = to_device(MIXED, device)
    tx = factory(**kwargs)
    state = tx.init(params)
    assert all(x.device == real_device(device) for x in ft.tree.leaves(state)), shapes_dtypes(state)
    for i in range(3):
        g = to_device(mixed_grads(i), device)
        p0, g0, s0 = clone_tree(params), clone_tree(g), clone_tree(state)
        updates, new_state = tx.update(g, state, params)
        assert_tree_bitwise_equal(params, p0)
        assert_tree_bitwise_equal(g, g0)
        assert_tree_bitwise_equal(state, s0)
        assert shapes_dtypes(new_state) == shapes_dtypes(state)
        assert shapes_dtypes(updates) == shapes_dtypes(g)
        assert updates["frozen"] is None
        state = new_state


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_inject_hyperparams_gives_the_same_updates(device, name, factory, kwargs, static):
    """Every numeric argument injected as a 0-d float32 tensor: same numbers (to float32 rounding of the values)."""
    params = to_device(MIXED, device)
    plain = factory(**kwargs)
    injected = ft.inject_hyperparams(factory, static_args=static)(**kwargs)
    s1, s2 = plain.init(params), injected.init(params)
    numeric = {
        k for k, v in kwargs.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in static
    }
    assert set(s2.hyperparams) == numeric
    for i in range(4):
        g = to_device(mixed_grads(i), device)
        u1, s1 = plain.update(g, s1, params)
        u2, s2 = injected.update(g, s2, params)
        for a, b in zip(ft.tree.leaves(u1), ft.tree.leaves(u2)):
            assert a.dtype == b.dtype
            # float16 results that cancel down to a few ulps of their terms move by an ulp of the
            # terms when a hyperparameter is rounded differently: compare at the tensor's scale.
            tol = 2e-3 if a.dtype == torch.float16 else 1e-5
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * float(a.abs().max()))


def close_per_dtype(got, expected):
    """Equal shapes and dtypes; float16 to 2e-3 and the rest to 1e-5 of the tensor's scale; integers exactly."""
    for a, b in zip(ft.tree.leaves(got), ft.tree.leaves(expected)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.is_floating_point():
            tol = 2e-3 if a.dtype == torch.float16 else 1e-5
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
        else:
            assert torch.equal(a, b)


@pytest.mark.compile
def test_every_transformation_compiles_fullgraph_without_recompiling(fresh_dynamo):
    txs = [factory(**kwargs) for _, factory, kwargs, _ in TRANSFORMS]
    by_name = {t[0]: t for t in TRANSFORMS}
    for name in ("adam", "sgd", "rmsprop", "clip", "multi_steps"):
        _, factory, kwargs, static = by_name[name]
        if "learning_rate" in kwargs:
            kwargs = {**kwargs, "learning_rate": ft.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)}
        txs.append(ft.inject_hyperparams(factory, static_args=static)(**kwargs))
    assert_updates_compile_like_eager(txs, MIXED, mixed_grads, compare=close_per_dtype)


@pytest.mark.compile
@pytest.mark.slow
def test_optimizers_compile_with_inductor(fresh_dynamo):
    params = {"w": torch.randn(8, 4), "b": torch.randn(4), "s": torch.randn(())}
    txs = [
        ft.apply_if_finite(ft.adamw(0.01, weight_decay=0.1, amsgrad=True)),
        ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(0.1, momentum=0.9, nesterov=True)), 2),
    ]
    grads = lambda i: ft.tree.map(lambda p: torch.randn_like(p), params)  # noqa: E731
    assert_updates_compile_like_eager(txs, params, grads, backend="inductor", compare=close_per_dtype)


# ---------------------------------------------------------------- what every transformation rejects

STATELESS = {
    "scale", "scale_by_learning_rate", "scale_by_schedule", "clip", "clip_by_global_norm", "zero_nans",
    "topk", "topk_density", "topk_schedule", "layerwise_topk", "randk", "threshold", "dgc_local_clipping",
    "compression_stats",
}
"""Transformations that keep no per-leaf state and do not need the parameters: a map of the gradient alone."""


def _with_w(tree, w):
    return {**tree, "w": w}


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_gradient_of_another_shape_is_an_error_naming_the_leaf(name, factory, kwargs, static):
    """A (1, 2) gradient for a (2, 2) parameter is never broadcast against the state or the parameter."""
    for tx in (factory(**kwargs), ft.inject_hyperparams(factory, static_args=static)(**kwargs)):
        state = tx.init(MIXED)
        before = clone_tree(state)
        g = _with_w(mixed_grads(0), torch.ones(1, 2))
        if name in STATELESS:  # nothing to broadcast against: the update has the gradient's shape
            updates, _ = tx.update(g, state, MIXED)
            assert updates["w"].shape == (1, 2)
        else:
            shapes = r"leaf at \['w'\] has shape \(\d, 2\), but .* has shape \(\d, 2\) there"
            with pytest.raises(ValueError, match=shapes):
                tx.update(g, state, MIXED)
        assert_tree_bitwise_equal(state, before)


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_gradients_are_rejected(name, factory, kwargs, static, dtype):
    tx = factory(**kwargs)
    g = _with_w(mixed_grads(0), torch.ones(2, 2, dtype=dtype))
    with pytest.raises(TypeError, match=rf"updates leaf at \['w'\] has dtype {dtype}; expected a floating-point"):
        tx.update(g, tx.init(MIXED), MIXED)


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_state_of_another_transformation_is_an_error(name, factory, kwargs, static):
    """Not an AttributeError deep inside: a TypeError saying whose state was expected."""
    tx = factory(**kwargs)
    other = ft.trace(0.9).init(MIXED) if not name.startswith("trace") else ft.scale_by_adam().init(MIXED)
    with pytest.raises(TypeError, match="state must be"):
        tx.update(mixed_grads(0), other, MIXED)


@pytest.mark.parametrize(
    "make, other, match",
    [
        (lambda: ft.adam(0.1, amsgrad=True), lambda: ft.adam(0.1), r"adam's state has no nu_max: it was made with"),
        (lambda: ft.scale_by_adam(), lambda: ft.scale_by_adam(amsgrad=True), r"scale_by_adam's state has a nu_max"),
        (lambda: ft.scale_by_rms(centered=True), lambda: ft.scale_by_rms(), r"scale_by_rms's state has no mu"),
        (lambda: ft.scale_by_rms(), lambda: ft.scale_by_rms(centered=True), r"scale_by_rms's state has a mu"),
    ],
)
def test_state_of_the_same_class_made_with_other_options_is_an_error(make, other, match):
    tx = make()
    with pytest.raises(ValueError, match=match):
        tx.update(mixed_grads(0), other().init(MIXED), MIXED)
