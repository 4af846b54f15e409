"""topk_sparsify / topk_mask / topk_indices / gaussian_threshold / k_from_density / resolve_k, against brute force."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import KernelConfig
from functopk.sparse.kernels.base import common_dtype
from tests.helpers import (
    assert_compiles_like_eager,
    assert_tree_bitwise_equal,
    bad_k_cases,
    bits,
    bits_any_nan,
    clone_tree,
    non_float_leaves,
    numel,
    real_device,
    reference_mask,
    reference_sparsify,
    to_device,
    trees_st,
)

# --------------------------------------------------------------------------- kernel configurations

# The eager "exact" kernel only runs its sampled path on trees of 2**16+ coordinates
# with its production constants. These configurations shrink the constants so that
# every branch (column scan, direct scan, packed small leaves, segment tails, band
# selection, both fallbacks) runs on the small trees hypothesis draws. (Test helper
# of this module: EXACT_CONFIGS / EXACT_RUNS.)
EXACT_CONFIGS = {
    "columns": KernelConfig(exact_min_numel=0, segment=40, sample_size=16, min_columns=2, max_rows=4,
                            column_max_fraction=1.0, band_min=4, native=False),
    "direct": KernelConfig(exact_min_numel=0, segment=24, sample_size=8, column_max_fraction=0.0, band_min=4,
                           native=False),
    "fallback": KernelConfig(exact_min_numel=0, segment=32, sample_size=16, margin=-2.0, min_columns=2, max_rows=4,
                             column_max_fraction=1.0, native=False),
    "abandon": KernelConfig(exact_min_numel=0, segment=24, sample_size=8, abandon_min=0, abandon_factor=0.0),
    "native": KernelConfig(exact_min_numel=0, sample_size=16, band_min=4),  # the compiled scan, where it is built
}
EXACT_RUNS = [("torch", None), ("exact", None)] + [("exact", config) for config in EXACT_CONFIGS.values()]
EXACT_IDS = ["torch", "exact-default"] + [f"exact-{name}" for name in EXACT_CONFIGS]


def cpu(tree):
    """``tree`` (or a tensor) moved to the CPU, to compare a device's output with the CPU references."""
    return to_device(tree, "cpu")


def reference_indices(tree, k):
    mask = reference_mask(tree, k)
    leaves = optree.tree_leaves(tree)
    dtype = common_dtype(leaves)
    flat = torch.cat([x.reshape(-1).to(dtype) for x in leaves])
    idx = torch.cat([m.reshape(-1) for m in optree.tree_leaves(mask)]).nonzero().view(-1)
    return idx, flat[idx]


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
@settings(max_examples=40)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_exact_methods_match_bruteforce(device, method, config, tree, data):
    """On every device the same selection as the CPU brute force (off CPU "exact" is the static kernel)."""
    n = numel(tree)
    dtree = to_device(tree, device)
    if n == 0:
        with pytest.raises(ValueError, match="the tree has no coordinates"):
            ft.topk_sparsify(dtree, 1, method=method, config=config)
        return
    k = data.draw(st.integers(1, n), label="k")
    before = clone_tree(dtree)
    out = ft.topk_sparsify(dtree, k, method=method, config=config)
    mask = ft.topk_mask(dtree, k, method=method, config=config)
    sparse = ft.topk_indices(dtree, k, method=method, config=config)
    tensor_k = ft.topk_sparsify(dtree, torch.tensor(k, device=device), method=method, config=config)
    assert all(x.device == real_device(device) for x in optree.tree_leaves((out, mask, tensor_k, tuple(sparse[:2]))))
    assert_tree_bitwise_equal(cpu(out), reference_sparsify(tree, k))
    assert_tree_bitwise_equal(tensor_k, out)
    ref_mask = reference_mask(tree, k)
    assert optree.tree_structure(mask) == optree.tree_structure(ref_mask)
    for m, r in zip(optree.tree_leaves(mask), optree.tree_leaves(ref_mask)):
        assert m.dtype == torch.bool and torch.equal(m.cpu(), r)
    idx, vals = reference_indices(tree, k)
    assert sparse.numel == n and torch.equal(sparse.indices.cpu(), idx)
    assert sparse.sizes == tuple(x.numel() for x in optree.tree_leaves(tree))
    assert torch.equal(bits_any_nan(sparse.values.cpu()), bits_any_nan(vals))  # converted to the common dtype
    assert_tree_bitwise_equal(dtree, before)  # pure


