"""topk_sparsify / topk_mask / topk_indices / topk and sparse updates, against brute force."""

from __future__ import annotations

import contextlib
import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import select
from tests.helpers import (
    assert_tree_bitwise_equal,
    assert_tree_close,
    bits,
    clone_tree,
    numel,
    reference_mask,
    reference_sparsify,
    trees_st,
)

# --------------------------------------------------------------------------- kernel configurations

# The eager "exact" kernel only runs its sampled path on trees of 2**16+ coordinates
# with its production constants. These configurations shrink the constants so that
# every branch (column scan, direct scan, packed small leaves, segment tails, band
# selection, fallback) runs on the small trees hypothesis draws.
EXACT_CONFIGS = {
    "columns": dict(EXACT_MIN_NUMEL=0, SEGMENT=40, SAMPLE_SIZE=16, MIN_COLUMNS=2, MAX_ROWS=4,
                    COLUMN_MAX_FRACTION=1.0, BAND_MIN=4),
    "direct": dict(EXACT_MIN_NUMEL=0, SEGMENT=24, SAMPLE_SIZE=8, COLUMN_MAX_FRACTION=0.0, BAND_MIN=4),
    "fallback": dict(EXACT_MIN_NUMEL=0, SEGMENT=32, SAMPLE_SIZE=16, MARGIN=-2.0, MIN_COLUMNS=2, MAX_ROWS=4,
                     COLUMN_MAX_FRACTION=1.0),
}
EXACT_RUNS = [("torch", None), ("exact", None)] + [("exact", name) for name in EXACT_CONFIGS]
EXACT_IDS = ["torch", "exact-default"] + [f"exact-{name}" for name in EXACT_CONFIGS]


@contextlib.contextmanager
def kernel_config(name):
    """Patch functopk.sparse.select's tuning constants for one configuration (None: production)."""
    with pytest.MonkeyPatch.context() as mp:
        for attr, value in (EXACT_CONFIGS[name] if name else {}).items():
            mp.setattr(select, attr, value)
        yield


def reference_indices(tree, k):
    mask = reference_mask(tree, k)
    leaves = optree.tree_leaves(tree)
    dtype = select.common_dtype(leaves)
    flat = torch.cat([x.reshape(-1).to(dtype) for x in leaves])
    idx = torch.cat([m.reshape(-1) for m in optree.tree_leaves(mask)]).nonzero().view(-1)
    return idx, flat[idx]


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
@settings(max_examples=40)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_exact_methods_match_bruteforce(method, config, tree, data):
    n = numel(tree)
    if n == 0:
        with pytest.raises(ValueError, match="exceeds"):
            ft.topk_sparsify(tree, 1, method=method)
        return
    k = data.draw(st.integers(1, n), label="k")
    before = clone_tree(tree)
    with kernel_config(config):
        out = ft.topk_sparsify(tree, k, method=method)
        mask = ft.topk_mask(tree, k, method=method)
        sparse = ft.topk_indices(tree, k, method=method)
        tensor_k = ft.topk_sparsify(tree, torch.tensor(k), method=method)
    assert_tree_bitwise_equal(out, reference_sparsify(tree, k))
    assert_tree_bitwise_equal(tensor_k, out)
    ref_mask = reference_mask(tree, k)
    assert optree.tree_structure(mask) == optree.tree_structure(ref_mask)
    for m, r in zip(optree.tree_leaves(mask), optree.tree_leaves(ref_mask)):
        assert m.dtype == torch.bool and torch.equal(m, r)
    idx, vals = reference_indices(tree, k)
    assert sparse.numel == n and torch.equal(sparse.indices, idx)
    assert torch.equal(bits(sparse.values), bits(vals))
    assert_tree_bitwise_equal(tree, before)  # pure


