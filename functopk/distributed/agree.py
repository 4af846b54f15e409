"""Agreement across ranks: every rank checks once that the others were configured as it was.

Ranks configured differently (another ``density``, ``warmup_iters`` or tree) do
not fail by themselves: they diverge silently, or issue different collectives
and wait for each other until the process-group timeout. So the hook and the
transform exchange a *fingerprint* of their configuration the first time they
run (one small all-gather of int64 codes, read back to the host once) and every
rank raises the same ``ValueError`` naming the first field that differs, with
rank 0's value and the first differing rank's. A text's code (a crc32) cannot
be decoded, so when a text field differs the ranks gather the texts themselves
(two more small collectives, on that error path only).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch
import torch.distributed as dist

from functopk.distributed.wire import gather_or_fail

__all__: list[str] = []


def _code(value: Any) -> int:
    """An int64 code of a field value: ints and bools as themselves, floats by their bits, others by crc32."""
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(str(value).encode())


def _shown(value: bool | int | float, code: int) -> str:
    """How a rank's number is printed: decoded from its code (the code is the value)."""
    if isinstance(value, bool):
        return str(bool(code))
    if isinstance(value, int):
        return str(code)
    return repr(struct.unpack("<d", struct.pack("<q", code))[0])


def check_agreement(
    what: str, fields: dict[str, Any], group: dist.ProcessGroup, rank: int, world: int, device: torch.device
) -> None:
    """Raise ``ValueError`` on every rank if any field of ``fields`` differs between the ranks of ``group``.

    A collective (every rank of ``group`` must call it with the same field names,
    in the same order); it reads the gathered codes back to the host.

    Args:
        what: The caller, for the message (``"topk_hook"``).
        fields: Field name to a Python value (int, bool, float, or anything with a stable ``str``;
            the message shows such a value's ``repr``).
        group, rank, world: The group, this rank in it, its size.
        device: Where the codes travel (the gradients' device: CUDA for NCCL).
    """
    names = list(fields)
    mine = torch.tensor([_code(fields[n]) for n in names], dtype=torch.int64)
    gathered = torch.empty(world * len(names), dtype=torch.int64, device=device)
    gather_or_fail(gathered, mine.to(device), group, f"the configuration check of {what}")
    table = gathered.view(world, len(names)).cpu()
    for j, name in enumerate(names):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            other = next(r for r, c in enumerate(column) if c != column[0])
            value = fields[name]
            if isinstance(value, (bool, int, float)):
                shown = [_shown(value, column[0]), _shown(value, column[other])]
            else:  # a code cannot be decoded: every rank takes part in gathering the texts
                shown = _excerpts(_gather_texts(repr(value), group, world, device, what), 0, other)
            raise ValueError(
                f"functopk.distributed: {what} is configured differently across ranks: {name} is {shown[0]} on "
                f"rank 0 but {shown[1]} on rank {other}. "
                f"Every rank must use the same settings (they would otherwise diverge or wait on each other "
                f"until the process-group timeout)."
            )


def _gather_texts(text: str, group: dist.ProcessGroup, world: int, device: torch.device, what: str) -> list[str]:
    """Every rank's ``text`` (a collective: their lengths, then their UTF-8 bytes padded to the longest)."""
    mine = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    gather_or_fail(lengths, torch.tensor([mine.numel()], device=device), group, f"the configuration check of {what}")
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine.to(device)
    texts = torch.empty(world * longest, dtype=torch.uint8, device=device)
    gather_or_fail(texts, padded, group, f"the configuration check of {what}")
    rows = texts.view(world, longest).cpu()
    return [bytes(rows[r, : int(lengths[r])].tolist()).decode(errors="replace") for r in range(world)]


def _excerpts(texts: list[str], a: int, b: int, width: int = 120) -> list[str]:
    """Ranks ``a``'s and ``b``'s texts, each cut to about ``width`` characters around where they first differ."""
    x, y = texts[a], texts[b]
    start = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    start = max(0, start - width // 3) if max(len(x), len(y)) > width else 0

    def cut(t: str) -> str:
        return ("..." if start else "") + t[start : start + width] + ("..." if len(t) > start + width else "")

    return [cut(x), cut(y)]


def layout_code(shapes: Any, dtypes: Any, structure: Any) -> int:
    """A crc32 of a tree's structure, shapes and dtypes (stable across processes, unlike ``hash``)."""
    return zlib.crc32(repr((str(structure), [tuple(s) for s in shapes], [str(d) for d in dtypes])).encode())
