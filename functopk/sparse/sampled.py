"""A layer's weight gradient at fixed coordinates only: sampled dense-dense products, never the dense gradient.

For ``y = x W^T`` (``nn.Linear``) the weight gradient at ``(i, j)`` is
``sum_t dy[t, i] * x[t, j]``: ``T`` multiply-adds per coordinate, against
``T * m * n`` for the whole ``m x n`` gradient. Every kernel here computes such
sums for a fixed list of coordinates:

* :func:`plan_product` and :func:`sampled_product`: ``v_j = sum_t a[t, rows_j] *
  b[t, cols_j]``, the coordinates as the pattern of a CSR matrix and the sums by
  ``torch.sparse.sampled_addmm`` (one vectorized dot product of length ``T`` per
  coordinate), over chunks of tokens so that the operands it copies stay small
  (``benchmarks/sampled_grad.py`` measures it against gathering the columns and
  multiplying, and against dense products of the rows and columns a block of
  coordinates spans: on CPU it is the fastest of the three, or level);
* :func:`plan_conv2d` and :func:`conv2d_values`: ``nn.Conv2d``, whose gradient at
  ``(o, c, p, q)`` sums ``dy[b, o, y, x] * x[b, c', y*s + p*d - pad, x*s + q*d - pad]``
  over the batch and the output positions: the coordinates are grouped by
  kernel offset ``(p, q)``, and each group is a sampled product of a window of
  ``dy`` and a strided view of ``x``, copied a few images (or rows) at a time:
  no padded copy, no im2col;
* :func:`embedding_values`: ``nn.Embedding``, whose gradient row ``v`` sums
  ``dy`` over the tokens equal to ``v``.

Plans depend only on the coordinates (and the layer's shape), so a caller that
keeps a coordinate set for several steps builds them once. Values come in the
order of the coordinates given (ascending flat positions). Reduced-precision
inputs are summed in float32.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "Conv2dPlan",
    "ProductPlan",
    "conv2d_values",
    "embedding_values",
    "plan_conv2d",
    "plan_product",
    "sampled_product",
]

CHUNK_ELEMENTS = 1 << 20  # the most operand elements copied at once per chunk of tokens (4 MiB in float32)


class ProductPlan(NamedTuple):
    """The coordinates of :func:`sampled_product`: the rows and columns they use, and a CSR pattern over those.

    Example:
        >>> import torch
        >>> plan = plan_product(torch.tensor([0, 0, 7]), torch.tensor([3, 9, 3]))
        >>> plan.rows, plan.cols, plan.crow, plan.col
        (tensor([0, 7]), tensor([3, 9]), tensor([0, 2, 3]), tensor([0, 1, 0]))
    """

    rows: torch.Tensor  # the distinct rows, ascending
    cols: torch.Tensor  # the distinct columns, ascending
    crow: torch.Tensor  # (len(rows) + 1,): where each row's coordinates start
    col: torch.Tensor  # (k,): each coordinate's column, as a position in cols


def plan_product(rows: torch.Tensor, cols: torch.Tensor) -> ProductPlan:
    """The plan of :func:`sampled_product` for the coordinates ``(rows[j], cols[j])``, in row-major order.

    Example:
        >>> import torch
        >>> plan_product(torch.tensor([1]), torch.tensor([4])).col
        tensor([0])
    """
    used_rows, row_at = torch.unique_consecutive(rows, return_counts=True)
    used_cols, col_at = torch.unique(cols, return_inverse=True)
    crow = torch.zeros(used_rows.numel() + 1, dtype=torch.int64, device=rows.device)
    crow[1:] = row_at.cumsum(0)
    return ProductPlan(used_rows, used_cols, crow, col_at.to(torch.int64))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced precision summed in float32; float32 and float64 as they are."""
    return torch.promote_types(dtype, torch.float32)


def _accumulate(plan: ProductPlan, dtype: torch.dtype, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The sum over ``pairs`` of ``m1 @ m2`` (``|rows| x t`` by ``t x |cols|``) at the plan's coordinates."""
    shape = (plan.rows.numel(), plan.cols.numel())
    with warnings.catch_warnings():  # torch's notice that sparse CSR support is in beta
        warnings.simplefilter("ignore", UserWarning)
        values = torch.zeros(plan.col.shape, dtype=dtype, device=plan.col.device)
        acc = torch.sparse_csr_tensor(plan.crow, plan.col, values, shape, check_invariants=False)
        for m1, m2 in pairs:
            acc = torch.sparse.sampled_addmm(acc, m1.to(dtype), m2.to(dtype))
    return acc.values()


def sampled_product(
    a: torch.Tensor, b: torch.Tensor, plan: ProductPlan, *, chunk: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """``v_j = sum_t a[t, rows_j] * b[t, cols_j]`` for the plan's coordinates; ``a`` and ``b`` are ``(T, .)``.

    Only the rows and columns the coordinates use are copied (token-major to
    coordinate-major), at most ``chunk`` elements at once. Returns the values in
    the plan's order, in float32 or wider.

    Example:
        >>> import torch
        >>> dy, x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        >>> sampled_product(dy, x, plan_product(torch.tensor([0, 1]), torch.tensor([1, 0])))  # at [0, 1] and [1, 0]
        tensor([3., 6.])
        >>> dy.T @ x
        tensor([[4., 3.],
                [6., 4.]])
    """
    dtype = _work_dtype(torch.promote_types(a.dtype, b.dtype))
    step = max(1, chunk // max(1, plan.rows.numel() + plan.cols.numel()))
    pairs = [
        (a[t : t + step].t().index_select(0, plan.rows), b[t : t + step].t().index_select(0, plan.cols).t())
        for t in range(0, a.shape[0], step)
    ]
    return _accumulate(plan, dtype, pairs)


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
        >>> plan_conv2d(torch.tensor([5]), (2, 1, 2, 2), groups=2).offsets[0][3].cols   # o=1: input channel 1
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
        groups_out.append((p, q, where, plan_product(o[where], channel[where])))
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
    *,
    chunk: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The gradient of ``conv2d(x, W)`` (zero padding ``padding`` at the top and left) at the plan's coordinates.

    Each kernel offset's windows are copied at most ``chunk`` elements at a time.

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
        pairs = _window_pairs(dy[:, :, y0:y1, x0:x1], x[:, :, rows, cols], product, chunk)
        out[where] = _accumulate(product, out.dtype, pairs)
    return out


def _window_pairs(
    dy: torch.Tensor, x: torch.Tensor, plan: ProductPlan, chunk: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(|rows| x t, t x |cols|)`` operands of one kernel offset's windows (the channels the coordinates use), a few
    images (or output rows) at a time."""
    images, _, height, width = dy.shape
    per_row = width * (plan.rows.numel() + plan.cols.numel())
    rows_at_once = max(1, chunk // max(1, per_row))
    if rows_at_once >= height:  # whole images
        step = max(1, rows_at_once // height)
        spans = [(slice(i, i + step), slice(None)) for i in range(0, images, step)]
    else:  # an image larger than a chunk: a few of its output rows at a time
        starts = range(0, height, rows_at_once)
        spans = [(slice(i, i + 1), slice(r, r + rows_at_once)) for i in range(images) for r in starts]

    def channels_first(t: torch.Tensor, used: torch.Tensor) -> torch.Tensor:  # one copy: the used channels, leading
        return t.transpose(0, 1).index_select(0, used).reshape(used.numel(), -1)

    return [(channels_first(dy[i, :, r], plan.rows), channels_first(x[i, :, r], plan.cols).t()) for i, r in spans]


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
