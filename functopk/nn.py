"""``nn.Module`` glue: pure model functions over (params, buffers) trees.

``torch.func.functional_call`` runs a module with tensors you pass in, but a
module whose forward pass updates buffers (BatchNorm's running statistics in
training mode) then writes into the tensors you passed. Inside
``torch.func.grad`` that fails ("attempted to call in-place operation ... that
would mutate a captured Tensor"), and outside it silently mutates your inputs.
:func:`functionalize` makes the buffers explicit: they go in as an argument and
the updated buffers come out as a result, and the inputs are never written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["FunctionalModel", "functionalize"]

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
        if train is not None and not isinstance(train, bool):
            raise TypeError(f"train must be a bool or None, got {type(train).__name__}")
        # Fresh copies for the module to update in place (BatchNorm running stats):
        # the caller's buffers are never written, and inside torch.func.grad the
        # copies belong to the transformed function, so mutating them is allowed.
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        module = self.module
        switch = train is not None and train != module.training
        if switch:
            module.train(train)
        try:
            out = functional_call(module, (params, new_buffers), args, kwargs, strict=True)
        finally:
            if switch:
                module.train(not train)
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
