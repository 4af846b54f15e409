"""The sampled weight-gradient kernels against the dense gradients, in float64."""

from __future__ import annotations

import pytest
import torch

from functopk.sparse.sampled import conv2d_values, embedding_values, plan_conv2d, plan_product, sampled_product


def some(numel: int, count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(numel, generator=gen)[:count].sort().values


def clustered(rows: int, cols: int, keep_rows: int, keep_cols: int, seed: int) -> torch.Tensor:
    """Every coordinate of a few rows times a few columns: what a top-k of an outer-product gradient looks like."""
    r, c = some(rows, keep_rows, seed), some(cols, keep_cols, seed + 1)
    return (r[:, None] * cols + c[None, :]).reshape(-1)


@pytest.mark.parametrize("pick", ["random", "clustered"])
@pytest.mark.parametrize("chunk", [1 << 20, 300], ids=["whole", "chunked"])
def test_linear_product_equals_the_dense_gradient_at_the_coordinates(pick, chunk):
    """Scattered coordinates, or coordinates filling a few rows and columns (a top-k's shape); all the tokens at
    once, or a few at a time (chunk: 300 elements of operands, 1 token of 130 + 90)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 90, generator=gen, dtype=torch.float64)
    dy = torch.randn(40, 130, generator=gen, dtype=torch.float64)
    dense = dy.T @ x  # nn.Linear's weight gradient, (out, in)
    pos = some(dense.numel(), 300, 1) if pick == "random" else clustered(130, 90, 6, 7, 2)
    plan = plan_product(pos // 90, pos % 90)
    got = sampled_product(dy, x, plan, chunk=chunk)
    torch.testing.assert_close(got, dense.reshape(-1)[pos], rtol=1e-13, atol=1e-13)


def test_no_coordinates_and_no_tokens():
    x, dy = torch.randn(0, 3), torch.randn(0, 4)
    assert sampled_product(dy, x, plan_product(torch.tensor([1]), torch.tensor([2]))).tolist() == [0.0]
    empty = torch.zeros(0, dtype=torch.int64)
    assert sampled_product(torch.randn(5, 4), torch.randn(5, 3), plan_product(empty, empty)).numel() == 0


def test_reduced_precision_is_summed_in_float32():
    gen = torch.Generator().manual_seed(6)
    x, dy = torch.randn(512, 8, generator=gen), torch.randn(512, 8, generator=gen)
    pos = some(64, 20, 7)
    got = sampled_product(dy.bfloat16(), x.bfloat16(), plan_product(pos // 8, pos % 8))
    assert got.dtype == torch.float32
    rounded = (dy.bfloat16().double().T @ x.bfloat16().double()).reshape(-1)[pos]  # the inputs' own rounding
    torch.testing.assert_close(got.double(), rounded, rtol=1e-5, atol=1e-4)


CONVS = [  # (batch, in, height, width, out, kernel, stride, padding, dilation, groups)
    (2, 4, 7, 6, 6, (3, 3), (2, 2), (1, 1), (1, 1), 2),
    (1, 3, 5, 5, 4, (2, 3), (1, 1), (0, 2), (2, 1), 1),
    (3, 2, 4, 4, 2, (1, 1), (1, 1), (0, 0), (1, 1), 1),
    (2, 6, 9, 9, 6, (3, 3), (3, 2), (2, 4), (2, 2), 3),  # padding wider than some offsets reach
    (2, 3, 6, 6, 4, (5, 5), (1, 1), (2, 2), (1, 1), 1),
]


def dense_conv_grad(x, dy, weight, stride, padding, dilation, groups):
    """The dense weight gradient, by the kernel autograd uses."""
    mask = [False, True, False]
    return torch.ops.aten.convolution_backward(
        dy, x, weight, None, list(stride), list(padding), list(dilation), False, [0, 0], groups, mask
    )[1]


@pytest.mark.parametrize("batch, cin, h, w, cout, kernel, stride, padding, dilation, groups", CONVS)
def test_conv2d_equals_the_dense_gradient_at_the_coordinates(
    batch, cin, h, w, cout, kernel, stride, padding, dilation, groups
):
    """Every kernel offset reads a window of dy and a strided view of x (no padded copy), a few images or rows at a
    time, batched or not."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(batch, cin, h, w, generator=gen, dtype=torch.float64)
    weight = torch.randn(cout, cin // groups, *kernel, generator=gen, dtype=torch.float64)
    y = torch.nn.functional.conv2d(x, weight, None, stride, padding, dilation, groups)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    dense = dense_conv_grad(x, dy, weight, stride, padding, dilation, groups)
    pos = some(weight.numel(), weight.numel() // 2, 9)
    plan = plan_conv2d(pos, tuple(weight.shape), groups)
    for chunk in (1 << 20, 60, 1):  # all the images at once; one image, a few rows at a time; one row at a time
        got = conv2d_values(x, dy, plan, stride, padding, dilation, chunk=chunk)
        torch.testing.assert_close(got, dense.reshape(-1)[pos], rtol=1e-12, atol=1e-12)
    unbatched = conv2d_values(x[0], dy[0], plan, stride, padding, dilation)
    dense0 = dense_conv_grad(x[:1], dy[:1], weight, stride, padding, dilation, groups)
    torch.testing.assert_close(unbatched, dense0.reshape(-1)[pos], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_equals_the_dense_gradient_bit_for_bit(padding_idx):
    """Its sums run over the tokens in order, as the dense backward's: the same bits."""
    gen = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 12, (4, 9), generator=gen)
    ids[0, :3] = 2
    dy = torch.randn(4, 9, 5, generator=gen, dtype=torch.float64)
    weight = torch.zeros(12, 5, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.embedding(ids, weight, padding_idx=padding_idx).backward(dy)
    pos = torch.arange(weight.numel())  # every coordinate: present rows, absent rows, the padding row
    got = embedding_values(ids, dy, pos // 5, pos % 5, padding_idx)
    assert torch.equal(got, weight.grad.reshape(-1))
    empty = embedding_values(ids[:0], dy[:0], pos // 5, pos % 5, padding_idx)
    assert torch.equal(empty, torch.zeros_like(got))
