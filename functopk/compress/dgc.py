"""Deep Gradient Compression (Lin et al. 2018), as composable pieces and an alias.

DGC trains with 99.9% of each step's gradient held back, without losing
accuracy, by four techniques on top of top-k with a local residual:

1. **Momentum correction**: accumulate the *momentum* (velocity), not the raw
   gradient, in the residual, so that the coordinates finally sent carry the
   momentum they would have had in dense momentum SGD.
   With ``u`` the velocity and ``v`` the residual (the paper's symbols)::

       u = m * u + g              (Nesterov: u = m * u + g; delta = g + m * u)
       v = v + u                  (or v + delta)
       sent = sparsify(v)

2. **Momentum factor masking**: at the coordinates just sent, zero both ``u``
   and ``v``. The residual was spent; the velocity there is stale (it pushed a
   delayed update once already) and would overshoot if kept.
3. **Local gradient clipping** before the accumulation, with the threshold
   scaled by ``N**-0.5`` for ``N`` workers (each adds ``1/N`` of the gradient
   variance): :func:`dgc_local_clipping`.
4. **Warm-up**: a learning-rate warm-up and an exponentially falling density in
   the first epochs: :func:`functopk.dgc_density_warmup`.

:func:`momentum_correction` does 1 and 2 around any sparsifier; :func:`dgc`
chains clipping, momentum correction around ``topk`` (global, or per leaf with
small leaves dense as in the reference implementation), the reference's local
weight decay, and the learning rate.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import check_same_structure
from functopk._checks import path_str as _path_str
from functopk.base import (
    GradientTransformation,
    OptState,
    Params,
    ScalarOrSchedule,
    Updates,
    check_transformation,
    stateless,
)
from functopk.combine import chain
from functopk.compress.sparsifiers import _method_kwargs, float_leaves, layerwise_topk
from functopk.compress.topk import topk
from functopk.optim.elementary import check_hyperparam, scale_by_learning_rate
from functopk.tree.foreach import keep_dtypes
from functopk.tree.maths import PyTree
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = ["LocalWeightDecayState", "MomentumCorrectionState", "dgc", "dgc_local_clipping", "momentum_correction"]


def _axpy(a: list[torch.Tensor], scalar: float | torch.Tensor, b: list[torch.Tensor]) -> list[torch.Tensor]:
    """``a + scalar * b`` over lists of tensors, without a host sync for a tensor scalar."""
    if isinstance(scalar, torch.Tensor):
        return list(torch._foreach_add(a, torch._foreach_mul(b, scalar)))
    return list(torch._foreach_add(a, b, alpha=scalar))


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_min_size(min_size: Any) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral):
        raise TypeError(f"min_size must be an int, got {type(min_size).__name__} {min_size!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    return int(min_size)


# --------------------------------------------------------------------------- momentum correction + masking


class MomentumCorrectionState(NamedTuple):
    """State of :func:`momentum_correction`.

    Attributes:
        velocity: The momentum buffer ``u`` (the paper's "velocity"), a tree like the parameters.
        residual: The accumulated, not yet sent velocity ``v``; zero on dense leaves.
        inner_state: The state of the sparsifier.
    """

    velocity: PyTree
    residual: PyTree
    inner_state: OptState


def momentum_correction(
    inner: GradientTransformation,
    momentum: float | torch.Tensor,
    *,
    nesterov: bool = False,
    masking: bool = True,
    min_size: int = 0,
) -> GradientTransformation:
    """DGC's momentum correction and momentum factor masking around a sparsifier.

    For each leaf of at least ``min_size`` coordinates::

        u = momentum * u + g;  delta = g + momentum * u if nesterov else u
        v = v + delta
        sent = inner(v)
        v = where(sent != 0, 0, v);  u = where(sent != 0, 0, u) if masking

    and ``sent`` is the output (scale it by the learning rate afterwards). The
    coordinates "sent" are those where ``inner``'s output is non-zero (a
    coordinate sent with value 0 carries nothing; NaN counts as sent). At every
    sent coordinate the residual, and with ``masking`` the velocity, are exactly
    zero after the update; everywhere else they hold ``v`` and ``u``. Use a
    sparsifier that copies the values it keeps (``topk``, ``layerwise_topk``,
    ``threshold``, ``randk`` without ``unbiased``): the residual is zeroed, not
    reduced by the sent value.

    Leaves with fewer than ``min_size`` coordinates are not compressed: they get
    plain momentum SGD (``delta`` is their output, as ``ft.trace`` computes it),
    their residual stays zero, and ``inner`` sees ``None`` in their place (so a
    global ``topk(density=d)`` then takes ``d`` of the compressed coordinates
    only). This is how the DGC reference treats 1-d parameters. With
    ``min_size=0`` (default) every leaf goes through ``inner``.

    With ``inner`` sending everything and ``masking=False`` this is exactly
    momentum SGD (``torch.optim.SGD``); with ``masking=True`` and everything
    sent, the velocity restarts every step (plain SGD).

    Args:
        inner: The sparsifier, e.g. ``ft.topk(density=0.001)``.
        momentum: The momentum coefficient ``m >= 0`` (a number or a 0-d tensor).
        nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)``.
        masking: Zero the velocity at sent coordinates (momentum factor masking).
        min_size: Leaves with fewer coordinates stay dense with plain momentum.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.momentum_correction(ft.topk(1), momentum=0.5)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> sent, state = tx.update({"w": torch.tensor([2.0, 1.0])}, state)
        >>> sent["w"], state.velocity["w"], state.residual["w"]
        (tensor([2., 0.]), tensor([0., 1.]), tensor([0., 1.]))
        >>> sent, state = tx.update({"w": torch.tensor([0.0, 1.0])}, state)
        >>> sent["w"]   # v = 1 + (0.5 * 1 + 1) = 2.5 wins over 0
        tensor([0.0000, 2.5000])
    """
    check_transformation(inner, "inner")
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0)
    nesterov = _check_bool(nesterov, "nesterov")
    masking = _check_bool(masking, "masking")
    min_size = _check_min_size(min_size)

    def compressed_flags(leaves: list[torch.Tensor]) -> list[bool]:
        return [leaf.numel() >= min_size for leaf in leaves]

    def inner_tree(treedef: optree.PyTreeSpec, leaves: list[torch.Tensor], flags: list[bool]) -> PyTree:
        if all(flags):
            return optree.tree_unflatten(treedef, leaves)
        return optree.tree_unflatten(treedef, [x if f else None for x, f in zip(leaves, flags)])

    def init(params: Params) -> MomentumCorrectionState:
        if params is None:
            raise ValueError("momentum_correction needs the parameters at init: they shape its buffers")
        leaves, treedef = float_leaves(params, "params")
        flags = compressed_flags(leaves)
        if leaves and not any(flags):
            raise ValueError(f"min_size={min_size} leaves no leaf to compress (the largest has "
                             f"{max(x.numel() for x in leaves)} coordinates)")
        return MomentumCorrectionState(
            velocity=tree_zeros_like(params),
            residual=tree_zeros_like(params),
            inner_state=inner.init(inner_tree(treedef, leaves, flags)),
        )

    def update(
        updates: Updates, state: MomentumCorrectionState, params: Params | None = None
    ) -> tuple[Updates, MomentumCorrectionState]:
        if not isinstance(state, MomentumCorrectionState):
            raise ValueError(f"state must be a MomentumCorrectionState, got {type(state).__name__}")
        check_same_structure(state.velocity, updates, name="updates", expected_name="the velocity state")
        g, treedef = float_leaves(updates, "updates")
        u = optree.tree_leaves(state.velocity)
        v = optree.tree_leaves(state.residual)
        for path, x, y in zip(treedef.paths(), g, u):
            if x.shape != y.shape:
                raise ValueError(f"updates leaf at {_path_str(path)} has shape {tuple(x.shape)}, but the velocity "
                                 f"state has shape {tuple(y.shape)}")
        if not g:
            return updates, state
        flags = compressed_flags(g)
        u_new = keep_dtypes(_axpy(g, momentum, u), u)
        delta = keep_dtypes(_axpy(g, momentum, u_new), g) if nesterov else u_new
        v_acc = keep_dtypes(torch._foreach_add(v, delta), v)
        if params is None or all(flags):
            inner_params = params
        else:
            inner_params = inner_tree(treedef, optree.tree_leaves(params), flags)
        sent_tree, inner_state = inner.update(inner_tree(treedef, v_acc, flags), state.inner_state, inner_params)
        sent_c = optree.tree_leaves(sent_tree)
        if len(sent_c) != sum(flags):
            raise ValueError(
                f"the inner transformation returned {len(sent_c)} leaves for {sum(flags)} compressed leaves; "
                "momentum_correction needs a dense tree like its input"
            )
        sent_iter = iter(sent_c)
        out, v_out, u_out = [], [], []
        for path, f, gi, ui, di, v_old, vi in zip(treedef.paths(), flags, g, u_new, delta, v, v_acc):
            if not f:  # a dense leaf: plain momentum, its residual stays zero
                out.append(di)
                v_out.append(v_old)
                u_out.append(ui)
                continue
            si = next(sent_iter)
            if si.shape != gi.shape:
                raise ValueError(f"the inner transformation returned shape {tuple(si.shape)} at {_path_str(path)} "
                                 f"for a leaf of shape {tuple(gi.shape)}; it must return a dense tree like its input")
            sent_mask = si != 0
            out.append(si)
            v_out.append(torch.where(sent_mask, 0.0, vi))
            u_out.append(torch.where(sent_mask, 0.0, ui) if masking else ui)
        new_state = MomentumCorrectionState(
            velocity=optree.tree_unflatten(treedef, u_out),
            residual=optree.tree_unflatten(treedef, v_out),
            inner_state=inner_state,
        )
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- local gradient clipping


def dgc_local_clipping(
    max_norm: float | torch.Tensor, *, num_workers: int = 1, per_leaf: bool = True
) -> GradientTransformation:
    """DGC's local gradient clipping: rescale so the L2 norm is at most ``max_norm / sqrt(num_workers)``.

    Applied to each worker's own gradient before it is accumulated into the
    residual (before :func:`momentum_correction`). With ``N`` workers the summed
    gradient's variance is ``N`` times a worker's, so each worker clips at
    ``max_norm * N**-0.5`` (Lin et al. 2018, section 3.2).

    ``per_leaf=True`` clips each leaf by its own norm, as the reference
    implementation does per tensor; ``per_leaf=False`` clips the whole tree by
    its global norm, as the paper's text describes. Either way a leaf (or tree)
    whose norm is at most the threshold is returned bit for bit, and otherwise
    it is multiplied by ``threshold / (norm + 1e-6)``, so its norm ends
    below the threshold. Norms are computed in float32 or wider.

    Stateless; static shapes; no host sync. A NaN in a leaf makes its norm NaN
    and the whole leaf (``per_leaf``) or tree (global) NaN; an infinite norm
    gives a factor 0, so ``±inf`` coordinates become NaN and the others 0.

    Args:
        max_norm: The clipping threshold for the summed gradient of all workers, ``> 0``.
        num_workers: ``N``, the number of data-parallel workers, ``>= 1``.
        per_leaf: Clip each leaf separately (default) or the whole tree.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.dgc_local_clipping(2.0, num_workers=4)    # threshold 2 / sqrt(4) = 1
        >>> out = tx.update({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.5])}, tx.init(None))[0]
        >>> out["a"], out["b"]
        (tensor([0.6000, 0.8000]), tensor([0.5000]))
    """
    max_norm = check_hyperparam(max_norm, "max_norm")
    if not isinstance(max_norm, torch.Tensor) and max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    per_leaf = _check_bool(per_leaf, "per_leaf")
    scale = 1.0 / math.sqrt(num_workers)

    def fn(updates: Updates, params: Params | None) -> Updates:
        del params
        leaves, treedef = float_leaves(updates, "updates")
        if not leaves:
            return updates
        thr = max_norm * scale
        norms = list(torch._foreach_norm(leaves, 2, dtype=_norm_dtype(leaves)))
        if per_leaf:
            factors = torch._foreach_clamp_max(
                torch._foreach_mul(torch._foreach_reciprocal(torch._foreach_add(norms, 1e-6)), thr), 1.0
            )
            out = torch._foreach_mul(leaves, list(factors))
        else:
            total = torch.linalg.vector_norm(torch.stack(norms))
            factor = torch.clamp_max(thr / (total + 1e-6), 1.0)
            out = torch._foreach_mul(leaves, factor)
        return optree.tree_unflatten(treedef, keep_dtypes(out, leaves))

    return stateless(fn)


def _norm_dtype(leaves: list[torch.Tensor]) -> torch.dtype:
    dtype = torch.float32
    for leaf in leaves:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return dtype


# --------------------------------------------------------------------------- the reference's local weight decay


class LocalWeightDecayState(NamedTuple):
    """State of DGC's local weight decay: a momentum buffer for the decay term."""

    trace: PyTree