@settings(max_examples=40)
@given(tree=trees_st(), data=st.data())
def test_topk_transform_equals_function(tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    tx = ft.topk(k)
    state = tx.init(tree)
    out, new_state = tx.update(tree, state)
    assert new_state == state == ft.EmptyState()
    assert_tree_bitwise_equal(out, ft.topk_sparsify(tree, k))
    sparse, _ = ft.topk(k, sparse=True).update(tree, state)
    assert_tree_bitwise_equal(sparse.to_dense(tree), out)


@pytest.mark.parametrize("method", ["approx", "gaussian"])
@settings(max_examples=30)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_approx_methods_are_consistent_threshold_selections(method, tree, data):
    """Whatever count they pick: a threshold on |x| (NaN in), kept values bit-exact, outputs agree."""
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    before = clone_tree(tree)
    out = ft.topk_sparsify(tree, k, method=method)
    mask = ft.topk_mask(tree, k, method=method)
    sparse = ft.topk_indices(tree, k, method=method)
    assert_tree_bitwise_equal(tree, before)
    kept = torch.cat([m.reshape(-1) for m in optree.tree_leaves(mask)])
    flat = torch.cat([x.reshape(-1).double() for x in optree.tree_leaves(tree)])
    mags = torch.where(flat.isnan(), math.inf, flat.abs())
    if kept.any() and (~kept).any():  # a threshold: every kept magnitude is above every dropped one
        assert mags[kept].min() > mags[~kept].max() or (mags[kept].min() == mags[~kept].max() == math.inf)
    assert torch.equal(sparse.indices, kept.nonzero().view(-1))
    for x, m, o in zip(optree.tree_leaves(tree), optree.tree_leaves(mask), optree.tree_leaves(out)):
        assert torch.equal(bits(o[m]), bits(x[m])) and not o[~m].any()


# --------------------------------------------------------------------------- hand-computed cases


def test_hand_computed_global_selection_across_leaves():
    grads = {"a": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "b": torch.tensor([-1.0, 2.5]), "c": None}
    out = ft.topk_sparsify(grads, 3)
    assert out["c"] is None
    assert torch.equal(out["a"], torch.tensor([[0.0, -2.0], [0.0, 3.0]]))
    assert torch.equal(out["b"], torch.tensor([0.0, 2.5]))


def test_ties_lower_flat_index_wins():
    # flat order: "a" (sorted key) then "b"; all magnitudes equal
    tree = {"b": torch.tensor([1.0, -1.0]), "a": torch.tensor([-1.0, 1.0, 1.0])}
    out = ft.topk_sparsify(tree, 4)
    assert torch.equal(out["a"], torch.tensor([-1.0, 1.0, 1.0]))
    assert torch.equal(out["b"], torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_all_zero_keeps_first_k_and_outputs_zeros(method, config):
    tree = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
    with kernel_config(config):
        mask = ft.topk_mask(tree, 4, method=method)
        out = ft.topk_sparsify(tree, 4, method=method)
    assert mask["a"].all() and mask["b"].reshape(-1).tolist() == [True, False, False, False]
    assert all(not x.any() for x in optree.tree_leaves(out))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_mixed_dtypes_rank_in_common_dtype_and_keep_bits(method, config):
    half = torch.tensor([1.0009765625, 0.25], dtype=torch.float16)  # 1 + 2**-10, exact in fp16
    single = torch.tensor([1.0001, -7.0], dtype=torch.float32)
    bf = torch.tensor([-1.0078125], dtype=torch.bfloat16)  # 1 + 2**-7, exact in bf16
    with kernel_config(config):
        out = ft.topk_sparsify({"h": half, "s": single, "b": bf}, 3, method=method)
    assert out["h"].dtype == torch.float16 and out["b"].dtype == torch.bfloat16
    assert torch.equal(bits(out["s"]), bits(torch.tensor([0.0, -7.0])))
    assert torch.equal(bits(out["b"]), bits(bf))
    assert torch.equal(bits(out["h"]), bits(torch.tensor([1.0009765625, 0.0], dtype=torch.float16)))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_nan_and_inf_are_selected_first_and_propagate(method, config):
    tree = {"a": torch.tensor([1.0, math.nan, -math.inf, 5.0]), "b": torch.tensor([math.inf, 100.0])}
    with kernel_config(config):
        out = ft.topk_sparsify(tree, 3, method=method)
        out2 = ft.topk_sparsify(tree, 2, method=method)
    # NaN and +-inf all rank as infinite magnitude; ties by flat index -> a[1], a[2], b[0]
    assert torch.equal(bits(out["a"]), bits(torch.tensor([0.0, math.nan, -math.inf, 0.0])))
    assert torch.equal(out["b"], torch.tensor([math.inf, 0.0]))
    assert torch.isnan(out2["a"][1]) and out2["a"][2] == -math.inf and out2["b"][0] == 0


def test_output_preserves_dtype_shape_device_and_negative_zero():
    tree = {"z": torch.tensor([-0.0, 0.0]), "s": torch.tensor(4.0, dtype=torch.float64)}
    out = ft.topk_sparsify(tree, 2)
    assert out["s"].shape == () and out["s"].dtype == torch.float64
    assert torch.equal(bits(out["z"]), bits(torch.tensor([-0.0, 0.0])))  # -0.0 kept bit-exact


def test_density_form():
    tree = {"w": torch.arange(200.0)}
    tx = ft.topk(density=0.05)
    out, _ = tx.update(tree, tx.init(tree))
    assert int((out["w"] != 0).sum()) == 10
    assert torch.equal(out["w"][-10:], torch.arange(190.0, 200.0))
    assert ft.sparse.k_from_density(0.01, 25600) == 256
    assert ft.sparse.k_from_density(1.0, 7) == 7
    assert ft.sparse.k_from_density(1e-12, 7) == 1


def test_works_under_torch_func_grad():
    from torch.func import grad

    def loss(params):
        return (params["w"] ** 2).sum() + params["b"].sum()

    params = {"w": torch.tensor([1.0, -3.0, 2.0]), "b": torch.tensor([0.1])}
    g = grad(loss)(params)
    out = ft.topk_sparsify(g, 2)
    assert torch.equal(out["w"], torch.tensor([0.0, -6.0, 4.0])) and torch.equal(out["b"], torch.tensor([0.0]))


# --------------------------------------------------------------------------- bad input, one row each

GOOD = {"w": torch.ones(3), "b": torch.ones(2)}


@pytest.mark.parametrize(
    "k, exc, match",
    [
        (2.0, TypeError, "k must be an int"),
        (True, TypeError, "k must be an int"),
        (torch.tensor([2]), TypeError, "k must be an int or a 0-d"),
        (torch.tensor(2.0 + 1j), TypeError, "k must be an int or a 0-d"),
        ("3", TypeError, "k must be an int"),
        (0, ValueError, "k must be >= 1"),
        (-1, ValueError, "k must be >= 1"),
        (6, ValueError, r"k=6 exceeds the number of coordinates in the tree \(5\)"),
    ],
    ids=["float", "bool", "1d-tensor", "complex-tensor", "str", "zero", "negative", "too-large"],
)
def test_bad_k(k, exc, match):
    before = clone_tree(GOOD)
    with pytest.raises(exc, match=match):
        ft.topk_sparsify(GOOD, k)
    with pytest.raises(exc, match=match):
        ft.topk_mask(GOOD, k)
    with pytest.raises(exc, match=match):
        tx = ft.topk(k)
        tx.init(GOOD)
    assert_tree_bitwise_equal(GOOD, before)


def test_k_too_large_for_the_updates_at_update_time():
    tx = ft.topk(4)
    state = tx.init(None)
    with pytest.raises(ValueError, match="exceeds"):
        tx.update({"w": torch.ones(3)}, state)


@pytest.mark.parametrize(
    "density, exc",
    [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), ("0.1", TypeError),
     (True, TypeError)],
    ids=["zero", "above-one", "negative", "nan", "str", "bool"],
)
def test_bad_density(density, exc):
    with pytest.raises(exc, match="density"):
        ft.topk(density=density)


def test_k_and_density_exclusive():
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.topk(3, density=0.1)
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.topk()


@pytest.mark.parametrize(
    "leaf",
    [torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.complex64)],
    ids=["int", "bool", "complex"],
)
def test_non_float_leaves_rejected(leaf):
    tree = {"w": torch.ones(3), "bad": leaf}
    with pytest.raises(TypeError, match=r"leaf at \['bad'\] has dtype"):
        ft.topk_sparsify(tree, 1)
    tx = ft.topk(1)
    with pytest.raises(TypeError, match="dtype"):
        tx.update(tree, tx.init(None))


