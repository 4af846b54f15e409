"""SparseUpdates, apply_sparse_updates and apply_sparse_updates_: against the dense path, and their contract."""

from __future__ import annotations

import bisect
import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import updates
from functopk.sparse.kernels.base import common_dtype
from functopk.sparse.updates import zeros_with
from tests.helpers import (
    UNWRITABLE,
    assert_compiles_like_eager,
    assert_tree_bitwise_equal,
    assert_tree_close,
    clone_tree,
    numel,
    real_device,
    to_device,
    trees_st,
    unwritable_params,
)


@settings(max_examples=40)
@given(tree=trees_st(), data=st.data())
def test_sparse_apply_equals_dense_apply(device, tree, data):
    """On every device; off CPU the apply is the static ``torch.cat`` + ``index_add_`` path."""
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    lr = data.draw(st.sampled_from([0.1, 1.0, torch.tensor(0.25)]), label="lr")
    lr = lr.to(device) if isinstance(lr, torch.Tensor) else lr
    params = optree.tree_map(lambda x: torch.linspace(-1.0, 1.0, x.numel()).to(x.dtype).reshape(x.shape), tree)
    params, tree = to_device(params, device), to_device(tree, device)
    p0, g0 = clone_tree(params), clone_tree(tree)
    sparse = ft.topk_indices(tree, k)
    dense = ft.apply_updates(params, ft.tree.scale(ft.topk_sparsify(tree, k), -lr))
    new = ft.apply_sparse_updates(params, sparse, -lr)
    assert_tree_bitwise_equal(params, p0)  # pure
    assert_tree_bitwise_equal(tree, g0)
    dtypes = {x.dtype for x in optree.tree_leaves(tree)}
    # off CPU, index_add_ of half floats (atomics) may round p + v differently from the dense add (float opmath)
    one_dtype = len(dtypes) == 1 and (device == "cpu" or dtypes <= {torch.float32, torch.float64})
    if one_dtype:
        assert_tree_bitwise_equal(new, dense)
    else:  # the values are scaled in the common dtype before rounding to each leaf's dtype
        assert_tree_close(new, dense, rtol=1e-2, atol=1e-3)
    inplace = clone_tree(params)
    ptrs = [x.data_ptr() for x in optree.tree_leaves(inplace)]
    assert ft.apply_sparse_updates_(inplace, sparse, -lr) is inplace
    assert [x.data_ptr() for x in optree.tree_leaves(inplace)] == ptrs
    if device == "cpu" or dtypes <= {torch.float32, torch.float64}:
        assert_tree_bitwise_equal(inplace, new)
    else:  # CUDA's half-float index_add_ adds in pairs: an untouched -0.0 beside a target may become +0.0
        assert_tree_close(inplace, new, rtol=0.0, atol=0.0)
    assert_tree_bitwise_equal(sparse.to_dense(tree), ft.topk_sparsify(tree, k))


def test_sparse_sgd_step_on_module_parameters_and_non_contiguous_leaves(device):
    lin = torch.nn.Linear(4, 3).to(device)
    params = dict(lin.named_parameters())
    grads = to_device({"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.tensor([100.0, 0.0, -200.0])}, device)
    before = {name: p.detach().clone() for name, p in params.items()}
    ft.apply_sparse_updates_(params, ft.topk_indices(grads, 3), -0.5)
    assert torch.equal(lin.bias.detach(), before["bias"] + torch.tensor([-50.0, 0.0, 100.0], device=device))
    expected_w = before["weight"].clone()
    expected_w[2, 3] -= 5.5
    assert torch.equal(lin.weight.detach(), expected_w)
    # a transposed (non-contiguous) leaf is updated through a copy, still in place
    w = torch.zeros(3, 2, device=device).t()
    g = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]], device=device)
    ft.apply_sparse_updates_({"w": w}, ft.topk_indices({"w": g}, 1))
    assert torch.equal(w, g)


