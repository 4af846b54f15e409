"""The functional form of sampled weight gradients: :func:`grad_at`, the gradient at a fixed coordinate set.

``torch.func.grad(loss_fn)(params, ...)`` returns every coordinate's gradient;
between refreshes a :func:`~functopk.sparse.sparse_optimizer` needs ``k`` of
them. :func:`grad_at` runs ``loss_fn`` on the parameters with the supported
layers' weights claimed at the set (:mod:`functopk.sparse.layers`, the same
mechanism a :class:`~functopk.sparse.StreamingTopK` uses between selections),
so that those layers compute their weight gradient only there, and returns
the gradient at the set as a :class:`~functopk.SparseUpdates`, ready for
``opt.update(..., refresh=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functopk._checks import check_bool, check_leaves, one_device
from functopk.sparse.gathering import checked_indices
from functopk.sparse.kernels.base import common_dtype
from functopk.sparse.layers import Claim, claimed
from functopk.sparse.updates import SparseUpdates
from functopk.tree.layout import FlatLayout
from functopk.tree.maths import PyTree

__all__ = ["grad_at"]


def _claims(leaves: list[torch.Tensor], idx: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[Any, ...]]]:
    """Detached aliases of ``leaves`` (requiring grad where the set has coordinates) and, for those, their claims."""
    aliases, wanted = [], []
    for leaf, (off, lo, hi) in zip(leaves, FlatLayout.from_tree(leaves).bounds(idx, name="indices")):
        alias = leaf.detach()
        if hi > lo:  # a leaf without coordinates needs no gradient at all
            alias.requires_grad_()
            at = torch.zeros(hi - lo, dtype=leaf.dtype, device=leaf.device, requires_grad=True)
            wanted.append((alias, Claim(at, idx[lo:hi] - off, {}), off, lo, hi))
        aliases.append(alias)
    return aliases, wanted


def _values(loss: Any, wanted: list[tuple[Any, ...]], idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient at ``idx``: a leaf's dense gradient (its uses outside the claimed layers) plus its claim's."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"grad_at: fn must return a 0-d tensor (a scalar loss), got {type(loss).__name__}")
    values = torch.zeros(idx.shape, dtype=dtype, device=idx.device)
    if not wanted or not loss.requires_grad:
        return values
    inputs = [t for alias, claim, *_ in wanted for t in (alias, claim.leaf)]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    for (_, _, off, lo, hi), dense, at in zip(wanted, grads[0::2], grads[1::2]):
        if dense is not None:
            values[lo:hi] += dense.reshape(-1).index_select(0, idx[lo:hi] - off).to(dtype)
        if at is not None:
            values[lo:hi] += at.to(dtype)
    return values


def grad_at(fn: Callable[..., Any], indices: torch.Tensor, *, has_aux: bool = False) -> Callable[..., Any]:
    """``torch.func.grad(fn)`` at the flat ``indices`` only: a :class:`~functopk.SparseUpdates` of the gradient there.

    ``grad_at(fn, indices)(params, *args, **kwargs)`` calls ``fn(params, *args,
    **kwargs)`` (a scalar loss, or ``(loss, aux)`` with ``has_aux=True``) and
    returns the gradient with respect to ``params`` at ``indices`` (flat indices
    in optree's order of ``params``: a dict's keys sorted, not
    ``named_parameters()`` order), over all of ``params``. The weight gradient of
    ``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding`` and ``nn.Conv2d``
    layers that ``fn`` calls with these parameters
    (``torch.func.functional_call(model, params, ...)``) is computed at the
    indices only, without the dense gradient; other parameters (biases, norms,
    other layers) get their dense gradient, read at the indices; a leaf without
    an index gets none. The values equal ``torch.func.grad``'s at the indices
    within rounding (``tests/sparse/test_grad_at.py``). For the steps between
    refreshes of :func:`~functopk.sparse.sparse_optimizer`: pass
    ``state.indices``. It runs with plain autograd (``torch.autograd.grad``), so
    it does not nest inside other ``torch.func`` transforms. Pure: ``params``
    are not changed, and get no ``.grad``.

    Args:
        fn: ``fn(params, *args, **kwargs)``, a scalar loss (or ``(loss, aux)``).
        indices: 1-d int64 (or int32) strictly ascending flat indices, on the parameters' device.
        has_aux: Whether ``fn`` returns ``(loss, aux)``; the result is then ``(updates, aux)``.

    Raises:
        TypeError: ``indices`` is not an integer tensor, or ``params`` not a tree of float tensors.
        ValueError: ``indices`` not 1-d, ascending and in range, or ``fn`` does not return a scalar.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(3, 2)
        >>> params = dict(model.named_parameters())      # flat order: bias (2), then weight (6): keys sorted
        >>> def loss_fn(p, x):
        ...     return torch.func.functional_call(model, p, (x,)).square().sum()
        >>> x = torch.tensor([[1.0, 2.0, 3.0]])
        >>> sparse = ft.sparse.grad_at(loss_fn, torch.tensor([1, 4]))(params, x)   # bias[1], weight[0, 2]
        >>> dense = torch.func.grad(loss_fn)(params, x)
        >>> torch.allclose(sparse.values, torch.stack([dense["bias"][1], dense["weight"][0, 2]]))
        True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_bool(has_aux, "has_aux")

    def gradient_at(params: PyTree, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = check_leaves(params, "params", floating=True)
        idx = checked_indices(indices, one_device(leaves, "params"), sum(x.numel() for x in leaves))
        aliases, wanted = _claims(leaves, idx)
        with torch.enable_grad(), claimed({id(alias): (alias, claim) for alias, claim, *_ in wanted}):
            out = fn(treedef.unflatten(aliases), *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            values = _values(loss, wanted, idx, common_dtype(leaves))
        sizes = tuple(x.numel() for x in leaves)
        updates = SparseUpdates(idx, values, sum(sizes), sizes)
        return (updates, aux) if has_aux else updates

    return gradient_at
