"""A layer's weight gradient at fixed coordinates only: sampled dense-dense products, never the dense gradient.

For ``y = x W^T`` (``nn.Linear``) the weight gradient at ``(i, j)`` is
``sum_t dy[t, i] * x[t, j]``: ``T`` multiply-adds per coordinate on two gathered
columns, against ``T * m * n`` for the whole ``m x n`` gradient. Every kernel
here computes such sums for a fixed list of coordinates:

* :func:`plan_product` and :func:`sampled_product`: ``v_j = sum over tokens of
  a[:, rows_j] * b[:, cols_j]`` (the tokens are every dimension but the gathered
  one). The coordinates are cut into blocks of rows; a block whose coordinates
  fill a good part of the box of its distinct rows times its distinct columns
  (top-k gradients cluster in a few large rows and columns) is one dense
  product of the gathered rows and columns (``|R| x |C|``, bounded), from which
  its coordinates are read; a sparser block gathers each coordinate's pair of
  columns, multiplies and sums (bounded chunks). ``benchmarks/sampled_grad.py``
  measures both against ``torch.sparse.sampled_addmm``.
* :func:`plan_conv2d` and :func:`conv2d_values`: ``nn.Conv2d``, whose gradient at
  ``(o, c, p, q)`` sums ``dy[b, o, y, x] * x[b, c', y*s + p*d - pad, x*s + q*d - pad]``
  over the batch and the output positions: the coordinates are grouped by
  kernel offset ``(p, q)``, and each group is a sampled product of a window of
  ``dy`` and a strided view of ``x`` (no padded copy, no im2col).
* :func:`embedding_values`: ``nn.Embedding``, whose gradient row ``v`` sums
  ``dy`` over the tokens equal to ``v``: ``dy`` summed per distinct token
  (``index_add_``, at most ``T x D``), then read at the coordinates.

Plans depend only on the coordinates (and the layer's shape), so a caller that
keeps a coordinate set for several steps builds them once. Values come in the
order of the coordinates given. Reduced-precision inputs are summed in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "Conv2dPlan",
    "ProductPlan",
    "box_limit",
    "conv2d_values",
    "embedding_values",
    "plan_conv2d",
    "plan_product",
    "sampled_product",
]

# A dense block product costs about this many multiply-adds per gathered coordinate pair at equal time
# (a BLAS product against gathers, on CPU: benchmarks/sampled_grad.py); a block denser than 1/BOX_RATIO
# of its box is computed as a product.
BOX_RATIO = 32
BOX_ELEMENTS = 1 << 20  # the largest |R| x |C| product block held at once (4 MiB in float32)


def box_limit(numel: int) -> int:
    """The largest box of a weight of ``numel`` elements: ``BOX_ELEMENTS``, and at most half of the weight.

    So no block ever holds the weight's whole gradient, however its coordinates fill it.

    Example:
        >>> box_limit(36), box_limit(10**9)
        (18, 1048576)
    """
    return max(1, min(BOX_ELEMENTS, numel // 2))
GATHER_ELEMENTS = 1 << 20  # the most gathered elements (tokens x coordinates) held per operand at once


class _Block(NamedTuple):
    start: int  # where its values go among the plan's
    rows: torch.Tensor  # a box: its distinct rows; a gather: each coordinate's row
    cols: torch.Tensor  # the same for columns
    flat: torch.Tensor | None  # a box: each coordinate's position in the |rows| x |cols| product; a gather: None


class ProductPlan(NamedTuple):
    """How :func:`sampled_product` computes its coordinates: row blocks, each a box product or gathers.

    Example:
        >>> import torch
        >>> plan = plan_product(torch.tensor([0, 0, 1]), torch.tensor([0, 2, 1]))
        >>> plan.size, len(plan.blocks)
        (3, 1)
    """

    blocks: tuple[_Block, ...]
    size: int


def plan_product(
    rows: torch.Tensor, cols: torch.Tensor, *, box_ratio: float = BOX_RATIO, box_elements: int = BOX_ELEMENTS
) -> ProductPlan:
    """The blocks of :func:`sampled_product` for the coordinates ``(rows[j], cols[j])``, sorted by row.

    A block is a box product when its distinct rows times columns are at most
    ``box_ratio`` times its coordinates; no box holds more than ``box_elements``
    (tests pass small ones). Reads a few sizes on the host (the distinct rows and
    columns of each block).

    Example:
        >>> import torch
        >>> plan_product(torch.tensor([2, 5]), torch.tensor([1, 1])).blocks[0].flat
        tensor([0, 1])
    """
    if rows.numel() == 0:
        return ProductPlan((), 0)
    uniq_rows, row_of = torch.unique_consecutive(rows, return_inverse=True)
    n_cols = int(torch.unique(cols).numel())
    per_block = max(1, box_elements // n_cols)  # distinct rows per block: its box stays within box_elements
    bounds = torch.searchsorted(row_of, torch.arange(0, uniq_rows.numel(), per_block, device=rows.device))
    edges = [*bounds.tolist(), rows.numel()]
    blocks = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        r, c = rows[lo:hi], cols[lo:hi]
        box_rows, r_at = torch.unique_consecutive(r, return_inverse=True)
        box_cols, c_at = torch.unique(c, return_inverse=True)
        if box_rows.numel() * box_cols.numel() <= box_ratio * (hi - lo):
            blocks.append(_Block(lo, box_rows, box_cols, r_at * box_cols.numel() + c_at))
        else:
            blocks.append(_Block(lo, r, c, None))
    return ProductPlan(tuple(blocks), rows.numel())


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced precision summed in float32; float32 and float64 as they are."""
    return torch.promote_types(dtype, torch.float32)


