"""The exact global top-k in Triton: the buffers, the launches, and when the kernel serves.

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's
interpreter, for tests: it must be set before ``triton`` is first imported).
Same selection as every exact kernel of functopk (:mod:`functopk.sparse.kernels`):
``|x|`` compared in the common dtype, NaN as ``+inf``, ties to the lower flat
index; bit for bit the CPU kernel's indices and values.

Step 1, bracket (one program): a systematic sample of 4096 coordinates gives
a threshold key with a little more than ``k`` coordinates at or above it.
Step 2, compact (the one read of every coordinate): the coordinates above the
threshold become candidates, written tile by tile in flat order; those at the
threshold (ties) are only counted.
Step 3, radix (``L`` passes of 8 bits: 4 for fp16/bf16/fp32 trees, 8 for fp64):
the histograms of the candidates' keys find the k-th largest key exactly.
When fewer than ``k`` candidates lie above the threshold but the ties make up
the rest, the threshold is the k-th largest key and the passes do nothing.
Step 4, emit: the keys above it and the first ties in flat order are written,
each at its rank: sorted indices and values, or a mask, or a dense buffer.

Nothing is read on the host and every buffer's size is fixed by ``n``, ``k``
and the configuration, so a call can be captured in a CUDA graph and replayed,
and the custom operator (:func:`functopk.sparse.ops.triton_topk`) compiles.
When the sample misleads (fewer than ``k`` coordinates at or above the
threshold, or more candidates than the buffer holds), the radix passes and the
emit read the leaves themselves instead of the candidates: the same result, at
the cost of ``L + 1`` more reads. Where the leaves are read from:
:mod:`~functopk.sparse.kernels.triton_layout`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import torch

from functopk._compat import assume_constant_result
from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels.triton_layout import Plan, concatenated, plan

__all__ = [
    "MAX_NUMEL",
    "OUTPUTS",
    "TritonStats",
    "available",
    "capacity",
    "interpreting",
    "launches",
    "run",
    "sample_size",
    "serves",
]

OUTPUTS = ("indices", "masks", "dense")
"""What :func:`run` can write (the emit kernel's ``write`` argument is the index)."""

SAMPLE = 4096  # the most coordinates in the sample of step 1 (one program ranks them)
_STATE_HEAD = 4  # int64 words of the state before its radix slots (the kernels' SLOT)
MAX_NUMEL = 2**31 - 1
"""The largest tree the kernels take (their counts are int32); larger trees keep the ATen kernels."""

_TRITON: list[bool] = []  # whether triton imports, once known
_PRIMED: set[tuple] = set()  # launch signatures whose flat-buffer kernels are compiled (see _prime)


@assume_constant_result
def available() -> bool:
    """Whether Triton imports here (tried once; a compiled graph takes the answer as a constant).

    Example:
        >>> available() in (True, False)
        True
    """
    if not _TRITON:
        try:
            import triton  # noqa: F401
        except Exception:  # not installed, or broken: the ATen kernels serve
            _TRITON.append(False)
        else:
            _TRITON.append(True)
    return _TRITON[0]


@assume_constant_result
def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels on CPU tensors (``TRITON_INTERPRET=1``).

    Example:
        >>> interpreting() in (True, False)
        True
    """
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def serves(leaves: Sequence[torch.Tensor], n: int, backend: str) -> bool:
    """Whether the Triton kernel serves ``method="exact"`` on ``leaves`` with ``backend`` (see ``KernelConfig``).

    ``"auto"``: CUDA leaves where Triton imports and the tree fits (:data:`MAX_NUMEL`); ``"aten"``: never;
    ``"triton"``: always, or a ``ValueError`` saying why it cannot run.

    Example:
        >>> serves([torch.ones(3)], 3, "auto"), serves([torch.ones(3)], 3, "aten")
        (False, False)
    """
    if backend == "aten":
        return False
    device = leaves[0].device.type
    if backend == "auto":
        return device == "cuda" and n <= MAX_NUMEL and available()
    if not available():
        raise ValueError("backend='triton' needs the triton package, which does not import here")
    if device != "cuda" and not (device == "cpu" and interpreting()):
        raise ValueError(
            f"backend='triton' runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before "
            f"triton is imported); got {device} tensors"
        )
    if n > MAX_NUMEL:
        raise ValueError(f"backend='triton' takes trees of at most {MAX_NUMEL} coordinates, got {n}")
    return True


def sample_size(config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Coordinates in the sample of step 1: ``config.sample_size`` rounded down to a power of 2, at most 4096.

    Example:
        >>> from functopk.sparse.config import KernelConfig
        >>> sample_size(), sample_size(KernelConfig(sample_size=100))
        (4096, 64)
    """
    return min(SAMPLE, 1 << max(4, config.sample_size.bit_length() - 1))


def capacity(n: int, k: int | None, config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Candidates the buffers of step 2 hold: ``triton_room`` times the count the sample predicts, at least
    ``abandon_min``, at most ``n``.

    A tensor ``k`` (``None`` here: not read) gets an eighth of the tree.

    Example:
        >>> capacity(25_557_032, 1000), capacity(1000, 10), capacity(25_557_032, None)
        (65536, 1000, 3194629)
    """
    if k is None:
        expected = n / 8
    else:
        s = min(n, sample_size(config))
        p = k / n
        mean = s * p
        rank = math.floor(mean + config.margin * math.sqrt(mean * (1.0 - p))) + 2
        expected = config.triton_room * rank * n / s
    return max(1, int(min(n, max(config.abandon_min, expected))))


def _kernels():
    """The kernels module (imports Triton: only when a kernel runs)."""
    from functopk.sparse.kernels import triton_kernels

    return triton_kernels


def _even(size: int, per: int) -> int:
    """``size`` rounded up to a multiple of ``per`` (so every buffer cut from a workspace is 16-byte aligned)."""
    return -(-size // per) * per


@dataclasses.dataclass
class _Buffers:
    """The scratch of one call: sizes fixed by the plan, ``k`` and the capacity, nothing data-dependent."""

    state: torch.Tensor  # int64: threshold, candidates above it, ties at it, -, then (prefix, need) per radix slot
    hist: torch.Tensor  # int32 (passes, 256): the radix histograms
    rec_base: torch.Tensor  # int64 per tile: where its candidates start in the s* buffers
    rec_cnt: torch.Tensor  # int32 per tile: how many it has
    totals: torch.Tensor  # int32 per program: its candidates
    tie_totals: torch.Tensor  # int32 per program: its coordinates at the threshold
    skey: torch.Tensor  # the candidates as compact_kernel wrote them (tile by tile, in the atomics' order)
    sidx: torch.Tensor
    sval: torch.Tensor
    ckey: torch.Tensor  # the same in flat order (order_kernel)
    cidx: torch.Tensor
    cval: torch.Tensor
    above_rows: torch.Tensor  # int32 per program: keys above the prefix (last radix pass)
    digit_rows: torch.Tensor  # int32 (programs, 256): keys at or above each last digit (last radix pass)


def _buffers(p: Plan, cap: int, passes: int, grid: int, device: torch.device) -> _Buffers:
    key_dtype = torch.int64 if p.dtype == torch.float64 else torch.int32
    tiles = p.programs * p.tiles
    c = _even(cap, 4)
    sizes64 = [_even(_STATE_HEAD + 2 * (passes + 1), 2), _even(tiles, 2), c, c]
    sizes32 = [passes * 256, _even(tiles, 4), _even(p.programs, 4), _even(p.programs, 4), _even(grid, 4), grid * 256]
    i64 = torch.empty(sum(sizes64), dtype=torch.int64, device=device).split(sizes64)
    i32 = torch.empty(sum(sizes32), dtype=torch.int32, device=device).split(sizes32)
    keys = torch.empty(2 * c, dtype=key_dtype, device=device).split(c)
    vals = torch.empty(2 * c, dtype=p.dtype, device=device).split(c)
    return _Buffers(i64[0], i32[0], i64[1], i32[1], i32[2], i32[3], keys[0], i64[2], vals[0], keys[1], i64[3],
                    vals[1], i32[4], i32[5])


@dataclasses.dataclass
class TritonStats:
    """What one :func:`run` did (filled in when passed: host reads, for tests and benchmarks).

    Attributes:
        path: ``"candidates"`` (the radix passes read the candidates), ``"ties"`` (fewer than ``k``
            candidates, the ties at the threshold make up the rest: no radix pass) or ``"fallback"``
            (they read the leaves: fewer than ``k`` coordinates at or above the sampled threshold, or more
            candidates than the buffer holds).
        candidates: Coordinates above the sampled threshold.
        ties: Coordinates at the sampled threshold.
        capacity: Candidates the buffer holds.
        source: ``"flat"`` (one buffer), ``"table"`` (a leaf table) or ``"copy"`` (concatenated first).
    """

    path: str = ""
    candidates: int = -1
    ties: int = -1
    capacity: int = 0
    source: str = ""


def _outputs(output: str, size: int, p: Plan, device: torch.device) -> tuple:
    """(indices, values, mask, dense) for the emit kernel: the one ``output`` asks for, ``None`` for the rest."""
    if output == "indices":
        return (torch.empty(size, dtype=torch.int64, device=device), torch.empty(size, dtype=p.dtype, device=device),
                None, None)
    if output == "masks":
        return None, None, torch.zeros(p.n, dtype=torch.uint8, device=device), None
    return None, None, None, torch.zeros(p.n, dtype=p.dtype, device=device)


def launches(p: Plan, k: int | torch.Tensor, output: str, cap: int, config: KernelConfig = DEFAULT_CONFIG) -> tuple:
    """Steps 1 to 4 on the plan's source as ``(kernel, grid, args, meta)`` launches, the outputs and the scratch.

    Nothing runs here: :func:`run` launches them in order (``kernel[grid](*args, **meta)``); a test
    compiles them for a GPU without one.
    """
    kern = _kernels()
    device = p.flat.device if p.flat is not None else p.table.device  # type: ignore[union-attr]
    key64 = p.dtype == torch.float64
    passes = 8 if key64 else 4
    on_device = isinstance(k, torch.Tensor)
    grid = max(p.programs, -(-cap // p.tile))  # leaf programs (fallback), or one tile of candidates each
    buf = _buffers(p, cap, passes, grid, device)
    k_ptr, k_int = (k, 0) if on_device else (buf.state, int(k))  # (k_ptr is read only for a tensor k)
    src, table = p.flat, p.table
    meta = dict(FLAT=src is not None, KEY64=key64)
    tile = dict(TILE=p.tile, SUB=p.tiles, num_warps=8 if p.tile >= 1024 else 4)
    k_args = (k_ptr, k_int, int(on_device))
    steps = [
        (kern.bracket_kernel, 1, (src, table, buf.state, buf.hist, *k_args, p.n, p.leaves, float(config.margin)),
         dict(L=passes, SAMPLE=sample_size(config), num_warps=8, **meta)),
        (kern.compact_kernel, p.programs, (src, table, buf.state, buf.rec_base, buf.rec_cnt, buf.totals,
                                           buf.tie_totals, buf.skey, buf.sidx, buf.sval, p.n, p.leaves, cap),
         dict(**meta, **tile)),
        (kern.order_kernel, p.programs, (buf.state, buf.rec_base, buf.rec_cnt, buf.totals, buf.skey, buf.sidx,
                                         buf.sval, buf.ckey, buf.cidx, buf.cval, *k_args, cap), tile),
    ]
    scratch = (buf.state, buf.hist, buf.ckey, buf.cidx, buf.cval, buf.above_rows, buf.digit_rows, *k_args)
    common = dict(L=passes, **meta, **tile)
    for j in range(1, passes + 1):
        steps.append((kern.digit_kernel, grid, (src, table, *scratch, p.n, p.leaves, p.programs, cap, j), common))
    out = _outputs(output, p.n if on_device else int(k), p, device)
    # the outputs not written get stand-ins of the same dtypes: one compiled emit kernel serves all three
    stand_ins = (buf.cidx, buf.cval, buf.hist.view(torch.uint8), buf.cval)
    targets = tuple(stand_in if o is None else o for o, stand_in in zip(out, stand_ins))
    steps.append((kern.emit_kernel, grid, (src, table, *scratch, buf.totals, buf.tie_totals, *targets,
                                           OUTPUTS.index(output), p.n, p.leaves, p.programs, cap), common))
    return steps, out, buf


def _launch(p: Plan, k: int | torch.Tensor, output: str, cap: int, config: KernelConfig) -> tuple:
    """Run :func:`launches`; returns the outputs and the scratch."""
    steps, out, buf = launches(p, k, output, cap, config)
    for kernel, grid, args, meta in steps:
        kernel[(grid,)](*args, **meta)
    return out, buf


def _prime(leaves: Sequence[torch.Tensor], p: Plan, k: int | torch.Tensor, output: str, cap: int,
           config: KernelConfig) -> None:
    """Compile, once per signature, the kernels a CUDA graph capture of this call would run.

    A capture of leaves without a cached table (leaves no call outside the capture read, as in
    ``torch.compile(mode="reduce-overhead")``, whose graph allocates them) concatenates them and reads
    one flat buffer (:func:`~functopk.sparse.kernels.triton_layout.plan`): other kernels than the leaf
    table's. Triton compiles a kernel at its first launch, which must not happen while a graph is being
    captured; the usual warm-up call before a capture reaches this point and runs them once on the
    concatenated leaves (the result is dropped).
    """
    key = (p.table.device, p.dtype, p.tile, p.tiles, sample_size(config))  # type: ignore[union-attr]
    if key in _PRIMED:
        return
    _PRIMED.add(key)
    flat = concatenated(leaves, p.dtype, p.n)
    flat_plan = dataclasses.replace(p, flat=flat, table=None, leaves=1, programs=max(1, -(-p.n // (p.tile * p.tiles))),
                                    source="copy")
    _launch(flat_plan, k, output, cap, config)


def run(
    leaves: Sequence[torch.Tensor],
    k: int | torch.Tensor,
    output: str,
    config: KernelConfig = DEFAULT_CONFIG,
    *,
    stats: TritonStats | None = None,
) -> list[torch.Tensor]:
    """The exact top ``k`` of ``leaves`` by the Triton kernels (see the module docstring).

    Args:
        leaves: Supported float tensors on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``), at most
            ``2**31 - 1`` coordinates in all.
        k: An int in ``[1, n]``, or a 0-d int64 tensor in ``[1, n]`` on the leaves' device (never read here).
        output: ``"indices"``: ``[indices, values]``, ascending flat indices (int64) and their values in the
            common dtype, ``k`` of each (a tensor ``k``: ``n`` of each, the first ``k`` written);
            ``"masks"``: ``[mask]``, a flat bool tensor of ``n``; ``"dense"``: ``[values]``, the values in
            the common dtype at the selected flat indices, zeros elsewhere.
        config: The tuning constants (``triton_block``, ``triton_room``, ``sample_size``, ``margin``, ``abandon_min``).
        stats: Filled in with what the call did, when given (reads the device).
    """
    p = plan(leaves, config)
    cap = capacity(p.n, None if isinstance(k, torch.Tensor) else int(k), config)
    out, buf = _launch(p, k, output, cap, config)
    if p.source == "table" and p.table is not None and p.table.device.type == "cuda":
        _prime(leaves, p, k, output, cap, config)
    if stats is not None:
        m, ties, k = int(buf.state[1]), int(buf.state[2]), int(k)
        stats.candidates, stats.ties, stats.capacity, stats.source = m, ties, cap, p.source
        stats.path = "fallback" if m > cap or m + ties < k else "ties" if m < k else "candidates"
    if output == "indices":
        return [out[0], out[1]]
    if output == "masks":
        return [out[2].view(torch.bool)]
    return [out[3]]
