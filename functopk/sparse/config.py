"""The tuning constants of the selection kernels, as one frozen object: :class:`KernelConfig`.

The defaults are the measured production values (``docs/topk.md``). Tests and
benchmarks pass a different configuration to the public functions
(``config=``) instead of patching module globals: tiny trees then run every
branch of the eager exact kernel (column scan, direct scan, packed small
leaves, segment tails, band selection, fallbacks).
"""

from __future__ import annotations

import dataclasses

from functopk._checks import check_choice, check_int

__all__ = ["BACKENDS", "DEFAULT_CONFIG", "KernelConfig", "config_or_default"]

BACKENDS = ("auto", "triton", "aten")
"""The values of :attr:`KernelConfig.backend`."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning constants of the selection kernels (they change the speed, never the result).

    Attributes:
        exact_min_numel: Trees smaller than this use the static kernel even in
            eager mode (it is as fast there).
        segment: Elements per segment of the direct scan (2 MiB of float32: the
            reused buffer stays in the L3 cache).
        sample_size: Target size of the systematic sample that brackets the k-th magnitude.
        margin: Width of the bracket, in binomial standard deviations of the sample
            count on each side.
        band_min: Candidate count above which the upper end of the bracket is used
            to shrink the final selection.
        max_rows: Most rows of the column view of a leaf (see
            :func:`functopk.sparse.kernels.scan.column_rows`).
        column_balance: Balance constant of ``column_rows``.
        column_max_fraction: Candidate fraction above which leaves are scanned directly.
        words_max_fraction: Candidate fraction above which the direct scan runs
            ``nonzero`` on the values rather than on int64 words.
        min_columns: Leaves with fewer than ``rows * min_columns`` elements are scanned directly.
        column_block: Large leaves are viewed as columns block by block, of at most
            this many elements.
        abandon_min: The scan is abandoned (and the static kernel runs instead)
            once it has found more than ``max(abandon_min, abandon_factor *
            expected)`` candidates, ``expected`` being the count the sampled
            bracket predicts: a misleading sample costs at most about the static
            kernel, never a pathological candidate set.
        abandon_factor: See ``abandon_min``.
        native: Scan with the compiled loop of :mod:`functopk.sparse.kernels.native`
            where it could be built (CPU leaves); ``False``: always the ATen scan
            (its strategies are what the other fields tune).
        backend: Which kernel serves ``method="exact"``: ``"auto"`` (the Triton
            kernel for CUDA tensors where Triton imports, else ATen; CPU tensors
            keep the CPU kernels), ``"triton"`` (always the Triton kernel: CUDA
            tensors, or CPU tensors under ``TRITON_INTERPRET=1``) or ``"aten"``
            (never). The result is the same on every backend.
        triton_block: Coordinates each program of the Triton kernel owns (a power
            of 2, at least 64).
        triton_room: The Triton kernel's candidate buffer holds this many times
            the count its sample predicts (at least ``abandon_min``); more
            candidates send it to its fallback. Its sample is ``sample_size`` (at
            most 4096) and its bracket ``margin`` wide, as for the CPU scan.

    Example:
        >>> import torch, functopk as ft
        >>> tiny = ft.sparse.KernelConfig(exact_min_numel=0, segment=64, sample_size=16)
        >>> ft.topk_indices({"w": torch.arange(-50.0, 50.0)}, 2, config=tiny).indices
        tensor([0, 1])
    """

    exact_min_numel: int = 1 << 16
    segment: int = 1 << 19
    sample_size: int = 1 << 16
    margin: float = 4.0
    band_min: int = 1 << 15
    max_rows: int = 256
    column_balance: float = 0.25
    column_max_fraction: float = 0.003
    words_max_fraction: float = 0.03
    min_columns: int = 256
    column_block: int = 1 << 21
    abandon_min: int = 1 << 16
    abandon_factor: float = 8.0
    native: bool = True
    backend: str = "auto"
    triton_block: int = 1 << 15
    triton_room: float = 2.0

    def __post_init__(self) -> None:
        check_choice(self.backend, "backend", BACKENDS)
        block = check_int(self.triton_block, "triton_block", minimum=64)
        if block & (block - 1):
            raise ValueError(f"triton_block must be a power of 2, got {block}")


DEFAULT_CONFIG = KernelConfig()
"""The production configuration (used when a function is given ``config=None``)."""


def config_or_default(config: object) -> KernelConfig:
    """``config``, or :data:`DEFAULT_CONFIG` for ``None``; ``TypeError`` for anything else.

    Example:
        >>> config_or_default(None) is DEFAULT_CONFIG
        True
    """
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a functopk.sparse.KernelConfig or None, got {type(config).__name__}")
    return config
