"""The classes of ``from_torch`` optimizers: named as, and instances of, the ``torch.optim`` class they replace.

``TorchOptimizer.from_torch(torch.optim.AdamW, ...)`` makes an object whose class
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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.registry import spec_for
from functopk.base import GradientTransformation

__all__ = ["from_torch_optimizer", "torch_class"]

_CLASS_ATTRIBUTES = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__"})


class TorchNamed(type):
    """The metaclass of the generated classes: a class pickles as the ``torch_class`` call that makes it."""

    torch_recipe: tuple[type[torch.optim.Optimizer], GradientTransformation | None]
    token: str


_CLASSES: dict[tuple[Any, Any], type[ParamGroupOptimizer]] = {}
# this process's classes by token: an unpickled copy of sparsify would be another _CLASSES key
_BY_TOKEN: dict[str, type[ParamGroupOptimizer]] = {}


def _find_class(
    token: str, optimizer_class: type[torch.optim.Optimizer], sparsify: GradientTransformation | None
) -> type[ParamGroupOptimizer]:
    """The class again: the same object in the process that made it, else made from its recipe."""
    if token not in _BY_TOKEN:
        _BY_TOKEN[token] = torch_class(optimizer_class, sparsify)
    return _BY_TOKEN[token]


def _reduce_class(cls: TorchNamed) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return _find_class, (cls.token, *cls.torch_recipe)


copyreg.pickle(TorchNamed, _reduce_class)  # pickle saves classes by name unless their metaclass is registered


def _not_functopk(owner: type, name: str) -> Callable[..., Any]:
    """A stand-in for a torch method with no functopk counterpart (``_init_group``): it raises."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{owner.__module__}.{owner.__qualname__}.{name} is torch's implementation, which functopk's "
            f"{type(self).__name__} replaces; it is not available here"
        )

    method.__name__ = method.__qualname__ = name
    return method


def _shadows(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """For each attribute the torch class and its torch bases define: ParamGroupOptimizer's resolution of it."""
    out: dict[str, Any] = {}
    for owner in optimizer_class.__mro__[: optimizer_class.__mro__.index(torch.optim.Optimizer)]:
        for name in vars(owner):
            if name in out or name in _CLASS_ATTRIBUTES:
                continue
            ours = next((vars(k)[name] for k in ParamGroupOptimizer.__mro__ if name in vars(k)), None)
            out[name] = ours if ours is not None else _not_functopk(owner, name)
    return out


def torch_class(
    optimizer_class: type[torch.optim.Optimizer], sparsify: GradientTransformation | None = None
) -> type[ParamGroupOptimizer]:
    """The class ``C(params, **defaults)`` of ``from_torch(optimizer_class, params, sparsify, **defaults)`` (cached).

    ``C.__name__`` is ``optimizer_class.__name__``; ``C`` subclasses
    ``optimizer_class`` and :class:`~functopk.adapter.ParamGroupOptimizer`; the
    same arguments give the same class.
    """
    spec_for(optimizer_class)  # a bad class fails here, not at the first instance
    key = (optimizer_class, sparsify)
    if key not in _CLASSES:

        def __init__(self: ParamGroupOptimizer, params: Iterable[Any], **defaults: Any) -> None:
            ParamGroupOptimizer.__init__(self, optimizer_class, params, sparsify, **defaults)

        name = optimizer_class.__name__
        namespace = {
            **_shadows(optimizer_class),
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``torch.optim.{name}`` computed by functopk (see :class:`ParamGroupOptimizer`).",
        }
        cls: Any = TorchNamed(name, (optimizer_class, ParamGroupOptimizer), namespace)
        cls.torch_recipe, cls.token = key, uuid.uuid4().hex
        _CLASSES[key] = _BY_TOKEN[cls.token] = cls
    return _CLASSES[key]


def from_torch_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    sparsify: GradientTransformation | None,
    defaults: dict[str, Any],
) -> ParamGroupOptimizer:
    """``from_torch``'s optimizer: of the class ``torch_class(optimizer_class)``, with this ``sparsify``.

    (One class per torch class, not per ``sparsify``: a fresh transformation per call would grow the cache.)
    """
    cls = torch_class(optimizer_class)
    opt: ParamGroupOptimizer = cls.__new__(cls)
    ParamGroupOptimizer.__init__(opt, optimizer_class, params, sparsify, **defaults)
    return opt
