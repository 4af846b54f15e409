"""Every PyTorch name functopk's FSDP2 support touches, in one place, imported on first use.

FSDP2 (``torch.distributed.fsdp.fully_shard``) accepts a custom reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``), but the base class such a comm must
derive from, ``ReduceScatter``, is importable only from a private module, and a
DTensor shard's offset in the unsharded tensor comes from a private helper. Both
are imported here and nowhere else, so that a PyTorch release that moves them
breaks one module, and ``tests/distributed/test_fsdp_torch.py`` says which name
moved and what signature it expected.

The names are attributes of this module, resolved at their first use (PEP 562
``__getattr__``): FSDP2 and DTensor import ``torch.distributed.tensor``, about
half a second, which ``import functopk`` does not pay. Modules here write
``fsdp_torch.DTensor``, never ``from functopk.distributed.fsdp_torch import
DTensor``, which would import it at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the type checker only: at run time the names resolve at first use (below)
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_HOMES = {
    "FSDPModule": "torch.distributed.fsdp",
    "fully_shard": "torch.distributed.fsdp",
    "ReduceScatter": "torch.distributed.fsdp._fully_shard._fsdp_api",
    "DTensor": "torch.distributed.tensor",
    "Shard": "torch.distributed.tensor",
    "compute_local_shape_and_global_offset": "torch.distributed.tensor._utils",
}

__all__ = ["DTensor", "FSDPModule", "ReduceScatter", "Shard", "compute_local_shape_and_global_offset", "fully_shard"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later reads are plain attribute reads
    return value
