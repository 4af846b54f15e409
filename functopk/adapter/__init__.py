"""``torch.optim`` interoperability: two doors, named by what they return.

* the transformation door, :func:`~functopk.from_torch` (:mod:`~functopk.adapter.registry`): a
  ``torch.optim`` class's semantics as a functopk transformation, for the functional style;
* the optimizer door, :func:`~functopk.optimizer_from_torch` and
  :func:`~functopk.optimizer_class_from_torch` (:mod:`~functopk.adapter.classes`): a drop-in
  ``torch.optim`` optimizer (or its class), named as and subclassing the torch class, with an
  optional global sparsification; its behaviour is :class:`ParamGroupOptimizer`'s
  (:mod:`~functopk.adapter.groups`).

``ft.TorchOptimizer.from_torch`` and ``ft.TorchOptimizer.from_torch_class`` are the optimizer
door's older names, kept. The modules behind the doors:

* :mod:`~functopk.adapter.per_param`: a state cut into torch's per-parameter entries;
* :mod:`~functopk.adapter.inplace`: :class:`ParamGroupOptimizer`'s steps that write into its own
  state, as ``torch.optim``'s foreach implementations do (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax);
* :mod:`~functopk.adapter.views`: sparse gradients and complex parameters as dense real tensors;
* :mod:`~functopk.adapter.checkpoint`: :class:`ParamGroupOptimizer`'s state dicts in torch's
  layout, checked whole before loading;
* :mod:`~functopk.adapter.sparse_classes`: :func:`~functopk.sparse_optimizer_from_torch` (and its
  class, :func:`~functopk.sparse_optimizer_class_from_torch`), a
  ``torch.optim`` optimizer on ``k`` coordinates with state of size ``k`` (also ``ft.sparse``'s),
  whose behaviour is :class:`SparseStateOptimizer`'s (:mod:`~functopk.adapter.sparse_state`);
* :mod:`~functopk.adapter.recut`: ``TorchOptimizer``'s state when the set of parameters changes.
"""

from functopk.adapter.classes import optimizer_class_from_torch, optimizer_from_torch
from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.registry import from_torch
from functopk.adapter.sparse_classes import sparse_optimizer_class_from_torch, sparse_optimizer_from_torch
from functopk.adapter.sparse_state import SparseStateOptimizer

__all__ = [
    "ParamGroupOptimizer",
    "SparseStateOptimizer",
    "from_torch",
    "optimizer_class_from_torch",
    "optimizer_from_torch",
    "sparse_optimizer_class_from_torch",
    "sparse_optimizer_from_torch",
]