def _local_weight_decay(
    weight_decay: float | torch.Tensor, momentum: float | torch.Tensor, nesterov: bool
) -> GradientTransformation:
    """Add ``trace(weight_decay * params)`` to the (already sparsified) updates.

    The DGC reference (``DGCSGD``) applies weight decay on every rank locally,
    dense, with its own momentum buffer, and compresses only the loss gradient:
    the decay term is known to every rank, so it need not be communicated.
    """

    def init(params: Params) -> LocalWeightDecayState:
        return LocalWeightDecayState(trace=tree_zeros_like(params))

    def update(
        updates: Updates, state: LocalWeightDecayState, params: Params | None = None
    ) -> tuple[Updates, LocalWeightDecayState]:
        if params is None:
            raise ValueError("dgc with weight_decay > 0 needs params in update")
        leaves, treedef = optree.tree_flatten(updates)
        buf = optree.tree_leaves(state.trace)
        p = optree.tree_leaves(params)
        if len(p) != len(leaves):
            raise ValueError("params and updates must have the same structure")
        if not leaves:
            return updates, state
        decay = torch._foreach_mul(p, weight_decay)
        new_buf = keep_dtypes(_axpy(list(decay), momentum, buf), buf)
        term = _axpy(list(decay), momentum, new_buf) if nesterov else new_buf
        out = keep_dtypes(torch._foreach_add(leaves, term), leaves)
        return optree.tree_unflatten(treedef, out), LocalWeightDecayState(optree.tree_unflatten(treedef, new_buf))

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- the alias


