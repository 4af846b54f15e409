"""The global top-k engine (``ft.sparse``): selection functions, sparse updates, and their kernels.

* :mod:`~functopk.sparse.api`: ``topk_sparsify``, ``topk_mask``,
  ``topk_indices``, ``gaussian_threshold``: pure functions on any tree of tensors;
* :mod:`~functopk.sparse.k`: what ``k`` is, the one home of the count kept:
  ``k_from_density``, ``resolve_k``, and what a kernel takes from a tensor ``k``;
* :mod:`~functopk.sparse.updates`: :class:`SparseUpdates` and
  ``apply_sparse_updates`` / ``apply_sparse_updates_``;
* :mod:`~functopk.sparse.dispatch`: the one place that picks a kernel,
  returning a :class:`~functopk.sparse.selection.Selection` (``Indices``,
  ``Mask``, ``Threshold``, ``HostThreshold`` of :mod:`~functopk.sparse.selection`,
  or ``ExactOp`` of :mod:`~functopk.sparse.ops`);
* :mod:`~functopk.sparse.streaming`: :class:`StreamingTopK`, the same exact
  selection made while backward runs, each gradient freed once folded, through
  the weakly held hooks of :mod:`~functopk.sparse.hooks`; between selections it
  gathers at a fixed set (:mod:`~functopk.sparse.gathering`), with the weight
  gradients of the supported layers computed there only
  (:mod:`~functopk.sparse.layers`, kernels in :mod:`~functopk.sparse.sampled`);
* :mod:`~functopk.sparse.grad_at`: :func:`grad_at`, the same for ``torch.func``-style
  loss functions: the gradient at fixed coordinates as a :class:`SparseUpdates`;
* :mod:`~functopk.sparse.optimizer`: :func:`sparse_optimizer`, a coordinate-wise
  optimizer on ``k`` coordinates with state of size ``k``
  (:class:`SparseOptState`, :mod:`~functopk.sparse.opt_state`);
* its ``torch.optim`` form is :func:`functopk.sparse_optimizer_from_torch` (``ft.sparse.sparse_optimizer_from_torch``
  is a deprecated alias, for one release);
* :mod:`~functopk.sparse.ops`: the exact CPU kernel and the Triton kernel as custom operators, for
  compiled graphs;
* :mod:`~functopk.sparse.kernels`: the kernels (static, scan, exact, approx, Triton);
* :mod:`~functopk.sparse.config`: :class:`KernelConfig`, their tuning constants.

The transformation form, :func:`functopk.topk`, lives in :mod:`functopk.compress`.
"""

from functopk.sparse.api import gaussian_threshold, topk_indices, topk_mask, topk_sparsify
from functopk.sparse.config import KernelConfig
from functopk.sparse.dispatch import SlowPathWarning
from functopk.sparse.grad_at import grad_at
from functopk.sparse.k import k_from_density, resolve_k
from functopk.sparse.opt_state import SparseOptState
from functopk.sparse.optimizer import SparseOptimizer, sparse_optimizer
from functopk.sparse.streaming import StreamingTopK
from functopk.sparse.updates import SparseUpdates, apply_sparse_updates, apply_sparse_updates_

__all__ = [
    "KernelConfig",
    "SlowPathWarning",
    "SparseOptState",
    "SparseOptimizer",
    "SparseUpdates",
    "StreamingTopK",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "gaussian_threshold",
    "grad_at",
    "k_from_density",
    "resolve_k",
    "sparse_optimizer",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
]


def __getattr__(name: str) -> object:
    # the deprecated alias of ft.sparse_optimizer_from_torch (the interop layer, imported on first use)
    if name == "sparse_optimizer_from_torch":
        from functopk.adapter.sparse_classes import deprecated_alias

        return deprecated_alias
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