def sampled_product(
    a: torch.Tensor, b: torch.Tensor, plan: ProductPlan, reduce: tuple[int, ...], *, chunk: int = GATHER_ELEMENTS
) -> torch.Tensor:
    """``v_j = sum over the dimensions reduce of a[:, rows_j] * b[:, cols_j]`` for the plan's coordinates.

    ``a`` and ``b`` index their rows and columns along dimension 1 and share the
    ``reduce`` dimensions (the tokens); views (a window, strides) are read as they are.
    Gathers hold at most ``chunk`` elements per operand at once. Returns the
    values in the plan's order, in float32 or wider.

    Example:
        >>> import torch
        >>> dy, x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        >>> plan = plan_product(torch.tensor([0, 1]), torch.tensor([1, 0]))
        >>> sampled_product(dy, x, plan, (0,))                     # (dy.T @ x)[0, 1], (dy.T @ x)[1, 0]
        tensor([3., 6.])
        >>> (dy.T @ x)
        tensor([[4., 3.],
                [6., 4.]])
    """
    dtype = _work_dtype(torch.promote_types(a.dtype, b.dtype))
    out = torch.empty(plan.size, dtype=dtype, device=a.device)
    tokens = max(1, a.numel() // max(1, a.shape[1]))
    for block in plan.blocks:
        stop = block.start + (block.flat.numel() if block.flat is not None else block.rows.numel())
        if block.flat is not None:
            ar = a.index_select(1, block.rows).to(dtype)
            bc = b.index_select(1, block.cols).to(dtype)
            out[block.start : stop] = torch.tensordot(ar, bc, dims=(reduce, reduce)).view(-1)[block.flat]
            continue
        step = max(1, chunk // tokens)
        for lo in range(0, stop - block.start, step):
            ar = a.index_select(1, block.rows[lo : lo + step]).to(dtype)
            ar.mul_(b.index_select(1, block.cols[lo : lo + step]))
            out[block.start + lo : block.start + lo + ar.shape[1]] = ar.sum(reduce)
    return out


class Conv2dPlan(NamedTuple):
    """:func:`conv2d_values`' coordinates grouped by kernel offset: ``(p, q, positions in the output, plan)``.

    Example:
        >>> import torch
        >>> plan = plan_conv2d(torch.tensor([0, 4]), (2, 1, 3, 3), groups=1)   # (0, 0, 0, 0) and (0, 0, 1, 1)
        >>> [(p, q) for p, q, _, _ in plan.offsets]
        [(0, 0), (1, 1)]
    """

    offsets: tuple[tuple[int, int, torch.Tensor, ProductPlan], ...]
    size: int


def plan_conv2d(positions: torch.Tensor, shape: tuple[int, ...], groups: int) -> Conv2dPlan:
    """The plan of :func:`conv2d_values` for ascending flat ``positions`` into a weight of ``shape``.

    ``shape`` is ``(O, C / groups, kh, kw)``; a coordinate's column is its
    input channel in the whole input (its group's channels come first).

    Example:
        >>> import torch
        >>> plan_conv2d(torch.tensor([5]), (2, 1, 2, 2), groups=2).offsets[0][3].blocks[0].cols   # o=1: channel 1
        tensor([1])
    """
    out_ch, per_group, kh, kw = shape
    o = positions // (per_group * kh * kw)
    rest = positions % (per_group * kh * kw)
    channel = (o // (out_ch // groups)) * per_group + rest // (kh * kw)
    offset = rest % (kh * kw)
    groups_out = []
    for off in torch.unique(offset).tolist():
        where = torch.nonzero(offset == off).view(-1)
        p, q = divmod(int(off), kw)
        product = plan_product(o[where], channel[where], box_elements=box_limit(out_ch * per_group * kh * kw))
        groups_out.append((p, q, where, product))
    return Conv2dPlan(tuple(groups_out), positions.numel())


def _window(kernel_at: int, pad: int, stride: int, size_in: int, size_out: int) -> tuple[int, int, int]:
    """The output positions ``[lo, hi)`` that read inside the input at this kernel offset, and the first input row."""
    lo = max(0, -((kernel_at - pad) // stride))  # ceil((pad - kernel_at) / stride), at least 0
    hi = min(size_out, (size_in - 1 + pad - kernel_at) // stride + 1)
    return lo, max(lo, hi), lo * stride + kernel_at - pad


def conv2d_values(
    x: torch.Tensor,
    dy: torch.Tensor,
    plan: Conv2dPlan,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> torch.Tensor:
    """The gradient of ``conv2d(x, W)`` (zero padding ``padding`` at the top and left) at the plan's coordinates.

    Example:
        >>> import torch
        >>> x, w = torch.randn(2, 3, 5, 5, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64)
        >>> dy = torch.randn(2, 4, 5, 5, dtype=torch.float64)
        >>> dense = torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        ...                                             [False, True, False])[1]
        >>> pos = torch.tensor([3, 50, 107])
        >>> got = conv2d_values(x, dy, plan_conv2d(pos, tuple(w.shape), 1), (1, 1), (1, 1), (1, 1))
        >>> torch.allclose(got, dense.view(-1)[pos])
        True
    """
    x = x.unsqueeze(0) if x.dim() == 3 else x  # unbatched (dy may come batched: the output's base)
    dy = dy.unsqueeze(0) if dy.dim() == 3 else dy
    out = torch.zeros(plan.size, dtype=_work_dtype(torch.promote_types(x.dtype, dy.dtype)), device=x.device)
    (height, width), (out_h, out_w) = x.shape[-2:], dy.shape[-2:]
    for p, q, where, product in plan.offsets:
        y0, y1, iy = _window(p * dilation[0], padding[0], stride[0], height, out_h)
        x0, x1, ix = _window(q * dilation[1], padding[1], stride[1], width, out_w)
        if y1 == y0 or x1 == x0:  # this offset reads only padding: zero
            continue
        rows = slice(iy, iy + (y1 - y0 - 1) * stride[0] + 1, stride[0])
        cols = slice(ix, ix + (x1 - x0 - 1) * stride[1] + 1, stride[1])
        out[where] = sampled_product(dy[:, :, y0:y1, x0:x1], x[:, :, rows, cols], product, (0, 2, 3))
    return out


def embedding_values(
    ids: torch.Tensor, dy: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, padding_idx: int | None
) -> torch.Tensor:
    """The gradient of ``embedding(ids, W)`` at ``(rows[j], cols[j])`` (rows ascending): ``dy`` summed over the tokens.

    Each token is paired with the coordinates of its row (at most ``T x D``
    pairs, usually far fewer), and each pair's ``dy`` is added into its
    coordinate in token order. Tokens equal to ``padding_idx`` add nothing
    (``nn.Embedding``'s padding row has no gradient).

    Example:
        >>> import torch
        >>> ids, dy = torch.tensor([3, 1, 3]), torch.tensor([[1.0, 2.0], [5.0, 6.0], [10.0, 20.0]])
        >>> embedding_values(ids, dy, torch.tensor([0, 3, 3]), torch.tensor([0, 0, 1]), None)
        tensor([ 0., 11., 22.])
    """
    flat_ids = ids.reshape(-1)
    dtype = _work_dtype(dy.dtype)
    grads = dy.reshape(flat_ids.numel(), dy.shape[-1])
    first = torch.searchsorted(rows, flat_ids)  # each token's row: its coordinates are rows[first:last]
    count = torch.searchsorted(rows, flat_ids, right=True) - first
    if padding_idx is not None:
        count = torch.where(flat_ids == padding_idx, 0, count)
    token = torch.repeat_interleave(torch.arange(flat_ids.numel(), device=ids.device), count)
    start = torch.cumsum(count, 0) - count
    coordinate = first[token] + torch.arange(token.numel(), device=ids.device) - start[token]
    out = torch.zeros(rows.shape, dtype=dtype, device=dy.device)
    return out.index_add_(0, coordinate, grads[token, cols[coordinate]].to(dtype))