@pytest.mark.parametrize("method", ["torch", "exact"])
@settings(max_examples=30)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_max_k_gives_the_top_max_k_indices_with_the_top_k_values(device, method, tree, data):
    """With ``max_k``, for an int or a tensor ``k``: the brute force's top ``max_k`` indices, the values of all
    but its top ``k`` zeroed, so that the update densifies to the top ``k``; a tensor ``k`` above keeps ``max_k``."""
    n = numel(tree)
    if n == 0:
        return
    max_k = data.draw(st.integers(1, n), label="max_k")
    k = data.draw(st.integers(1, max_k), label="k")
    dtree = to_device(tree, device)
    idx, vals = reference_indices(tree, max_k)
    top, _ = reference_indices(tree, k)
    want = torch.where(torch.isin(idx, top), vals, torch.zeros((), dtype=vals.dtype))
    for given_k in (k, torch.tensor(k, device=device), torch.tensor(float(k) + 0.3, device=device)):
        sparse = ft.topk_indices(dtree, given_k, method=method, max_k=max_k)
        assert sparse.indices.shape == (max_k,) and torch.equal(sparse.indices.cpu(), idx)
        assert torch.equal(bits_any_nan(sparse.values.cpu()), bits_any_nan(want))
        dense, ref = optree.tree_leaves(cpu(sparse.to_dense(dtree))), optree.tree_leaves(reference_sparsify(tree, k))
        assert all(torch.equal(bits_any_nan(a), bits_any_nan(b)) for a, b in zip(dense, ref))  # (NaN payloads:
        # the values pass through the common dtype)
    for above in (n + 5, math.nan):  # clamped to max_k: all kept
        sparse = ft.topk_indices(dtree, torch.tensor(above, device=device), method=method, max_k=max_k)
        assert torch.equal(bits_any_nan(sparse.values.cpu()), bits_any_nan(vals))


@pytest.mark.parametrize(
    "k, max_k, method, exc, match",
    [
        (2, 2.0, "exact", TypeError, "max_k must be an int"),
        (2, 0, "exact", ValueError, "max_k"),
        (2, 9, "exact", ValueError, r"max_k=9 must lie in \[k, n\]"),
        (3, 2, "torch", ValueError, r"max_k=2 must lie in \[k, n\] for an int k \(k=3"),
        (torch.tensor(2), 3, "approx", ValueError, "approximate methods keep a data-dependent count"),
    ],
)
def test_bad_max_k(k, max_k, method, exc, match):
    with pytest.raises(exc, match=match):
        ft.topk_indices({"w": torch.arange(8.0)}, k, method=method, max_k=max_k)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_tensor_k_with_max_k_compiles_to_a_static_shape_without_recompiling():
    calls = [(TREE, torch.tensor(k)) for k in [3, 7, 1]]
    fn = lambda t, k: tuple(ft.topk_indices(t, k, method="torch", max_k=8)[:2])  # noqa: E731
    for (_, k), (indices, values) in zip(calls, assert_compiles_like_eager(fn, calls, bitwise=True)):
        dense = ft.SparseUpdates(indices, values, numel(TREE)).to_dense(TREE)
        assert indices.shape == (8,) and int((values != 0).sum()) == int(k)  # (TREE has no zeros)
        assert_tree_bitwise_equal(dense, reference_sparsify(TREE, int(k)))


