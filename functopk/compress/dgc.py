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
   With a sparsifier that sends everything and no masking, 1 is exactly
   momentum SGD (``torch.optim.SGD``); with masking, the velocity restarts
   every step (plain SGD).
3. **Local gradient clipping** before the accumulation, with the threshold
   scaled by ``N**-0.5`` for ``N`` workers (each adds ``1/N`` of the gradient
   variance): :func:`dgc_local_clipping`.
4. **Warm-up**: a learning-rate warm-up and an exponentially falling density in
   the first epochs: :func:`functopk.dgc_density_warmup`.

:func:`momentum_correction` does 1 and 2 around any sparsifier, composed of
the existing pieces: :func:`functopk.trace` keeps the velocity ``u``,
:func:`functopk.error_feedback` keeps the residual ``v`` (``v += delta; sent =
inner(v); v -= sent``), :func:`functopk.masked` keeps leaves under ``min_size``
away from the sparsifier, and one small step clears ``v`` (and, masking, ``u``)
where ``sent != 0``. :func:`dgc` chains clipping, momentum correction around
``topk`` (global, or per leaf with small leaves dense as in the reference
implementation), the reference's local weight decay (a :func:`functopk.trace`
of ``weight_decay * params``), and the learning rate.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import (
    check_bool,
    check_hyperparam,
    check_int,
    check_leaves,
    check_like,
    is_zero,
    require_params,
)
from functopk._compat import replace
from functopk.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    ScalarOrSchedule,
    Updates,
    check_transformation,
    recorded,
)
from functopk.build import leafwise, wrapper
from functopk.combine import chain, masked
from functopk.compress.feedback import ErrorFeedbackState, error_feedback
from functopk.compress.layerwise import check_method, layerwise_topk
from functopk.compress.topk import topk
from functopk.optim import TraceState, clip_by_global_norm, scale_by_learning_rate, trace
from functopk.tree import foreach
from functopk.tree.maths import PyTree
from functopk.tree.maths import add as tree_add
from functopk.tree.maths import scale as tree_scale

__all__ = ["LocalWeightDecayState", "MomentumCorrectionState", "dgc", "dgc_local_clipping", "momentum_correction"]


# --------------------------------------------------------------------------- momentum correction + masking


class MomentumCorrectionState(NamedTuple):
    """State of :func:`momentum_correction`: the states of the two pieces it is made of.

    Attributes:
        trace: The state of ``ft.trace(momentum, nesterov=nesterov)``: the
            velocity ``u`` (the paper's symbol; ``trace.trace``, a tree like the
            parameters) and the step count.
        feedback: The state of ``ft.error_feedback(ft.masked(inner, large leaves))``:
            the residual ``v`` (``feedback.residual``, the accumulated velocity
            not yet sent; zero on leaves under ``min_size``) and the sparsifier's
            state (``feedback.inner_state.inner_state``).

    The properties ``velocity``, ``residual`` and ``inner_state`` read them.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.momentum_correction(ft.topk(1), momentum=0.9).init({"w": torch.zeros(2)})
        >>> state.velocity, state.residual
        ({'w': tensor([0., 0.])}, {'w': tensor([0., 0.])})
    """

    trace: TraceState
    feedback: ErrorFeedbackState

    @property
    def velocity(self) -> PyTree:
        """The momentum buffer ``u``, a tree like the parameters."""
        return self.trace.trace

    @property
    def residual(self) -> PyTree:
        """The accumulated, not yet sent velocity ``v``; zero on leaves under ``min_size``."""
        return self.feedback.residual

    @property
    def inner_state(self) -> OptState:
        """The sparsifier's state."""
        return self.feedback.inner_state.inner_state


