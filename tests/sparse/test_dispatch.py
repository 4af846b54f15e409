"""functopk.sparse.dispatch: which kernel runs when, and what a tensor k becomes."""

from __future__ import annotations

import math
import typing
import warnings

import optree
import pytest
import torch

import functopk as ft
from functopk.sparse import dispatch
from functopk.sparse.ops import ExactOp
from functopk.sparse.selection import HostThreshold, Indices, Mask, Selection, Threshold
from tests.helpers import assert_tree_bitwise_equal, bits


def _leaves():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(40, generator=g), torch.randn(3, 5, generator=g).double(), torch.randn(7, generator=g).half()]


@pytest.mark.parametrize(
    "method, k, requires_grad, kind",
    [
        ("exact", 5, False, Indices),
        ("exact", torch.tensor(5.0), False, Indices),  # read on the host by the eager kernel
        ("exact", 5, True, Mask),  # a leaf requires grad: the static kernel (differentiable outputs)
        ("torch", 5, False, Mask),
        ("torch", torch.tensor(5), False, Mask),
        ("approx", 5, False, HostThreshold),
        ("approx", 5, True, Threshold),
        ("gaussian", torch.tensor(5), False, HostThreshold),
        ("gaussian", 5, True, Threshold),
    ],
)
def test_dispatch_table(method, k, requires_grad, kind):
    leaves = [x.requires_grad_(requires_grad) for x in _leaves()]
    assert type(dispatch.select(leaves, k, method)) is kind


@pytest.mark.compile
def test_route():
    leaves = _leaves()
    assert dispatch.route(leaves) == "eager"
    leaves[1].requires_grad_()
    assert dispatch.route(leaves) == "static"
    with torch.no_grad():
        assert dispatch.route(leaves) == "eager"
    assert dispatch.route([torch.ones(3, device="meta")]) == "static"
    routes = []
    torch.compile(lambda x: routes.append(dispatch.route([x])) or x, backend="eager", fullgraph=True)(torch.ones(3))
    assert routes == ["op"]


@pytest.mark.parametrize("method", ["exact", "approx", "gaussian"])
def test_eager_and_static_result_types_give_the_same_outputs(method):
    """The eager CPU selection (Indices, HostThreshold) and the static one (Mask, Threshold) agree bit for bit."""
    leaves = _leaves()
    leaves[0][3] = math.nan
    grad_leaves = [x.clone().requires_grad_() for x in leaves]
    for k in (1, 9, 62, torch.tensor(9)):
        eager, static = dispatch.select(leaves, k, method), dispatch.select(grad_leaves, k, method)
        assert type(eager) is not type(static)
        for a, b in zip(eager.masks(leaves), static.masks(grad_leaves)):
            assert torch.equal(a, b)
        assert_tree_bitwise_equal(eager.dense(leaves), [x.detach() for x in static.dense(grad_leaves)])
        se, ss = eager.sparse(leaves), static.sparse([x.detach() for x in grad_leaves])
        assert torch.equal(se.indices, ss.indices) and torch.equal(bits(se.values), bits(ss.values))
        assert se.numel == ss.numel == 62 and se.sizes == ss.sizes == (40, 15, 7)


def test_the_static_route_is_differentiable():
    """Leaves that require grad take the static kernel; the dense and sparse outputs pass gradients back."""
    leaves = [x.clone().requires_grad_() for x in _leaves()]
    sel = dispatch.select(leaves, 9, "exact")
    assert type(sel) is Mask
    weights = [torch.randn_like(x) for x in leaves]
    sum((w * o).sum() for w, o in zip(weights, sel.dense(leaves))).backward()
    for x, w, m in zip(leaves, weights, sel.masks(leaves)):
        assert torch.equal(x.grad, torch.where(m, w, 0.0))  # d/dx of where(mask, x, 0): the mask
    x0 = leaves[0].detach().clone().requires_grad_()
    one = dispatch.select([x0], 3, "torch").sparse([x0])
    one.values.sum().backward()
    assert int(x0.grad.sum()) == 3 and torch.equal(x0.grad[one.indices], torch.ones(3))