def test_non_tensor_leaf_rejected():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ft.topk_sparsify({"w": torch.ones(3), "x": 1.0}, 1)


def test_leaves_on_several_devices_rejected():
    tree = {"a": torch.ones(3), "b": torch.ones(3, device="meta")}
    with pytest.raises(ValueError, match="several devices"):
        ft.topk_sparsify(tree, 2)


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_sparsify(GOOD, 1, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk(1, method="fast")


def test_unknown_method_rejected_everywhere():
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_indices(GOOD, 1, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_mask(GOOD, 1, method="fast")


def test_unsupported_float_dtype_rejected():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        ft.topk_sparsify({"w": torch.ones(3, dtype=torch.float8_e4m3fn)}, 1)


@pytest.mark.parametrize("method", ["exact", "approx"])
def test_deterministic_and_independent_of_the_global_rng(method):
    g = torch.Generator().manual_seed(7)
    tree = {"a": torch.randn(300_000, generator=g), "b": torch.randn(70_000, generator=g)}
    torch.manual_seed(1)
    first = ft.topk_indices(tree, 2000, method=method)
    torch.manual_seed(2)
    torch.rand(10)
    second = ft.topk_indices(tree, 2000, method=method)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.values, second.values)


# --------------------------------------------------------------------------- tensor k and schedules


def test_tensor_k_is_rounded_and_clamped():
    tree = {"w": torch.tensor([1.0, -4.0, 2.0, 0.5])}
    for method in ("exact", "torch"):
        out = ft.topk_sparsify(tree, torch.tensor(2.4), method=method)
        assert torch.equal(out["w"], torch.tensor([0.0, -4.0, 2.0, 0.0]))
        assert int(ft.topk_mask(tree, torch.tensor(0), method=method)["w"].sum()) == 1
        assert int(ft.topk_mask(tree, torch.tensor(99), method=method)["w"].sum()) == 4


@pytest.mark.parametrize("method", ["exact", "torch", "approx"])
def test_k_schedule_keeps_a_count_and_follows_it(method):
    grads = {"a": torch.arange(1.0, 7.0).reshape(2, 3), "b": torch.tensor([-10.0, 0.5])}
    tx = ft.topk(lambda count: 1 + 2 * count, method=method)
    state = tx.init(grads)
    assert isinstance(state, ft.compress.TopKState) and state.count.dtype == torch.int64
    for step in range(3):
        before = clone_tree(state)
        out, state = tx.update(grads, state)
        # the old state is not changed
        assert_tree_bitwise_equal(before, ft.compress.TopKState(count=torch.tensor(step)))
        if method != "approx":
            assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 1 + 2 * step))
        else:
            assert sum(int((x != 0).sum()) for x in optree.tree_leaves(out)) == 1 + 2 * step
    assert int(state.count) == 3


