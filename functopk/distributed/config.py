"""The settings of a top-k exchange, checked once and frozen: what every rank must agree on.

:class:`ExchangeConfig` is what :func:`functopk.distributed.distributed_topk`
takes; :class:`HookConfig` adds what only the DDP hook has (warm-up,
selection, momentum correction, overlap) and is what
:class:`functopk.distributed.TopKHookState` keeps. Both check every field
when built (``TypeError``/``ValueError`` naming it) and cannot change
afterwards: the first call compares them across ranks
(:mod:`functopk.distributed.agree`), so a later change would go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functopk._checks import check_bool, check_choice, check_density, check_int, check_k_or_density, check_number
from functopk.sparse.k import k_from_density, resolve_k

__all__ = ["EXCHANGES", "SELECTIONS", "ExchangeConfig", "HookConfig"]

EXCHANGES = ("allgather", "tree")
SELECTIONS = ("exact", "threshold")


@dataclass(frozen=True)
class ExchangeConfig:
    """How many pairs each rank sends, and how they travel.

    Args:
        k: Pairs each rank sends per step (exactly one of ``k`` and ``density``).
        density: The fraction of all coordinates sent per step instead.
        reselect: gTop-k: keep only the global top ``k`` of the sum.
        exchange: ``"allgather"`` or ``"tree"``.

    Example:
        >>> from functopk.distributed.config import ExchangeConfig
        >>> ExchangeConfig(density=0.5).k_for(10)
        5
        >>> ExchangeConfig(k=2, exchange="ring")
        Traceback (most recent call last):
        ...
        ValueError: exchange must be one of ('allgather', 'tree'), got str 'ring'
    """

    k: int | None = None
    density: float | None = None
    reselect: bool = False
    exchange: str = "allgather"

    def __post_init__(self) -> None:
        k, density = check_k_or_density(self.k, self.density, allow_tensor=False)
        self._set(k=k, density=density)
        check_bool(self.reselect, "reselect")
        check_choice(self.exchange, "exchange", EXCHANGES)

    def _set(self, **fields: Any) -> None:
        """Store checked (converted) values on the frozen instance, once, while it is built."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def k_for(self, numel: int) -> int:
        """The pairs each rank sends for a tree of ``numel`` coordinates (a Python int: it sizes the buffers)."""
        k = resolve_k(self.k, self.density, numel, name="the tree")
        assert isinstance(k, int)  # k and density are Python numbers here
        return k


@dataclass(frozen=True)
class HookConfig(ExchangeConfig):
    """:func:`functopk.distributed.topk_hook`'s settings: a density per bucket, and the hook's own options.

    The fields are :class:`functopk.distributed.TopKHookState`'s arguments of
    the same names (see there); ``k`` is not one of them (always ``None``).

    Example:
        >>> from functopk.distributed.config import HookConfig
        >>> HookConfig(density=0.01, warmup_iters=5).bucket_k(1000)
        10
    """

    density: float | None = 0.01
    warmup_iters: int = 10
    selection: str = "exact"
    momentum: float = 0.0
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.k is not None:
            raise ValueError(f"HookConfig takes a density, not k (got k={self.k!r})")
        self._set(density=float(check_density(self.density, allow_tensor=False)))
        self._set(warmup_iters=check_int(self.warmup_iters, "warmup_iters", minimum=0))
        check_bool(self.reselect, "reselect")
        check_choice(self.selection, "selection", SELECTIONS)
        self._set(momentum=check_number(self.momentum, "momentum", minimum=0.0, below=1.0))
        check_choice(self.exchange, "exchange", EXCHANGES)
        check_bool(self.overlap, "overlap")

    def bucket_k(self, numel: int) -> int:
        """The pairs each rank sends for a bucket of ``numel`` coordinates."""
        k = k_from_density(self.density, numel)  # type: ignore[arg-type]  # a float after __post_init__
        assert isinstance(k, int)  # a Python density gives a Python k
        return k
