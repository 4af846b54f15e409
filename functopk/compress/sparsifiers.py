"""Gradient compressors beside global top-k: random-k, hard threshold, per-leaf top-k.

Each is a :class:`~functopk.GradientTransformation` that returns a tree like
its input, zero except at the coordinates it keeps ("sends"), so it composes
with :func:`functopk.error_feedback`, :func:`functopk.momentum_correction` and
the optimizers exactly as :func:`functopk.topk` does:

* :func:`randk` keeps ``k`` coordinates chosen pseudo-randomly from
  ``(seed, step, flat index)`` alone, with no global RNG state, so every
  data-parallel rank picks the same ones (Stich et al. 2018, "Sparsified SGD
  with memory"; Wangni et al. 2018 for the unbiased ``n/k`` scaling).
* :func:`threshold` keeps every coordinate with ``|x| >= v`` (Sahu et al.
  2021, "Rethinking gradient sparsification as total error minimization").
* :func:`layerwise_topk` keeps the top ``k`` (or a fraction) of *each leaf*,
  leaving small leaves dense, as the Deep Gradient Compression reference does
  for 1-d parameters (Lin et al. 2018).

Kept values are bit-exact copies of the input (``randk(unbiased=True)``
excepted, which scales them), so ``input - output`` is exactly the part that
was not sent.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import path_str as _path_str
from functopk.base import EmptyState, GradientTransformation, Params, Updates, stateless
from functopk.optim.elementary import check_hyperparam, init_count
from functopk.sparse.api import k_from_density, topk_sparsify
from functopk.tree.maths import PyTree

__all__ = ["RandKState", "layerwise_topk", "randk", "randk_mask", "threshold"]

_M32 = 0xFFFFFFFF
_MAX_RANDK_NUMEL = 1 << 32


# --------------------------------------------------------------------------- argument checks


def float_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree``; every leaf must be a floating-point tensor (``None`` nodes allowed)."""
    leaves, treedef = optree.tree_flatten(tree)
    for path, leaf in zip(treedef.paths(), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name} leaf at {_path_str(path)} is a {type(leaf).__name__}; expected a torch.Tensor")
        if not leaf.is_floating_point():
            raise TypeError(
                f"{name} leaf at {_path_str(path)} has dtype {leaf.dtype}; expected a floating-point tensor "
                "(integer, bool and complex tensors are not gradients)"
            )
    return leaves, treedef


def _one_device(leaves: list[torch.Tensor], name: str) -> torch.device:
    devices = {leaf.device for leaf in leaves}
    if len(devices) > 1:
        raise ValueError(f"{name} leaves are on several devices {sorted(map(str, devices))}; expected one device")
    return leaves[0].device if leaves else torch.device("cpu")


def check_k_or_density(k: Any, density: Any) -> tuple[int | None, float | None]:
    """Exactly one of ``k`` (an int >= 1) or ``density`` (a number in (0, 1])."""
    if (k is None) == (density is None):
        raise ValueError(f"give exactly one of k or density, got k={k!r} and density={density!r}")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return int(k), None
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a number in (0, 1], got {type(density).__name__} {density!r}")
    density = float(density)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return None, density


def _check_step(step: Any) -> torch.Tensor | int:
    if isinstance(step, torch.Tensor):
        if step.dim() != 0 or step.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"step must be an int or a 0-d integer tensor, got a {step.dtype} tensor of shape "
                            f"{tuple(step.shape)}")
        return step.to(torch.int64)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int or a 0-d integer tensor, got {type(step).__name__} {step!r}")
    if not 0 <= step < 1 << 63:
        raise ValueError(f"step must be in [0, 2**63), got {step}")
    return int(step)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


# --------------------------------------------------------------------------- counter-based hash


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