def test_select_returns_one_type_on_every_route(monkeypatch):
    """Eager, static and compiling (the operator) routes all return a Selection; ExactOp selects like Indices."""
    assert typing.get_type_hints(dispatch.select)["return"] is Selection
    leaves = _leaves()
    grad_leaves = [x.clone().requires_grad_() for x in leaves]
    for method in dispatch.METHODS:
        for k in (5, torch.tensor(5)):
            assert isinstance(dispatch.select(leaves, k, method), Selection)
            assert isinstance(dispatch.select(grad_leaves, k, method), Selection)
    eager = dispatch.select(leaves, 5, "exact")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the route of a compiled graph
    for k in (5, torch.tensor(5)):
        op = dispatch.select(leaves, k, "exact")
        assert type(op) is ExactOp and isinstance(op, Selection)
        assert_tree_bitwise_equal(op.dense(leaves), eager.dense(leaves))
        assert_tree_bitwise_equal(op.masks(leaves), eager.masks(leaves))
        assert torch.equal(op.sparse(leaves).indices, eager.sparse(leaves).indices)


def test_a_tensor_k_tunes_the_host_threshold_scan_for_the_named_fraction():
    leaves = _leaves()
    assert dispatch.select(leaves, torch.tensor(5), "approx").fraction == dispatch.TENSOR_K_FRACTION
    assert dispatch.select(leaves, 5, "approx").fraction == 5 / 62  # an int k: its own share


def test_nan_k_raises_only_where_k_is_read_on_the_host():
    leaves = _leaves()
    nan = torch.tensor(math.nan)
    with pytest.raises(ValueError, match="k is NaN"):
        dispatch.select(leaves, nan, "exact")
    for method in ("torch", "approx", "gaussian"):
        sel = dispatch.select(leaves, nan, method)
        assert all(bool(m.all()) for m in sel.masks(leaves)), method  # k = n: everything
    grad_leaves = [x.clone().requires_grad_() for x in leaves]
    assert all(bool(m.all()) for m in dispatch.select(grad_leaves, nan, "exact").masks(grad_leaves))


def test_check_method():
    assert dispatch.check_method("approx") == "approx"
    with pytest.raises(ValueError, match=r"method must be one of \('exact', 'torch', 'approx', 'gaussian'\)"):
        dispatch.check_method("fast")


def test_public_functions_pass_the_config_to_the_kernels():
    tree = {"w": torch.randn(5000, generator=torch.Generator().manual_seed(2))}
    tiny = ft.sparse.KernelConfig(exact_min_numel=0, sample_size=64, segment=256, abandon_min=0, abandon_factor=0.0)
    expected = ft.topk_indices(tree, 40, method="torch")
    got = ft.topk_indices(tree, 40, config=tiny)
    assert torch.equal(got.indices, expected.indices)
    with pytest.raises(TypeError, match="config must be a functopk.sparse.KernelConfig or None, got object"):
        ft.topk_indices(tree, 40, config=object())
    assert optree.tree_structure(ft.topk_mask(tree, 40, config=tiny)) == optree.tree_structure(tree)


def test_exact_warns_when_a_large_cpu_tree_requiring_grad_takes_the_static_kernel():
    big = [torch.randn(dispatch.SLOW_STATIC_NUMEL, requires_grad=True)]
    with pytest.warns(dispatch.SlowPathWarning, match="requires grad"):
        dispatch.select(big, 10, "exact")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.select([x.detach() for x in big], 10, "exact")  # the exact kernel: no warning
        dispatch.select(big, 10, "torch")  # asked for the static kernel: no warning
        dispatch.select([torch.randn(1000, requires_grad=True)], 10, "exact")  # small: as fast
