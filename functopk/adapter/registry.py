"""``ft.from_torch``: the functopk transformation with the semantics of a ``torch.optim`` class.

Every ``torch.optim`` class except ``LBFGS`` (it re-evaluates the loss inside
its step) and ``SparseAdam`` (sparse gradients) has a :class:`TorchSpec`: how
to build the transformation from the hyperparameters torch keeps in a param
group, and how the transformation's state fields are called in torch's
per-parameter state (``mu`` is ``exp_avg``). Where torch keeps a ``step`` that
the maths does not need (RMSprop without momentum, Adagrad without
``lr_decay``), the transformation counts its updates too, so that the states
and checkpoints match torch's.

Arguments go through torch's own constructor first (on a throw-away 2x2
parameter), so defaults, accepted keywords and validation errors are torch's
own, the implementation flags included (``foreach=True`` with a tensor ``lr``
raises torch's error). A flag is accepted where what it asks for holds:
``foreach`` and ``fused`` choose one of torch's kernels for the same maths, which
functopk computes with its own; ``capturable=True`` (a step that CUDA graphs can
capture) and ``differentiable=True`` (gradients through the step) do not hold and
raise ``NotImplementedError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from functopk._checks import check_distinct_params, group_scalar, is_zero, torch_duplicate_warning_ignored
from functopk.adapter.checkpoint import check_group_sizes, filled_group
from functopk.base import GradientTransformation, init_count, recorded
from functopk.build import Formula, leafwise
from functopk.combine import chain
from functopk.optim import adam_variants as _adam_variants
from functopk.optim import alias
from functopk.optim import classic as _classic
from functopk.optim.adafactor import TORCH_BUILDERS as _ADAFACTOR_BUILDERS
from functopk.optim.adafactor import TORCH_STATE_NAMES as _ADAFACTOR_NAMES
from functopk.optim.muon import TORCH_BUILDERS as _MUON_BUILDERS
from functopk.optim.muon import TORCH_STATE_NAMES as _MUON_NAMES

__all__ = [
    "IMPLEMENTATION_FLAGS", "NOT_HYPER", "TorchClassGroups", "TorchSpec", "add_checked_group",
    "check_implementation_flags", "check_torch_step_accepts", "from_torch", "spec_for", "torch_hyperparams",
]  # fmt: skip

IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
"""Keywords of ``torch.optim`` classes that choose an implementation: checked by torch, then by
:func:`check_implementation_flags`."""

_REFUSED_FLAGS = {
    "capturable": "its step replaces state tensors (the step counts at least) instead of updating them in place, "
    "so a CUDA graph replay would read stale state. Leave capturable=False (torch's default)",
    "differentiable": "no gradient flows through its step (the adapter's step() runs under torch.no_grad and "
    "updates the parameters in place). Leave differentiable=False (torch's default)",
}

Hyperparams = Mapping[str, Any]


class TorchSpec(NamedTuple):
    """How a ``torch.optim`` class maps onto functopk.

    Attributes:
        build: The transformation for a param group's hyperparameters (torch's keys, all present).
        state_names: functopk state field name -> torch's per-parameter state key.
        from_defaults: Hyperparameters the torch class reads from the constructor's arguments
            (``optimizer.defaults``), never from a param group (Adagrad's ``initial_accumulator_value``).
    """

    build: Callable[[Hyperparams], GradientTransformation]
    state_names: Mapping[str, str]
    from_defaults: tuple[str, ...] = ()


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


class StepCountState(NamedTuple):
    """State of the step counter chained after RMSprop without momentum and Adagrad without ``lr_decay``."""

    count: torch.Tensor  # type: ignore[assignment]  # torch's per-parameter "step"


def _counting_steps(tx: GradientTransformation) -> GradientTransformation:
    """``tx``, then a step count that changes nothing: torch keeps a ``step`` where ``tx``'s maths needs none.

    (``torch.optim`` loading a state dict without it fails at its next step.)
    """

    def prepare(state: StepCountState, like: Any, params: Any) -> tuple[Any, dict[str, Any]]:
        return (lambda w, g, fields, p: (g, ())), {"count": state.count + 1}

    init = lambda ps: StepCountState(init_count(ps))  # noqa: E731
    counter = leafwise("step count", formula=Formula(prepare, sliced=True), init=init, state=StepCountState)
    return chain(tx, counter)


def _rmsprop(h: Hyperparams) -> GradientTransformation:
    momentum = group_scalar(h["momentum"])
    tx = alias.rmsprop(
        group_scalar(h["lr"]), alpha=group_scalar(h["alpha"]), eps=group_scalar(h["eps"]),
        weight_decay=group_scalar(h["weight_decay"]), momentum=momentum, centered=h["centered"],
        maximize=h["maximize"],
    )
    return _counting_steps(tx) if is_zero(momentum) else tx  # with momentum, the trace's count is torch's step


def _adagrad(h: Hyperparams) -> GradientTransformation:
    lr_decay = group_scalar(h["lr_decay"])
    tx = alias.adagrad(
        group_scalar(h["lr"]), lr_decay=lr_decay, weight_decay=group_scalar(h["weight_decay"]),
        initial_accumulator_value=group_scalar(h["initial_accumulator_value"]), eps=group_scalar(h["eps"]),
        maximize=h["maximize"],
    )
    return _counting_steps(tx) if is_zero(lr_decay) else tx  # with lr_decay, the schedule's count is torch's step


_ADAM_NAMES = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}

_SPECS: dict[str, TorchSpec] = {
    "SGD": TorchSpec(_sgd, {"trace": "momentum_buffer"}),
    "Adam": TorchSpec(_adam, _ADAM_NAMES),
    "AdamW": TorchSpec(lambda h: _adam(h, decoupled=True), _ADAM_NAMES),
    "RMSprop": TorchSpec(_rmsprop, {"nu": "square_avg", "mu": "grad_avg", "trace": "momentum_buffer", "count": "step"}),
    "Adagrad": TorchSpec(_adagrad, {"sum_of_squares": "sum", "count": "step"}, ("initial_accumulator_value",)),
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


def check_implementation_flags(hyperparams: Hyperparams) -> None:
    """Refuse the implementation flags whose behaviour functopk does not give.

    ``foreach`` and ``fused`` pass (a kernel choice; the maths is the same);
    ``capturable=True`` and ``differentiable=True`` raise.

    Raises:
        NotImplementedError: ``capturable`` or ``differentiable`` is true, with what to do instead.
    """
    for flag, why in _REFUSED_FLAGS.items():
        if hyperparams.get(flag):
            raise NotImplementedError(f"{flag}=True is not supported by functopk: {why}")


def torch_hyperparams(optimizer_class: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The complete param-group hyperparameters torch would use for ``optimizer_class(params, **kwargs)``.

    Torch's constructor runs on a throw-away parameter, so a bad keyword or value
    (or a combination of implementation flags torch refuses, such as ``foreach=True``
    with a tensor ``lr``) raises torch's own ``TypeError``/``ValueError``/``RuntimeError``;
    then :func:`check_implementation_flags` refuses what torch accepts but functopk
    cannot do.
    """
    dummy = torch.zeros(2, 2, requires_grad=True)
    group = dict(optimizer_class([dummy], **kwargs).param_groups[0])
    del group["params"]
    check_implementation_flags(group)
    return group


def check_torch_step_accepts(
    optimizer_class: type[torch.optim.Optimizer],
    hyperparams: Hyperparams,
    params: list[torch.Tensor],
    accepted: set[tuple[torch.device, torch.dtype]],
) -> None:
    """Torch's checks of ``fused=True`` at a step (the parameters' devices and dtypes), before anything changes.

    Torch checks them as it steps, so its optimizer takes one step on a
    one-element stand-in for each device and dtype among ``params`` not yet in
    ``accepted`` (nothing when ``fused`` is off): what torch refuses raises
    torch's own error; what it takes joins ``accepted``.
    """
    if not hyperparams.get("fused"):
        return
    kinds = sorted({(p.device, p.dtype) for p in params} - accepted, key=str)
    if not kinds:
        return
    keys = inspect.signature(optimizer_class.__init__).parameters
    stand_ins = [torch.zeros(1, device=device, dtype=dtype, requires_grad=True) for device, dtype in kinds]
    for s in stand_ins:
        s.grad = torch.zeros_like(s)
    optimizer_class(stand_ins, **{k: v for k, v in hyperparams.items() if k in keys and k != "params"}).step()
    accepted.update(kinds)


def add_checked_group(
    opt: torch.optim.Optimizer,
    optimizer_class: type[torch.optim.Optimizer],
    param_group: dict[str, Any],
    also: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """torch's ``add_param_group`` on ``opt``, then the checks of the new group, which is removed if one fails.

    The checks: no parameter listed twice (``ValueError``), and torch's own constructor's checks of the
    group's hyperparameters (as ``optimizer_class`` would refuse them); then ``also(group)``.
    """
    with torch_duplicate_warning_ignored():  # a repeated parameter is refused below, by name
        torch.optim.Optimizer.add_param_group(opt, param_group)
    group = opt.param_groups[-1]
    try:
        check_distinct_params(group, len(opt.param_groups) - 1)
        accepted = inspect.signature(optimizer_class.__init__).parameters
        torch_hyperparams(optimizer_class, {k: group[k] for k in opt.defaults if k in accepted})
        if also is not None:
            also(group)
    except Exception:
        opt.param_groups.pop()
        raise


@recorded
def from_torch(optimizer_class: type[torch.optim.Optimizer], /, **torch_kwargs: Any) -> GradientTransformation:
    """The transformation with the semantics of ``optimizer_class(params, **torch_kwargs)``.

    For every ``torch.optim`` class except ``LBFGS`` and ``SparseAdam``: the same
    keywords, defaults and validation errors as torch's constructor (it is run
    to check them), and updates that, added with :func:`functopk.apply_updates`,
    reproduce torch's parameters step by step (tested on PyTorch's own optimizer
    test configurations). ``lr`` keeps its Python type: a float stays a float
    (exact in float64 models), a 0-d tensor is read on device at every step.
    ``foreach`` and ``fused`` are checked by torch and then only choose torch's
    kernel, so the result is the same; ``capturable=True`` and
    ``differentiable=True`` raise ``NotImplementedError``.

    The optax-style aliases (:func:`functopk.adam`, ...) have optax's argument
    names (``b1``, ``b2``); this is the torch-named door to the same maths.

    Args:
        optimizer_class: A ``torch.optim`` class, e.g. ``torch.optim.AdamW``.
        **torch_kwargs: Its keyword arguments, as for torch.

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or torch rejects a keyword.
        ValueError: the class has no functopk form, or torch rejects a value.
        RuntimeError: torch rejects a combination of flags (``fused=True`` with ``foreach=True``).
        NotImplementedError: ``capturable=True`` or ``differentiable=True``.

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


NOT_HYPER = ("params", "param_names")
"""The keys of a param group that are not hyperparameters."""


class TorchClassGroups:
    """The base of the optimizers that compute a ``torch.optim`` class by functopk (``ParamGroupOptimizer``,
    ``SparseStateOptimizer``): their param groups, with the class's defaults and torch's own checks (its
    constructor's, :func:`add_checked_group`), each group's transformation, and saved groups read as torch reads
    them. Mixed in before :class:`torch.optim.Optimizer`."""

    optimizer_class: type[torch.optim.Optimizer]
    _spec: TorchSpec
    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]

    def _init_groups(self, optimizer_class: type[torch.optim.Optimizer], params: Any, defaults: Any) -> None:
        """``torch.optim.Optimizer``'s init with the class's complete hyperparameters (torch's checks first)."""
        self.optimizer_class, self._spec = optimizer_class, spec_for(optimizer_class)
        torch.optim.Optimizer.__init__(self, params, torch_hyperparams(optimizer_class, defaults))  # type: ignore[arg-type]

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group``'s hyperparameters, with what torch reads from the constructor's arguments instead."""
        return {**group, **{k: self.defaults[k] for k in self._spec.from_defaults}}

    def _build(self, group: dict[str, Any]) -> GradientTransformation:
        """The transformation for ``group``'s current hyperparameters."""
        return self._spec.build(self._hyper(group))

    def _owner_name(self) -> str:
        return f"torch.optim.{self.optimizer_class.__name__} through functopk"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim``); missing hyperparameters take the defaults.

        Raises:
            TypeError, ValueError: a hyperparameter of the group is invalid (checked now, not at the next
                step), or the group lists a parameter twice.
            NotImplementedError: the group sets ``capturable`` or ``differentiable``.
        """
        add_checked_group(self, self.optimizer_class, param_group, self._check_group)  # type: ignore[arg-type]

    def _check_group(self, group: dict[str, Any]) -> None:
        """What a new group must also satisfy (none here)."""

    def _saved_groups(self, state_dict: Any) -> list[dict[str, Any]]:
        """A state dict's param groups, read as torch reads them (keys an older torch did not save get the
        class's defaults: :func:`functopk.adapter.checkpoint.filled_group`), as many and as large as ours.

        Raises:
            TypeError: ``state_dict`` is not a dict with a list ``param_groups`` and a dict ``state``.
            ValueError: the groups differ in number or size, or a group lacks one of the class's keys.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict must be a dict with keys 'state' and 'param_groups'")
        if not isinstance(state_dict["param_groups"], list) or not isinstance(state_dict["state"], dict):
            raise TypeError("state_dict['param_groups'] must be a list and state_dict['state'] a dict")
        keys = [k for k in self.defaults if k not in NOT_HYPER]
        saved = state_dict["param_groups"]
        groups = [filled_group(self.optimizer_class, i, s, keys) for i, s in enumerate(saved)]
        check_group_sizes(groups, self.param_groups)
        return groups
