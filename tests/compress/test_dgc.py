"""DGC: momentum correction and masking against the paper's algorithm, clipping bounds, warm-up, the alias."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo

import functopk as ft
from functopk.combine import MaskedState
from tests.helpers import (
    assert_steps_compile_like_eager,
    assert_tree_bitwise_equal,
    assert_tree_close,
    batch,
    clone_tree,
    make_step,
    ref_leaf_topk_mask,
    small_cnn,
    to_device,
)

SHAPES = {"conv": (4, 3, 2), "fc": (5, 4), "bias": (3,)}


def dyadic_tree(seed: int, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randint(-512, 513, s, generator=g) / 64).to(dtype).to(device) for n, s in SHAPES.items()}


def normal_tree(seed: int, dtype=torch.float32, device="cpu"):
    """The same values on every device (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g).to(dtype).to(device) for n, s in SHAPES.items()}


def reference_dgc(grads_seq, k, m, nesterov, masking):
    """The paper's algorithm, coordinate-wise on one flat vector, with brute-force top-k."""
    names = sorted(SHAPES)
    sizes = [math.prod(SHAPES[n]) for n in names]
    u = torch.zeros(sum(sizes), dtype=torch.float64)
    v = torch.zeros_like(u)
    outs, us, vs = [], [], []
    for g in grads_seq:
        gf = torch.cat([g[n].reshape(-1) for n in names])
        u = m * u + gf
        delta = gf + m * u if nesterov else u
        v = v + delta
        mask = ref_leaf_topk_mask(v, k)
        outs.append(torch.where(mask, v, 0.0))
        v = torch.where(mask, 0.0, v)
        if masking:
            u = torch.where(mask, 0.0, u)
        us.append(u.clone())
        vs.append(v.clone())

    def unflat(x):
        return {n: p.view(SHAPES[n]) for n, p in zip(names, torch.split(x, sizes))}

    return [unflat(x) for x in outs], [unflat(x) for x in us], [unflat(x) for x in vs]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_equals_the_papers_algorithm(device, nesterov, masking):
    """m = 0.5 and dyadic gradients make every operation exact, so the comparison is bit for bit.

    Exact arithmetic has one result on every device: the CPU reference holds off CPU too.
    """
    k, m = 5, 0.5
    params = dyadic_tree(0, device=device)
    grads = [dyadic_tree(t + 1) for t in range(12)]
    tx = ft.momentum_correction(ft.topk(k), m, nesterov=nesterov, masking=masking)
    state = tx.init(params)
    outs, us, vs = reference_dgc(grads, k, m, nesterov, masking)
    for t, g in enumerate(grads):
        g = to_device(g, device)
        before, state_before = clone_tree(g), clone_tree(state)
        sent, new_state = tx.update(g, state, params)
        assert_tree_bitwise_equal(g, before)  # pure
        assert_tree_bitwise_equal(state, state_before)
        state = new_state
        assert_tree_bitwise_equal(to_device(sent, "cpu"), outs[t])
        assert_tree_bitwise_equal(to_device(state.velocity, "cpu"), us[t])
        assert_tree_bitwise_equal(to_device(state.residual, "cpu"), vs[t])


def test_masking_zeroes_velocity_and_residual_exactly_at_sent_coordinates(device):
    params = normal_tree(0, device=device)
    m = 0.9
    tx = ft.momentum_correction(ft.topk(density=0.1), m)
    state = tx.init(params)
    for t in range(8):
        g = normal_tree(t + 1, device=device)
        if device == "cpu":  # g + m * u, before masking, with the trace's kernels: one fused multiply-add on the CPU,
            u_expected = ft.tree.add_scaled(g, m, state.velocity)
        else:  # m * u then + g eagerly on a GPU
            u_expected = {n: m * u + g[n] for n, u in state.velocity.items()}
        v_expected = ft.tree.add(state.residual, u_expected)
        sent, state = tx.update(g, state, params)
        sent_count = 0
        for name in SHAPES:
            mask = sent[name] != 0
            sent_count += int(mask.sum())
            assert torch.all(state.velocity[name][mask] == 0) and torch.all(state.residual[name][mask] == 0)
            torch.testing.assert_close(state.velocity[name][~mask], u_expected[name][~mask], rtol=1e-6, atol=0)
            torch.testing.assert_close(state.residual[name][~mask], v_expected[name][~mask], rtol=1e-6, atol=0)
            assert torch.equal(sent[name][mask], v_expected[name][mask])
        assert sent_count == ft.sparse.k_from_density(0.1, 20 + 24 + 3)