def test_density_schedule_and_injected_density():
    grads = {"w": torch.arange(1.0, 201.0)}
    tx = ft.topk(density=ft.linear_schedule(0.25, 0.05, transition_steps=2))
    state = tx.init(grads)
    counts = []
    for _ in range(4):
        out, state = tx.update(grads, state)
        counts.append(int((out["w"] != 0).sum()))
    assert counts == [50, 30, 10, 10]
    injected = ft.inject_hyperparams(ft.topk, static_args=("method",))(density=0.1)
    state = injected.init(grads)
    out, state = injected.update(grads, state)
    assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 20))
    state = state._replace(hyperparams={"density": torch.tensor(0.02)})
    out, _ = injected.update(grads, state)
    assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 4))


def test_bad_schedule_output_and_state():
    tx = ft.topk(lambda count: "ten")
    with pytest.raises(TypeError, match="k schedule must return a number or a 0-d tensor"):
        tx.update(GOOD, tx.init(GOOD))
    with pytest.raises(TypeError, match="state must be a TopKState"):
        ft.topk(lambda c: 2).update(GOOD, ft.EmptyState())
    with pytest.raises(TypeError, match="sparse must be a bool"):
        ft.topk(2, sparse=1)


# --------------------------------------------------------------------------- sparse updates