def _clear_sent(
    state: MomentumCorrectionState, sent: Updates, compressed: list[bool], masking: bool
) -> MomentumCorrectionState:
    """Zero the residual where ``sent != 0`` and, with ``masking``, the velocity of compressed leaves there.

    Where a finite value was sent, error feedback's ``v - sent`` is already
    exactly 0 (kept values are copies); a sent NaN or infinity leaves NaN
    (``inf - inf``), which this clears, as the paper's rule ``v = 0`` says.
    """
    sent_leaves, treedef = optree.tree_flatten(sent)
    v = [torch.where(s != 0, 0.0, x) for s, x in zip(sent_leaves, optree.tree_leaves(state.feedback.residual))]
    u = optree.tree_leaves(state.trace.trace)
    if masking:
        u = [torch.where(s != 0, 0.0, x) if c else x for s, x, c in zip(sent_leaves, u, compressed)]
    return MomentumCorrectionState(
        trace=replace(state.trace, trace=optree.tree_unflatten(treedef, u)),
        feedback=replace(state.feedback, residual=optree.tree_unflatten(treedef, v)),
    )


def _check_min_size(params: Params, min_size: int) -> None:
    """``ValueError`` when no leaf of ``params`` has ``min_size`` coordinates (nothing would be compressed)."""
    leaves, _ = check_leaves(params, "params", floating=True)
    if leaves and all(x.numel() < min_size for x in leaves):
        raise ValueError(f"min_size={min_size} leaves no leaf to compress (the largest has "
                         f"{max(x.numel() for x in leaves)} coordinates)")


@recorded
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
    zero after the update; everywhere else they hold ``v`` and ``u`` (the pieces
    that keep them: :class:`MomentumCorrectionState`).

    Leaves under ``min_size`` coordinates (the DGC reference's 1-d parameters)
    get plain momentum SGD (``delta`` is their output), their residual stays
    zero, and ``inner`` sees ``None`` in their place (so a global
    ``topk(density=d)`` takes ``d`` of the compressed coordinates only).

    Args:
        inner: The sparsifier, e.g. ``ft.topk(density=0.001)``: one that copies the values it keeps
            (``topk``, ``layerwise_topk``, ``threshold``, ``randk`` without ``unbiased``), since the
            residual is zeroed where sent, not reduced by the sent value.
        momentum: The momentum coefficient, in ``[0, 1)`` (a number or a 0-d tensor, whose value is not checked).
        nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)``.
        masking: Zero the velocity at sent coordinates (momentum factor masking).
        min_size: Leaves with fewer coordinates stay dense with plain momentum.

    Raises:
        ValueError: ``momentum`` outside ``[0, 1)``; ``init`` without parameters, or with no leaf of ``min_size``
            coordinates; an update whose structure or leaf shapes differ from the state's (naming the leaf).
        TypeError: a state from another transformation; a gradient leaf that is not floating-point.

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
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0, below=1.0)  # (from 1 the velocity never decays)
    nesterov, masking = check_bool(nesterov, "nesterov"), check_bool(masking, "masking")
    min_size = check_int(min_size, "min_size", minimum=0)
    velocity = trace(momentum, nesterov=nesterov)  # the wrapped transformation; memory holds the sparsifier
    memory = error_feedback(masked(inner, lambda tree: optree.tree_map(lambda x: x.numel() >= min_size, tree)))

    def init(params: Params, trace_state: OptState) -> MomentumCorrectionState:
        _check_min_size(params, min_size)
        return MomentumCorrectionState(trace=trace_state, feedback=memory.init(params))

    def update(
        updates: Updates, state: MomentumCorrectionState, params: Params | None = None
    ) -> tuple[Updates, MomentumCorrectionState]:
        g, treedef = check_leaves(updates, "updates", floating=True)
        check_like(state.trace.trace, g, treedef, name="updates", expected_name="momentum_correction's velocity")
        if not g:
            return updates, state
        delta, trace_state = velocity.update(updates, state.trace)
        sent, feedback_state = memory.update(delta, state.feedback, params)
        new = MomentumCorrectionState(trace=trace_state, feedback=feedback_state)
        return sent, _clear_sent(new, sent, [x.numel() >= min_size for x in g], masking)

    state_type, needs = MomentumCorrectionState, "they shape its buffers"
    return wrapper("momentum_correction", velocity, update, init=init, state=state_type, needs_params=needs)


