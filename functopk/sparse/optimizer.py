"""Optimizer state for the selected coordinates only: :func:`sparse_optimizer`.

A coordinate-wise optimizer (SGD with momentum, Adam, AdamW, RMSprop, ...)
treats every coordinate alone: its state and its update at one coordinate
depend on that coordinate's gradient, parameter and step count, and on nothing
else. So it can run on a vector of ``k`` gathered coordinates, with state of
size ``k``, and give exactly the updates the dense optimizer would give those
coordinates if they had been its only parameters since they were chosen.

:func:`sparse_optimizer` keeps a coordinate set ``S`` (``k`` ascending flat
indices into the parameters) and the inner optimizer's state for ``S`` only.
Each step gathers the gradient (and the parameters, for weight decay) at
``S``, runs the inner update on those ``k`` values, and returns a
:class:`~functopk.SparseUpdates` for :func:`~functopk.apply_sparse_updates`.
On a refresh step ``S`` is chosen again, as the exact global top-``k`` of a
score; coordinates that stay keep their state, new ones start from the inner
optimizer's initial state, and dropped ones keep their trained values.

**Per-coordinate step counts.** The inner state's scalars (the step ``count``
that Adam's bias corrections and SGD's first-step rule read, NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``) are kept per coordinate, as a
``k``-vector, so a coordinate chosen at step 100 gets the bias correction of
its own first step, not of step 100. The foreach maths broadcasts such a
vector (:func:`functopk.tree.foreach.per_leaf`). This is also why a schedule
inside the inner optimizer is refused: it would be evaluated at each
coordinate's own count. The state's form and what ``update`` checks of it
are in :mod:`functopk.sparse.opt_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import (
    check_bool,
    check_choice,
    check_k_or_density,
    check_leaves,
    check_like,
    one_device,
    require_params,
)
from functopk._compat import replace
from functopk.base import GradientTransformation, Recorded
from functopk.sparse.api import topk_indices
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.kernels.base import common_dtype
from functopk.sparse.opt_state import (
    SparseOptState,
    check_sparse_state,
    index_dtype,
    per_coordinate,
    reads_on_host,
    remap,
    stored,
    working,
)
from functopk.sparse.updates import SparseUpdates, check_update_of
from functopk.tree import foreach
from functopk.tree.layout import FlatLayout
from functopk.tree.maths import PyTree
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = ["SCORES", "SparseOptimizer", "sparse_optimizer", "trusted_sparse_optimizer"]

SCORES = ("gradient", "accumulated")

# Factories whose transformations treat each coordinate alone (their state and update at a
# coordinate depend only on that coordinate): the ones that may run on gathered coordinates.
COORDINATEWISE = frozenset(
    "adadelta adagrad adam adamax adamw add_decayed_weights asgd chain clip identity lion nadam named_chain "
    "radam rmsprop rprop scale scale_by_adam scale_by_learning_rate scale_by_lion scale_by_rms scale_by_rss "
    "sgd trace zero_nans".split()
)
# The same among the torch.optim classes ``ft.from_torch`` takes (not Adafactor or Muon).
TORCH_COORDINATEWISE = frozenset("ASGD Adadelta Adagrad Adam AdamW Adamax NAdam RAdam RMSprop Rprop SGD".split())


class SparseOptimizer(NamedTuple):
    """An optimizer over ``k`` coordinates of a tree (made by :func:`sparse_optimizer`).

    ``init(params) -> SparseOptState`` and
    ``update(grads, state, params, *, refresh) -> (SparseUpdates, SparseOptState)``;
    apply the updates with :func:`functopk.apply_sparse_updates` (or ``_`` in place).

    Example:
        >>> import torch, functopk as ft
        >>> opt = ft.sparse.sparse_optimizer(ft.sgd(1.0), k=1)
        >>> params = {"w": torch.zeros(3)}
        >>> updates, _ = opt.update({"w": torch.tensor([1.0, -2.0, 0.5])}, opt.init(params), params, refresh=True)
        >>> updates
        SparseUpdates(indices=tensor([1]), values=tensor([2.]), numel=3)
    """

    init: Callable[[PyTree], SparseOptState]
    update: Callable[..., tuple[SparseUpdates, SparseOptState]]


def check_coordinatewise(tx: Any, name: str = "inner") -> None:
    """``TypeError`` unless ``tx`` is a transformation; ``ValueError`` if it is known not to be coordinate-wise.

    Walks the recipe of a recorded transformation (and of the transformations
    it was built from, as ``chain`` is): a factory outside
    :data:`COORDINATEWISE` (LAMB's trust ratio, Adafactor's factored moments,
    Muon's orthogonalization, ``clip_by_global_norm``, a compressor) or a
    schedule argument is refused. A hand-built transformation cannot be looked
    into: it is taken to be coordinate-wise.
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"{name} must be a functopk GradientTransformation (e.g. ft.adamw(1e-3)), got {type(tx).__name__}"
        )
    recipe = tx.__dict__.get("recipe") if isinstance(tx, Recorded) else None
    if recipe is None:
        return
    factory, args, kwargs = recipe
    label = getattr(factory, "__name__", repr(factory))
    if label == "_injected":  # inject_hyperparams(factory)(*args, **kwargs): the factory decides
        factory, _, args = args
        label = getattr(factory, "__name__", repr(factory))
    if label == "from_torch":  # ft.from_torch(torch.optim.X, ...): the class decides
        label, args = args[0].__name__, args[1:]
        known = TORCH_COORDINATEWISE
    else:
        known = COORDINATEWISE
    if label not in known:
        raise ValueError(
            f"{name} is {tx!r}, which is not coordinate-wise ({label} looks at more than one coordinate at a time), "
            "so it cannot run on the selected coordinates alone; use an elementwise optimizer "
            f"({', '.join(sorted(known - {'chain', 'named_chain', 'identity'}))})"
        )
    for value in [*args, *kwargs.values()]:
        if isinstance(value, GradientTransformation):
            check_coordinatewise(value, name)
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GradientTransformation):
            check_coordinatewise(value[1], name)  # named_chain's (name, transformation) pairs
        elif callable(value):
            raise ValueError(
                f"{name} is {tx!r}, with a schedule: its state's step count is kept per coordinate, so the schedule "
                "would be evaluated at each coordinate's own count; use a 0-d tensor learning rate and change it "
                "in place between steps (lr.fill_(schedule(step)))"
            )