@settings(max_examples=40)
@given(tree=trees_st(), data=st.data())
def test_sparse_apply_equals_dense_apply(tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    lr = data.draw(st.sampled_from([0.1, 1.0, torch.tensor(0.25)]), label="lr")
    params = optree.tree_map(lambda x: torch.linspace(-1.0, 1.0, x.numel()).to(x.dtype).reshape(x.shape), tree)
    p0, g0 = clone_tree(params), clone_tree(tree)
    sparse = ft.topk_indices(tree, k)
    dense = ft.apply_updates(params, ft.tree.scale(ft.topk_sparsify(tree, k), -lr))
    new = ft.apply_sparse_updates(params, sparse, -lr)
    assert_tree_bitwise_equal(params, p0)  # pure
    assert_tree_bitwise_equal(tree, g0)
    one_dtype = len({x.dtype for x in optree.tree_leaves(tree)}) == 1
    if one_dtype:
        assert_tree_bitwise_equal(new, dense)
    else:  # the values are scaled in the common dtype before rounding to each leaf's dtype
        assert_tree_close(new, dense, rtol=1e-2, atol=1e-3)
    inplace = clone_tree(params)
    ptrs = [x.data_ptr() for x in optree.tree_leaves(inplace)]
    assert ft.apply_sparse_updates_(inplace, sparse, -lr) is inplace
    assert [x.data_ptr() for x in optree.tree_leaves(inplace)] == ptrs
    assert_tree_bitwise_equal(inplace, new)
    assert_tree_bitwise_equal(sparse.to_dense(tree), ft.topk_sparsify(tree, k))


def test_sparse_sgd_step_on_module_parameters_and_non_contiguous_leaves():
    lin = torch.nn.Linear(4, 3)
    params = dict(lin.named_parameters())
    grads = {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.tensor([100.0, 0.0, -200.0])}
    before = {name: p.detach().clone() for name, p in params.items()}
    ft.apply_sparse_updates_(params, ft.topk_indices(grads, 3), -0.5)
    assert torch.equal(lin.bias.detach(), before["bias"] + torch.tensor([-50.0, 0.0, 100.0]))
    expected_w = before["weight"].clone()
    expected_w[2, 3] -= 5.5
    assert torch.equal(lin.weight.detach(), expected_w)
    # a transposed (non-contiguous) leaf is updated through a copy, still in place
    w = torch.zeros(3, 2).t()
    ft.apply_sparse_updates_({"w": w}, ft.topk_indices({"w": torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]])}, 1))
    assert torch.equal(w, torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("fn", [ft.apply_sparse_updates, ft.apply_sparse_updates_], ids=["pure", "inplace"])
def test_sparse_apply_errors_leave_params_untouched(fn):
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    p0 = clone_tree(params)
    good = ft.SparseUpdates(torch.tensor([0, 4]), torch.tensor([1.0, 2.0]), 5)
    with pytest.raises(ValueError, match="covers 6 coordinates, but params has 5"):
        fn(params, good._replace(numel=6))
    with pytest.raises(TypeError, match="sparse must be a functopk.SparseUpdates"):
        fn(params, (good.indices, good.values))
    with pytest.raises(ValueError, match="1-d of one length"):
        fn(params, good._replace(values=torch.ones(3)))
    with pytest.raises(TypeError, match="int64"):
        fn(params, good._replace(indices=good.indices.int()))
    with pytest.raises(TypeError, match="scale must be a real number"):
        fn(params, good, "0.1")
    if fn is ft.apply_sparse_updates_:
        with pytest.raises(ValueError, match="strictly ascending"):
            fn(params, good._replace(indices=torch.tensor([4, 0])))
        with pytest.raises(ValueError, match=r"must lie in \[0, 5\)"):
            fn(params, good._replace(indices=torch.tensor([0, 5])))
    assert_tree_bitwise_equal(params, p0)


def test_sparse_transform_ends_a_sgd_step():
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(3)}
    grads = {"w": torch.tensor([[0.1, -3.0], [2.0, 0.0]]), "b": torch.tensor([0.5, 0.0, -0.2])}
    tx = ft.topk(2, sparse=True)
    sparse, _ = tx.update(grads, tx.init(params), params)
    assert isinstance(sparse, ft.SparseUpdates) and sparse.indices.tolist() == [4, 5]
    new = ft.apply_sparse_updates(params, sparse, -0.1)
    assert torch.allclose(new["w"], torch.tensor([[0.0, 0.3], [-0.2, 0.0]])) and not new["b"].any()


# --------------------------------------------------------------------------- compile


