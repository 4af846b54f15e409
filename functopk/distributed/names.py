"""Parameter names: what ``topk_hook``'s checkpoints key each parameter's residual and velocity by.

A bucket's memory is a flat buffer laid out like DDP's bucket; a checkpoint
holds one tensor per parameter name, shaped like the parameter and in gradient
units, so that it loads into any later bucketing (see
:mod:`functopk.distributed.memory` for the placing). The names come from the
model given to the hook's state (:func:`model_info`), as does DDP's
``find_unused_parameters``; :func:`registered_find_unused` finds the DDP
model a state is registered on when it was not given.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from functopk._checks import describe, listed
from functopk.distributed.memory import BucketMemory

__all__: list[str] = []


def model_info(model: Any) -> tuple[dict[int, str], dict[str, tuple[int, ...]], bool]:
    """``({id(param): name}, {name: shape}, find_unused_parameters)`` of the trainable parameters of ``model``."""
    if model is None:
        return {}, {}, False
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the DDP model or the module it wraps) or None, "
                        f"got {describe(model)}")  # fmt: skip
    find_unused = False
    if isinstance(model, DistributedDataParallel):
        find_unused, model = bool(model.find_unused_parameters), model.module
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return {id(p): name for name, p in named}, {name: tuple(p.shape) for name, p in named}, find_unused


def registered_find_unused(state: object) -> bool:
    """Is ``state`` the comm-hook state of a DDP model built with ``find_unused_parameters=True``?

    A hook is not told which DDP model calls it, so this looks for the
    ``(hook, state)`` pair that ``DistributedDataParallel.register_comm_hook``
    keeps in the model's ``_comm_hooks`` list, through the garbage collector's
    referrers (three scans of the tracked objects: run once per state).
    """
    pairs = [p for p in gc.get_referrers(state) if type(p) is tuple and len(p) == 2 and p[1] is state]
    lists = [x for x in gc.get_referrers(*pairs) if type(x) is list] if pairs else []
    for owner in gc.get_referrers(*lists) if lists else ():
        attrs = owner if type(owner) is dict else getattr(owner, "__dict__", None)  # the model or its __dict__
        if isinstance(attrs, dict) and any(attrs.get("_comm_hooks") is x for x in lists):
            if attrs.get("find_unused_parameters") is True:
                return True
    return False


def by_name(
    buckets: Iterable[BucketMemory],
    field: str,
    loaded: dict[str, torch.Tensor],
    names: dict[int, str],
    unit: torch.Tensor | float | None,
) -> dict[str, torch.Tensor]:
    """Every bucket's ``field`` (residual or velocity) split by parameter name, in gradient units (divided
    by ``unit``, the loss scale it is kept at), plus the ``loaded`` entries not yet placed in a bucket."""
    named = {name: t.clone() for name, t in loaded.items()}
    for mem in buckets:
        flat = getattr(mem, field)
        if flat is None:
            continue
        if mem.slots is None:
            raise ValueError(f"TopKHookState.state_dict: a bucket's parameters do not tile its buffer, so its "
                             f"{field} cannot be saved by parameter")  # fmt: skip
        for s, piece in zip(mem.slots, mem.pieces(flat)):
            if s.pid not in names:
                raise ValueError("TopKHookState.state_dict needs the parameters' names: build the state with "
                                 "TopKHookState(..., model=ddp_model)")  # fmt: skip
            piece = piece.view(s.shape)
            named[names[s.pid]] = piece.clone() if unit is None else piece / unit
    return named


def check_names(what: str, saved: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``state_dict[what]`` checked: each parameter name of the model (``shapes``) to a floating-point
    tensor of that parameter's shape. ``TypeError`` or ``ValueError`` (naming the key) otherwise."""
    key = f"state_dict[{what!r}]"
    if not isinstance(saved, Mapping):
        raise TypeError(f"{key} must be a dict of parameter name to tensor, got {describe(saved)}")
    for name, t in saved.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{key}[{name!r}] must be a floating-point tensor keyed by a parameter name, "
                            f"got {describe(t)}")  # fmt: skip
    if saved and not shapes:
        raise ValueError(f"TopKHookState.load_state_dict needs the parameters' names to place the saved "
                         f"{what}: build the state with TopKHookState(..., model=ddp_model)")  # fmt: skip
    unknown = sorted(set(saved) - set(shapes))
    reshaped = sorted(n for n, t in saved.items() if n in shapes and tuple(t.shape) != shapes[n])
    if unknown or reshaped:
        raise ValueError(f"TopKHookState.load_state_dict: {what} that match no parameter of the model "
                         f"{listed([repr(n) for n in unknown])}, or whose shape differs from it "
                         f"{listed([repr(n) for n in reshaped])}")  # fmt: skip
    return dict(saved)
