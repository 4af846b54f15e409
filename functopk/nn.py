"""``nn.Module`` glue: pure model functions over (params, buffers) trees.

``torch.func.functional_call`` runs a module with tensors you pass in, but a
module whose forward pass updates buffers (BatchNorm's running statistics in
training mode) then writes into the tensors you passed. Inside
``torch.func.grad`` that fails ("attempted to call in-place operation ... that
would mutate a captured Tensor"), and outside it silently mutates your inputs.
:func:`functionalize` makes the buffers explicit: they go in as an argument and
the updated buffers come out as a result, and the inputs are never written.

The model function works under ``torch.func.grad`` (BatchNorm in training mode
included), ``torch.func.vmap`` (per-example gradients, for models without
BatchNorm or with BatchNorm in evaluation mode: ``train=False``; a batch-norm in
training mode needs the whole batch and cannot run per example) and
``torch.compile(fullgraph=True)``. :func:`load_into_module_` writes trained
``(params, buffers)`` back into the module, e.g. to save it or to evaluate it
with ordinary code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from functopk._checks import check_bool, describe, path_str

__all__ = ["FunctionalModel", "functionalize", "load_into_module_"]

Tree = dict[str, torch.Tensor]


class FunctionalModel:
    """A pure function ``(params, buffers, *args, train=None, **kwargs) -> (output, new_buffers)``.

    Wraps a module; see :func:`functionalize`. ``params`` and ``buffers`` are
    dicts keyed like ``module.named_parameters()`` / ``named_buffers()``, and
    every key must be present (``strict``), so a misspelt or missing key is an
    error rather than a silent fall-back to the module's own tensors.

    ``train=True``/``False`` runs the module in training/evaluation mode for this
    call only (the module's own flag is restored afterwards); ``None`` uses the
    module's current mode.

    Example:
        >>> import torch, functopk as ft
        >>> model_fn, params, buffers = ft.nn.functionalize(torch.nn.Linear(2, 1))
        >>> type(model_fn).__name__
        'FunctionalModel'
        >>> out, new_buffers = model_fn(params, buffers, torch.zeros(3, 2))
        >>> out.shape, new_buffers
        (torch.Size([3, 1]), {})
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module

    def __call__(
        self, params: Tree, buffers: Tree, *args: Any, train: bool | None = None, **kwargs: Any
    ) -> tuple[Any, Tree]:
        if not isinstance(params, dict) or not isinstance(buffers, dict):
            raise TypeError(
                f"params and buffers must be dicts of tensors, got {type(params).__name__} and {type(buffers).__name__}"
            )
        if train is not None:
            check_bool(train, "train")
        # Fresh copies for the module to update in place (BatchNorm running stats):
        # the caller's buffers are never written, and inside torch.func.grad the
        # copies belong to the transformed function, so mutating them is allowed.
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        module = self.module
        was_training = module.training
        switch = train is not None and train != was_training
        if switch:
            module.train(not was_training)
        try:
            out = functional_call(module, (params, new_buffers), args, kwargs, strict=True)
        finally:
            if switch:
                module.train(was_training)
        return out, new_buffers

    def __repr__(self) -> str:
        return f"FunctionalModel({type(self.module).__name__})"


def functionalize(module: nn.Module) -> tuple[FunctionalModel, Tree, Tree]:
    """Split a module into a pure function and its ``(params, buffers)`` trees.

    The returned tensors are detached from autograd and share storage with the
    module: pure updates (:func:`functopk.apply_updates`) build new tensors and
    leave the module alone, while :func:`functopk.apply_updates_` writes into
    the module's own parameters.

    Returns:
        ``(model_fn, params, buffers)`` with
        ``model_fn(params, buffers, *inputs, train=None) -> (output, new_buffers)``.

    Example:
        >>> import torch, functopk as ft
        >>> from torch.func import grad
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        >>> model_fn, params, buffers = ft.nn.functionalize(net)
        >>> def loss_fn(params, buffers, x):
        ...     out, new_buffers = model_fn(params, buffers, x)
        ...     return out.square().mean(), new_buffers
        >>> grads, new_buffers = grad(loss_fn, has_aux=True)(params, buffers, torch.randn(8, 3))
        >>> int(new_buffers["1.num_batches_tracked"]), int(buffers["1.num_batches_tracked"])
        (1, 0)
    """
    model_fn = FunctionalModel(module)
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = {name: b.detach() for name, b in module.named_buffers()}
    return model_fn, params, buffers


def _checked_pairs(named: dict[str, torch.Tensor], values: Tree, kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair module tensors with new values after checking keys, shapes and dtypes."""
    if not isinstance(values, dict):
        raise TypeError(f"{kind} must be a dict of tensors, got {type(values).__name__}")
    missing = sorted(set(named) - set(values))
    unexpected = sorted(set(values) - set(named))
    if missing or unexpected:
        raise ValueError(
            f"{kind} keys do not match the module's {kind}: missing {missing}, unexpected {unexpected}"
        )
    pairs = []
    for name, target in named.items():
        value = values[name]
        where = kind + path_str((name,))
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be a tensor, got {describe(value)}")
        if value.shape != target.shape or value.dtype != target.dtype:
            raise ValueError(
                f"{where} has shape {tuple(value.shape)} and dtype {value.dtype}; the module's has "
                f"shape {tuple(target.shape)} and dtype {target.dtype}"
            )
        pairs.append((target, value))
    return pairs


def load_into_module_(module: nn.Module, params: Tree | None = None, buffers: Tree | None = None) -> nn.Module:
    """In place: copy ``params`` and ``buffers`` into the module's own tensors; return ``module``.

    The inverse of :func:`functionalize` after functional training. **Mutates**
    ``module`` (under ``torch.no_grad``); the dicts are only read. Keys must be
    exactly those of ``module.named_parameters()`` / ``named_buffers()`` (tied
    parameters appear once, as there), with equal shapes and dtypes; values may
    live on another device and are copied across. Everything is checked before
    anything is written, so a failed call leaves the module unchanged. Pass
    ``None`` to leave parameters or buffers alone.

    Args:
        module: The module to write into.
        params: New parameter values, keyed like ``module.named_parameters()``.
        buffers: New buffer values, keyed like ``module.named_buffers()``.

    Raises:
        TypeError: a dict or value has the wrong type.
        ValueError: keys, shapes or dtypes do not match the module's.

    Example:
        >>> import torch, functopk as ft
        >>> net = torch.nn.Linear(2, 1)
        >>> model_fn, params, buffers = ft.nn.functionalize(net)
        >>> params = ft.tree.map(torch.zeros_like, params)
        >>> ft.nn.load_into_module_(net, params).weight
        Parameter containing:
        tensor([[0., 0.]], requires_grad=True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    pairs = []
    if params is not None:
        pairs += _checked_pairs(dict(module.named_parameters()), params, "params")
    if buffers is not None:
        pairs += _checked_pairs(dict(module.named_buffers()), buffers, "buffers")
    with torch.no_grad():
        for target, value in pairs:
            target.copy_(value)
    return module