TREE = {"a": torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), "b": torch.tensor([3.0, -0.1, 7.0]),
        "c": (torch.tensor([[-8.0, 0.2]], dtype=torch.float64), None)}


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("method", ["exact", "torch", "approx", "gaussian"])
def test_methods_compile_fullgraph(method):
    fn = torch.compile(lambda t: ft.topk_sparsify(t, 7, method=method), fullgraph=True, backend="aot_eager")
    assert_tree_bitwise_equal(fn(TREE), ft.topk_sparsify(TREE, 7, method=method))
    if method in ("exact", "torch"):  # the compiled "exact" runs the static kernel: same result
        assert_tree_bitwise_equal(fn(TREE), reference_sparsify(TREE, 7))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_tensor_k_compiles_without_recompiling():
    fn = torch.compile(lambda t, k: ft.topk_sparsify(t, k, method="torch"), fullgraph=True, backend="aot_eager")
    for i, k in enumerate([3, 7, 1, 33]):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = fn(TREE, torch.tensor(k))
        assert_tree_bitwise_equal(out, reference_sparsify(TREE, k))  # radix select
    for method in ("approx", "gaussian"):
        fn = torch.compile(lambda t, k, m=method: ft.topk_sparsify(t, k, method=m), fullgraph=True, backend="aot_eager")
        for i, k in enumerate([3, 20]):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = fn(TREE, torch.tensor(k))
            assert_tree_bitwise_equal(out, ft.topk_sparsify(TREE, torch.tensor(k), method=method))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_scheduled_density_chain_compiles_without_recompiling():
    tx = ft.chain(ft.topk(density=ft.linear_schedule(0.5, 0.1, transition_steps=3)), ft.sgd(0.1))
    params = optree.tree_map(torch.zeros_like, TREE)
    update = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    state_c = state_e = tx.init(params)
    for i in range(3):
        grads = optree.tree_map(lambda x: torch.randn_like(x), TREE)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            u_c, state_c = update(grads, state_c, params)
        u_e, state_e = tx.update(grads, state_e, params)
        assert_tree_bitwise_equal(u_c, u_e)
    assert int(state_c[0].count) == 3


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_sparse_paths_compile_and_the_eager_exact_kernel_does_not():
    def step(params, grads):
        return ft.apply_sparse_updates(params, ft.topk_indices(grads, 5), -0.5)

    params = optree.tree_map(torch.ones_like, TREE)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert_tree_bitwise_equal(compiled(params, TREE), step(params, TREE))
    # approx: a data-dependent number of indices (nonzero), still one graph
    for method in ("approx", "gaussian"):
        fn = torch.compile(lambda g, m=method: ft.topk_indices(g, 5, method=m), fullgraph=True, backend="aot_eager")
        got, expected = fn(TREE), ft.topk_indices(TREE, 5, method=method)
        assert torch.equal(got.indices, expected.indices) and torch.equal(got.values, expected.values)
    # why "exact" switches to the static kernel under compile: the eager one branches on data
    big = torch.randn(1 << 17)
    kernel = torch.compile(lambda x: select.select_exact([x], 10, torch.float32), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="data-dependent"):
        kernel(big)


# --------------------------------------------------------------------------- memory


