"""Elementary and adaptive transforms: hand-computed values, purity, stable states, compilation.

Parity of the optimizers with torch.optim is in test_alias.py; combinators,
clipping, apply_if_finite and multi_steps in test_combine.py.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree

PARAMS = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor(0.5, dtype=torch.float64)}
GRADS = {"w": torch.tensor([0.5, 0.25, -1.0]), "b": torch.tensor(2.0, dtype=torch.float64)}


def run_pure(tx, params=PARAMS, grads=GRADS, steps=3):
    """Run a few updates, checking that no input is modified; return the final updates and state."""
    state = tx.init(params)
    for _ in range(steps):
        p0, g0, s0 = clone_tree(params), clone_tree(grads), clone_tree(state)
        updates, new_state = tx.update(grads, state, params)
        assert_tree_bitwise_equal(params, p0)
        assert_tree_bitwise_equal(grads, g0)
        assert_tree_bitwise_equal(state, s0)
        assert ft.tree.map(lambda a: (a.shape, a.dtype), new_state) == ft.tree.map(lambda a: (a.shape, a.dtype), state)
        state = new_state
    return updates, state


def test_scale():
    updates, _ = run_pure(ft.scale(-3.0))
    assert torch.equal(updates["w"], torch.tensor([-1.5, -0.75, 3.0]))
    assert updates["b"].dtype == torch.float64


def test_scale_by_learning_rate_constant_and_sign():
    updates, _ = run_pure(ft.scale_by_learning_rate(0.1))
    torch.testing.assert_close(updates["w"], torch.tensor([-0.05, -0.025, 0.1]))
    updates, _ = run_pure(ft.scale_by_learning_rate(0.1, flip_sign=False))
    torch.testing.assert_close(updates["w"], torch.tensor([0.05, 0.025, -0.1]))


def test_scale_by_schedule_uses_tensor_step_counter():
    seen = []

    def schedule(count):
        seen.append(count)
        return 1.0 / (count + 1)

    tx = ft.scale_by_schedule(schedule)
    state = tx.init(PARAMS)
    assert state.count.dtype == torch.int64 and state.count.shape == ()
    outs = []
    for _ in range(3):
        updates, state = tx.update(GRADS, state)
        outs.append(updates["w"][0].item())
    assert outs == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert all(isinstance(c, torch.Tensor) for c in seen)
    assert int(state.count) == 3


def test_scale_keeps_leaf_dtypes_with_tensor_scalars():
    params = {"h": torch.tensor(2.0, dtype=torch.float16), "v": torch.ones(3, dtype=torch.bfloat16)}
    tx = ft.scale_by_learning_rate(lambda c: torch.tensor(0.5))
    updates, _ = tx.update(params, tx.init(params))
    assert updates["h"].dtype == torch.float16 and updates["v"].dtype == torch.bfloat16
    assert updates["h"].item() == -1.0


@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_hand_computed(nesterov):
    tx = ft.trace(0.5, nesterov=nesterov)
    state = tx.init(PARAMS)
    g1 = {"w": torch.tensor([1.0, 0.0, 0.0]), "b": torch.tensor(0.0, dtype=torch.float64)}
    g2 = {"w": torch.tensor([0.0, 1.0, 0.0]), "b": torch.tensor(1.0, dtype=torch.float64)}
    u1, state = tx.update(g1, state)
    u2, state = tx.update(g2, state)
    # trace after 2 steps: g2 + 0.5 * g1
    assert torch.equal(state.trace["w"], torch.tensor([0.5, 1.0, 0.0]))
    if nesterov:
        assert torch.equal(u1["w"], torch.tensor([1.5, 0.0, 0.0]))
        assert torch.equal(u2["w"], torch.tensor([0.25, 1.5, 0.0]))
    else:
        assert torch.equal(u2["w"], state.trace["w"])
    run_pure(tx)


def test_trace_rejects_structure_mismatch_without_changing_state():
    tx = ft.trace(0.9)
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(ValueError, match="updates does not have the tree structure of the trace state"):
        tx.update({"w": torch.ones(3)}, state)
    assert_tree_bitwise_equal(state, before)


def test_chain_state_mismatch():
    tx = ft.chain(ft.topk(1), ft.sgd(0.1, momentum=0.9))
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(ValueError, match="tuple of 2 states"):
        tx.update(GRADS, state[:1], PARAMS)
    with pytest.raises(ValueError, match="the trace state"):
        tx.update({"w": GRADS["w"]}, state, PARAMS)
    assert_tree_bitwise_equal(state, before)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"learning_rate": "0.1"}, TypeError, "learning_rate must be a real number"),
        ({"learning_rate": None}, TypeError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate must not be NaN"),
        ({"learning_rate": 0.1, "momentum": -0.5}, ValueError, "momentum must be >= 0"),
        ({"learning_rate": 0.1, "nesterov": True}, ValueError, "nesterov=True needs momentum > 0"),
        ({"learning_rate": 0.1, "momentum": 0.9, "nesterov": 1}, TypeError, "nesterov must be a bool"),
    ],
)
def test_sgd_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ft.sgd(**kwargs)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread avoids OpenMP hand-offs on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(100 + i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype), like)


# ---------------------------------------------------------------- hand-computed references


def test_trace_dampening_first_step_undamped_then_damped():
    """torch.optim.SGD's rule: buf = g on the first step, then m * buf + (1 - d) * g."""
    m, d = 0.9, 0.25
    tx = ft.trace(m, dampening=d)
    state = tx.init(PARAMS)
    buf = None
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(g, state)
        buf = g["w"].clone() if buf is None else m * buf + (1 - d) * g["w"]
        torch.testing.assert_close(updates["w"], buf, rtol=1e-6, atol=0)
        torch.testing.assert_close(state.trace["w"], buf, rtol=1e-6, atol=0)
    assert int(state.count) == 4
    with pytest.raises(ValueError, match="nesterov=True needs dampening == 0"):
        ft.trace(0.9, nesterov=True, dampening=0.1)


