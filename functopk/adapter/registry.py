"""``ft.from_torch``: the functopk transformation with the semantics of a ``torch.optim`` class.

Every ``torch.optim`` class except ``LBFGS`` (it re-evaluates the loss inside
its step) and ``SparseAdam`` (sparse gradients) has a :class:`TorchSpec`: how
to build the transformation from the hyperparameters torch keeps in a param
group, and how the transformation's state fields are called in torch's
per-parameter state (``mu`` is ``exp_avg``).

Arguments go through torch's own constructor first (on a throw-away 2x2
parameter), so defaults, accepted keywords and validation errors are torch's
own. The implementation flags ``foreach``, ``fused``, ``capturable`` and
``differentiable`` are accepted and ignored: functopk has one implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from functopk.base import GradientTransformation, recorded
from functopk.optim import adam_variants as _adam_variants
from functopk.optim import alias
from functopk.optim import classic as _classic
from functopk.optim._shared import group_scalar
from functopk.optim.adafactor import TORCH_BUILDERS as _ADAFACTOR_BUILDERS
from functopk.optim.adafactor import TORCH_STATE_NAMES as _ADAFACTOR_NAMES
from functopk.optim.muon import TORCH_BUILDERS as _MUON_BUILDERS
from functopk.optim.muon import TORCH_STATE_NAMES as _MUON_NAMES

__all__ = ["IMPLEMENTATION_FLAGS", "TorchSpec", "from_torch", "spec_for", "torch_hyperparams"]

IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
"""Keywords of ``torch.optim`` classes that choose an implementation, not the maths: ignored."""

Hyperparams = Mapping[str, Any]


class TorchSpec(NamedTuple):
    """How a ``torch.optim`` class maps onto functopk.

    Attributes:
        build: The transformation for a param group's hyperparameters (torch's keys, all present).
        state_names: functopk state field name -> torch's per-parameter state key.
    """

    build: Callable[[Hyperparams], GradientTransformation]
    state_names: Mapping[str, str]


def _sgd(h: Hyperparams) -> GradientTransformation:
    return alias.sgd(
        group_scalar(h["lr"]), momentum=group_scalar(h["momentum"]), nesterov=h["nesterov"],
        dampening=group_scalar(h["dampening"]), weight_decay=group_scalar(h["weight_decay"]), maximize=h["maximize"],
    )


def _adam(h: Hyperparams, decoupled: bool = False) -> GradientTransformation:
    b1, b2 = group_scalar(h["betas"])
    make = alias.adamw if decoupled or h.get("decoupled_weight_decay", False) else alias.adam
    return make(
        group_scalar(h["lr"]), b1=b1, b2=b2, eps=group_scalar(h["eps"]), weight_decay=group_scalar(h["weight_decay"]),
        amsgrad=h["amsgrad"], maximize=h["maximize"],
    )


def _rmsprop(h: Hyperparams) -> GradientTransformation:
    return alias.rmsprop(
        group_scalar(h["lr"]), alpha=group_scalar(h["alpha"]), eps=group_scalar(h["eps"]),
        weight_decay=group_scalar(h["weight_decay"]), momentum=group_scalar(h["momentum"]), centered=h["centered"],
        maximize=h["maximize"],
    )


def _adagrad(h: Hyperparams) -> GradientTransformation:
    return alias.adagrad(
        group_scalar(h["lr"]), lr_decay=group_scalar(h["lr_decay"]), weight_decay=group_scalar(h["weight_decay"]),
        initial_accumulator_value=group_scalar(h["initial_accumulator_value"]), eps=group_scalar(h["eps"]),
        maximize=h["maximize"],
    )


_ADAM_NAMES = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}

_SPECS: dict[str, TorchSpec] = {
    "SGD": TorchSpec(_sgd, {"trace": "momentum_buffer"}),
    "Adam": TorchSpec(_adam, _ADAM_NAMES),
    "AdamW": TorchSpec(lambda h: _adam(h, decoupled=True), _ADAM_NAMES),
    "RMSprop": TorchSpec(_rmsprop, {"nu": "square_avg", "mu": "grad_avg", "trace": "momentum_buffer", "count": "step"}),
    "Adagrad": TorchSpec(_adagrad, {"sum_of_squares": "sum", "count": "step"}),
}


def _add_module_specs(*tables: tuple[Mapping[str, Any], Mapping[str, Mapping[str, str]]]) -> None:
    """Register the torch classes an optimizer module maps (its ``TORCH_BUILDERS`` and ``TORCH_STATE_NAMES``)."""
    for builders, names in tables:
        for name, build in builders.items():
            _SPECS[name] = TorchSpec(build, names[name])


_add_module_specs(
    (_adam_variants.TORCH_BUILDERS, _adam_variants.TORCH_STATE_NAMES),
    (_classic.TORCH_BUILDERS, _classic.TORCH_STATE_NAMES),
    (_ADAFACTOR_BUILDERS, _ADAFACTOR_NAMES),  # (ft.optim.adafactor and ft.optim.muon are the functions)
    (_MUON_BUILDERS, _MUON_NAMES),
)

_UNSUPPORTED = {
    "LBFGS": "it re-evaluates the loss several times inside one step (a closure-driven line search), which a "
    "gradient transformation cannot do",
    "SparseAdam": "it works on sparse gradients (torch.sparse), which functopk's dense trees do not hold",
}


def spec_for(optimizer_class: Any) -> TorchSpec:
    """The :class:`TorchSpec` of a ``torch.optim`` class.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: it is one functopk does not cover (``LBFGS``, ``SparseAdam``, or not from ``torch.optim``).
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got "
            f"{optimizer_class!r}"
        )
    name = optimizer_class.__name__
    if name in _UNSUPPORTED and getattr(torch.optim, name, None) is optimizer_class:
        raise ValueError(f"optimizer_class torch.optim.{name} has no functopk form: {_UNSUPPORTED[name]}")
    if getattr(torch.optim, name, None) is not optimizer_class or name not in _SPECS:
        known = ", ".join(sorted(_SPECS))
        raise ValueError(f"optimizer_class must be one of torch.optim's {known}; got {optimizer_class!r}")
    return _SPECS[name]