@pytest.mark.parametrize("fn", [ft.apply_sparse_updates, ft.apply_sparse_updates_], ids=["pure", "inplace"])
def test_sparse_apply_errors_leave_params_untouched(device, fn):
    params = {"w": torch.ones(3, device=device), "b": torch.ones(2, device=device)}
    p0 = clone_tree(params)
    good = to_device(ft.SparseUpdates(torch.tensor([0, 4]), torch.tensor([1.0, 2.0]), 5), device)
    with pytest.raises(ValueError, match="covers 6 coordinates, but params has 5"):
        fn(params, good._replace(numel=6))
    with pytest.raises(TypeError, match="sparse must be a functopk.SparseUpdates"):
        fn(params, (good.indices, good.values))
    with pytest.raises(ValueError, match="1-d of one length"):
        fn(params, good._replace(values=torch.ones(3, device=device)))
    with pytest.raises(TypeError, match="int64"):
        fn(params, good._replace(indices=good.indices.int()))
    with pytest.raises(TypeError, match="scale must be a real number"):
        fn(params, good, "0.1")
    with pytest.raises(ValueError, match="strictly ascending"):
        fn(params, good._replace(indices=torch.tensor([4, 0], device=device)))
    with pytest.raises(ValueError, match=r"must lie in \[0, 5\)"):
        fn(params, good._replace(indices=torch.tensor([0, 5], device=device)))
    with pytest.raises(ValueError, match=r"must lie in \[0, 5\)"):
        fn(params, good._replace(indices=torch.tensor([-1, 2], device=device)))
    assert_tree_bitwise_equal(params, p0)


CONSUMERS = {
    "pure": lambda params, sparse: ft.apply_sparse_updates(params, sparse, -1.0),
    "inplace": lambda params, sparse: ft.apply_sparse_updates_(params, sparse, -1.0),
    "to_dense": lambda params, sparse: sparse.to_dense(params),
}


