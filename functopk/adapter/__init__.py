"""``torch.optim`` interoperability: one class family, its doors named by what they return.

* the transformation door, :func:`~functopk.from_torch` (:mod:`~functopk.adapter.registry`): a
  ``torch.optim`` class's semantics as a functopk transformation, for the functional style;
* three ways to make a ``torch.optim``-style optimizer, all :class:`ParamGroupOptimizer`'s family:
  :func:`~functopk.optimizer_from_torch` (and its class form :func:`~functopk.optimizer_class_from_torch`,
  :mod:`~functopk.adapter.classes`): a drop-in ``torch.optim`` optimizer, named as and subclassing the
  torch class, with an optional global sparsification (:mod:`~functopk.adapter.groups`);
  :func:`~functopk.sparse_optimizer_from_torch` (:mod:`~functopk.adapter.sparse_classes`): one on ``k``
  coordinates with state of size ``k`` (:mod:`~functopk.adapter.sparse_state`); and
  :class:`TorchOptimizer` (:mod:`~functopk.adapter.torch_optimizer`): any transformation over all groups.

Every step runs on the in-place engine of :mod:`functopk.inplace`. The modules behind the doors:
:mod:`~functopk.adapter.part` and :mod:`~functopk.adapter.per_param` (a transformation over
parameters whose state is cut into torch's per-parameter entries), :mod:`~functopk.adapter.sparsify`
(the all-groups transformation), :mod:`~functopk.adapter.views` (sparse gradients and complex
parameters as dense real tensors), :mod:`~functopk.adapter.checkpoint` (state dicts in torch's layout,
checked whole before loading), :mod:`~functopk.adapter.group_digest` and
:mod:`~functopk.adapter.sparse_classes` (:func:`~functopk.sparse_optimizer_from_torch` and its class,
:func:`~functopk.sparse_optimizer_class_from_torch`, over :mod:`~functopk.adapter.sparse_state`).
``ft.TorchOptimizer.from_torch``, ``ft.TorchOptimizer.from_torch_class`` and
``ft.sparse.sparse_optimizer_from_torch`` are deprecated names.
"""

from functopk.adapter.classes import optimizer_class_from_torch, optimizer_from_torch
from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.registry import from_torch
from functopk.adapter.sparse_classes import sparse_optimizer_class_from_torch, sparse_optimizer_from_torch
from functopk.adapter.sparse_state import SparseStateOptimizer
from functopk.adapter.torch_optimizer import TorchOptimizer

__all__ = [
    "ParamGroupOptimizer",
    "SparseStateOptimizer",
    "TorchOptimizer",
    "from_torch",
    "optimizer_class_from_torch",
    "optimizer_from_torch",
    "sparse_optimizer_class_from_torch",
    "sparse_optimizer_from_torch",
]
