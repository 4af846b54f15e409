"""Data-parallel training with sparse top-k communication, on ``torch.distributed``.

Three layers, each usable alone (see ``docs/distributed.md``):

* :func:`sparse_allreduce` sums (or averages) every rank's ``(index, value)``
  pairs into one dense vector: one ``all_gather`` of a packed byte buffer, then
  ``index_add_`` into a single output. Memory is ``O(n + P*k)``, never ``P``
  dense copies.
* :func:`distributed_topk` is a :class:`~functopk.GradientTransformation` for
  functional data-parallel training: local error feedback and top-k, the
  exchange, the mean; optionally gTop-k re-selection of the global top ``k``.
* :func:`topk_hook` with :class:`TopKHookState` is a DDP communication hook
  (``ddp.register_comm_hook(state, topk_hook)``) doing the same per DDP bucket.

The transport is ``torch.distributed`` itself (gloo on CPU, NCCL on GPU); every
function here needs an initialised process group when it *runs*, none when it
is imported or built.

**Wire format.** Each rank sends ``capacity`` pairs as one ``uint8`` buffer:
``capacity`` indices, then ``capacity`` values, back to back. Indices are
int32 when ``numel < 2**31 - 1`` and int64 otherwise; values keep their dtype.
So a rank sends ``capacity * (index bytes + value bytes)`` bytes (8 per pair for
fp32 gradients) and every rank receives ``P`` times that. Packing both arrays
into one buffer costs one collective (one latency) instead of two; unpacking is
a byte view of the gathered buffer (a copy only in the rare case where a part is
not aligned for its dtype). A rank with fewer than ``capacity`` pairs pads with
the index ``numel`` (one past the end) and the value 0, so the padding records
the true count on the wire and lands in a scratch slot that is dropped.

**Summation order.** The gathered pairs are added rank by rank (rank 0's first),
one ``index_add_`` per rank; for a mean, each value is scaled by ``1/P`` as it
is added (sparing a pass over the dense result). When each rank's indices are
distinct (always so for top-k), no two additions in one call touch the same
coordinate, so the sum is deterministic on every device, including CUDA, where
``index_add_`` uses atomics; every rank then holds bit-identical results, which
data-parallel replicas need in order not to drift apart.
"""

from functopk.distributed.exchange import sparse_allreduce
from functopk.distributed.fsdp_compress import FSDPCompressState, compress_fsdp
from functopk.distributed.fsdp_topk import FSDPTopKState, fsdp_topk
from functopk.distributed.hook import HookStats, TopKHookState, topk_hook
from functopk.distributed.transform import DistributedTopKState, distributed_topk

__all__ = [
    "DistributedTopKState",
    "FSDPTopKState",
    "FSDPCompressState",
    "HookStats",
    "TopKHookState",
    "compress_fsdp",
    "distributed_topk",
    "fsdp_topk",
    "sparse_allreduce",
    "topk_hook",
]