def test_everything_sent_without_masking_is_torch_sgd_with_weight_decay(device):
    for nesterov in (False, True):  # torch.optim runs on the same device
        params = normal_tree(0, device=device)
        torch_params = [params[n].clone().requires_grad_(True) for n in sorted(SHAPES)]
        opt = torch.optim.SGD(torch_params, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
        tx = ft.dgc(0.1, momentum=0.9, density=1.0, masking=False, weight_decay=0.01, nesterov=nesterov)
        state = tx.init(params)
        for t in range(6):
            g = normal_tree(t + 1, device=device)
            updates, state = tx.update(g, state, params)
            params = ft.apply_updates(params, updates)
            for p, n in zip(torch_params, sorted(SHAPES)):
                p.grad = g[n].clone()
            opt.step()
        assert_tree_close(params, dict(zip(sorted(SHAPES), [p.detach() for p in torch_params])), rtol=1e-5, atol=1e-6)


def test_everything_sent_with_masking_is_plain_sgd(device):
    params = normal_tree(0, device=device)
    tx = ft.dgc(0.1, momentum=0.9, density=1.0)
    plain = ft.sgd(0.1)
    s, sp = tx.init(params), plain.init(params)
    p, pp = params, params
    for t in range(4):
        g = normal_tree(t + 1, device=device)
        u, s = tx.update(g, s, p)
        p = ft.apply_updates(p, u)
        u, sp = plain.update(g, sp, pp)
        pp = ft.apply_updates(pp, u)
        assert all(bool((x == 0).all()) for x in ft.tree.leaves(s[0].velocity))
    assert_tree_close(p, pp, rtol=1e-6, atol=1e-7)


def test_min_size_leaves_get_plain_momentum_and_the_rest_is_compressed():
    params = normal_tree(0)  # conv 24, fc 20, bias 3
    m = 0.9
    tx = ft.momentum_correction(ft.topk(density=0.25), m, min_size=4)
    trace = ft.trace(m)
    state, tstate = tx.init(params), trace.init({"bias": params["bias"]})
    for t in range(5):
        g = normal_tree(t + 1)
        sent, state = tx.update(g, state, params)
        expected_bias, tstate = trace.update({"bias": g["bias"]}, tstate)
        assert torch.equal(sent["bias"], expected_bias["bias"])  # the dense leaf: torch.optim-style momentum
        assert torch.equal(state.velocity["bias"], tstate.trace["bias"])
        assert torch.equal(state.residual["bias"], torch.zeros(3))
        # the density applies to the compressed leaves only: 25% of 44
        assert int((sent["conv"] != 0).sum() + (sent["fc"] != 0).sum()) == ft.sparse.k_from_density(0.25, 44)


def test_nan_is_sent_and_cleared_from_the_memory(device):
    params = {"w": torch.zeros(4, device=device)}
    tx = ft.momentum_correction(ft.topk(1), 0.9)
    state = tx.init(params)
    sent, state = tx.update({"w": torch.tensor([1.0, float("nan"), 2.0, 0.5], device=device)}, state)
    assert math.isnan(float(sent["w"][1])) and int((sent["w"] != 0).sum()) == 1
    assert float(state.velocity["w"][1]) == 0.0 and float(state.residual["w"][1]) == 0.0
    assert state.residual["w"][[0, 2, 3]].tolist() == [1.0, 2.0, 0.5]


def test_momentum_correction_errors():
    with pytest.raises(TypeError, match="inner must be"):
        ft.momentum_correction(None, 0.9)
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        ft.momentum_correction(ft.topk(1), -0.1)
    for momentum in (1.0, 1.5):  # a velocity that never decays (or grows): refused, in dgc too
        with pytest.raises(ValueError, match=r"momentum must be < 1\.0, got"):
            ft.momentum_correction(ft.topk(1), momentum)
        with pytest.raises(ValueError, match=r"momentum must be < 1\.0, got"):
            ft.dgc(0.1, momentum=momentum, density=0.5)
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        ft.momentum_correction(ft.topk(1), 0.9, nesterov="yes")
    with pytest.raises(ValueError, match="min_size must be >= 0"):
        ft.momentum_correction(ft.topk(1), 0.9, min_size=-2)
    tx = ft.momentum_correction(ft.topk(1), 0.9, min_size=100)
    with pytest.raises(ValueError, match="leaves no leaf to compress"):
        tx.init({"w": torch.zeros(4)})
    tx = ft.momentum_correction(ft.topk(1), 0.9)
    with pytest.raises(ValueError, match="needs the parameters at init"):
        tx.init(None)
    state = tx.init({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="tree structure"):
        tx.update({"x": torch.zeros(4)}, state)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": torch.zeros(5)}, state)
    with pytest.raises(TypeError, match="MomentumCorrectionState"):
        tx.update({"w": torch.zeros(4)}, ft.EmptyState())
    with pytest.raises(ValueError, match="dgc with weight_decay > 0 needs the parameters"):
        d = ft.dgc(0.1, weight_decay=0.1, density=0.5)
        d.update({"w": torch.ones(4)}, d.init({"w": torch.zeros(4)}))


def test_gradient_of_another_shape_is_an_error_naming_the_leaf_not_a_broadcast():
    """A (1, 4) gradient against a (3, 4) state: today's momentum would broadcast it; it must raise."""
    params = {"layer": {"w": torch.zeros(3, 4)}, "b": torch.zeros(4)}
    grads = {"layer": {"w": torch.ones(1, 4)}, "b": torch.ones(4)}
    match = r"updates leaf at \['layer'\]\['w'\] has shape \(1, 4\), but momentum_correction's velocity has shape"
    tx = ft.momentum_correction(ft.topk(2), 0.9)
    with pytest.raises(ValueError, match=match):
        tx.update(grads, tx.init(params), params)
    for d in (ft.dgc(0.1, density=0.5), ft.dgc(0.1, density=0.5, max_norm=1.0, weight_decay=0.1, min_size=5)):
        with pytest.raises(ValueError, match=match):
            d.update(grads, d.init(params), params)


def test_integer_gradients_are_a_type_error():
    params = {"w": torch.zeros(4)}
    grads = {"w": torch.ones(4, dtype=torch.int64)}
    for tx in (ft.momentum_correction(ft.topk(2), 0.9), ft.dgc(0.1, density=0.5, max_norm=1.0),
               ft.dgc_local_clipping(1.0)):
        with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.int64"):
            tx.update(grads, tx.init(params), params)
    with pytest.raises(TypeError, match="floating-point"):
        ft.momentum_correction(ft.topk(2), 0.9).init({"w": torch.zeros(4, dtype=torch.int64)})


def test_local_weight_decay_checks_params_against_updates():
    tx = ft.dgc(0.1, density=1.0, weight_decay=0.1)
    params = {"w": torch.zeros(4)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\] has shape \(4,\), but params has shape \(5,\)"):
        tx.update({"w": torch.ones(4)}, state, {"w": torch.zeros(5)})


def test_state_structure_is_the_pieces_states():
    """momentum_correction's state holds trace's and error_feedback(masked(inner))'s states; dgc's decay a trace."""
    params = normal_tree(0)
    tx = ft.dgc(0.1, momentum=0.9, density=0.25, weight_decay=1e-3, min_size=4)
    state = tx.init(params)
    _, state = tx.update(normal_tree(1), state, params)
    mc, decay = state[0], state[1]
    assert isinstance(mc, ft.compress.MomentumCorrectionState)
    assert isinstance(mc.trace, ft.optim.TraceState) and mc.velocity is mc.trace.trace
    assert isinstance(mc.feedback, ft.compress.ErrorFeedbackState) and mc.residual is mc.feedback.residual
    assert isinstance(mc.feedback.inner_state, MaskedState)
    assert mc.inner_state is mc.feedback.inner_state.inner_state
    assert isinstance(decay, ft.compress.LocalWeightDecayState) and decay.trace is decay.momentum.trace
    assert int(mc.trace.count) == 1


# --------------------------------------------------------------------------- local gradient clipping


def test_per_leaf_clipping_bounds_each_leaf_and_leaves_small_ones_alone():
    g = {"big": torch.randn(50) * 10, "small": torch.randn(5) * 0.01, "half": (torch.randn(20) * 10).half()}
    before = clone_tree(g)
    tx = ft.dgc_local_clipping(2.0, num_workers=4)  # threshold 1
    out, _ = tx.update(g, tx.init(None))
    assert_tree_bitwise_equal(g, before)
    assert torch.equal(out["small"], g["small"])  # norm below the threshold: bit for bit
    for name in ("big", "half"):
        assert out[name].dtype == g[name].dtype
        norm = float(out[name].double().norm())
        assert 0.99 < norm <= 1.0 + 1e-3 * (name == "half") + 1e-6
        cos = torch.nn.functional.cosine_similarity(out[name].double(), g[name].double(), dim=0)
        assert float(cos) > 0.9999  # a rescaling: the direction is kept


def test_global_clipping_bounds_the_tree_norm():
    g = {"a": torch.randn(30) * 3, "b": torch.randn(4, 4) * 3}
    tx = ft.dgc_local_clipping(5.0, per_leaf=False)
    out, _ = tx.update(g, ft.EmptyState())
    total = math.sqrt(sum(float(x.double().square().sum()) for x in ft.tree.leaves(out)))
    assert 4.99 < total <= 5.0
    ratio = [out[n] / g[n] for n in g]
    torch.testing.assert_close(ratio[0], torch.full_like(ratio[0], float(ratio[0][0])))  # one factor for all
    torch.testing.assert_close(ratio[1], torch.full_like(ratio[1], float(ratio[0][0])))
    small = {"a": torch.ones(3) * 0.1}
    assert torch.equal(tx.update(small, ft.EmptyState())[0]["a"], small["a"])


def test_clipping_threshold_as_tensor_and_non_finite_behaviour():
    g = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([float("nan"), 1.0]), "c": torch.tensor([float("inf"), 1.0])}
    out, _ = ft.dgc_local_clipping(torch.tensor(1.0)).update(g, ft.EmptyState())
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.8]))
    assert torch.isnan(out["b"]).all()  # documented: a NaN leaf becomes NaN
    assert math.isnan(float(out["c"][0])) and float(out["c"][1]) == 0.0  # inf * 0, finite * 0
    out, _ = ft.dgc_local_clipping(1.0, per_leaf=False).update({"a": g["a"], "b": g["b"]}, ft.EmptyState())
    assert torch.isnan(out["a"]).all()  # global: one NaN poisons the tree


