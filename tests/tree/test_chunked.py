"""functopk.tree.chunked: a step added slice by slice equals the same kernels on whole tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch

from functopk.tree import chunked
from tests.helpers import assert_tree_bitwise_equal

# The kernels the sliced steps use, as (name, f(a, b, c)); c > 0 where it divides or is a square root.
KERNELS = [
    ("add alpha", lambda a, b, c: torch.add(a, b, alpha=0.9)),
    ("mul", lambda a, b, c: torch.mul(a, -1e-3)),
    ("mul 0-d", lambda a, b, c: torch.mul(a, torch.tensor(0.7, dtype=torch.float64))),
    ("div", lambda a, b, c: torch.div(a, c)),
    ("sqrt + eps", lambda a, b, c: torch.sqrt(c).add_(1e-8)),
    ("lerp", lambda a, b, c: torch.lerp(a, b, 0.1)),
    ("addcmul", lambda a, b, c: torch.addcmul(a, b, b, value=0.001)),
    ("maximum abs", lambda a, b, c: torch.maximum(a, torch.abs(b).add_(1e-8))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("name", "kernel"), KERNELS)
def test_kernels_give_each_element_the_same_value_in_any_slice(name, kernel, dtype):
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1001, generator=gen, dtype=dtype) for _ in range(3))
    c = c.abs() + 0.1
    whole = kernel(a, b, c)
    for size in (1, 7, 64):  # one element (the scalar path), an odd slice, a vector-sized one
        parts = [kernel(a[i : i + size], b[i : i + size], c[i : i + size]) for i in range(0, 1001, size)]
        assert torch.equal(torch.cat(parts), whole), (name, size)


def _body(scratch, ps, gs, bufs):
    """SGD with momentum on a batch: the momentum written in place, the updates into the scratch rows."""
    assert sum(p.numel() for p in ps) <= 5 or (len(ps) == 1 and not ps[0].is_contiguous())  # a batch, or a strided leaf
    for g, buf in zip(gs, bufs):
        torch.add(g, buf, alpha=0.9, out=buf)
    updates = scratch.mul(bufs, -0.1)
    if all(p.is_contiguous() for p in ps):  # (a large strided leaf runs whole, its temporaries fresh)
        ROWS.update(u.untyped_storage().data_ptr() for u in updates)
    return updates


ROWS: set[int] = set()


def test_add_is_the_whole_tensor_step_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(4, 3, generator=gen), torch.randn(2, generator=gen, dtype=torch.float64),
              torch.randn(3, 4, generator=gen).t(), torch.randn((), generator=gen)]  # fmt: skip
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    bufs = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    want_bufs = [torch.add(g, b, alpha=0.9) for g, b in zip(grads, bufs)]
    want = [p + torch.mul(b, -0.1) for p, b in zip(params, want_bufs)]
    ptrs = [p.data_ptr() for p in params]
    ROWS.clear()
    chunked.add_(params, [grads, bufs], _body, chunk=5)  # 12 elements: three slices; the strided one whole
    assert_tree_bitwise_equal(params, want)
    assert_tree_bitwise_equal(bufs, want_bufs)
    assert [p.data_ptr() for p in params] == ptrs
    assert len(ROWS) == 2  # every batch's updates in one of two rows: float32's and float64's, reused


def test_applies_on_cpu_only():
    assert chunked.applies([torch.zeros(2)])
    assert not chunked.applies([])
    assert not chunked.applies([torch.zeros(2, device="meta")])


class _Subclass(torch.Tensor):
    pass


def test_applies_to_plain_tensors_only():
    """A tensor subclass (an FSDP2 DTensor shard, say) takes the foreach path: scratch rows are plain tensors."""
    assert chunked.applies([torch.nn.Parameter(torch.zeros(2))])
    assert not chunked.applies([torch.zeros(2), torch.zeros(2).as_subclass(_Subclass)])
