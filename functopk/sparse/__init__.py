"""The global top-k engine (``ft.sparse``): selection functions, sparse updates, and their kernels.

* :mod:`~functopk.sparse.api`: ``topk_sparsify``, ``topk_mask``,
  ``topk_indices``, ``gaussian_threshold``, ``k_from_density``: pure functions
  on any tree of tensors;
* :mod:`~functopk.sparse.updates`: :class:`SparseUpdates` and
  ``apply_sparse_updates`` / ``apply_sparse_updates_``;
* :mod:`~functopk.sparse.select`: the selection kernels.

The transformation form, :func:`functopk.topk`, lives in :mod:`functopk.compress`.
"""

from functopk.sparse.api import gaussian_threshold, k_from_density, topk_indices, topk_mask, topk_sparsify
from functopk.sparse.updates import SparseUpdates, apply_sparse_updates, apply_sparse_updates_

__all__ = [
    "SparseUpdates",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "gaussian_threshold",
    "k_from_density",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
]
