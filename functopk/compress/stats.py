"""What a compressor did at each step, measured on device: :func:`compression_stats`.

Wrap any compressor (``topk``, ``randk``, ``threshold``, ``layerwise_topk``,
...) and its state carries, after every update, the coordinates it kept, the
density, the fraction of the input's squared norm it kept, the norm of what it
did not send, and the bytes a data-parallel rank would put on the wire as
(index, value) pairs. All are 0-d tensors computed with the update (foreach
norms and per-leaf counts, no host sync), so a compiled step stays one graph;
read them when you log, e.g. once per epoch.

Where to put it: *inside* :func:`functopk.error_feedback`,
``error_feedback(compression_stats(topk(k)))``, the wrapper sees the corrected
input (gradient plus residual) and the sent part, so ``residual_norm`` is the
norm of the new residual and ``energy`` the share of the corrected update that
was sent; around ``topk`` alone it measures the gradient itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functopk._checks import check_int, check_leaves, check_like
from functopk.base import GradientTransformation, OptState, Params, Updates, recorded
from functopk.build import wrapper
from functopk.tree import foreach

__all__ = ["CompressionStats", "CompressionStatsState", "compression_stats"]


class CompressionStats(NamedTuple):
    """One step of a compressor, as 0-d tensors on the updates' device.

    Attributes:
        kept: Coordinates sent (non-zero in the output), int64.
        density: ``kept / n`` for the ``n`` coordinates of the input, float32.
        energy: ``|output|^2 / |input|^2``, the fraction of the squared norm sent
            (1 for an all-zero input), float32.
        residual_norm: ``|input - output|``, the norm of what was not sent, float32.
        bytes: ``kept * (index_bytes + value bytes)`` summed over leaves: a
            rank's wire bytes for (index, value) pairs, int64.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.compress.compression_stats(ft.topk(1))
        >>> _, state = tx.update({"w": torch.tensor([3.0, -4.0])}, tx.init({"w": torch.zeros(2)}))
        >>> state.stats.kept, state.stats.density, state.stats.bytes
        (tensor(1), tensor(0.5000), tensor(8))
    """

    kept: torch.Tensor
    density: torch.Tensor
    energy: torch.Tensor
    residual_norm: torch.Tensor
    bytes: torch.Tensor


class CompressionStatsState(NamedTuple):
    """State of :func:`compression_stats`: the last step's statistics and the compressor's own state.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.compress.compression_stats(ft.topk(1)).init({"w": torch.zeros(2)})
        >>> state.stats.kept, state.inner_state
        (tensor(0), EmptyState())
    """

    stats: CompressionStats
    inner_state: OptState


def _zero_stats(device: torch.device) -> CompressionStats:
    i, f = torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), device=device)
    return CompressionStats(kept=i, density=f, energy=f.clone(), residual_norm=f.clone(), bytes=i.clone())


def _measure(inputs: list[torch.Tensor], outputs: list[torch.Tensor], index_bytes: int) -> CompressionStats:
    device = inputs[0].device
    counts = torch.stack([torch.count_nonzero(y) for y in outputs])
    sizes = torch.tensor([index_bytes + y.element_size() for y in outputs], dtype=torch.int64, device=device)
    n = sum(x.numel() for x in inputs)
    norm_in, norm_out = foreach.global_norm(inputs), foreach.global_norm(outputs)
    energy = torch.where(norm_in > 0, (norm_out / norm_in).square(), torch.ones_like(norm_in))
    kept = counts.sum()
    return CompressionStats(
        kept=kept,
        density=(kept.to(torch.float64) / max(n, 1)).to(torch.float32),
        energy=energy.to(torch.float32),
        residual_norm=foreach.global_norm(foreach.sub(inputs, outputs)).to(torch.float32),
        bytes=(counts * sizes).sum(),
    )


@recorded
def compression_stats(inner: GradientTransformation, *, index_bytes: int = 4) -> GradientTransformation:
    """Record what the compressor ``inner`` kept at each step in the state (see the module docstring).

    The updates pass through unchanged: this is ``inner`` plus bookkeeping (a
    count per leaf and three foreach norms per step).

    Args:
        inner: A compressor returning a dense tree like its input, zero where it sent nothing.
        index_bytes: Bytes of one flat index on the wire (4 for int32, enough below 2**31 coordinates).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.error_feedback(ft.compress.compression_stats(ft.topk(1)))
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> sent, state = tx.update({"w": torch.tensor([3.0, 0.0, 4.0])}, state)
        >>> stats = state.inner_state.stats
        >>> stats.energy, stats.residual_norm     # 4 of 5 (norm) sent: 16/25 of the energy; 3 left
        (tensor(0.6400), tensor(3.))
    """
    index_bytes = check_int(index_bytes, "index_bytes", minimum=0)

    def init(params: Params, inner_state: OptState) -> CompressionStatsState:
        leaves, _ = check_leaves(params, "params") if params is not None else ([], None)
        device = leaves[0].device if leaves else torch.device("cpu")
        return CompressionStatsState(stats=_zero_stats(device), inner_state=inner_state)

    def update(
        updates: Updates, state: CompressionStatsState, params: Params | None = None
    ) -> tuple[Updates, CompressionStatsState]:
        inputs, treedef = check_leaves(updates, "updates", floating=True)
        out, inner_state = inner.update(updates, state.inner_state, params)
        outputs = check_like(out, inputs, treedef, name="the inner transformation's output", expected_name="its input")
        stats = _measure(inputs, outputs, index_bytes) if inputs else state.stats
        return out, CompressionStatsState(stats=stats, inner_state=inner_state)

    return wrapper("compression_stats", inner, update, init=init, state=CompressionStatsState)