@pytest.mark.parametrize("consume", CONSUMERS.values(), ids=CONSUMERS.keys())
def test_all_three_consumers_check_one_contract(device, consume):
    """Before: the pure apply summed duplicated indices, to_dense kept the last, only the in-place one checked."""
    params = {"w": torch.ones(3, device=device), "b": torch.ones(2, device=device)}
    p0 = clone_tree(params)
    good = to_device(ft.SparseUpdates(torch.tensor([0, 4]), torch.tensor([1.0, 2.0]), 5, (2, 3)), device)

    def idx(*values):
        return torch.tensor(values, device=device)

    cases = [
        (good._replace(indices=idx(1, 1)), "strictly ascending, so distinct"),
        (good._replace(indices=idx(3, 1)), "strictly ascending"),
        (good._replace(indices=idx(0, 5)), r"must lie in \[0, 5\)"),
        (good._replace(indices=idx(-2, 0)), r"must lie in \[0, 5\)"),
        (good._replace(sizes=(3, 2)),
         r"(params|like) leaf at \['b'\] has 2 coordinates, but the tree the sparse update was selected from has 3"),
        (good._replace(sizes=(5,)), "selected from a tree of 1 leaves, but (params|like) has 2"),
        (good._replace(indices=good.indices.to("meta")), "sparse.indices is on meta but (params|like) is on"),
        (good._replace(values=good.values.to("meta")), "sparse.values is on meta but (params|like) is on"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            consume(params, bad)
        assert_tree_bitwise_equal(params, p0)  # nothing written
    assert_tree_bitwise_equal(consume(params, good._replace(sizes=None)), consume(clone_tree(p0), good))


def test_sparse_updates_carry_the_leaf_sizes_and_hide_them_in_the_repr(device):
    grads = to_device({"a": torch.tensor([[0.5, -3.0]]), "b": None, "c": torch.tensor([2.0, 0.0, 1.0])}, device)
    for method in ("exact", "torch", "approx", "gaussian"):
        sparse = ft.topk_indices(grads, 2, method=method)
        assert sparse.numel == 5 and sparse.sizes == (2, 3)
        assert "sizes" not in repr(sparse)
    # the same numel split differently over the leaves is refused: the indices would land elsewhere
    with pytest.raises(ValueError, match=r"params leaf at \['a'\] has 3 coordinates"):
        ft.apply_sparse_updates({"a": torch.zeros(3, device=device), "c": torch.zeros(2, device=device)}, sparse)


def test_integer_parameters_are_rejected_not_truncated(device):
    sparse = to_device(ft.SparseUpdates(torch.tensor([1]), torch.tensor([0.5]), 2), device)
    for fn in (ft.apply_sparse_updates, ft.apply_sparse_updates_):
        params = {"w": torch.zeros(2, dtype=torch.int64, device=device)}
        with pytest.raises(TypeError, match=r"params leaf at \['w'\] has dtype torch.int64"):
            fn(params, sparse)
        assert not params["w"].any()


def test_a_sparse_sgd_step_is_topk_indices_then_apply_sparse_updates(device):
    """What ``topk(sparse=True)`` did, with the functions: the selection, then the sparse apply."""
    params = to_device({"w": torch.zeros(2, 2), "b": torch.zeros(3)}, device)
    grads = to_device({"w": torch.tensor([[0.1, -3.0], [2.0, 0.0]]), "b": torch.tensor([0.5, 0.0, -0.2])}, device)
    sparse = ft.topk_indices(grads, 2)
    assert isinstance(sparse, ft.SparseUpdates) and sparse.indices.tolist() == [4, 5]
    new = ft.apply_sparse_updates(params, sparse, -0.1)
    assert new["w"].device == real_device(device)
    assert torch.allclose(new["w"].cpu(), torch.tensor([[0.0, 0.3], [-0.2, 0.0]])) and not new["b"].any()
    assert_tree_bitwise_equal(sparse.to_dense(grads), ft.topk_sparsify(grads, 2))


# --------------------------------------------------------------------------- compile

TREE = {"a": torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), "b": torch.tensor([3.0, -0.1, 7.0]),
        "c": (torch.tensor([[-8.0, 0.2]], dtype=torch.float64), None)}


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_sparse_paths_compile():
    def step(params, grads):
        return ft.apply_sparse_updates(params, ft.topk_indices(grads, 5), -0.5)

    params = optree.tree_map(torch.ones_like, TREE)
    assert_compiles_like_eager(step, [(params, TREE)], bitwise=True)
    assert_compiles_like_eager(lambda s, like: s.to_dense(like), [(ft.topk_indices(TREE, 5), TREE)], bitwise=True)
    # approx: a data-dependent number of indices (nonzero), still one graph
    for method in ("approx", "gaussian"):
        torch._dynamo.reset()  # one code object, two defaults: dynamo 2.10 and 2.11 reuse the first compilation
        fn = lambda g, m=method: ft.topk_indices(g, 5, method=m)  # noqa: E731
        (got,) = assert_compiles_like_eager(lambda g, f=fn: tuple(f(g)[:2]), [(TREE,)], bitwise=True)
        expected = ft.topk_indices(TREE, 5, method=method)
        assert torch.equal(got[0], expected.indices) and torch.equal(got[1], expected.values)


@pytest.mark.parametrize("case", UNWRITABLE)
def test_sparse_apply_inplace_is_all_or_nothing(case):
    """A leaf that cannot take an in-place add, last in flat order: no leaf before it is written."""
    params, message = unwritable_params(case)
    grads = ft.tree.map(lambda p: torch.ones(p.shape), params)
    sparse = ft.topk_indices(grads, 16)  # every coordinate: the last leaf is written too
    p0 = clone_tree(params)
    with pytest.raises(ValueError, match=message):
        ft.apply_sparse_updates_(params, sparse, -0.5)
    assert_tree_bitwise_equal(params, p0)


def _one_write_per_coordinate(leaves, idx, values, masks):
    """Reference for zeros_with: zeros, then each index written on its own through Python's bisect."""
    offsets = [0]
    for x in leaves:
        offsets.append(offsets[-1] + x.numel())
    out = [torch.zeros(x.shape, dtype=torch.bool if masks else x.dtype) for x in leaves]
    for t, i in enumerate(idx):
        j = bisect.bisect_right(offsets, i) - 1
        pos = i - offsets[j]
        if masks:
            out[j].view(-1)[pos] = True
        else:
            own = leaves[j].reshape(-1)[pos]
            # a 1-d cast, as the writer's (a 0-d cast writes other NaN bits into bfloat16)
            out[j].view(-1)[pos] = own if values is None else values[t : t + 1].to(own.dtype)[0]
    return out


@settings(max_examples=40)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_zeros_with_writes_the_same_bits_whatever_the_pieces(tree, data):
    """Leaves cut into pieces of a few bytes (piece edges everywhere) or kept whole: one write per coordinate."""
    leaves = optree.tree_leaves(tree)
    n = numel(tree)
    idx = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n), label="idx")) if n else []
    chunk_bytes = data.draw(st.sampled_from([None, 1, 2, 8, 24, 1 << 20]), label="chunk_bytes")
    min_per_chunk = data.draw(st.sampled_from([0, 1, 4]), label="min_per_chunk")
    before = clone_tree(leaves)
    flat = torch.cat([x.reshape(-1).to(common_dtype(leaves)) for x in leaves]) if leaves else torch.zeros(0)
    indices = torch.tensor(idx, dtype=torch.int64)
    for values, masks in [(flat[indices], False), (None, False), (None, True)]:
        out = zeros_with(leaves, indices, values, masks=masks, chunk_bytes=chunk_bytes, min_per_chunk=min_per_chunk)
        assert all(y.is_contiguous() for y in out)
        assert_tree_bitwise_equal(out, _one_write_per_coordinate(leaves, idx, values, masks))
    assert_tree_bitwise_equal(leaves, before)  # pure