@pytest.mark.parametrize("method", ["approx", "gaussian"])
@settings(max_examples=30)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_approx_methods_are_consistent_threshold_selections(device, method, tree, data):
    """Whatever count they pick: a threshold on |x| (NaN in), kept values bit-exact, outputs agree.

    Off CPU "approx" selects exactly what it selects on the CPU: its threshold is
    a sampled magnitude (no arithmetic), compared exactly. "gaussian"'s threshold
    is a sum of squares, whose rounding may differ between devices.
    """
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    dtree = to_device(tree, device)
    before = clone_tree(dtree)
    out = cpu(ft.topk_sparsify(dtree, k, method=method))
    mask = cpu(ft.topk_mask(dtree, k, method=method))
    sparse = cpu(ft.topk_indices(dtree, k, method=method))
    assert_tree_bitwise_equal(dtree, before)
    if method == "approx" and device != "cpu":
        for m, r in zip(optree.tree_leaves(mask), optree.tree_leaves(ft.topk_mask(tree, k, method=method))):
            assert torch.equal(m, r)
    kept = torch.cat([m.reshape(-1) for m in optree.tree_leaves(mask)])
    flat = torch.cat([x.reshape(-1).double() for x in optree.tree_leaves(tree)])
    mags = torch.where(flat.isnan(), math.inf, flat.abs())
    if kept.any() and (~kept).any():  # a threshold: every kept magnitude is above every dropped one
        assert mags[kept].min() > mags[~kept].max() or (mags[kept].min() == mags[~kept].max() == math.inf)
    assert torch.equal(sparse.indices, kept.nonzero().view(-1))
    for x, m, o in zip(optree.tree_leaves(tree), optree.tree_leaves(mask), optree.tree_leaves(out)):
        assert torch.equal(bits(o[m]), bits(x[m])) and not o[~m].any()


# --------------------------------------------------------------------------- hand-computed cases


def test_hand_computed_global_selection_across_leaves(device):
    grads = {"a": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "b": torch.tensor([-1.0, 2.5]), "c": None}
    out = cpu(ft.topk_sparsify(to_device(grads, device), 3))
    assert out["c"] is None
    assert torch.equal(out["a"], torch.tensor([[0.0, -2.0], [0.0, 3.0]]))
    assert torch.equal(out["b"], torch.tensor([0.0, 2.5]))


