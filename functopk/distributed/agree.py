"""Agreement across ranks: every rank checks once that the others were configured as it was.

Ranks configured differently (another ``density``, ``warmup_iters`` or tree) do
not fail by themselves: they diverge silently, or issue different collectives
and wait for each other until the process-group timeout. So the hook and the
transform exchange a *fingerprint* of their configuration the first time they
run (one small all-gather of int64 codes, read back to the host once) and every
rank raises the same ``ValueError`` naming the first field that differs, with
each rank's value.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch
import torch.distributed as dist

from functopk.distributed.exchange import _all_gather, _comm_error

__all__: list[str] = []


def _code(value: Any) -> int:
    """An int64 code of a field value: ints and bools as themselves, floats by their bits, others by crc32."""
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(str(value).encode())


def _shown(value: Any, code: int) -> str:
    """How a rank's value is printed: decoded from its code where the code is the value."""
    if isinstance(value, bool):
        return str(bool(code))
    if isinstance(value, int):
        return str(code)
    if isinstance(value, float):
        return repr(struct.unpack("<d", struct.pack("<q", code))[0])
    return f"<crc32 {code:#010x}>"


def check_agreement(
    what: str, fields: dict[str, Any], group: dist.ProcessGroup, rank: int, world: int, device: torch.device
) -> None:
    """Raise ``ValueError`` on every rank if any field of ``fields`` differs between the ranks of ``group``.

    A collective (every rank of ``group`` must call it with the same field names,
    in the same order); it reads the gathered codes back to the host.

    Args:
        what: The caller, for the message (``"topk_hook"``).
        fields: Field name to a Python value (int, bool, float, or anything with a stable ``str``).
        group, rank, world: The group, this rank in it, its size.
        device: Where the codes travel (the gradients' device: CUDA for NCCL).
    """
    names = list(fields)
    mine = torch.tensor([_code(fields[n]) for n in names], dtype=torch.int64)
    gathered = torch.empty(world * len(names), dtype=torch.int64, device=device)
    try:
        _all_gather(gathered, mine.to(device), group, False)
    except RuntimeError as exc:
        raise _comm_error(f"the configuration check of {what}", group, exc) from exc
    table = gathered.view(world, len(names)).cpu()
    for j, name in enumerate(names):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            other = next(r for r, c in enumerate(column) if c != column[0])
            value = fields[name]
            if isinstance(value, (bool, int, float)):
                detail = f"{_shown(value, column[0])} on rank 0 but {_shown(value, column[other])} on rank {other}"
            else:
                detail = f"this rank ({rank}) has {value}, and rank {other} differs from rank 0"
            raise ValueError(
                f"functopk.distributed: {what} is configured differently across ranks: {name} is {detail}. "
                f"Every rank must use the same settings (they would otherwise diverge or wait on each other "
                f"until the process-group timeout)."
            )


def layout_code(shapes: Any, dtypes: Any, structure: Any) -> int:
    """A crc32 of a tree's structure, shapes and dtypes (stable across processes, unlike ``hash``)."""
    return zlib.crc32(repr((str(structure), [tuple(s) for s in shapes], [str(d) for d in dtypes])).encode())
