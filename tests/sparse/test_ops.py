"""functopk.sparse.ops: the eager exact kernel as custom operators inside compiled graphs.

Compiled "exact" on CPU must run the eager kernel (the operator is in the
graph), select bit for bit what eager mode selects, on the property suite and
in whole compiled training steps under inductor, and not recompile when the
values or a tensor k change.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import KernelConfig, ops
from functopk.sparse.config import DEFAULT_CONFIG
from tests.helpers import assert_tree_bitwise_equal, batch, bits, numel, reference_sparsify, trees_st

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

# small constants so that the operator runs the sampled scan (columns and direct) on small trees
COLUMNS = KernelConfig(exact_min_numel=0, segment=40, sample_size=16, min_columns=2, max_rows=4,
                       column_max_fraction=1.0, band_min=4, native=False)
DIRECT = KernelConfig(exact_min_numel=0, segment=24, sample_size=8, column_max_fraction=0.0, band_min=4, native=False)


def _all_outputs(tree, k, kt, config):
    """Every output form, for an int k and for a tensor k (one compiled graph per tree)."""
    return (
        ft.topk_sparsify(tree, k, config=config),
        ft.topk_mask(tree, k, config=config),
        tuple(ft.topk_indices(tree, k, config=config)[:2]),
        ft.topk_sparsify(tree, kt, config=config),
        ft.topk_mask(tree, kt, config=config),
        tuple(ft.topk_indices(tree, kt, config=config)[:2]),
    )


def _graph_targets(fn, *args):
    """The call targets of the FX graph(s) dynamo captures for ``fn(*args)`` (fullgraph)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