def _allocations_during(fn):
    """Every CPU allocation and free (bytes, allocator total) during ``fn``, from the profiler's memory records."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []

    def walk(node):
        if node.typed[0] == _EventType.Allocation:
            records.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    records.sort()
    return [(size, total) for _, size, total in records]


def test_exact_does_not_allocate_an_n_sized_copy_for_small_k():
    """Peak extra CPU memory of the eager exact kernel, measured through the allocator's records.

    The profiler reports every allocation and free with the allocator's running
    total; the peak of that total minus its value before the call is the most
    memory the call held at once, output included. The exact kernel must stay
    within its fixed buffers (a scan buffer of ``SEGMENT`` values and the column
    maxima of one ``COLUMN_BLOCK``: 4 MiB in float32, 6 MiB allowed) plus 48
    bytes per selected coordinate, far below the n-sized float copy (28 MiB
    here) that the static kernel makes, which the same measurement must see.
    """
    g = torch.Generator().manual_seed(0)
    tree = {"conv": torch.randn(512, 512, 3, 3, generator=g), "fc": torch.randn(1000, 2048, generator=g),
            "bn": torch.randn(2048, generator=g), "rest": torch.randn(3_000_000, generator=g)}
    n_bytes = 4 * numel(tree)
    for k in [1000, numel(tree) // 100]:
        for method in ["exact", "torch"]:
            ft.topk_indices(tree, k, method=method)  # warm-up
            records = _allocations_during(lambda: ft.topk_indices(tree, k, method=method))
            base = records[0][1] - records[0][0]
            peak = max(total for _, total in records) - base
            largest = max(size for size, _ in records)
            if method == "torch":
                assert largest >= n_bytes and peak >= n_bytes
            else:
                assert largest < n_bytes // 8 and peak < (6 << 20) + 48 * k, (k, largest, peak, n_bytes)


# --------------------------------------------------------------------------- approximate count band


def _mlp_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _multiscale_heavy_tailed(n_leaves=40, seed=1):
    """Leaves of a normal scale mixture (log-normal scale per coordinate: heavy tails), each leaf with its
    own log-normal scale, so that scales span orders of magnitude as across a network's layers."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1000, 100_000, (n_leaves,), generator=g).tolist()
    scales = torch.exp(torch.randn(n_leaves, generator=g) * 2.0).tolist()
    return {f"p{i}": torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g)) * c
            for i, (s, c) in enumerate(zip(sizes, scales))}


@pytest.mark.parametrize("data", ["mlp-gradient", "multiscale-heavy-tailed"])
def test_approx_count_is_within_the_documented_band(data):
    tree = _mlp_gradient() if data == "mlp-gradient" else _multiscale_heavy_tailed()
    n = numel(tree)
    for density in [0.001, 0.01, 0.1]:
        k = ft.sparse.k_from_density(density, n)
        count = sum(int(m.sum()) for m in optree.tree_leaves(ft.topk_mask(tree, k, method="approx")))
        assert 0.5 * k <= count <= 1.5 * k, (density, k, count)


# --------------------------------------------------------------------------- large trees (slow)


def _big_tree(seed, dtype=torch.float32):
    """About 25M coordinates in ResNet-50-like leaves (3x3 and 1x1 convs, a big fc, many small vectors)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 3, 7, 7)] + [(c, c, 3, 3) for c in (64, 128, 256, 512, 512) for _ in range(3)]
    shapes += [(4 * c, c, 1, 1) for c in (64, 128, 256, 512) for _ in range(4)] + [(1000, 2048)]
    shapes += [(c,) for c in (64, 128, 256, 512, 1024, 2048) for _ in range(8)]
    return {f"p{i:03d}": torch.randn(s, generator=g).to(dtype) for i, s in enumerate(shapes)}


@pytest.mark.slow
def test_large_tree_exact_equals_static_kernel():
    tree = _big_tree(0)
    n = numel(tree)
    assert n > 20_000_000
    leaves = optree.tree_leaves(tree)
    leaves[5].view(-1)[123] = math.nan
    leaves[7].view(-1)[:50_000] = 4.0  # a block of ties around the 1%-cut
    for k in [1000, n // 100]:
        exact = ft.topk_indices(tree, k)
        static = ft.topk_indices(tree, k, method="torch")
        assert torch.equal(exact.indices, static.indices)
        assert torch.equal(bits(exact.values), bits(static.values))
    assert exact.indices.numel() == n // 100


@pytest.mark.slow
def test_large_mostly_zero_tree_with_mixed_dtypes_takes_the_fallback_exactly():
    tree = _big_tree(1)
    for i, x in enumerate(optree.tree_leaves(tree)):
        x.mul_(torch.rand(x.shape, generator=torch.Generator().manual_seed(i)) < 0.002)  # 99.8% exact zeros
    tree["p001"] = tree["p001"].to(torch.bfloat16)
    tree["p010"] = tree["p010"].to(torch.float16)
    nonzeros = sum(int((x != 0).sum()) for x in optree.tree_leaves(tree))
    k = nonzeros + 1000  # every nonzero, then the first 1000 zeros by flat index: the sampled bracket fails
    sparse = ft.topk_indices(tree, k)
    static = ft.topk_indices(tree, k, method="torch")
    assert torch.equal(sparse.indices, static.indices) and torch.equal(bits(sparse.values), bits(static.values))
    assert int((sparse.values != 0).sum()) == nonzeros