def test_dense_outputs_of_a_leaf_hit_by_1_percent_equal_the_static_kernels():
    """A leaf of 2 MiB hit by 1% of its coordinates: whole (the default) or in L2-sized pieces, the same bits."""
    g = torch.Generator().manual_seed(0)
    tree = {"big": torch.randn(1024, 512, generator=g), "half": torch.randn(300, generator=g).half()}
    tree["big"][7, :100] = math.nan  # NaN ranks first: selected and kept bit for bit
    k = 5243
    assert k * updates.ZEROS_CHUNK_BYTES // 4 >= updates.ZEROS_MIN_PER_CHUNK * 1024 * 512  # pieces if asked
    for fn in (ft.topk_sparsify, ft.topk_mask):
        assert_tree_bitwise_equal(fn(tree, k), fn(tree, k, method="torch"))
    sparse = ft.topk_indices(tree, k)
    assert_tree_bitwise_equal(sparse.to_dense(tree), ft.topk_sparsify(tree, k, method="torch"))
    leaves = list(tree.values())
    for masks in (False, True):
        whole = zeros_with(leaves, sparse.indices, None, masks=masks)
        pieces = zeros_with(leaves, sparse.indices, None, masks=masks, chunk_bytes=updates.ZEROS_CHUNK_BYTES)
        assert_tree_bitwise_equal(whole, pieces)


def test_zeros_with_rejects_indices_outside_the_tree():
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 3\)"):
        zeros_with([torch.zeros(3)], torch.tensor([1, 3]), torch.ones(2))


@pytest.mark.parametrize(
    "numel, sizes, error, match",
    [
        (-1, None, ValueError, "numel must be >= 0, got -1"),
        (2.5, None, TypeError, "numel must be an int"),
        (True, None, TypeError, "numel must be an int"),
        (5, (2, 2), ValueError, r"adding up to numel=5, got \(2, 2\)"),
        (3, (4, -1), ValueError, "counts >= 0"),
        (3, "3", TypeError, "sizes must be None or a tuple of ints"),
    ],
)
def test_sparse_updates_refuse_counts_that_describe_no_tree(numel, sizes, error, match):
    with pytest.raises(error, match=match):
        ft.SparseUpdates(torch.tensor([0]), torch.tensor([1.0]), numel, sizes)
    assert ft.SparseUpdates(torch.tensor([0]), torch.tensor([1.0]), 0).numel == 0  # an empty tree is a tree


@settings(max_examples=30)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=6), data=st.data())
def test_shift_indices_moves_a_selection_between_the_leaves_present_and_all_leaves(sizes, data):
    present = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    over_all = [offsets[i] + j for i, size in enumerate(sizes) if present[i] for j in range(size)]  # brute force
    chosen = sorted(data.draw(st.sets(st.integers(0, max(len(over_all) - 1, 0)), max_size=len(over_all))))
    compact = torch.tensor(chosen, dtype=torch.int64)
    expected = torch.tensor([over_all[c] for c in chosen], dtype=torch.int64)
    assert torch.equal(updates.shift_indices(compact, sizes, present, to_all=True), expected)
    assert torch.equal(updates.shift_indices(expected, sizes, present, to_all=False), compact)
