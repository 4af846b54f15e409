"""The optimizer door of torch interop: a ``torch.optim`` class's optimizer, and its class, computed by functopk.

:func:`optimizer_from_torch` makes the optimizer, :func:`optimizer_class_from_torch`
its class (the transformation door is :func:`functopk.from_torch`).
``optimizer_from_torch(torch.optim.AdamW, ...)`` makes an object whose class
is called ``AdamW`` and subclasses both :class:`torch.optim.AdamW` and
:class:`~functopk.adapter.ParamGroupOptimizer`, so that loggers (Lightning's
``LearningRateMonitor`` names its series ``lr-{type(opt).__name__}``) and
``isinstance(opt, torch.optim.AdamW)`` see the class being replaced.

None of the torch class's own code runs: the class lists ``optimizer_class``
before ``ParamGroupOptimizer``, so that ``ParamGroupOptimizer``'s ``super()``
reaches :class:`torch.optim.Optimizer` directly, and every attribute the torch
class (or its torch bases, ``Adam`` for ``AdamW``) defines is shadowed by
functopk's or ``torch.optim.Optimizer``'s own (``step``, ``__setstate__``),
or by a stub that raises (``_init_group``).

The classes are cached per ``(optimizer_class, sparsify)`` and pickle as that
pair (through their metaclass), so a pickled optimizer finds its class again in
a fresh process.
"""

from __future__ import annotations

import copyreg
import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopk._checks import check_choice
from functopk.adapter.groups import SPARSIFY_ON, ParamGroupOptimizer
from functopk.adapter.registry import spec_for
from functopk.base import GradientTransformation

__all__ = ["TorchNamedMeta", "deprecated", "optimizer_class_from_torch", "optimizer_from_torch", "shadows"]

def deprecated(old: str, new: str) -> None:
    """The ``DeprecationWarning`` of a kept alias: ``old`` still works, for one release; ``new`` is the name."""
    warnings.warn(f"{old} is deprecated: use {new} (the alias goes in the next release)", DeprecationWarning,
                  stacklevel=3)  # fmt: skip


_CLASS_ATTRIBUTES = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__"})


class TorchNamedMeta(type):
    """The metaclass of the torch-named classes: a class pickles as the :func:`optimizer_class_from_torch` call."""

    torch_recipe: tuple[type[torch.optim.Optimizer], GradientTransformation | None, str]
    token: str


_CLASSES: dict[tuple[Any, Any, str], type[ParamGroupOptimizer]] = {}
# this process's classes by token: an unpickled copy of sparsify would be another _CLASSES key
_BY_TOKEN: dict[str, type[ParamGroupOptimizer]] = {}


def _find_class(
    token: str,
    optimizer_class: type[torch.optim.Optimizer],
    sparsify: GradientTransformation | None,
    sparsify_on: str = "gradient",
) -> type[ParamGroupOptimizer]:
    """The class again: the same object in the process that made it, else made from its recipe."""
    if token not in _BY_TOKEN:
        _BY_TOKEN[token] = optimizer_class_from_torch(optimizer_class, sparsify, sparsify_on=sparsify_on)
    return _BY_TOKEN[token]


def _reduce_class(cls: TorchNamedMeta) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return _find_class, (cls.token, *cls.torch_recipe)


copyreg.pickle(TorchNamedMeta, _reduce_class)  # pickle saves classes by name unless their metaclass is registered


