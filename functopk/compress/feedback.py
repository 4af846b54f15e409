"""Error feedback: remember what a compressor did not send and add it back next step.

Stich et al. 2018 ("Sparsified SGD with memory") and Karimireddy et al. 2019
("Error feedback fixes SignSGD and other gradient compression schemes", EF-SGD)
show that a biased compressor such as top-k converges like the uncompressed
method once the part it drops is kept in a residual and added to the next
input. :func:`error_feedback` wraps any compressor written as a
:class:`~functopk.GradientTransformation` (``topk``, ``randk``, ``threshold``,
``layerwise_topk``, ...):

    corrected = updates + residual
    sent      = inner(corrected)
    residual  = corrected - sent

The invariant is conservation of mass: after ``T`` steps,
``sum_t sent_t + residual_T == sum_t updates_t`` coordinate by coordinate,
exactly up to the rounding of the additions (bit-exact in fp64 for dyadic
inputs; within a few ulps per step in fp32).

**The unit of the residual** is the unit of the updates where the wrapper sits
in the chain, and that choice matters as soon as the learning rate changes:

* ``chain(scale_by_learning_rate(lr), error_feedback(topk(k)))`` keeps the
  residual in *parameter units* (``lr * g``), as EF-SGD and mem-SGD do. Then
  ``params_T + residual_T == params_0 - sum_t lr_t g_t`` exactly: the
  parameters lag plain SGD by precisely the residual, whatever the schedule.
  This is the form the convergence proofs analyse. Recommended whenever the
  compressor is the last transformation before the update and the learning
  rate is scheduled (warm-up, decay).
* ``chain(error_feedback(topk(k)), sgd(lr, momentum=m))`` keeps it in *gradient
  units*: a coordinate that waited ``s`` steps is applied with the learning
  rate of the step it is sent at, not the steps it was computed at. Under a
  constant learning rate the two are the same up to the factor ``lr``; under a
  schedule the applied total differs from SGD's by ``sum_t (lr_t - lr_send) g_t``
  over the delayed parts. This is the form a communication hook sees (it
  compresses gradients before the optimizer runs, as in DDP) and the one to use
  when an optimizer with its own state (momentum) must run *after* the
  compression on every rank alike. Keep the schedule smooth relative to how long
  coordinates wait (at density ``d``, an average coordinate waits about
  ``1/d`` steps).

The residual has the dtype of the parameters (it is created from them by
``init``); in half precision small residuals can round away, so keep it in
fp32 where that matters (compress fp32 gradients).

NaN and Inf are not hidden: a non-finite input makes the residual at that
coordinate non-finite (``inf - inf`` is NaN), so it keeps reaching later
updates where a guard can see it. Skip non-finite steps upstream.
"""

from __future__ import annotations

from typing import NamedTuple

import optree

from functopk._checks import check_leaves, check_like, check_shapes
from functopk.base import GradientTransformation, OptState, Params, Updates, recorded
from functopk.build import wrapper
from functopk.tree import foreach
from functopk.tree.maths import PyTree, flatten_like
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = ["ErrorFeedbackState", "error_feedback"]


class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
        residual: What the compressor has not sent yet, a tree like the parameters.
        inner_state: The state of the wrapped compressor.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.error_feedback(ft.topk(1))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> state.residual
        {'w': tensor([0., 0.])}
    """

    residual: PyTree
    inner_state: OptState


@recorded
def error_feedback(inner: GradientTransformation) -> GradientTransformation:
    """Wrap a compressor with residual memory (error feedback).

    ``corrected = updates + residual``; ``sent = inner(corrected)``;
    ``residual = corrected - sent``; returns ``sent``. See the module
    documentation for the invariant and for where to place it in a chain (the
    unit of the residual).

    Args:
        inner: A transformation that returns a tree with its input's structure,
            shapes and dtypes (a dense tree, zero where nothing was sent).

    Raises:
        ValueError: at ``init``, when no parameters are given (they shape the
            residual); at ``update``, when the updates or the inner output do
            not match the residual's structure and shapes (naming the leaf).
        TypeError: at ``update``, for a state from another transformation or a
            leaf that is not a floating-point tensor.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.error_feedback(ft.topk(1))
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> sent, state = tx.update({"w": torch.tensor([3.0, 2.0, 1.0])}, state)
        >>> sent["w"], state.residual["w"]
        (tensor([3., 0., 0.]), tensor([0., 2., 1.]))
        >>> sent, state = tx.update({"w": torch.tensor([0.0, 0.0, 1.5])}, state)
        >>> sent["w"], state.residual["w"]
        (tensor([0.0000, 0.0000, 2.5000]), tensor([0., 2., 0.]))
    """

    def init(params: Params, inner_state: OptState) -> ErrorFeedbackState:
        return ErrorFeedbackState(residual=tree_zeros_like(params), inner_state=inner_state)

    def update(
        updates: Updates, state: ErrorFeedbackState, params: Params | None = None
    ) -> tuple[Updates, ErrorFeedbackState]:
        leaves, treedef = check_leaves(updates, "updates", floating=True)
        residual = check_like(state.residual, leaves, treedef, name="updates",
                              expected_name="error_feedback's residual")
        corrected = foreach.add(leaves, residual)
        sent, inner_state = inner.update(optree.tree_unflatten(treedef, corrected), state.inner_state, params)
        sent_leaves = flatten_like(
            sent, treedef, "the inner transformation's output",
            "its input (error_feedback needs a dense tree like its input, zero where nothing was sent)",
        )
        check_shapes(treedef, sent_leaves, corrected, name="the inner transformation's output",
                     expected_name="its input")
        new_residual = foreach.keep_dtypes(foreach.sub(corrected, sent_leaves), residual)
        return sent, ErrorFeedbackState(optree.tree_unflatten(treedef, new_residual), inner_state)

    return wrapper(
        "error_feedback", inner, update, init=init, state=ErrorFeedbackState,
        needs_params="they give the residual its shapes",
    )