def test_scale_by_adam_against_float64_formula():
    b1, b2, eps, eps_root = 0.8, 0.9, 1e-3, 1e-4
    tx = ft.scale_by_adam(b1, b2, eps, eps_root)
    state = tx.init(PARAMS)
    mu = nu = torch.zeros(3, dtype=torch.float64)
    for t in range(1, 5):
        g = grads_at(t)
        updates, state = tx.update(g, state)
        g64 = g["w"].double()
        mu = b1 * mu + (1 - b1) * g64
        nu = b2 * nu + (1 - b2) * g64**2
        expected = (mu / (1 - b1**t)) / (torch.sqrt(nu / (1 - b2**t) + eps_root) + eps)
        torch.testing.assert_close(updates["w"].double(), expected, rtol=2e-6, atol=0)
    assert updates["b"].dtype == torch.float64 and int(state.count) == 4


def test_scale_by_adam_amsgrad_uses_running_max_of_raw_nu():
    b1, b2, eps = 0.0, 0.5, 0.0
    tx = ft.scale_by_adam(b1, b2, eps, amsgrad=True)
    params = {"w": torch.zeros(1)}
    state = tx.init(params)
    nu = nu_max = 0.0
    for t, g in enumerate([4.0, 0.0, 0.0], start=1):
        updates, state = tx.update({"w": torch.tensor([g if g else 1e-3])}, state)
        g = g if g else 1e-3
        nu = b2 * nu + (1 - b2) * g * g
        nu_max = max(nu_max, nu)
        expected = g / (nu_max / (1 - b2**t)) ** 0.5
        assert updates["w"].item() == pytest.approx(expected, rel=1e-6)
    assert state.nu_max["w"].item() == pytest.approx(8.0)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("eps_in_sqrt", [False, True])
def test_scale_by_rms_against_formula(centered, eps_in_sqrt):
    decay, eps, init = 0.7, 1e-2, 0.5
    tx = ft.scale_by_rms(decay, eps, initial_scale=init, centered=centered, eps_in_sqrt=eps_in_sqrt)
    state = tx.init(PARAMS)
    nu = torch.full((3,), init, dtype=torch.float64)
    mu = torch.zeros(3, dtype=torch.float64)
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(g, state)
        g64 = g["w"].double()
        nu = decay * nu + (1 - decay) * g64**2
        mu = decay * mu + (1 - decay) * g64
        sq = nu - mu**2 if centered else nu
        expected = g64 / (torch.sqrt(sq + eps) if eps_in_sqrt else torch.sqrt(sq) + eps)
        torch.testing.assert_close(updates["w"].double(), expected, rtol=2e-6, atol=0)
    assert (state.mu is None) != centered