def test_clipping_errors():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        ft.dgc_local_clipping(0.0)
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        ft.dgc_local_clipping(1.0, num_workers=0)
    with pytest.raises(TypeError, match="per_leaf must be a bool"):
        ft.dgc_local_clipping(1.0, per_leaf=1)


# --------------------------------------------------------------------------- density warm-up


def test_dgc_density_warmup_values_at_documented_steps():
    s = ft.dgc_density_warmup(0.001, steps_per_epoch=100, warmup_epochs=4)
    expected = {0: 0.001**0.2, 99: 0.001**0.2, 100: 0.001**0.4, 250: 0.001**0.6, 399: 0.001**0.8, 400: 0.001,
                10**6: 0.001}
    for step, value in expected.items():
        got = s(torch.tensor(step))
        assert got.dtype == torch.float32 and got.shape == ()
        assert float(got) == pytest.approx(value, rel=1e-6), step
    assert float(s(400)) == float(torch.tensor(0.001, dtype=torch.float32))  # exactly the final density
    # the paper's sequence 25% -> 6.25% -> 1.5625% -> 0.4% -> 0.1%, to the paper's rounding
    paper = [0.25, 0.0625, 0.015625, 0.004, 0.001]
    for e, d in enumerate(paper):
        assert float(s(100 * e)) == pytest.approx(d, rel=0.02)
    # the reference implementation's formula: max(coeff ** (epoch + 1), final), coeff = final ** (1 / (W + 1))
    coeff = 0.001 ** (1 / 5)
    for e in range(8):
        assert float(s(100 * e)) == pytest.approx(max(coeff ** (e + 1), 0.001), rel=1e-6)
    constant = ft.dgc_density_warmup(0.01, steps_per_epoch=3, warmup_epochs=0)
    assert float(constant(0)) == float(constant(50)) == pytest.approx(0.01)