def _flat_randk_mask(numel: int, k: int, seed: int, step: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    keys = randk_keys(numel, seed, step, device)
    chosen = torch.topk(keys, k, sorted=False).indices
    return torch.zeros(numel, dtype=torch.bool, device=device).index_fill(0, chosen, True)


def _resolve_k(k: int | None, density: float | None, numel: int, name: str = "updates") -> int:
    if numel == 0:
        raise ValueError(f"{name} has no coordinates: there is nothing to select")
    if k is not None:
        if k > numel:
            raise ValueError(f"k={k} exceeds the number of coordinates in {name} ({numel})")
        return k
    return k_from_density(density, numel)


def _check_randk_numel(numel: int) -> None:
    if numel >= _MAX_RANDK_NUMEL:
        raise ValueError(f"randk hashes 32-bit flat indices; the tree has {numel} >= 2**32 coordinates")


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
    leaves, treedef = float_leaves(tree, "tree")
    device = _one_device(leaves, "tree")
    numel = sum(leaf.numel() for leaf in leaves)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = _resolve_k(int(k), None, numel, "tree")
    _check_randk_numel(numel)
    mask = _flat_randk_mask(numel, k, _check_seed(seed), _check_step(step), device)
    pieces = torch.split(mask, [leaf.numel() for leaf in leaves])
    return optree.tree_unflatten(treedef, [p.view(leaf.shape) for p, leaf in zip(pieces, leaves)])


class RandKState(NamedTuple):
    """State of :func:`randk`: the step counter that, with the seed, fixes the selection."""

    count: torch.Tensor


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
    where not.

    Args:
        k: Coordinates kept per step.
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
    k, density = check_k_or_density(k, density)
    seed = _check_seed(seed)
    if not isinstance(unbiased, bool):
        raise TypeError(f"unbiased must be a bool, got {type(unbiased).__name__}")

    def init(params: Params) -> RandKState:
        if params is not None:
            leaves, _ = float_leaves(params, "params")
            numel = sum(leaf.numel() for leaf in leaves)
            _resolve_k(k, density, numel, "params")
            _check_randk_numel(numel)
        return RandKState(count=init_count(params))

    def update(updates: Updates, state: RandKState, params: Params | None = None) -> tuple[Updates, RandKState]:
        del params
        if not isinstance(state, RandKState):
            raise ValueError(f"state must be a RandKState, got {type(state).__name__}")
        leaves, treedef = float_leaves(updates, "updates")
        device = _one_device(leaves, "updates")
        numel = sum(leaf.numel() for leaf in leaves)
        kk = _resolve_k(k, density, numel)
        _check_randk_numel(numel)
        mask = _flat_randk_mask(numel, kk, seed, state.count.to(device), device)
        pieces = torch.split(mask, [leaf.numel() for leaf in leaves])
        scale = numel / kk
        out = []
        for p, leaf in zip(pieces, leaves):
            kept = leaf * scale if unbiased else leaf
            out.append(torch.where(p.view(leaf.shape), kept, 0.0))
        return optree.tree_unflatten(treedef, out), RandKState(count=state.count + 1)

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- hard threshold


def threshold(v: float | torch.Tensor) -> GradientTransformation:
    """Hard-threshold sparsification: keep the coordinates with ``|x| >= v``, zero the rest.

    Sahu et al. 2021 ("Rethinking gradient sparsification as total error
    minimization") show that, under error feedback, a fixed threshold bounds the
    *total* error over training better than a fixed ``k`` does, and adapts the
    number of coordinates sent to the step. The count sent is therefore data
    dependent, but the output is a dense tree of the input's shape, so the
    transformation itself has static shapes and compiles with ``fullgraph=True``
    (a sparse exchange of the result would have a data-dependent size).

    ``|x|`` is compared with ``v`` converted to the leaf's dtype. ``v = 0`` keeps
    everything. NaN is kept (``|NaN| < v`` is false), like top-k, so it stays
    visible; ``±inf`` is kept.

    Args:
        v: The threshold, ``>= 0``: a number or a 0-d float tensor
            (so :func:`functopk.inject_hyperparams` can schedule it).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.threshold(1.0)
        >>> tx.update({"w": torch.tensor([0.5, -1.0, 2.0, -0.99])}, tx.init(None))[0]
        {'w': tensor([ 0., -1.,  2.,  0.])}
    """
    v = check_hyperparam(v, "v", minimum=0.0)

    def fn(updates: Updates, params: Params | None) -> Updates:
        del params
        leaves, treedef = float_leaves(updates, "updates")
        out = []
        for leaf in leaves:
            thr = v.to(device=leaf.device, dtype=leaf.dtype) if isinstance(v, torch.Tensor) else v
            out.append(torch.where(leaf.abs() < thr, 0.0, leaf))
        return optree.tree_unflatten(treedef, out)

    return stateless(fn)


# --------------------------------------------------------------------------- per-leaf top-k


def _method_kwargs(method: Any) -> dict[str, Any]:
    if method is None:
        return {}
    if not isinstance(method, str):
        raise TypeError(f"method must be a str or None, got {type(method).__name__} {method!r}")
    return {"method": method}


def layerwise_topk(
    k: int | None = None, *, density: float | None = None, min_size: int = 4096, method: str | None = None
) -> GradientTransformation:
    """Per-leaf top-k: keep the ``k`` largest ``|x|`` of *each* leaf (or a fraction of each).

    This is the selection of Deep Gradient Compression's reference
    implementation (Lin et al. 2018), which sparsifies every tensor separately,
    as opposed to :func:`functopk.topk`'s global selection across the whole
    model. Within a leaf the rules of global top-k hold (ties: lower index first;
    NaN ranks as an infinite magnitude; exactly ``k`` kept; kept values are the
    input's bits), since each leaf goes through :func:`functopk.topk_sparsify`.

    Leaves with fewer than ``min_size`` coordinates are passed through dense.
    The default, 4096, keeps every bias and normalisation weight of torchvision's
    ResNets (at most 2048 elements) and the fc bias dense, as the reference does
    for all 1-d parameters; at a density of 0.1% such a leaf would send 1 to 4
    coordinates, too few to be useful. Use ``min_size=0`` to sparsify every leaf.

    With ``k``, a leaf of at most ``k`` coordinates is kept whole. With
    ``density``, leaf ``i`` keeps ``k_from_density(density, numel_i)``.
    ``density`` must be a number: per-leaf ``k`` sets the shapes of per-leaf
    selections, so a scheduled density needs the global :func:`functopk.topk`.

    Args:
        k: Coordinates kept per leaf.
        density: Fraction of each leaf kept, in ``(0, 1]``.
        min_size: Leaves with fewer coordinates than this stay dense (``>= 0``).
        method: Passed to :func:`functopk.topk_sparsify` when given (e.g. ``"torch"``
            for the compile-friendly selection); ``None`` uses its default.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.layerwise_topk(1, min_size=3)
        >>> grads = {"w": torch.tensor([1.0, -5.0, 2.0]), "v": torch.tensor([4.0, 3.0, 0.5]),
        ...          "bias": torch.tensor([0.1, 0.2])}
        >>> tx.update(grads, tx.init(None))[0]
        {'w': tensor([ 0., -5.,  0.]), 'v': tensor([4., 0., 0.]), 'bias': tensor([0.1000, 0.2000])}
    """
    if callable(density):
        raise TypeError(
            "layerwise_topk needs a numeric density (per-leaf k sets shapes); a scheduled density needs the "
            "global functopk.topk"
        )
    k, density = check_k_or_density(k, density)
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral):
        raise TypeError(f"min_size must be an int, got {type(min_size).__name__} {min_size!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    method_kw = _method_kwargs(method)
    if method_kw:
        topk_sparsify(torch.zeros(1), 1, **method_kw)  # an unknown method fails now, not at the first update

    def leaf_k(numel: int) -> int:
        return min(k, numel) if k is not None else k_from_density(density, numel)

    def init(params: Params) -> EmptyState:
        if params is not None:
            float_leaves(params, "params")
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        leaves, treedef = float_leaves(updates, "updates")
        out = []
        for leaf in leaves:
            n = leaf.numel()
            if n == 0 or n < min_size:
                out.append(leaf)
            else:
                out.append(topk_sparsify(leaf, leaf_k(n), **method_kw))
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(init, update)