def test_scale_by_rss_against_formula():
    tx = ft.scale_by_rss(initial_accumulator_value=0.2, eps=1e-3)
    state = tx.init(PARAMS)
    acc = torch.full((3,), 0.2, dtype=torch.float64)
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(g, state)
        acc = acc + g["w"].double() ** 2
        torch.testing.assert_close(updates["w"].double(), g["w"].double() / (acc.sqrt() + 1e-3), rtol=2e-6, atol=0)


def test_add_decayed_weights_masks():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2), "frozen": None}
    g = {"w": torch.zeros(2, 2), "b": torch.zeros(2), "frozen": None}
    full = ft.add_decayed_weights(0.5)
    u, _ = full.update(g, full.init(params), params)
    assert torch.equal(u["w"], torch.full((2, 2), 0.5)) and torch.equal(u["b"], torch.full((2,), 0.5))
    assert u["frozen"] is None
    for mask in ({"w": True, "b": False, "frozen": None}, lambda p: ft.tree.map(lambda x: x.dim() > 1, p)):
        tx = ft.add_decayed_weights(0.5, mask=mask)
        u, _ = tx.update(g, tx.init(params), params)
        assert torch.equal(u["w"], torch.full((2, 2), 0.5))
        assert u["b"] is g["b"]  # untouched: the very same tensor
    with pytest.raises(ValueError, match="needs the parameters"):
        full.update(g, full.init(params))
    bad = ft.add_decayed_weights(0.5, mask={"w": True, "b": torch.tensor(True), "frozen": None})
    with pytest.raises(TypeError, match=r"mask leaf at \['b'\] must be a Python bool"):
        bad.init(params)
    with pytest.raises(ValueError, match="mask must have the structure"):
        ft.add_decayed_weights(0.5, mask={"w": True}).init(params)


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (ft.trace, {"decay": -1.0}, ValueError, "decay must be >= 0"),
        (ft.trace, {"decay": 0.9, "dampening": "x"}, TypeError, "dampening must be a real number"),
        (ft.scale_by_adam, {"b1": 1.0}, ValueError, "b1 must be < 1"),
        (ft.scale_by_adam, {"eps_root": -1.0}, ValueError, "eps_root must be >= 0"),
        (ft.scale_by_adam, {"b2": torch.ones(2)}, TypeError, "b2 must be a real number or a 0-d float tensor"),
        (ft.scale_by_rms, {"decay": 1.0}, ValueError, "decay must be < 1"),
        (ft.scale_by_rms, {"eps_in_sqrt": 0}, TypeError, "eps_in_sqrt must be a bool"),
        (ft.scale_by_rss, {"eps": -1.0}, ValueError, "eps must be >= 0"),
        (ft.add_decayed_weights, {"weight_decay": None}, TypeError, "weight_decay must be a real number"),
        (ft.scale_by_learning_rate, {"learning_rate": 0.1, "flip_sign": "no"}, TypeError, "flip_sign must be a bool"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


# ---------------------------------------------------------------- every transformation: pure, stable, compiled

MIXED = {
    "w": torch.tensor([[1.0, -2.0], [3.0, 0.5]]),
    "h": torch.tensor([0.5, -1.5, 2.0], dtype=torch.float16),
    "s": torch.tensor(0.25),
    "frozen": None,
}


def mixed_grads(i):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype), MIXED)


# (id, factory, keyword arguments, static_args for inject_hyperparams)
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
]
IDS = [t[0] for t in TRANSFORMS]