@pytest.mark.compile
def test_dgc_density_warmup_compiles_and_errors():
    s = ft.dgc_density_warmup(0.01, steps_per_epoch=2, warmup_epochs=3)
    compiled = torch.compile(s, fullgraph=True, backend="aot_eager")
    for step in range(8):
        assert torch.equal(compiled(torch.tensor(step)), s(torch.tensor(step)))
    with pytest.raises(ValueError, match="final_density must be in"):
        ft.dgc_density_warmup(0.0, 10)
    with pytest.raises(ValueError, match="steps_per_epoch must be >= 1"):
        ft.dgc_density_warmup(0.1, 0)
    with pytest.raises(ValueError, match="warmup_epochs must be >= 0"):
        ft.dgc_density_warmup(0.1, 10, -1)


def test_dgc_with_density_warmup_sends_the_scheduled_number_of_coordinates():
    params = normal_tree(0)
    n = 24 + 20 + 3
    schedule = ft.dgc_density_warmup(0.05, steps_per_epoch=2, warmup_epochs=3)
    tx = ft.dgc(0.1, momentum=0.9, density=schedule)
    state = tx.init(params)
    for t in range(10):
        updates, state = tx.update(normal_tree(t + 1), state, params)
        expected = int(ft.sparse.k_from_density(schedule(torch.tensor(t)), n))
        sent = sum(int((x != 0).sum()) for x in ft.tree.leaves(updates))
        assert sent == expected, (t, sent, expected)
    assert ft.sparse.k_from_density(float(schedule(0)), n) > 4 * ft.sparse.k_from_density(float(schedule(6)), n)


