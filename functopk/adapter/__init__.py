"""``torch.optim`` interoperability: torch's optimizer classes as functopk transformations, and back.

* :mod:`~functopk.adapter.registry`: :func:`~functopk.from_torch`, the transformation with a
  ``torch.optim`` class's semantics;
* :mod:`~functopk.adapter.groups`: :class:`ParamGroupOptimizer`, made by
  :meth:`functopk.TorchOptimizer.from_torch`: a drop-in ``torch.optim`` optimizer with torch's
  param-group semantics and an optional global sparsification;
* :mod:`~functopk.adapter.classes`: the classes of its optimizers, named as (and subclasses of) the
  torch class they replace;
* :mod:`~functopk.adapter.per_param`: a state cut into torch's per-parameter entries;
* :mod:`~functopk.adapter.checkpoint`: :class:`ParamGroupOptimizer`'s state dicts in torch's
  layout, checked whole before loading.
"""

from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.registry import from_torch

__all__ = ["ParamGroupOptimizer", "from_torch"]