def torch_hyperparams(optimizer_class: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The complete param-group hyperparameters torch would use for ``optimizer_class(params, **kwargs)``.

    Torch's constructor runs on a throw-away parameter, so a bad keyword or value
    raises torch's own ``TypeError``/``ValueError``. The implementation flags
    are kept in the result as given but not passed to torch (``fused=True``
    would need a CUDA parameter).
    """
    flags = {k: kwargs[k] for k in IMPLEMENTATION_FLAGS if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in flags}
    dummy = torch.zeros(2, 2, requires_grad=True)
    group = dict(optimizer_class([dummy], **rest).param_groups[0])
    del group["params"]
    group.update(flags)
    return group


@recorded
def from_torch(optimizer_class: type[torch.optim.Optimizer], /, **torch_kwargs: Any) -> GradientTransformation:
    """The transformation with the semantics of ``optimizer_class(params, **torch_kwargs)``.

    For every ``torch.optim`` class except ``LBFGS`` and ``SparseAdam``: the same
    keywords, defaults and validation errors as torch's constructor (it is run
    to check them), and updates that, added with :func:`functopk.apply_updates`,
    reproduce torch's parameters step by step (tested on PyTorch's own optimizer
    test configurations). ``lr`` keeps its Python type: a float stays a float
    (exact in float64 models), a 0-d tensor is read on device at every step.
    The implementation flags ``foreach``, ``fused``, ``capturable`` and
    ``differentiable`` are accepted and ignored.

    The optax-style aliases (:func:`functopk.adam`, ...) have optax's argument
    names (``b1``, ``b2``); this is the torch-named door to the same maths.

    Args:
        optimizer_class: A ``torch.optim`` class, e.g. ``torch.optim.AdamW``.
        **torch_kwargs: Its keyword arguments, as for torch.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or torch rejects a keyword.
        ValueError: the class has no functopk form, or torch rejects a value.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.from_torch(torch.optim.SGD, lr=0.5, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates["w"]
        tensor([-1.])
    """
    spec = spec_for(optimizer_class)
    return spec.build(torch_hyperparams(optimizer_class, torch_kwargs))