# --------------------------------------------------------------------------- the alias, compile, inject


def test_dgc_alias_is_the_documented_chain():
    params = normal_tree(0)
    tx = ft.dgc(0.05, momentum=0.9, density=0.2, max_norm=3.0, num_workers=2, weight_decay=1e-3, min_size=4)
    manual = ft.chain(
        ft.dgc_local_clipping(3.0, num_workers=2),
        ft.momentum_correction(ft.topk(density=0.2), 0.9, min_size=4),
    )
    s, sm = tx.init(params), manual.init(params)
    for t in range(4):
        g = normal_tree(t + 1)
        u, s = tx.update(g, s, params)
        sent, sm = manual.update(g, sm, params)
        assert_tree_bitwise_equal(s[1], sm[1])
        # updates = -lr * (sent + trace(wd * params))
        decay = s[2].trace
        expected = ft.tree.scale(ft.tree.add(sent, decay), -0.05)
        assert_tree_close(u, expected, rtol=1e-6, atol=1e-9)


def test_dgc_layerwise_uses_per_leaf_selection():
    params = normal_tree(0)
    tx = ft.dgc(1.0, momentum=0.0, density=0.25, layerwise=True)
    u, _ = tx.update(normal_tree(1), tx.init(params), params)
    for name, shape in SHAPES.items():
        assert int((u[name] != 0).sum()) == ft.sparse.k_from_density(0.25, math.prod(shape)), name


def test_dgc_with_inject_hyperparams_equals_plain():
    params = normal_tree(0)
    injected = ft.inject_hyperparams(ft.dgc, static_args=("density",))(
        learning_rate=0.1, momentum=0.9, density=0.2, weight_decay=1e-3, max_norm=2.0
    )
    plain = ft.dgc(0.1, momentum=0.9, density=0.2, weight_decay=1e-3, max_norm=2.0)
    si, sp = injected.init(params), plain.init(params)
    for t in range(3):
        g = normal_tree(t + 1)
        ui, si = injected.update(g, si, params)
        up, sp = plain.update(g, sp, params)
        assert_tree_close(ui, up, rtol=1e-6, atol=1e-8)
    assert set(si.hyperparams) == {"learning_rate", "momentum", "weight_decay", "max_norm"}


@pytest.mark.compile
def test_dgc_training_step_compiles_fullgraph_without_recompiling(fresh_dynamo):
    model_fn, params, buffers = ft.nn.functionalize(small_cnn())
    tx = ft.dgc(0.1, momentum=0.9, density=0.05, max_norm=1.0, weight_decay=1e-4, min_size=8, method="torch")
    comp = assert_steps_compile_like_eager(
        make_step(model_fn, tx), (params, buffers, tx.init(params)), [batch(seed=i) for i in range(3)],
        backend="aot_eager", compare=lambda got, expected: assert_tree_close(got, expected, rtol=1e-5, atol=1e-6),
    )
    assert not torch.equal(comp[0]["7.weight"], params["7.weight"])


@pytest.mark.compile
def test_dgc_density_warmup_compiles_once_across_density_changes(fresh_dynamo):
    """k changes every 2 steps; compiled, k is a 0-d tensor and the selection a radix select: one graph."""
    params = normal_tree(0)
    schedule = ft.dgc_density_warmup(0.05, steps_per_epoch=2, warmup_epochs=2)
    tx = ft.dgc(0.1, momentum=0.9, density=schedule)
    update = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    state_c = state_e = tx.init(params)
    counts = []
    for t in range(6):
        grads = normal_tree(t + 1)
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            u_c, state_c = update(grads, state_c, params)
        u_e, state_e = tx.update(grads, state_e, params)
        assert_tree_close(u_c, u_e, rtol=0, atol=0)
        counts.append(sum(int((x != 0).sum()) for x in ft.tree.leaves(u_c)))
    assert counts[0] > counts[2] > counts[4] >= 1, counts