def test_ties_lower_flat_index_wins(device):
    # flat order: "a" (sorted key) then "b"; all magnitudes equal
    tree = {"b": torch.tensor([1.0, -1.0]), "a": torch.tensor([-1.0, 1.0, 1.0])}
    out = cpu(ft.topk_sparsify(to_device(tree, device), 4))
    assert torch.equal(out["a"], torch.tensor([-1.0, 1.0, 1.0]))
    assert torch.equal(out["b"], torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_all_zero_keeps_first_k_and_outputs_zeros(device, method, config):
    tree = {"a": torch.zeros(3, device=device), "b": torch.zeros(2, 2, device=device)}
    mask = cpu(ft.topk_mask(tree, 4, method=method, config=config))
    out = ft.topk_sparsify(tree, 4, method=method, config=config)
    assert mask["a"].all() and mask["b"].reshape(-1).tolist() == [True, False, False, False]
    assert all(not x.any() for x in optree.tree_leaves(out))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_mixed_dtypes_rank_in_common_dtype_and_keep_bits(device, method, config):
    half = torch.tensor([1.0009765625, 0.25], dtype=torch.float16)  # 1 + 2**-10, exact in fp16
    single = torch.tensor([1.0001, -7.0], dtype=torch.float32)
    bf = torch.tensor([-1.0078125], dtype=torch.bfloat16)  # 1 + 2**-7, exact in bf16
    out = cpu(ft.topk_sparsify(to_device({"h": half, "s": single, "b": bf}, device), 3, method=method, config=config))
    assert out["h"].dtype == torch.float16 and out["b"].dtype == torch.bfloat16
    assert torch.equal(bits(out["s"]), bits(torch.tensor([0.0, -7.0])))
    assert torch.equal(bits(out["b"]), bits(bf))
    assert torch.equal(bits(out["h"]), bits(torch.tensor([1.0009765625, 0.0], dtype=torch.float16)))


@pytest.mark.parametrize("method, config", EXACT_RUNS, ids=EXACT_IDS)
def test_nan_and_inf_are_selected_first_and_propagate(device, method, config):
    tree = to_device({"a": torch.tensor([1.0, math.nan, -math.inf, 5.0]), "b": torch.tensor([math.inf, 100.0])}, device)
    out = cpu(ft.topk_sparsify(tree, 3, method=method, config=config))
    out2 = cpu(ft.topk_sparsify(tree, 2, method=method, config=config))
    # NaN and +-inf all rank as infinite magnitude; ties by flat index -> a[1], a[2], b[0]
    assert torch.equal(bits(out["a"]), bits(torch.tensor([0.0, math.nan, -math.inf, 0.0])))
    assert torch.equal(out["b"], torch.tensor([math.inf, 0.0]))
    assert torch.isnan(out2["a"][1]) and out2["a"][2] == -math.inf and out2["b"][0] == 0


def test_output_preserves_dtype_shape_device_and_negative_zero(device):
    tree = to_device({"z": torch.tensor([-0.0, 0.0]), "s": torch.tensor(4.0, dtype=torch.float64)}, device)
    out = ft.topk_sparsify(tree, 2)
    assert out["s"].shape == () and out["s"].dtype == torch.float64
    assert out["s"].device == out["z"].device == real_device(device)
    assert torch.equal(bits(out["z"].cpu()), bits(torch.tensor([-0.0, 0.0])))  # -0.0 kept bit-exact


def test_works_under_torch_func_grad(device):
    from torch.func import grad

    def loss(params):
        return (params["w"] ** 2).sum() + params["b"].sum()

    params = to_device({"w": torch.tensor([1.0, -3.0, 2.0]), "b": torch.tensor([0.1])}, device)
    g = grad(loss)(params)
    out = cpu(ft.topk_sparsify(g, 2))
    assert torch.equal(out["w"], torch.tensor([0.0, -6.0, 4.0])) and torch.equal(out["b"], torch.tensor([0.0]))


# --------------------------------------------------------------------------- bad input, one row each

GOOD = {"w": torch.ones(3), "b": torch.ones(2)}


@pytest.mark.parametrize("k, exc, match", bad_k_cases("the tree"))
def test_bad_k(device, k, exc, match):
    good = to_device(GOOD, device)
    before = clone_tree(good)
    with pytest.raises(exc, match=match):
        ft.topk_sparsify(good, k)
    with pytest.raises(exc, match=match):
        ft.topk_mask(good, k)
    with pytest.raises(exc, match=match):
        ft.topk_indices(good, k)
    assert_tree_bitwise_equal(good, before)


@pytest.mark.parametrize("leaf", non_float_leaves())
def test_non_float_leaves_rejected(leaf):
    tree = {"w": torch.ones(3), "bad": leaf}
    with pytest.raises(TypeError, match=r"leaf at \['bad'\] has dtype"):
        ft.topk_sparsify(tree, 1)


def test_non_tensor_leaf_rejected():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ft.topk_sparsify({"w": torch.ones(3), "x": 1.0}, 1)


def test_leaves_on_several_devices_rejected(device):
    tree = {"a": torch.ones(3), "b": torch.ones(3, device="meta" if device == "cpu" else device)}
    with pytest.raises(ValueError, match="several devices"):
        ft.topk_sparsify(tree, 2)


def test_unknown_method_rejected_everywhere():
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_sparsify(GOOD, 1, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_indices(GOOD, 1, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_mask(GOOD, 1, method="fast")


def test_unsupported_float_dtype_rejected():
    expected = "expected a floating-point tensor of dtype float16, bfloat16, float32, float64"
    with pytest.raises(TypeError, match=expected):
        ft.topk_sparsify({"w": torch.ones(3, dtype=torch.float8_e4m3fn)}, 1)


@pytest.mark.parametrize("method", ["exact", "approx"])
def test_deterministic_and_independent_of_the_global_rng(device, method):
    g = torch.Generator().manual_seed(7)
    tree = to_device({"a": torch.randn(300_000, generator=g), "b": torch.randn(70_000, generator=g)}, device)
    torch.manual_seed(1)
    first = ft.topk_indices(tree, 2000, method=method)
    torch.manual_seed(2)
    torch.rand(10, device=device)
    second = ft.topk_indices(tree, 2000, method=method)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.values, second.values)
    if device != "cpu":  # and the CPU's selection
        on_cpu = ft.topk_indices(cpu(tree), 2000, method=method)
        assert torch.equal(first.indices.cpu(), on_cpu.indices) and torch.equal(first.values.cpu(), on_cpu.values)


# --------------------------------------------------------------------------- tensor k: rounding, clamping, NaN


def test_tensor_k_is_rounded_and_clamped(device):
    tree = {"w": torch.tensor([1.0, -4.0, 2.0, 0.5], device=device)}
    for method in ("exact", "torch"):
        for where in dict.fromkeys(("cpu", device)):  # k on the CPU or on the leaves' device
            out = ft.topk_sparsify(tree, torch.tensor(2.4, device=where), method=method)
            assert torch.equal(out["w"].cpu(), torch.tensor([0.0, -4.0, 2.0, 0.0]))
            assert int(ft.topk_mask(tree, torch.tensor(0, device=where), method=method)["w"].sum()) == 1
            assert int(ft.topk_mask(tree, torch.tensor(99, device=where), method=method)["w"].sum()) == 4


@pytest.mark.parametrize("method", ["exact", "torch", "approx", "gaussian"])
@pytest.mark.parametrize("value", [math.inf, 1e30, 2.0**70, -math.inf, -1e30],
                         ids=["inf", "1e30", "2^70", "-inf", "-1e30"])
def test_tensor_k_beyond_int64_or_infinite_clamps_to_n_or_1(device, method, value):
    """Before: ``.to(int64)`` of inf or 1e30 gave a huge negative number, clamped to k=1."""
    tree = {"a": torch.tensor([1.0, -4.0, 2.0]), "b": torch.tensor([0.5, 3.0])}
    dtree, k = to_device(tree, device), torch.tensor(value, device=device)
    kept = sum(int(m.sum()) for m in optree.tree_leaves(ft.topk_mask(dtree, k, method=method)))
    expected = 5 if value > 0 else 1
    if method in ("exact", "torch"):
        assert kept == expected
        assert_tree_bitwise_equal(cpu(ft.topk_sparsify(dtree, k, method=method)), reference_sparsify(tree, expected))
    elif value > 0:  # approximate: keeps everything non-zero at k = n
        assert kept == 5


@pytest.mark.parametrize("method", ["torch", "approx", "gaussian"])
def test_nan_tensor_k_keeps_everything_in_the_static_kernels(device, method):
    tree = to_device({"a": torch.tensor([1.0, -4.0, 2.0]), "b": torch.tensor([0.5, 3.0])}, device)
    nan = torch.tensor(math.nan, device=device)
    assert_tree_bitwise_equal(ft.topk_sparsify(tree, nan, method=method), tree)
    assert all(bool(m.all()) for m in optree.tree_leaves(ft.topk_mask(tree, nan, method=method)))
    # "exact" where the static kernel runs (a leaf requires grad): the same documented value
    grad_tree = optree.tree_map(lambda x: x.clone().requires_grad_(), tree)
    out = ft.topk_sparsify(grad_tree, nan)
    assert_tree_bitwise_equal(optree.tree_map(torch.Tensor.detach, out), tree)
    if device != "cpu":  # off CPU "exact" always runs the static kernel: NaN keeps everything, no error
        assert_tree_bitwise_equal(ft.topk_sparsify(tree, nan), tree)
        assert ft.topk_indices(tree, nan).indices.tolist() == [0, 1, 2, 3, 4]


def test_nan_tensor_k_raises_in_the_eager_exact_kernel():
    tree = {"a": torch.tensor([1.0, -4.0, 2.0]), "b": torch.tensor([0.5, 3.0])}
    for fn in (ft.topk_sparsify, ft.topk_mask, ft.topk_indices):
        with pytest.raises(ValueError, match=r"k is NaN; expected a count in \[1, 5\]"):
            fn(tree, torch.tensor(math.nan))


# --------------------------------------------------------------------------- gaussian_threshold


def test_gaussian_threshold_on_gaussian_data(device):
    g = {"a": (torch.randn(400_000, generator=torch.Generator().manual_seed(5)) * 0.01).to(device)}
    for density in [0.001, 0.01, 0.1]:
        t = ft.sparse.gaussian_threshold(g, density=density)
        count = int((g["a"].abs() > t).sum())
        assert abs(count - density * 400_000) < 5 * math.sqrt(density * 400_000) + 5
    k = ft.sparse.k_from_density(0.01, 400_000)
    assert torch.equal(ft.sparse.gaussian_threshold(g, k), ft.sparse.gaussian_threshold(g, density=0.01))
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.sparse.gaussian_threshold(g)
    with pytest.raises(ValueError, match="the tree has no coordinates"):
        ft.sparse.gaussian_threshold({"a": torch.zeros(0, device=device)}, density=0.1)
    g16 = {"a": (torch.randn(1000) * 300).half().to(device)}  # sum of squares overflows float16: accumulated in float32
    assert torch.isfinite(ft.sparse.gaussian_threshold(g16, density=0.1))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gaussian_method_with_non_finite_input_keeps_exactly_the_non_finite_coordinates(device, bad, dtype):
    """As the docstring says: the estimate becomes the dtype's largest finite value (not NaN or inf)."""
    g = torch.Generator().manual_seed(0)
    tree = {"a": torch.randn(1000, generator=g).to(dtype), "b": torch.randn(7, generator=g).to(torch.float32)}
    tree["a"][[3, 500]] = bad
    tree["b"][2] = math.nan
    tree = to_device(tree, device)
    t = ft.sparse.gaussian_threshold(tree, density=0.1)
    assert float(t) == torch.finfo(torch.float32).max and t.device == real_device(device)
    expected = optree.tree_map(lambda x: ~torch.isfinite(x), tree)
    for k in (1, 100, torch.tensor(100), torch.tensor(100, device=device)):
        for m, e in zip(optree.tree_leaves(ft.topk_mask(tree, k, method="gaussian")), optree.tree_leaves(expected)):
            assert torch.equal(m, e)
        out = ft.topk_sparsify(tree, k, method="gaussian")
        assert_tree_bitwise_equal(out, optree.tree_map(lambda x, e: torch.where(e, x, 0.0), tree, expected))
        sparse = ft.topk_indices(tree, k, method="gaussian")
        flat = torch.cat([e.reshape(-1) for e in optree.tree_leaves(expected)])
        assert torch.equal(sparse.indices, flat.nonzero().view(-1))
    # the static comparison (a leaf requires grad) keeps the same coordinates
    grad_tree = optree.tree_map(lambda x: x.clone().requires_grad_(), tree)
    for m, e in zip(optree.tree_leaves(ft.topk_mask(grad_tree, 100, method="gaussian")), optree.tree_leaves(expected)):
        assert torch.equal(m, e)


def test_gaussian_threshold_nan_density_counts_as_one(device):
    tree = {"a": torch.tensor([1.0, 0.0, -2.0], device=device)}
    for where in dict.fromkeys(("cpu", device)):
        assert float(ft.sparse.gaussian_threshold(tree, density=torch.tensor(math.nan, device=where))) == 0.0
        assert float(ft.sparse.gaussian_threshold(tree, torch.tensor(math.nan, device=where))) == 0.0


# --------------------------------------------------------------------------- compile


TREE = {"a": torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), "b": torch.tensor([3.0, -0.1, 7.0]),
        "c": (torch.tensor([[-8.0, 0.2]], dtype=torch.float64), None)}


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("method", ["exact", "torch", "approx", "gaussian"])
def test_methods_compile_fullgraph(method):
    (out,) = assert_compiles_like_eager(lambda t: ft.topk_sparsify(t, 7, method=method), [(TREE,)], bitwise=True)
    if method in ("exact", "torch"):  # the compiled "exact" runs the static kernel: same result
        assert_tree_bitwise_equal(out, reference_sparsify(TREE, 7))


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_tensor_k_compiles_without_recompiling():
    calls = [(TREE, torch.tensor(k)) for k in [3, 7, 1, 33]]
    outs = assert_compiles_like_eager(lambda t, k: ft.topk_sparsify(t, k, method="torch"), calls, bitwise=True)
    for (_, k), out in zip(calls, outs):
        assert_tree_bitwise_equal(out, reference_sparsify(TREE, int(k)))  # radix select
    for method in ("approx", "gaussian"):
        fn = lambda t, k, m=method: ft.topk_sparsify(t, k, method=m)  # noqa: E731
        assert_compiles_like_eager(fn, [(TREE, torch.tensor(3)), (TREE, torch.tensor(20))], bitwise=True)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_nan_and_huge_tensor_k_compile_to_n():
    calls = [(TREE, torch.tensor(v)) for v in (math.nan, math.inf, 1e30)]
    for out in assert_compiles_like_eager(lambda t, k: ft.topk_sparsify(t, k, method="torch"), calls, bitwise=True):
        assert_tree_bitwise_equal(out, TREE)  # k = n: everything kept
    compiled = torch.compile(lambda t, k: ft.topk_sparsify(t, k), fullgraph=True)
    assert_tree_bitwise_equal(compiled(TREE, torch.tensor(math.inf)), TREE)
    # compiled "exact" on CPU runs the eager kernel as an operator, which reads k: NaN is the eager ValueError
    with pytest.raises(ValueError, match="k is NaN"):
        compiled(TREE, torch.tensor(math.nan))
    with pytest.raises(ValueError, match="k is NaN"):
        ft.topk_sparsify(TREE, torch.tensor(math.nan))


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
def test_approx_count_is_within_the_documented_band(device, data):
    tree = to_device(_mlp_gradient() if data == "mlp-gradient" else _multiscale_heavy_tailed(), device)
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
def test_large_tree_exact_equals_static_kernel(device):
    tree = _big_tree(0)
    n = numel(tree)
    assert n > 20_000_000
    leaves = optree.tree_leaves(tree)
    leaves[5].view(-1)[123] = math.nan
    leaves[7].view(-1)[:50_000] = 4.0  # a block of ties around the 1%-cut
    dtree = to_device(tree, device)
    for k in [1000, n // 100]:
        exact = ft.topk_indices(dtree, k)
        static = ft.topk_indices(dtree, k, method="torch")
        assert torch.equal(exact.indices, static.indices)
        assert torch.equal(bits(exact.values), bits(static.values))
        if device != "cpu":  # the CPU's eager exact kernel selects the same coordinates
            on_cpu = ft.topk_indices(tree, k)
            assert torch.equal(exact.indices.cpu(), on_cpu.indices)
            assert torch.equal(bits(exact.values.cpu()), bits(on_cpu.values))
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

