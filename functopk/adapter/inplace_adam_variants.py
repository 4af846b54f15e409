"""In-place steps for ``torch.optim.NAdam`` and ``RAdam``: :mod:`functopk.optim.adam_variants`'s maths, in the state.

As :mod:`functopk.adapter.inplace` (its checks and conventions): the moments
are updated with ``lerp_``, ``mul_`` and ``addcmul_`` where the pure update calls
the out-of-place kernels, then the same direction function
(:func:`~functopk.optim.adam_variants.nadam_direction`,
:func:`~functopk.optim.adam_variants.radam_direction`) computes the update, so
the results are the pure path's bit for bit (``tests/adapter/test_inplace.py``).
NAdam's running product ``mu_product`` is a shared 0-d leaf: a new one each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functopk.adapter.inplace import Entries, InplaceStep, Run, all_numbers, fits, with_entry
from functopk.optim import adam_variants

__all__ = ["nadam_step", "radam_step"]


def _moments_(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries, cfg: Any) -> tuple[Any, ...]:
    """torch's first moves on the gradient, then Adam's moments updated in the state; ``(g, m, v)``."""
    g = adam_variants.torch_gradient(grads, params, cfg)
    m, v = [e["exp_avg"] for e in entries], [e["exp_avg_sq"] for e in entries]
    torch._foreach_lerp_(m, g, 1.0 - cfg.b1)
    torch._foreach_mul_(v, cfg.b2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - cfg.b2)
    return g, m, v


def _hyper(h: Mapping[str, Any], *extra: str) -> Any:
    """The checked config of a group whose hyperparameters are all Python numbers, else ``None``."""
    b1, b2 = h["betas"]
    if not all_numbers(h["lr"], b1, b2, h["eps"], h["weight_decay"], *(h[k] for k in extra)):
        return None
    return adam_variants.torch_config(dict(h))


def nadam_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.NAdam`` in place: the maths of :func:`functopk.optim.nadam`.

    Example:
        >>> from functopk.adapter.inplace_adam_variants import nadam_step
        >>> h = {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "momentum_decay": 4e-3,
        ...      "decoupled_weight_decay": False, "maximize": False}
        >>> nadam_step(h) is not None
        True
    """
    cfg = _hyper(h, "momentum_decay")
    if cfg is None:
        return None
    decay = h["momentum_decay"]

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("exp_avg", "exp_avg_sq")):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g, m, v = _moments_(grads, params, entries, cfg)
            count, product = entries[0]["step"], entries[0]["mu_product"]
            out, stored = adam_variants.nadam_direction(g, m, v, count, product, params, cfg, decay)
            shared = {"step": count + 1, "mu_product": stored}  # one of each for the cohort: it steps together
            return out, [{**e, **shared} for e in entries]

        return run

    return check


def radam_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.RAdam`` in place: the maths of :func:`functopk.optim.radam`.

    Example:
        >>> import torch
        >>> from functopk.adapter.inplace_adam_variants import radam_step
        >>> h = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
        ...      "decoupled_weight_decay": False, "maximize": False}
        >>> radam_step({**h, "lr": torch.tensor(1e-3)}) is None   # a tensor lr: the pure path
        True
    """
    cfg = _hyper(h)
    if cfg is None:
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("exp_avg", "exp_avg_sq")):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g, m, v = _moments_(grads, params, entries, cfg)
            count = entries[0]["step"]
            out = adam_variants.radam_direction(g, m, v, count, params, cfg)
            return out, with_entry(entries, "step", count + 1)

        return run

    return check