# --------------------------------------------------------------------------- local gradient clipping


@recorded
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
    its global norm, as the paper's text describes, and is
    ``ft.clip_by_global_norm(max_norm / sqrt(N))``. Either way a leaf (or tree)
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
    num_workers = check_int(num_workers, "num_workers", minimum=1)
    thr = max_norm * (1.0 / math.sqrt(num_workers))
    if not check_bool(per_leaf, "per_leaf"):
        return clip_by_global_norm(max_norm=thr)

    def update(
        grads: list[torch.Tensor], state: EmptyState, params: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], EmptyState]:
        norms = foreach.norms(grads)
        factors = foreach.clamp(foreach.div(foreach.full_like(norms, thr), foreach.add_scalar(norms, 1e-6)), 0.0, 1.0)
        return foreach.mul_list(grads, factors), state

    return leafwise("dgc_local_clipping", update)


# --------------------------------------------------------------------------- the reference's local weight decay


class LocalWeightDecayState(NamedTuple):
    """State of DGC's local weight decay: the state of ``ft.trace`` run on ``weight_decay * params``.

    Attributes:
        momentum: The :class:`~functopk.optim.TraceState` of the decay term;
            its buffer is also readable as ``trace``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.dgc(0.1, momentum=0.9, density=0.5, weight_decay=1e-4)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> type(state[1]).__name__, state[1].trace
        ('LocalWeightDecayState', {'w': tensor([0., 0.])})
    """

    momentum: TraceState

    @property
    def trace(self) -> PyTree:
        """The momentum buffer of the decay term, a tree like the parameters."""
        return self.momentum.trace


def _local_weight_decay(
    weight_decay: float | torch.Tensor, momentum: float | torch.Tensor, nesterov: bool
) -> GradientTransformation:
    """Add ``trace(weight_decay * params)`` to the (already sparsified) updates.

    The DGC reference (``DGCSGD``) applies weight decay on every rank locally,
    dense, with its own momentum buffer, and compresses only the loss gradient:
    the decay term is known to every rank, so it need not be communicated.
    """
    decay_trace = trace(momentum, nesterov=nesterov)

    def update(
        updates: Updates, state: LocalWeightDecayState, params: Params | None = None
    ) -> tuple[Updates, LocalWeightDecayState]:
        params = require_params(params, "dgc with weight_decay > 0")
        leaves, treedef = check_leaves(updates, "updates", floating=True)
        check_like(params, leaves, treedef, name="updates", expected_name="params")
        term, new = decay_trace.update(tree_scale(params, weight_decay), state.momentum)
        return tree_add(updates, term), LocalWeightDecayState(momentum=new)

    return wrapper(
        "dgc's local weight decay", decay_trace, update, init=lambda params, inner: LocalWeightDecayState(inner),
        state=LocalWeightDecayState,
    )


# --------------------------------------------------------------------------- the alias


@recorded
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
    momentum buffer (``ft.trace`` of ``weight_decay * params``, state
    :class:`LocalWeightDecayState`), after the sparsification, since every
    rank can compute it.

    ``density`` may be a schedule of the step (DGC's warm-up:
    :func:`functopk.dgc_density_warmup`) where ``ft.topk`` accepts one; each
    change of density changes ``k`` and therefore the selection's shapes.

    Args:
        learning_rate: A number or a schedule ``step -> lr``.
        momentum: Momentum coefficient, in ``[0, 1)``.
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
    if check_bool(layerwise, "layerwise"):
        sparsifier = layerwise_topk(density=density, min_size=0, method=method)
    else:
        sparsifier = topk(density=density, method=check_method(method))
    parts = []
    if max_norm is not None:
        parts.append(dgc_local_clipping(max_norm, num_workers=num_workers))
    else:
        check_int(num_workers, "num_workers", minimum=1)
    parts.append(momentum_correction(sparsifier, momentum, nesterov=nesterov, masking=masking, min_size=min_size))
    if not is_zero(weight_decay):
        parts.append(_local_weight_decay(weight_decay, momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)
