"""Parameter names: what ``topk_hook``'s checkpoints key each parameter's residual and velocity by.

A bucket's memory is a flat buffer laid out like DDP's bucket; a checkpoint
holds one tensor per parameter name, shaped like the parameter and in gradient
units, so that it loads into any later bucketing (see
:mod:`functopk.distributed.memory` for the placing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from functopk._checks import describe, listed
from functopk.distributed.memory import BucketMemory

__all__: list[str] = []


def model_info(model: Any) -> tuple[dict[int, str], dict[str, int], bool]:
    """``({id(param): name}, {name: numel}, find_unused_parameters)`` of the trainable parameters of ``model``."""
    if model is None:
        return {}, {}, False
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the DDP model or the module it wraps) or None, "
                        f"got {describe(model)}")  # fmt: skip
    find_unused = False
    if isinstance(model, DistributedDataParallel):
        find_unused, model = bool(model.find_unused_parameters), model.module
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return {id(p): name for name, p in named}, {name: p.numel() for name, p in named}, find_unused


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


def check_names(what: str, saved: dict[str, torch.Tensor], numels: dict[str, int]) -> None:
    """``ValueError`` unless every saved name is a parameter of the model (``numels``) of the same size."""
    if saved and not numels:
        raise ValueError(f"TopKHookState.load_state_dict needs the parameters' names to place the saved "
                         f"{what}: build the state with TopKHookState(..., model=ddp_model)")  # fmt: skip
    unknown = sorted(set(saved) - set(numels))
    resized = sorted(n for n, t in saved.items() if n in numels and t.numel() != numels[n])
    if unknown or resized:
        raise ValueError(f"TopKHookState.load_state_dict: {what} that match no parameter of the model "
                         f"{listed([repr(n) for n in unknown])}, or whose size differs from it "
                         f"{listed([repr(n) for n in resized])}")  # fmt: skip
