"""Random-k sparsification from a counter-based hash: :func:`randk` and :func:`randk_mask`.

:func:`randk` keeps ``k`` coordinates chosen pseudo-randomly from ``(seed,
step, flat index)`` alone, with no global RNG state, so every data-parallel
rank picks the same ones (Stich et al. 2018, "Sparsified SGD with memory";
Wangni et al. 2018 for the unbiased ``n/k`` scaling). Kept values are bit-exact
copies of the input (``unbiased=True`` excepted, which scales them), so
``input - output`` is exactly the part that was not sent.

The hash: each flat index ``i`` gets the key ``F(F(i ^ s1) ^ s2)``, with ``F``
MurmurHash3's 32-bit finaliser (a bijection of 32-bit words) and ``s1, s2``
mixed from the seed and the step; the ``k`` largest keys are kept. Only
integer tensor ops, every product below ``2**48``: exact and identical on
every device and backend.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import optree
import torch

from functopk._checks import (
    check_bool,
    check_int,
    check_k_or_density,
    check_leaves,
    check_scalar_tensor,
    one_device,
)
from functopk.base import GradientTransformation, recorded
from functopk.build import leafwise
from functopk.sparse.k import resolve_k
from functopk.tree.layout import FlatLayout
from functopk.tree.maths import PyTree

__all__ = ["RandKState", "randk", "randk_keys", "randk_mask"]

_M32 = 0xFFFFFFFF
_MAX_RANDK_NUMEL = 1 << 32


# --------------------------------------------------------------------------- the counter-based hash


def _check_step(step: Any) -> torch.Tensor | int:
    if isinstance(step, torch.Tensor):
        return check_scalar_tensor(step, "step", kind="int", expected="an int or a 0-d integer tensor").to(torch.int64)
    return check_int(step, "step", minimum=0, below=1 << 63)


def _check_seed(seed: Any) -> int:
    return check_int(seed, "seed", minimum=0, below=1 << 64)


def _mul32(x: Any, c: int) -> Any:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` held in int64, without overflowing int64.

    ``c`` is split into 16-bit halves so every intermediate product stays below
    ``2**48``: the result is exact and identical on every device and backend
    (signed overflow is never relied on). Works on Python ints and int64 tensors.
    """
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Any) -> Any:
    """MurmurHash3's 32-bit finaliser: a bijection of ``[0, 2**32)`` with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _seed_key(seed: int) -> int:
    return _fmix32(_fmix32((seed >> 32) ^ 0x9E3779B9) ^ (seed & _M32))


def randk_keys(numel: int, seed: int, step: torch.Tensor | int, device: torch.device | None = None) -> torch.Tensor:
    """The pseudo-random key of each flat index: ``numel`` distinct int64 values in ``[0, 2**32)``.

    ``key(i) = F(F(i ^ s1) ^ s2)`` with ``F`` the MurmurHash3 finaliser and
    ``s1, s2`` mixed from ``(seed, step)``. ``F`` is a bijection of 32-bit
    words, so the keys of distinct indices are distinct and the ``k`` largest
    form a unique set, whichever ``torch.topk`` kernel picks them. Only integer
    tensor ops: no RNG state, no host sync, static shapes.

    Args:
        numel: How many keys (flat indices ``0 .. numel - 1``).
        seed: An int in ``[0, 2**64)``.
        step: The step: an int in ``[0, 2**63)`` or a 0-d integer tensor.
        device: Where the keys are made (default: the step tensor's device, else CPU).

    Example:
        >>> from functopk.compress.randk import randk_keys
        >>> keys = randk_keys(5, seed=0, step=0)
        >>> keys.dtype, keys.unique().numel()
        (torch.int64, 5)
    """
    seed = _check_seed(seed)
    step = _check_step(step)
    if isinstance(step, torch.Tensor):
        device = step.device if device is None else device
        step = step.to(device)
    else:
        step = torch.tensor(step, dtype=torch.int64, device=device)
    s1 = _fmix32(_fmix32((step & _M32) ^ _seed_key(seed)) ^ ((step >> 32) & _M32))
    s2 = _fmix32(s1 ^ 0x7F4A7C15)
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    return _fmix32(_fmix32(idx ^ s1) ^ s2)


def _flat_mask(layout: FlatLayout, k: int, seed: int, step: torch.Tensor | int, device: torch.device) -> list[Any]:
    """The selection of ``k`` of the layout's coordinates, cut into per-leaf boolean views."""
    chosen = torch.topk(randk_keys(layout.numel, seed, step, device), k, sorted=False).indices
    return layout.split(torch.zeros(layout.numel, dtype=torch.bool, device=device).index_fill(0, chosen, True))


def _check_numel(leaves: list[torch.Tensor], name: str) -> int:
    """The number of coordinates of ``leaves``, at most ``2**32`` (``ValueError``)."""
    numel = sum(x.numel() for x in leaves)
    if numel >= _MAX_RANDK_NUMEL:
        raise ValueError(f"randk hashes 32-bit flat indices; {name} has {numel} >= 2**32 coordinates")
    return numel


def _layout(tree: PyTree, name: str) -> tuple[list[torch.Tensor], FlatLayout, torch.device]:
    """The float leaves of ``tree``, its layout and its one device; at most ``2**32`` coordinates."""
    leaves, _ = check_leaves(tree, name, floating=True)
    _check_numel(leaves, name)
    return leaves, FlatLayout.from_tree(tree), one_device(leaves, name)


def randk_mask(tree: PyTree, k: int, *, seed: int, step: torch.Tensor | int) -> PyTree:
    """Boolean tree marking ``k`` coordinates chosen by a hash of ``(seed, step, flat index)``.

    The choice depends on nothing else: not on the values of ``tree``, not on any
    global random state, not on the device. Two processes (data-parallel ranks)
    with the same ``seed``, ``step`` and layout (the tree structure and leaf
    sizes, which fix the flat indices) select the same coordinates. Exactly ``k``
    are selected: the ``k`` flat indices with the largest :func:`randk_keys`.

    Args:
        tree: A pytree of floating-point tensors on one device (only the layout is read).
        k: How many coordinates to select, ``1 <= k <= numel``.
        seed: An int in ``[0, 2**64)``.
        step: The step number: an int or a 0-d integer tensor (no host sync).

    Example:
        >>> import torch, functopk as ft
        >>> tree = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
        >>> m0 = ft.compress.randk_mask(tree, 2, seed=7, step=0)
        >>> sum(int(m.sum()) for m in ft.tree.leaves(m0))
        2
        >>> m1 = ft.compress.randk_mask(tree, 2, seed=7, step=0)
        >>> all(torch.equal(a, b) for a, b in zip(ft.tree.leaves(m0), ft.tree.leaves(m1)))
        True
    """
    _, layout, device = _layout(tree, "tree")
    count = cast(int, resolve_k(check_int(k, "k", minimum=1), None, layout.numel, name="tree"))
    pieces = _flat_mask(layout, count, _check_seed(seed), _check_step(step), device)
    return optree.tree_unflatten(layout.treedef, pieces)


class RandKState(NamedTuple):
    """State of :func:`randk`: the step counter that, with the seed, fixes the selection.

    Example:
        >>> import torch, functopk as ft
        >>> ft.randk(1, seed=3).init({"w": torch.zeros(4)})
        RandKState(count=tensor(0))
    """

    count: torch.Tensor  # type: ignore[assignment]


@recorded
def randk(
    k: int | None = None, *, density: float | None = None, seed: int = 0, unbiased: bool = False
) -> GradientTransformation:
    """Random-k sparsification: keep ``k`` pseudo-random coordinates of the whole tree.

    At step ``t`` (the counter in :class:`RandKState`) the kept coordinates are
    ``randk_mask(updates, k, seed=seed, step=t)``: a function of ``(seed, t,
    layout)`` only, so data-parallel ranks agree without communicating indices,
    and a compiled step neither syncs nor recompiles (integer hashing and one
    ``torch.topk`` over the ``n`` keys: static shapes, ``fullgraph=True``).
    The cost is one pass of integer hashing plus a top-k over ``n`` keys, about
    the cost of :func:`functopk.topk`'s selection; the values are never read.

    Every coordinate is kept with probability ``k / n`` at each step (``n`` the
    number of coordinates). With ``unbiased=True`` kept values are multiplied by
    ``n / k``, making the compressor unbiased, ``E[randk(x)] = x``, at the price
    of a variance of ``(n/k - 1) * |x|**2`` (Wangni et al. 2018). Leave it off
    under :func:`functopk.error_feedback`, which corrects the bias itself and
    would otherwise store ``(1 - n/k) * x`` as residual (Stich et al. 2018 use
    the unscaled form with memory).

    NaN and Inf are not looked at: they pass where selected and are dropped
    where not. ``params`` are neither needed nor read (nor checked) by
    ``update``, as for :func:`functopk.topk`; at ``init`` they are checked,
    when given, against ``k``.

    Args:
        k: Coordinates kept per step (an int).
        density: Fraction of coordinates kept per step, in ``(0, 1]`` (``k_from_density``).
        seed: An int in ``[0, 2**64)``; ranks must share it.
        unbiased: Scale kept values by ``n / k``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.randk(2, seed=0)
        >>> state = tx.init({"w": torch.zeros(6)})
        >>> out, state = tx.update({"w": torch.arange(1.0, 7.0)}, state)
        >>> int((out["w"] != 0).sum()), int(state.count)
        (2, 1)
    """
    k, density = check_k_or_density(k, density, allow_tensor=False)
    seed = _check_seed(seed)
    check_bool(unbiased, "unbiased")

    def validate(leaves: list[torch.Tensor], treedef: optree.PyTreeSpec, name: str) -> None:
        numel = _check_numel(leaves, name)
        if name == "params":  # k must fit the parameters; at update, resolve_k below checks it
            resolve_k(k, density, numel, name=name)

    def update(grads: list[torch.Tensor], state: RandKState, params: list[torch.Tensor] | None) -> tuple[
        list[torch.Tensor], RandKState
    ]:
        layout = FlatLayout.from_tree(grads)
        device = grads[0].device if grads else torch.device("cpu")
        kk = cast(int, resolve_k(k, density, layout.numel))  # an int: k and density are numbers here
        mask = _flat_mask(layout, kk, seed, state.count.to(device), device)
        scale = layout.numel / kk
        return [torch.where(m, x * scale if unbiased else x, 0.0) for m, x in zip(mask, grads)], state

    return leafwise(
        "randk", update, state=RandKState, counted=True, same_device=True, validate=validate
    )
