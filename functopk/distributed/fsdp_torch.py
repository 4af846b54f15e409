"""Every private PyTorch name functopk's FSDP2 support touches, in one place.

FSDP2 (``torch.distributed.fsdp.fully_shard``) accepts a custom reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``), but the base class such a comm must
derive from, ``ReduceScatter``, is importable only from a private module, and a
DTensor shard's offset in the unsharded tensor comes from a private helper. Both
are imported here and nowhere else, so that a PyTorch release that moves them
breaks one module, and ``tests/distributed/test_fsdp_torch.py`` says which name
moved and what signature it expected.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["FSDPModule", "ReduceScatter", "compute_local_shape_and_global_offset", "fully_shard"]