def dgc(
    learning_rate: ScalarOrSchedule,
    momentum: float | torch.Tensor = 0.9,
    density: float | Any = 0.001,
    *,
    nesterov: bool = False,
    max_norm: float | torch.Tensor | None = None,
    num_workers: int = 1,
    weight_decay: float | torch.Tensor = 0.0,
    layerwise: bool = False,
    min_size: int = 0,
    masking: bool = True,
    method: str | None = None,
) -> GradientTransformation:
    """Deep Gradient Compression (Lin et al. 2018) as one optimizer.

    ``chain(dgc_local_clipping(max_norm, num_workers)`` (when ``max_norm`` is
    given) ``, momentum_correction(sparsifier, momentum, nesterov, masking,
    min_size), local weight decay`` (when ``weight_decay > 0``) ``,
    scale_by_learning_rate(learning_rate))``, where the sparsifier is the global
    ``ft.topk(density=density)`` or, with ``layerwise=True``, the reference's
    per-tensor ``ft.layerwise_topk(density=density, min_size=0)``.

    The reference implementation keeps 1-d parameters out of the compression
    (plain momentum SGD for them); ``min_size=4096`` does the same for every
    bias and normalisation weight of torchvision's ResNets. Weight decay, when
    given, follows the reference too: added locally and densely with its own
    momentum buffer, after the sparsification, since every rank can compute it.

    ``density`` may be a schedule of the step (DGC's warm-up:
    :func:`functopk.dgc_density_warmup`) where ``ft.topk`` accepts one; each
    change of density changes ``k`` and therefore the selection's shapes.

    Args:
        learning_rate: A number or a schedule ``step -> lr``.
        momentum: Momentum coefficient ``>= 0``.
        density: Fraction of (compressed) coordinates sent per step, or a schedule of it.
        nesterov: Nesterov momentum.
        max_norm: Local gradient clipping threshold for the sum over workers; ``None``: no clipping.
        num_workers: Number of data-parallel workers ``N`` (the clipping threshold is ``max_norm / sqrt(N)``).
        weight_decay: L2 coefficient ``>= 0``, applied densely and locally.
        layerwise: Select per leaf (reference) instead of globally.
        min_size: Leaves with fewer coordinates are not compressed.
        masking: Momentum factor masking.
        method: The top-k selection method passed to ``ft.topk`` / ``ft.layerwise_topk``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.dgc(0.1, momentum=0.9, density=0.5)
        >>> params = {"w": torch.zeros(4)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0, 0.5, 3.0])}, state, params)
        >>> updates["w"]
        tensor([-0.0000,  0.2000, -0.0000, -0.3000])
    """
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    layerwise = _check_bool(layerwise, "layerwise")
    nesterov = _check_bool(nesterov, "nesterov")
    method_kw = _method_kwargs(method)
    if layerwise:
        sparsifier = layerwise_topk(density=density, min_size=0, method=method)
    else:
        sparsifier = topk(density=density, **method_kw)
    parts = []
    if max_norm is not None:
        parts.append(dgc_local_clipping(max_norm, num_workers=num_workers))
    elif isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    parts.append(momentum_correction(sparsifier, momentum, nesterov=nesterov, masking=masking, min_size=min_size))
    if isinstance(weight_decay, torch.Tensor) or weight_decay > 0:
        parts.append(_local_weight_decay(weight_decay, momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)
