"""functopk.sparse.kernels.triton_layout: where the Triton kernel reads the leaves from (host side, no GPU).

The kernels themselves read these plans in ``tests/sparse/triton_interpreted.py`` (strided leaves and
shared buffers, bit for bit against the CPU kernel) and ``tests/sparse/test_kernels_triton_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from functopk.sparse.kernels import triton_layout
from tests.sparse.triton_checks import LeafReads

LAYOUTS = [  # a layout and how many dimensions it has once merged
    (torch.zeros(2, 3, 4, 5), 1),
    (torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last), 3),  # (N, C, H*W)
    (torch.zeros(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d), 3),  # (N, C, D*H*W)
    (torch.zeros(4, 3, 1, 1).to(memory_format=torch.channels_last), 1),  # a 1x1 conv: contiguous in either format
    (torch.zeros(6, 7).t(), 2),
    (torch.zeros(3, 4, 5, 2).permute(2, 0, 3, 1), 4),  # four dimensions that do not merge
    (torch.zeros(2, 3, 2, 2, 3, 2).permute(5, 3, 1, 4, 2, 0), 6),  # six that do not merge: copied
    (torch.zeros(5, 1, 6).transpose(0, 2), 2),
]


@pytest.mark.parametrize(("x", "count"), LAYOUTS, ids=lambda x: f"{tuple(x.shape)}:{x.stride()}" if
                         isinstance(x, torch.Tensor) else str(x))
def test_dense_dims_give_every_flat_index_its_memory_offset(x, count):
    dims = triton_layout.dense_dims(x.shape, x.stride())
    assert dims is not None and len(dims) == count and all(size > 1 for size, _ in dims)
    # the reference: torch's own offset of each element, in row-major (flat) order
    want = torch.arange(x.numel()).as_strided(x.shape, x.stride()).reshape(-1)
    got = torch.zeros(x.numel(), dtype=torch.int64)
    rest = torch.arange(x.numel())
    for size, step in reversed(dims):
        got += rest % size * step
        rest = rest // size
    assert torch.equal(got, want)


def test_dense_dims_refuse_gaps_and_overlaps():
    x = torch.zeros(4, 6)
    for y in (x[:, ::2], x[1:3, 1:5], x[:, :1].expand(4, 3), x.as_strided((3, 3), (1, 1))):
        assert triton_layout.dense_dims(y.shape, y.stride()) is None


def test_leaves_in_one_buffer_are_read_in_place_and_others_through_a_cached_table():
    buf = torch.arange(40.0)
    shared = [buf[:10].view(2, 5), buf[10:11], buf[11:]]
    p = triton_layout.plan(shared)
    assert p.source == "flat" and p.table is None and p.n == 40
    assert p.flat is not None and p.flat.data_ptr() == buf.data_ptr() and p.flat.numel() == 40
    # a gap, two dtypes, a transposed view: back to back in memory but not in flat order
    for leaves in ([buf[:10], buf[12:]], [buf[:10], buf[10:].double()], [buf[:10], buf[10:].view(6, 5).t()]):
        assert triton_layout.plan(leaves).source == "table"
    config = ft.sparse.KernelConfig(triton_block=64)
    leaves = [torch.zeros(130), torch.zeros(0), torch.zeros(3, dtype=torch.float16)]
    p = triton_layout.plan(leaves, config)
    assert p.source == "table" and p.dtype == torch.float32 and p.programs == 4 and p.leaves == 3
    rows = p.table.view(-1).tolist()  # a row per leaf, then per program (leaf, start)
    contiguous = [1, 1, 1]  # one dimension, D1 = D2 = 1
    assert rows[:36] == [leaves[0].data_ptr(), 0, 130, 1, *contiguous, 130, 0, 0, 0, 1,
                         leaves[1].data_ptr(), 130, 0, 1, *contiguous, 0, 0, 0, 0, 1,
                         leaves[2].data_ptr(), 130, 3, 2, *contiguous, 3, 0, 0, 0, 1]
    assert rows[36:] == [0, 0, 0, 64, 0, 128, 2, 0]
    assert triton_layout.plan(leaves, config).table is p.table  # cached by addresses, sizes and dtypes


def test_strided_leaves_are_read_where_they_lie():
    conv = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    leaves = [torch.randn(7), conv]
    with LeafReads([conv]) as reads:
        p = triton_layout.plan(leaves)
    assert reads.ops == [] and p.source == "table" and p.held == ()
    row = p.table.view(-1).tolist()[triton_layout.ROW:2 * triton_layout.ROW]
    # (N, C, H*W) at memory strides (C*H*W, 1, C), padded in front to four dimensions
    assert row == [conv.data_ptr(), 7, 120, 1, 3, 2, 3, 20, 0, 60, 1, 3]
    other = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)  # same sizes, another address
    assert triton_layout.plan([torch.randn(7), other]).table is not p.table
    same_place = conv.permute(0, 2, 3, 1).contiguous().view(2, 3, 4, 5)  # contiguous at some address
    assert triton_layout.plan([leaves[0], same_place]).table is not p.table  # the key holds the strides


def test_leaves_with_gaps_are_copied_and_the_copy_lives_as_long_as_the_plan():
    gaps = torch.randn(3, 8)[:, ::2]  # reshape(-1) would be a view with stride 2: not contiguous
    with LeafReads([gaps]) as reads:
        p = triton_layout.plan([torch.randn(5), gaps])
    assert reads.ops == ["aten.clone.default"] and len(p.held) == 1
    copy = p.held[0]
    assert copy.is_contiguous() and torch.equal(copy, gaps.reshape(-1))
    assert p.table.view(-1)[triton_layout.ROW].item() == copy.data_ptr()  # the table points at the copy it holds


def test_concatenated_reads_each_leaf_once():
    conv = torch.randn(3, 2, 2, 2).to(memory_format=torch.channels_last)
    leaves = [torch.randn(4), conv, torch.randn(3, dtype=torch.float16), torch.randn(2, 5).t(), torch.randn(())]
    with LeafReads(leaves) as reads:
        flat = triton_layout.concatenated(leaves, torch.float32, sum(x.numel() for x in leaves))
    assert torch.equal(flat, torch.cat([x.reshape(-1).float() for x in leaves]))
    # one foreach copy of the contiguous fp32 leaves, one copy each of the others: nothing copied twice
    assert sorted(reads.ops) == ["aten._foreach_copy_.default"] + ["aten.copy_.default"] * 3, reads.ops


def test_a_capture_reads_the_table_its_warm_up_cached_and_copies_leaves_it_never_saw(monkeypatch):
    """A CUDA graph capture (seen here through ``capturing``) cannot copy a table in: it reads the cached one
    (kept for the graph's lifetime) or, for leaves no earlier call read, one concatenation of them."""
    leaves = [torch.randn(6), torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)]
    warm = triton_layout.plan(leaves)  # the warm-up call before a capture
    monkeypatch.setattr(triton_layout, "capturing", lambda device: True)
    during = triton_layout.plan(leaves)
    assert during.source == "table" and during.table is warm.table
    fresh = [torch.randn(6), torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)]
    with LeafReads(fresh) as reads:
        copied = triton_layout.plan(fresh)
    assert copied.source == "copy" and torch.equal(copied.flat, torch.cat([x.reshape(-1) for x in fresh]))
    assert sorted(reads.ops) == ["aten._foreach_copy_.default", "aten.copy_.default"], reads.ops