def _not_functopk(owner: type, name: str) -> Callable[..., Any]:
    """A stand-in for a torch method with no functopk counterpart (``_init_group``): it raises."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{owner.__module__}.{owner.__qualname__}.{name} is torch's implementation, which functopk's "
            f"{type(self).__name__} replaces; it is not available here"
        )

    method.__name__ = method.__qualname__ = name
    return method


def shadows(optimizer_class: type[torch.optim.Optimizer], base: type = ParamGroupOptimizer) -> dict[str, Any]:
    """For each attribute the torch class and its torch bases define: ``base``'s resolution of it.

    The namespace of a class ``(optimizer_class, base)`` in which none of the torch class's own code runs.
    """
    out: dict[str, Any] = {}
    for owner in optimizer_class.__mro__[: optimizer_class.__mro__.index(torch.optim.Optimizer)]:
        for name in vars(owner):
            if name in out or name in _CLASS_ATTRIBUTES:
                continue
            ours = next((vars(k)[name] for k in base.__mro__ if name in vars(k)), None)
            out[name] = ours if ours is not None else _not_functopk(owner, name)
    return out


def optimizer_class_from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    sparsify: GradientTransformation | None = None,
    *,
    sparsify_on: str = "gradient",
) -> type[ParamGroupOptimizer]:
    """The class ``C(params, **defaults)`` of :func:`optimizer_from_torch`, for code that wants an optimizer *class*.

    transformers' ``Trainer(optimizer_cls_and_kwargs=(C, kwargs))`` calls
    ``C(param_groups, **kwargs)`` when ``C`` is an optimizer class and takes any
    other callable (a ``functools.partial`` of :func:`optimizer_from_torch`) for a
    factory of the model, without its decay/no-decay groups. The same arguments
    give the same class; it is named as ``optimizer_class`` and subclasses it (and
    :class:`~functopk.adapter.ParamGroupOptimizer`), and it pickles. It is the class form of
    :func:`optimizer_from_torch` (one door, two forms).

    Args:
        optimizer_class: A ``torch.optim`` class, as for :func:`optimizer_from_torch`.
        sparsify: A transformation of the gradients (or updates) of all groups, or ``None``.
        sparsify_on: ``"gradient"`` or ``"update"``, as for :func:`optimizer_from_torch`.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass, or ``sparsify_on`` not a string.
        ValueError: it has no functopk form (``LBFGS``, ``SparseAdam``), or ``sparsify_on`` is another string.

    Example:
        >>> import torch, functopk as ft
        >>> SparseAdamW = ft.optimizer_class_from_torch(torch.optim.AdamW, ft.topk(2), sparsify_on="update")
        >>> opt = SparseAdamW(torch.nn.Linear(4, 1).parameters(), lr=0.01)
        >>> type(opt).__name__, isinstance(opt, torch.optim.AdamW), opt.param_groups[0]["lr"]
        ('AdamW', True, 0.01)
    """
    spec_for(optimizer_class)  # a bad class fails here, not at the first instance
    key = (optimizer_class, sparsify, check_choice(sparsify_on, "sparsify_on", SPARSIFY_ON))
    if key not in _CLASSES:

        def __init__(self: ParamGroupOptimizer, params: Iterable[Any], **defaults: Any) -> None:
            ParamGroupOptimizer.__init__(self, optimizer_class, params, sparsify, sparsify_on=sparsify_on, **defaults)

        name = optimizer_class.__name__
        namespace = {
            **shadows(optimizer_class),
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``torch.optim.{name}`` computed by functopk (see :class:`ParamGroupOptimizer`).",
        }
        cls: Any = TorchNamedMeta(name, (optimizer_class, ParamGroupOptimizer), namespace)
        cls.torch_recipe, cls.token = key, uuid.uuid4().hex
        _CLASSES[key] = _BY_TOKEN[cls.token] = cls
    return _CLASSES[key]


def optimizer_from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    sparsify: GradientTransformation | None = None,
    *,
    sparsify_on: str = "gradient",
    **defaults: Any,
) -> ParamGroupOptimizer:
    """A drop-in ``optimizer_class(params, **defaults)``, with ``sparsify`` on all groups' gradients or updates.

    The result behaves like the torch optimizer in everything a torch user
    relies on: per-group hyperparameters, per-parameter state and step counts,
    ``add_param_group``, ``state_dict`` in torch's layout, every scheduler,
    ``GradScaler``, ``isinstance(opt, optimizer_class)`` and the class name
    loggers show (``type(opt).__name__ == "AdamW"``), pickling and deep copies;
    see :class:`~functopk.adapter.ParamGroupOptimizer`. The maths is
    :func:`functopk.from_torch`'s. ``sparsify`` (e.g. ``ft.topk(1000)`` or
    ``ft.error_feedback(ft.topk(density=1e-3))``) sees the tensors of all
    groups as one tree, so a top-k is global across groups; it is the
    transformation that runs (a constant exact ``ft.topk`` keeps one flat
    gradient buffer between steps: :class:`functopk.compress.topk.KeptBuffer`).

    **What moves.** ``sparsify_on`` says what ``sparsify`` is applied to:

    * ``"gradient"`` (the default): the gradients, before the optimizer, as
      ``chain(topk(k), optimizer)``: ``k`` gradient coordinates per step (what a
      data-parallel rank would send), but more than ``k`` parameters move:
      momentum and Adam's moments keep moving coordinates selected before, and
      weight decay (AdamW's decoupled decay, on by default, or an L2
      ``weight_decay``) moves every parameter.
    * ``"update"``: the optimizer's updates, after it, as
      ``chain(optimizer, topk(k))``: the optimizer runs on the dense gradient
      (its state evolves on every coordinate, as torch's), and only the ``k``
      largest entries of its step (weight decay included) are added, so exactly
      ``k`` parameters move; weight decay acts on those only.

    Refused where torch's behaviour would not hold: a parameter listed twice in a
    group (``ValueError``), ``capturable=True``, ``differentiable=True`` and a
    compiled ``opt.step`` (``NotImplementedError``, saying what to use instead).

    Args:
        optimizer_class: A ``torch.optim`` class (all but ``LBFGS`` and ``SparseAdam``).
        params: Parameters, ``(name, parameter)`` pairs or param-group dicts, as for torch.
        sparsify: A transformation of the gradients (or updates), or ``None``.
        sparsify_on: ``"gradient"`` or ``"update"`` (see above; keyword only).
        **defaults: ``optimizer_class``'s keyword arguments (torch's defaults and checks).

    Raises:
        TypeError, ValueError: ``sparsify_on`` is not ``"gradient"`` or ``"update"``, or torch refuses ``defaults``.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(), ft.topk(2), sparsify_on="update",
        ...                               lr=0.1, weight_decay=0.05)
        >>> before = [p.detach().clone() for p in model.parameters()]
        >>> for _ in range(3):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        ...     changed = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
        ...     before = [p.detach().clone() for p in model.parameters()]
        ...     print(changed)
        2
        2
        2
    """
    # One class per torch class, not per sparsify: a fresh transformation per call would grow the cache.
    cls = optimizer_class_from_torch(optimizer_class)
    opt: ParamGroupOptimizer = cls.__new__(cls)
    ParamGroupOptimizer.__init__(opt, optimizer_class, params, sparsify, sparsify_on=sparsify_on, **defaults)
    return opt
