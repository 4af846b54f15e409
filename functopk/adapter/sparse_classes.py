"""``ft.sparse_optimizer_from_torch``: the door to :class:`~functopk.adapter.SparseStateOptimizer`, and its class.

Its optimizers' classes are named as, and subclass, the ``torch.optim`` class
(``isinstance(opt, torch.optim.AdamW)`` holds for loggers and trainers),
without running any of its code (:func:`functopk.adapter.classes.shadows`).
:func:`sparse_optimizer_class_from_torch` gives the class itself, for code
that takes an optimizer class (transformers' ``optimizer_cls_and_kwargs``),
as :func:`~functopk.optimizer_class_from_torch` does for the dense door.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from functopk.adapter.classes import deprecated, shadows
from functopk.adapter.registry import spec_for
from functopk.adapter.sparse_state import SparseStateOptimizer

__all__ = ["deprecated_alias", "sparse_optimizer_class_from_torch", "sparse_optimizer_from_torch"]


_CLASSES: dict[type[torch.optim.Optimizer], type[SparseStateOptimizer]] = {}


def sparse_optimizer_class_from_torch(optimizer_class: type[torch.optim.Optimizer]) -> type[SparseStateOptimizer]:
    """The class of :func:`sparse_optimizer_from_torch`'s optimizers, for code that wants an optimizer *class*.

    ``C(params, k=..., refresh_every=..., **defaults)`` is
    ``sparse_optimizer_from_torch(optimizer_class, params, k=..., ...)``: the
    same keyword arguments. transformers' ``Trainer(optimizer_cls_and_kwargs=(C,
    {"k": ..., "lr": ...}))`` calls ``C(param_groups, **kwargs)`` with its own
    weight-decay and no-decay groups. The class is named as ``optimizer_class``
    and subclasses it (``isinstance`` holds), without running any of its code
    (:func:`functopk.adapter.classes.shadows`); the same class for the same
    ``optimizer_class``.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: it has no functopk form.

    Example:
        >>> import torch, functopk as ft
        >>> SparseAdamW = ft.sparse_optimizer_class_from_torch(torch.optim.AdamW)
        >>> opt = SparseAdamW(torch.nn.Linear(4, 2).parameters(), k=3, refresh_every=10, lr=1e-3)
        >>> type(opt).__name__, isinstance(opt, torch.optim.AdamW), opt.k
        ('AdamW', True, 3)
        >>> opt.remove()
    """
    spec_for(optimizer_class)
    if optimizer_class in _CLASSES:
        return _CLASSES[optimizer_class]

    def __init__(self: SparseStateOptimizer, params: Iterable[Any], **kwargs: Any) -> None:
        SparseStateOptimizer.__init__(self, optimizer_class, params, **kwargs)

    name = optimizer_class.__name__
    namespace = {
        **shadows(optimizer_class, SparseStateOptimizer),
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``torch.optim.{name}`` on k coordinates (see :func:`sparse_optimizer_from_torch`).",
    }
    cls = _CLASSES[optimizer_class] = type(name, (optimizer_class, SparseStateOptimizer), namespace)
    return cls


def sparse_optimizer_from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    *,
    k: Any = None,
    density: Any = None,
    refresh_every: int = 1,
    score: str = "gradient",
    grad_accumulation: bool = False,
    sampled: bool = True,
    **defaults: Any,
) -> SparseStateOptimizer:
    """``optimizer_class(params, **defaults)`` training only ``k`` coordinates of ``params``, with state of size ``k``.

    The adapter form of :func:`functopk.sparse.sparse_optimizer`. On steps
    ``0, M, 2M, ...`` (``M = refresh_every``) the coordinate set becomes the
    exact global top-``k`` of ``|g|`` over all groups; on the steps between, the
    gradient is gathered at that set, and the weight gradients of
    ``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding`` and ``nn.Conv2d``
    layers are computed there only (``sampled=True``: no dense weight gradient).
    The ``k`` coordinates step with ``optimizer_class``'s maths and their own
    group's hyperparameters; new ones start from fresh state with their own
    step count, dropped ones keep their values. The flat indices (in
    ``state_dict()``) run over the parameters in ``param_groups`` order. The
    gradients are freed during backward (every ``p.grad`` is ``None`` after it);
    the state is 16 bytes per coordinate for AdamW in float32. The hooks live
    as long as the optimizer: ``opt.remove()`` or ``with`` removes them. What
    differs from ``torch.optim`` is listed in :class:`SparseStateOptimizer`.

    Args:
        optimizer_class: A coordinate-wise ``torch.optim`` class: ``SGD``, ``Adam``, ``AdamW``,
            ``RMSprop``, ``Adagrad``, ``Adadelta``, ``Adamax``, ``NAdam``, ``RAdam``, ``ASGD``, ``Rprop``.
        params: Parameters, ``(name, parameter)`` pairs or param-group dicts, as for torch; float
            tensors on one device, leaves of the autograd graph.
        k: How many coordinates to train (an int; give exactly one of ``k`` and ``density``).
        density: The fraction of the coordinates to train, in ``(0, 1]``.
        refresh_every: ``M``: choose the coordinate set again every ``M`` steps (1: every step).
        score: What a refresh ranks: ``"gradient"`` (``|g|`` of the refresh step) or
            ``"accumulated"`` (``|g|`` summed over the steps since the last refresh, this one
            included: one more ``n``-sized tensor, kept by the stream and saved in the state dict;
            it needs every dense gradient, so no layer is sampled).
        grad_accumulation: Several backward passes per step add up, as ``.grad`` does (the HF
            Trainer's ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``): a
            refresh step keeps the dense ``.grad`` until ``step()``, the steps between add each
            backward's gradient at the set.
        sampled: Between refreshes, compute the supported layers' weight gradients at the set
            only; ``False``: the dense backward's numbers, bit for bit.
        **defaults: ``optimizer_class``'s keyword arguments (torch's defaults and checks).

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass, a keyword is unknown to it,
            or ``k``/``density``/``refresh_every`` has the wrong type.
        ValueError: ``optimizer_class`` is not coordinate-wise (``Adafactor``, ``Muon``, ``LBFGS``,
            ``SparseAdam``), torch rejects a value, ``refresh_every < 1``, ``k`` exceeds the coordinates,
            the parameters are on the meta device, or a live sparse optimizer (or stream) holds one of them.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=3, lr=0.01)
        >>> isinstance(opt, torch.optim.AdamW), opt.param_groups[0]["lr"]
        (True, 0.01)
        >>> before = [p.detach().clone() for p in model.parameters()]
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> model.weight.grad is None                 # folded into the selection and freed
        True
        >>> opt.step()
        >>> sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
        3
        >>> sorted(opt.state_dict()["state"]["inner"]), opt.state_dict()["state"]["indices"].shape
        (['exp_avg', 'exp_avg_sq', 'step'], torch.Size([3]))
    """
    cls: Any = sparse_optimizer_class_from_torch(optimizer_class)
    return cls(
        params, k=k, density=density, refresh_every=refresh_every, score=score,
        grad_accumulation=grad_accumulation, sampled=sampled, **defaults,
    )  # fmt: skip


def deprecated_alias(*args: Any, **kwargs: Any) -> SparseStateOptimizer:
    """``ft.sparse.sparse_optimizer_from_torch``: deprecated, :func:`sparse_optimizer_from_torch` (``ft.``'s)."""
    deprecated("ft.sparse.sparse_optimizer_from_torch", "ft.sparse_optimizer_from_torch")
    return sparse_optimizer_from_torch(*args, **kwargs)
