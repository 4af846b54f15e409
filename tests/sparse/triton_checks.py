"""What the Triton kernel's tests share: the bit-for-bit check against the CPU kernel, and small configurations.

Used by ``tests/sparse/triton_interpreted.py`` (CPU tensors under ``TRITON_INTERPRET=1``, in a
subprocess) and ``tests/sparse/test_kernels_triton_cuda.py`` (a GPU). The reference is the CPU exact
kernel (``backend="aten"``), itself checked against a brute-force sort in ``tests/sparse/test_api.py``;
the selection is also checked against :func:`tests.helpers.reference_mask` here.
"""

from __future__ import annotations

import dataclasses

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import functopk as ft
from functopk.sparse.kernels import triton_select
from tests.helpers import bits, bits_any_nan, reference_mask, to_device

ATEN = ft.sparse.KernelConfig(backend="aten")
SMALL = ft.sparse.KernelConfig(backend="triton", triton_block=64, sample_size=16)
"""Programs of 4 tiles of 16 coordinates and a sample of 16: tiny trees run every branch of the kernels."""

CONFIGS = {
    "candidates": SMALL,
    "too-few": dataclasses.replace(SMALL, margin=-10.0),  # the sampled threshold is too high: fallback
    "overflow": dataclasses.replace(SMALL, margin=10.0, abandon_min=0, triton_room=0.01),  # buffer too small
}
"""The configurations that reach the normal path and both fallbacks (on trees of more than 16 coordinates)."""


class LeafReads(TorchDispatchMode):
    """Inside, ``ops`` records every op other than a view that takes one of ``leaves`` (or a view of one).

    The Triton kernel reads its leaves in its own launches, which do not dispatch: an op that shows here
    is a copy (``aten.clone`` of a ``reshape``, ``aten.cat``, ``aten.copy_``) or other host-side work.
    """

    def __init__(self, leaves) -> None:
        super().__init__()
        self.storages = {x.untyped_storage().data_ptr() for x in leaves}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [x for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not func.is_view and any(x.untyped_storage().data_ptr() in self.storages for x in inputs):
            self.ops.append(str(func))
        return func(*args, **kwargs)


def _leaf_bits(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bool else bits(x)


def assert_selects_like_cpu(tree, k, config: ft.sparse.KernelConfig, device: str) -> None:
    """The Triton kernel on ``device`` gives the CPU kernel's indices, values, masks and sparsified tree, bit for bit.

    ``k``: an int, or a float/int for a 0-d tensor ``k`` (given as ``("tensor", value)``).
    """
    as_tensor = isinstance(k, tuple)
    value = k[1] if as_tensor else k
    cpu = to_device(tree, "cpu")
    dev = to_device(tree, device)
    k_cpu = torch.tensor(value) if as_tensor else value
    k_dev = torch.tensor(value, device=device) if as_tensor else value
    want = ft.topk_indices(cpu, k_cpu, config=ATEN)
    got = ft.topk_indices(dev, k_dev, config=config)
    assert torch.equal(got.indices.cpu(), want.indices), (got.indices, want.indices)
    mixed = len({x.dtype for x in optree.tree_leaves(cpu)}) > 1
    same = bits_any_nan if mixed else bits  # NaNs converted by another implementation: see bits_any_nan
    assert got.values.dtype == want.values.dtype and torch.equal(same(got.values.cpu()), same(want.values))
    expected_mask = reference_mask(cpu, want.indices.numel())
    for fn, expected in ((ft.topk_mask, expected_mask), (ft.topk_sparsify, ft.topk_sparsify(cpu, k_cpu, config=ATEN))):
        out = to_device(fn(dev, k_dev, config=config), "cpu")
        for a, b in zip(optree.tree_leaves(out), optree.tree_leaves(expected)):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_leaf_bits(a), _leaf_bits(b)), (fn, a, b)


def path_of(tree, k, config: ft.sparse.KernelConfig, device: str) -> triton_select.TritonStats:
    """What the kernel did for ``tree`` and ``k`` (an int): its path, candidates and source."""
    stats = triton_select.TritonStats()
    leaves = [x for x in optree.tree_leaves(to_device(tree, device))]
    triton_select.run(leaves, k, "indices", config, stats=stats)
    return stats