@pytest.mark.compile
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, COLUMNS, DIRECT], ids=["default", "columns", "direct"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_compiled_exact_is_bit_identical_to_eager_on_the_property_suite(config, tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    kt = torch.tensor(data.draw(st.integers(1, n), label="tensor k"))
    torch._dynamo.reset()
    compiled = torch.compile(_all_outputs, backend="aot_eager", fullgraph=True)(tree, k, kt, config)
    eager = _all_outputs(tree, k, kt, config)
    for got, expected in zip(compiled, eager):
        assert_tree_bitwise_equal(got, expected)
    assert_tree_bitwise_equal(compiled[0], reference_sparsify(tree, k))  # and both are the exact top-k


@pytest.mark.compile
def test_the_operator_is_what_compiled_exact_runs():
    tree = {"a": torch.randn(300), "b": torch.randn(20, 10, dtype=torch.float64)}
    for fn, op in [
        (lambda t: ft.topk_sparsify(t, 5), "functopk.topk_dense.default"),
        (lambda t: ft.topk_mask(t, torch.tensor(5)), "functopk.topk_masks.default"),
        (lambda t: ft.topk_indices(t, 5).values, "functopk.topk_indices.default"),
    ]:
        assert op in _graph_targets(fn, tree)
    # "torch", and inputs that require grad, keep the static kernel (it has a gradient)
    assert not any("functopk" in t for t in _graph_targets(lambda t: ft.topk_sparsify(t, 5, method="torch"), tree))
    grad_tree = {"a": torch.randn(300, requires_grad=True)}
    assert not any("functopk" in t for t in _graph_targets(lambda t: ft.topk_sparsify(t, 5), grad_tree))


def test_opcheck():
    """torch.library.opcheck: schema, fake implementations, no aliasing, consistent with the real kernel."""
    leaves = [torch.randn(50), torch.randn(4, 5, dtype=torch.float64), torch.randn(7).half()]
    cfg = ops.config_values(COLUMNS)
    for op in (ops.exact_dense, ops.exact_masks, ops.exact_indices):
        torch.library.opcheck(op, (leaves, 6, None, cfg), test_utils=("test_schema", "test_faketensor"))
    for op in (ops.exact_dense, ops.exact_masks):
        torch.library.opcheck(op, (leaves, 0, torch.tensor(6), cfg), test_utils=("test_schema", "test_faketensor"))


def test_operator_arguments_name_k_never_count():
    """``count`` is the step counter everywhere else: the operators take ``k`` and ``k_tensor``."""
    for name in ("topk_dense", "topk_masks", "topk_indices"):
        schema = getattr(torch.ops.functopk, name).default._schema
        assert [a.name for a in schema.arguments] == ["leaves", "k", "k_tensor", "config"], name


def test_config_round_trips_through_the_operator_arguments():
    for config in (DEFAULT_CONFIG, COLUMNS, DIRECT):
        assert ops._config(ops.config_values(config)) == config


@pytest.mark.compile
def test_tensor_k_and_new_values_do_not_recompile():
    compiled = torch.compile(lambda t, k: (ft.topk_sparsify(t, k), ft.topk_indices(t, k)), fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for i, k in enumerate([3, 40, 1, 200]):
        tree = {"a": torch.randn(300, generator=g), "b": torch.randn(20, 10, generator=g)}
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            dense, sparse = compiled(tree, torch.tensor(k))
        assert_tree_bitwise_equal(dense, reference_sparsify(tree, k))
        expected = ft.topk_indices(tree, k)
        assert torch.equal(sparse.indices, expected.indices) and torch.equal(bits(sparse.values), bits(expected.values))


@pytest.mark.compile
def test_nan_tensor_k_is_the_eager_error_when_compiled():
    compiled = torch.compile(lambda t, k: ft.topk_sparsify(t, k), fullgraph=True)
    with pytest.raises(ValueError, match="k is NaN"):
        compiled({"a": torch.randn(10)}, torch.tensor(math.nan))


def wide_cnn() -> nn.Module:
    """A CNN with BatchNorm and 75k parameters: above the exact kernel's size for its sampled scan."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 3 * 3, 256), nn.ReLU(), nn.Linear(256, 3),
    )


def _loss(model_fn):
    def loss_fn(params, buffers, x, y):
        logits, buffers = model_fn(params, buffers, x)
        return torch.nn.functional.cross_entropy(logits, y), buffers

    return loss_fn


@pytest.mark.compile
def test_whole_compiled_step_under_inductor_selects_like_eager():
    """A whole ResNet-style step (conv, BatchNorm, grad, top-k, SGD with momentum) compiles under inductor.

    One step (one compilation) runs five selections of the same gradients side by side: exact and
    sampled with an int ``k`` and with a density schedule, and the Gaussian
    threshold; the exact one feeds SGD. Each selection inside the compiled step
    equals the eager selection of the same (compiled) gradients: bit for bit
    for the exact and sampled methods, which only compare and copy values. The
    Gaussian threshold involves a square root and ``ndtri``, whose rounding
    inductor may change, so there it is checked to be a threshold selection.
    (Symbolic sizes: see the next test; a whole step with ``dynamic=True`` takes
    minutes to compile on two cores.)
    """
    torch.manual_seed(0)
    model_fn, params, buffers = ft.nn.functionalize(wide_cnn())
    n = numel(params)
    assert n > DEFAULT_CONFIG.exact_min_numel
    schedule = ft.linear_schedule(0.02, 0.005, 2)
    selectors = {
        "exact": ft.topk(1000),
        "exact-schedule": ft.topk(density=schedule),
        "approx": ft.topk(1000, method="approx"),
        "approx-schedule": ft.topk(density=schedule, method="approx"),
        "gaussian": ft.topk(1000, method="gaussian"),
    }
    sgd = ft.sgd(0.1, momentum=0.9)
    loss_fn = _loss(model_fn)

    def step(params, buffers, states, sgd_state, x, y):
        grads, buffers = torch.func.grad(loss_fn, has_aux=True)(params, buffers, x, y)
        out = {name: tx.update(grads, states[name]) for name, tx in selectors.items()}
        updates, sgd_state = sgd.update(out["exact"][0], sgd_state, params)
        new_states = {name: o[1] for name, o in out.items()}
        selected = {name: o[0] for name, o in out.items()}
        return ft.apply_updates(params, updates), buffers, new_states, sgd_state, grads, selected

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    carry = (params, buffers, {name: tx.init(params) for name, tx in selectors.items()}, sgd.init(params))
    for i in range(2):
        x, y = batch(n=8, seed=i)
        before = carry[2]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            *carry, grads, selected = compiled(*carry, x, y)
        for name, tx in selectors.items():
            kept = torch.cat([s.reshape(-1) != 0 for s in optree.tree_leaves(selected[name])])
            if name == "gaussian":
                mags = torch.cat([g.reshape(-1).abs() for g in optree.tree_leaves(grads)])
                assert 0 < int(kept.sum()) < n and mags[kept].min() > mags[~kept].max()
            else:
                assert_tree_bitwise_equal(selected[name], tx.update(grads, before[name])[0])
        want = ft.sparse.k_from_density(schedule(torch.tensor(i)), n)
        assert int(sum(int((s != 0).sum()) for s in optree.tree_leaves(selected["exact-schedule"]))) == int(want)
        assert sum(int((s != 0).sum()) for s in optree.tree_leaves(selected["exact"])) == 1000
    assert not torch.equal(carry[0]["7.weight"], params["7.weight"])  # it trained


@pytest.mark.compile
@pytest.mark.parametrize("method", ["exact", "approx", "gaussian"])
def test_selection_compiles_with_symbolic_sizes(method):
    """``dynamic=True``: the sample stride (a prime search) and sizes become guards, not graph breaks."""
    g = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(600, 500, generator=g), "b": torch.randn(501, generator=g)}  # n > 2**18: a real stride
    fn = lambda t, k: ft.topk_sparsify(t, k, method=method)  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for k in (1000, torch.tensor(3000)):
        assert_tree_bitwise_equal(compiled(tree, k), fn(tree, k))