def gather(layout: FlatLayout, leaves: list[torch.Tensor], idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of ``leaves`` at the ascending flat indices ``idx``, in ``dtype``.

    Eager on CPU: the indices split by leaf on the host (one small read), one
    ``index_select`` per leaf. Compiled or off CPU: static shapes, no host
    sync: each leaf read at every index (clamped) and kept where the index is its.
    """
    if idx.device.type == "cpu" and not torch.compiler.is_compiling():
        parts = [
            x.reshape(-1).index_select(0, idx[lo:hi] - off).to(dtype)
            for x, (off, lo, hi) in zip(leaves, layout.bounds(idx))
            if hi > lo
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=idx.device)
    leaf_ids, positions = layout.locate(idx)
    out = torch.zeros(idx.shape, dtype=dtype, device=idx.device)
    for i, x in enumerate(leaves):
        if x.numel():
            vals = x.reshape(-1).index_select(0, positions.clamp(0, x.numel() - 1)).to(dtype)
            out = torch.where(leaf_ids == i, vals, out)
    return out


def _from_dense(
    grads: PyTree, state: SparseOptState, p_leaves: list[torch.Tensor], treedef: Any, refresh: bool, score: str
) -> tuple[torch.Tensor, torch.Tensor, PyTree | None]:
    """From dense gradients: the coordinate set, the gradient there (common dtype), and the new score."""
    g_leaves, g_def = check_leaves(grads, "grads", floating=True)
    check_like(grads, p_leaves, treedef, name="grads", expected_name="params")
    layout = FlatLayout.from_tree(p_leaves)
    k, dtype = state.indices.numel(), layout.common_dtype
    if score == "accumulated":
        total = foreach.add(optree.tree_leaves(state.score), foreach.abs(g_leaves))  # type: ignore[arg-type]
        if not refresh:
            return state.indices, gather(layout, g_leaves, state.indices, dtype), treedef.unflatten(total)
        idx = topk_indices(treedef.unflatten(total), k).indices
        return idx, gather(layout, g_leaves, idx, dtype), treedef.unflatten(foreach.zeros_like(total))
    if not refresh:
        return state.indices, gather(layout, g_leaves, state.indices, dtype), None
    sel = topk_indices(grads, k)
    return sel.indices, sel.values.to(dtype), None


def _from_sparse(
    grads: SparseUpdates, state: SparseOptState, params: PyTree, refresh: bool, score: str
) -> tuple[torch.Tensor, torch.Tensor, PyTree | None]:
    """From the gradient at given coordinates (a :class:`StreamingTopK`'s selection, or its gather)."""
    if score == "accumulated":
        raise ValueError(
            'score="accumulated" sums |g| over dense gradients, and a SparseUpdates holds only k of them: with a '
            'stream, let the stream sum them (StreamingTopK(..., score="accumulated")) and keep score="gradient" here'
        )
    leaves, _ = check_update_of(grads, params, "params")
    k = state.indices.numel()
    if grads.indices.numel() != k:
        raise ValueError(f"grads holds {grads.indices.numel()} coordinates, but this optimizer trains k={k}")
    if not refresh and reads_on_host(state.indices) and not torch.equal(grads.indices, state.indices):
        raise ValueError(
            "grads holds other coordinates than state.indices on a step without refresh: gather the gradient "
            "at state.indices, or pass refresh=True to make its coordinates the new set"
        )
    return grads.indices, grads.values.to(common_dtype(leaves)), state.score


class _Config(NamedTuple):
    inner: GradientTransformation
    k: int | None
    density: float | None
    score: str
    templates: dict[tuple[int, torch.dtype], Any]  # (k, dtype) -> the inner state's form, on the meta device

    def fresh(self, k: int, dtype: torch.dtype, device: torch.device | str) -> Any:
        """The inner state of ``k`` new coordinates: its initial state, one value per coordinate."""
        return per_coordinate(self.inner.init([torch.zeros(k, dtype=dtype, device=device)]), k, "inner")

    def template(self, k: int, dtype: torch.dtype) -> Any:
        """The inner state's structure, shapes and dtypes, without memory (built once for each ``k`` and dtype)."""
        if (k, dtype) not in self.templates:
            self.templates[k, dtype] = self.fresh(k, dtype, "meta")
        return self.templates[k, dtype]


def _init(cfg: _Config, params: PyTree) -> SparseOptState:
    leaves, _ = check_leaves(params, "params", floating=True)
    device = one_device(leaves, "params")
    n = sum(x.numel() for x in leaves)
    k = k_on_host(resolve_k(cfg.k, cfg.density, n, name="params"), n)
    count = torch.zeros((), dtype=torch.int64, device=device)
    scores = tree_zeros_like(params) if cfg.score == "accumulated" else None
    idx = torch.arange(k, device=device, dtype=index_dtype(n))
    return SparseOptState(count, idx, cfg.fresh(k, common_dtype(leaves), device), scores)


def _update(
    cfg: _Config, grads: PyTree | SparseUpdates, state: SparseOptState, params: PyTree, refresh: bool
) -> tuple[SparseUpdates, SparseOptState]:
    refresh = check_bool(refresh, "refresh")
    p_leaves, treedef = check_leaves(require_params(params, "sparse_optimizer"), "params", floating=True)
    n = sum(x.numel() for x in p_leaves)
    k = k_on_host(resolve_k(cfg.k, cfg.density, n, name="params"), n)
    template = cfg.template(k, common_dtype(p_leaves))
    state = check_sparse_state(state, k, template, cfg.score == "accumulated", p_leaves, treedef)
    kept_as = state.indices.dtype
    state = replace(state, indices=state.indices.long())  # int64, as SparseUpdates holds them (O(k))
    if isinstance(grads, SparseUpdates):
        idx, g, new_score = _from_sparse(grads, state, params, refresh, cfg.score)
    else:
        idx, g, new_score = _from_dense(grads, state, p_leaves, treedef, refresh, cfg.score)
    layout = FlatLayout.from_tree(p_leaves)
    inner = state.inner
    if refresh:
        inner = remap(state.indices, idx, inner, cfg.fresh(idx.numel(), g.dtype, g.device))
    u, inner = cfg.inner.update([g], working(inner), [gather(layout, p_leaves, idx, g.dtype)])
    sizes = tuple(x.numel() for x in p_leaves)
    new = SparseOptState(state.count + 1, idx.to(kept_as), stored(inner), new_score)
    return SparseUpdates(idx, u[0], layout.numel, sizes), new


def sparse_optimizer(
    inner: GradientTransformation, k: Any = None, *, density: Any = None, score: str = "gradient"
) -> SparseOptimizer:
    """A coordinate-wise optimizer run on ``k`` coordinates of the whole tree, with state of size ``k``.

    Trains a coordinate set ``S`` of ``k`` flat indices (in optree's flat order of
    the parameters: a dict's keys sorted, not ``named_parameters()`` order):
    each step runs ``inner`` on the gradient (and the parameters) gathered at ``S`` and returns
    the updates there as a :class:`~functopk.SparseUpdates`. ``update(...,
    refresh=True)`` first chooses ``S`` again: the exact global top-``k`` of
    ``|g|`` (``score="gradient"``, ties to the lower flat index, as
    :func:`~functopk.topk_indices`), or of ``|g|`` summed over the steps since
    the last refresh, this one included (``score="accumulated"``: an ``n``-sized
    sum in the state). Coordinates that stay keep their state; new ones start
    from ``inner``'s initial state with their own step count (so Adam's bias
    correction is that of their first step); dropped ones keep their trained
    values and lose their state. Refresh on the first step (before it ``S`` is
    the first ``k`` coordinates); ``refresh=(step % M == 0)`` keeps a set for
    ``M`` steps.

    Each coordinate of ``S`` gets exactly the updates ``inner`` would give it
    as its only parameter since it joined ``S`` (tested against one
    ``torch.optim`` optimizer per coordinate, in float64). Weight decay acts
    on the coordinates of ``S`` only. The state is ``indices`` (int32 while
    ``n < 2**31``) and one value per coordinate for each of ``inner``'s
    buffers and scalars (step counts as int32): 16 bytes per coordinate for
    AdamW in float32.

    ``update`` takes the dense gradients, or a :class:`~functopk.SparseUpdates`
    holding the gradient at ``k`` coordinates (the selection of a
    :class:`~functopk.sparse.StreamingTopK` on a refresh step; the gradient at
    ``state.indices`` otherwise). It is pure, and with dense gradients it
    compiles with ``torch.compile(fullgraph=True)`` (``refresh`` is a Python
    bool: one graph for each value). In eager mode on CPU the gathers read a
    few integers on the host, as :func:`~functopk.apply_sparse_updates` does.
    ``update`` checks the state it is given before any maths: everything that
    shows without reading values (``indices`` of shape ``(k,)`` for this ``k``,
    the inner state's structure, shapes and dtypes), and, where it reads the
    indices on the host anyway (eager on CPU), that they are ascending and in
    range (:mod:`functopk.sparse.opt_state`).

    Args:
        inner: A coordinate-wise transformation: ``ft.sgd``, ``ft.adam``,
            ``ft.adamw``, ``ft.rmsprop``, ``ft.adagrad``, ``ft.nadam``, ``ft.radam``,
            ``ft.adamax``, ``ft.adadelta``, ``ft.rprop``, ``ft.lion``, ``ft.from_torch``
            of their torch classes, ``ft.inject_hyperparams`` of one of them, or a
            ``chain`` of elementwise pieces. A learning rate that changes is a 0-d
            tensor changed in place, or an injected one (one value for all
            coordinates, kept through refreshes); a schedule would see each
            coordinate's own step count, so it is refused.
        k: How many coordinates to train (an int; give exactly one of ``k`` and ``density``).
        density: The fraction of the coordinates to train, in ``(0, 1]``.
        score: ``"gradient"`` or ``"accumulated"``: what a refresh ranks.

    Raises:
        TypeError: ``inner`` is not a transformation, or ``k``/``density``/``score`` has the wrong type.
        ValueError: ``inner`` is not coordinate-wise (LAMB, Adafactor, Muon,
            ``clip_by_global_norm``, a compressor) or holds a schedule, or ``score`` is unknown.

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.zeros(4)}
        >>> opt = ft.sparse.sparse_optimizer(ft.adam(0.1), k=2)
        >>> state = opt.init(params)
        >>> grads = {"w": torch.tensor([0.5, -3.0, 0.1, 2.0])}
        >>> updates, state = opt.update(grads, state, params, refresh=True)
        >>> updates.indices, state.inner.count
        (tensor([1, 3]), tensor([1, 1], dtype=torch.int32))
        >>> ft.apply_sparse_updates(params, updates)
        {'w': tensor([ 0.0000,  0.1000,  0.0000, -0.1000])}
    """
    check_coordinatewise(inner)
    return trusted_sparse_optimizer(inner, k, density=density, score=score)


def trusted_sparse_optimizer(
    inner: GradientTransformation, k: Any = None, *, density: Any = None, score: str = "gradient"
) -> SparseOptimizer:
    """:func:`sparse_optimizer` without looking into ``inner``: taken to be coordinate-wise.

    For a caller that knows it another way: ``ft.sparse_optimizer_from_torch``
    checks the ``torch.optim`` class, whose transformation chains pieces (a step
    counter) that are coordinate-wise but not recorded as such.

    Example:
        >>> import torch, functopk as ft
        >>> opt = trusted_sparse_optimizer(ft.from_torch(torch.optim.RMSprop, lr=0.1), k=1)
        >>> params = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([0.0, 2.0])}, opt.init(params), params, refresh=True)[0].indices
        tensor([1])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a functopk GradientTransformation, got {type(inner).__name__}")
    k_arg, density_arg = check_k_or_density(k, density, allow_tensor=False)
    cfg = _Config(inner, k_arg, density_arg, check_choice(score, "score", SCORES), {})

    def init(params: PyTree) -> SparseOptState:
        return _init(cfg, params)

    def update(
        grads: PyTree | SparseUpdates, state: SparseOptState, params: PyTree = None, *, refresh: bool
    ) -> tuple[SparseUpdates, SparseOptState]:
        return _update(cfg, grads, state, params, refresh)

    return SparseOptimizer(init, update)
