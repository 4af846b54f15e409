"""Applying dense updates to parameters: :func:`apply_updates` (pure) and :func:`apply_updates_` (in place)."""

from __future__ import annotations

import optree
import torch

from functopk._checks import path_str as _path_str
from functopk.base import Params, Updates

__all__ = ["apply_updates", "apply_updates_"]


def _paired_leaves(params: Params, updates: Updates) -> tuple[list, list, optree.PyTreeSpec]:
    """Leaves of params and updates (``None`` kept as a leaf) after a structure check."""
    p_leaves, p_def = optree.tree_flatten(params, none_is_leaf=True)
    u_leaves, u_def = optree.tree_flatten(updates, none_is_leaf=True)
    if p_def != u_def:
        raise ValueError(f"updates has tree structure {u_def}, but params has {p_def}; they must match")
    for path, p, u in zip(p_def.paths(), p_leaves, u_leaves):
        if u is None:
            continue
        if p is None:
            raise ValueError(f"updates has a tensor at {_path_str(path)} where params has None")
        if p.shape != u.shape:
            raise ValueError(
                f"updates leaf at {_path_str(path)} has shape {tuple(u.shape)}, but the parameter has "
                f"shape {tuple(p.shape)}"
            )
    return p_leaves, u_leaves, p_def


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates`` as a new tree (pure; inputs are not changed).

    Each update is cast to its parameter's dtype first, so parameters keep their
    dtype. Where an update is ``None`` (a frozen parameter), the parameter is
    returned as it is. The result stays differentiable (no ``torch.no_grad``), so
    it can be used inside ``torch.func`` transforms and meta-learning; detach
    parameters once (as :func:`functopk.nn.functionalize` does) to avoid growing
    an autograd graph across steps.

    Example:
        >>> import torch, functopk as ft
        >>> ft.apply_updates({"w": torch.ones(2), "frozen": torch.ones(1)},
        ...                  {"w": torch.tensor([0.5, -1.0]), "frozen": None})
        {'w': tensor([1.5000, 0.0000]), 'frozen': tensor([1.])}
    """
    p_leaves, u_leaves, treedef = _paired_leaves(params, updates)
    idx = [i for i, u in enumerate(u_leaves) if u is not None]
    if idx:
        ps = [p_leaves[i] for i in idx]
        us = [u_leaves[i] if u_leaves[i].dtype == p_leaves[i].dtype else u_leaves[i].to(p_leaves[i].dtype) for i in idx]
        new = torch._foreach_add(ps, us)
        out = list(p_leaves)
        for i, x in zip(idx, new):
            out[i] = x
    else:
        out = p_leaves
    return optree.tree_unflatten(treedef, out)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """In place: add ``updates`` into the tensors of ``params`` and return ``params``.

    The eager-mode fast path: one ``torch._foreach_add_`` into the existing
    parameter storage, no new parameter tensors. **Mutates** ``params`` (under
    ``torch.no_grad``, so ``nn.Parameter`` leaves are fine). Updates are cast to
    the parameters' dtypes; ``None`` updates leave their parameter alone.
    """
    p_leaves, u_leaves, _ = _paired_leaves(params, updates)
    pairs = [(p, u) for p, u in zip(p_leaves, u_leaves) if u is not None]
    if pairs:
        with torch.no_grad():
            torch._foreach_add_([p for p, _ in pairs], [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in pairs])
    return params