def shapes_dtypes(tree):
    return ft.tree.map(lambda a: (a.shape, a.dtype, a.device), tree)


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_pure_with_stable_state_and_leaf_dtypes(name, factory, kwargs, static):
    tx = factory(**kwargs)
    state = tx.init(MIXED)
    for i in range(3):
        g = mixed_grads(i)
        p0, g0, s0 = clone_tree(MIXED), clone_tree(g), clone_tree(state)
        updates, new_state = tx.update(g, state, MIXED)
        assert_tree_bitwise_equal(MIXED, p0)
        assert_tree_bitwise_equal(g, g0)
        assert_tree_bitwise_equal(state, s0)
        assert shapes_dtypes(new_state) == shapes_dtypes(state)
        assert shapes_dtypes(updates) == shapes_dtypes(g)
        assert updates["frozen"] is None
        state = new_state


@pytest.mark.parametrize("name, factory, kwargs, static", TRANSFORMS, ids=IDS)
def test_inject_hyperparams_gives_the_same_updates(name, factory, kwargs, static):
    """Every numeric argument injected as a 0-d float32 tensor: same numbers (to float32 rounding of the values)."""
    plain = factory(**kwargs)
    injected = ft.inject_hyperparams(factory, static_args=static)(**kwargs)
    s1, s2 = plain.init(MIXED), injected.init(MIXED)
    numeric = {
        k for k, v in kwargs.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in static
    }
    assert set(s2.hyperparams) == numeric
    for i in range(4):
        g = mixed_grads(i)
        u1, s1 = plain.update(g, s1, MIXED)
        u2, s2 = injected.update(g, s2, MIXED)
        for a, b in zip(ft.tree.leaves(u1), ft.tree.leaves(u2)):
            assert a.dtype == b.dtype
            # float16 results that cancel down to a few ulps of their terms move by an ulp of the
            # terms when a hyperparameter is rounded differently: compare at the tensor's scale.
            tol = 2e-3 if a.dtype == torch.float16 else 1e-5
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * float(a.abs().max()))


def check_compiled(txs, backend, steps=3, params=MIXED, grads=mixed_grads):
    """One compiled function runs every transformation in ``txs`` side by side.

    ``fullgraph=True`` makes any graph break in any of them an error; the results
    must equal eager ones, and steps 2 and 3 must not recompile (states keep their
    shapes and dtypes, and nothing depends on a tensor's value). One compilation
    for all keeps the test fast: dynamo's cost is per traced op, not per function.
    """

    def run_all(grads, states, params):
        outs = [tx.update(grads, s, params) for tx, s in zip(txs, states)]
        return [o[0] for o in outs], [o[1] for o in outs]

    compiled = torch.compile(run_all, fullgraph=True, backend=backend)
    s_e = s_c = [tx.init(params) for tx in txs]
    for i in range(steps):
        g = grads(i)
        u_e, s_e = run_all(g, s_e, params)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            u_c, s_c = compiled(g, s_c, params)
        for a, b in zip(ft.tree.leaves((u_c, s_c)), ft.tree.leaves((u_e, s_e))):
            assert a.dtype == b.dtype and a.shape == b.shape
            if a.is_floating_point():
                tol = 2e-3 if a.dtype == torch.float16 else 1e-5
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
            else:
                assert torch.equal(a, b)


def test_every_transformation_compiles_fullgraph_without_recompiling(fresh_dynamo):
    txs = [factory(**kwargs) for _, factory, kwargs, _ in TRANSFORMS]
    by_name = {t[0]: t for t in TRANSFORMS}
    for name in ("adam", "sgd", "rmsprop", "clip", "multi_steps"):
        _, factory, kwargs, static = by_name[name]
        if "learning_rate" in kwargs:
            kwargs = {**kwargs, "learning_rate": ft.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)}
        txs.append(ft.inject_hyperparams(factory, static_args=static)(**kwargs))
    check_compiled(txs, "aot_eager")


@pytest.mark.slow
def test_optimizers_compile_with_inductor(fresh_dynamo):
    params = {"w": torch.randn(8, 4), "b": torch.randn(4), "s": torch.randn(())}
    txs = [
        ft.apply_if_finite(ft.adamw(0.01, weight_decay=0.1, amsgrad=True)),
        ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(0.1, momentum=0.9, nesterov=True)), 2),
    ]
    check_compiled(txs, "inductor", params=params, grads=lambda i: ft.tree.map(lambda p: torch.randn_like(p), params))
