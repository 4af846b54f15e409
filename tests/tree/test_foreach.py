"""functopk.tree.foreach: list maths against per-leaf torch references, dtypes kept, empty lists accepted."""

from __future__ import annotations

import math

import pytest
import torch

from functopk.tree import foreach
from tests.helpers import CaptureBlockers, bits, to_device

LEAVES = [
    torch.tensor([1.0, -2.0, 3.0]),
    torch.tensor([[0.5, -0.25]], dtype=torch.float64),
    torch.tensor(1.5, dtype=torch.float16),
    torch.tensor([2.0, -4.0], dtype=torch.bfloat16),
]
OTHERS = [x * 0.5 + 1.0 for x in LEAVES]


def on(device):
    """``LEAVES`` and ``OTHERS`` on ``device``: small dyadic values, so fused and unfused maths agree bit for bit."""
    return to_device(LEAVES, device), to_device(OTHERS, device)


def same(out, expected):
    assert len(out) == len(expected)
    for a, b in zip(out, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b.to(a.dtype))), (a, b)


SCALARS = [0.25, torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64)]


@pytest.mark.parametrize("scalar", SCALARS, ids=["float", "t32", "t64"])
def test_scalar_ops_match_per_leaf_maths_and_keep_dtypes(device, scalar):
    """A tensor scalar on the CPU (as users and schedules make them) and on the leaves' device."""
    xs, ys = on(device)
    for s in [scalar, scalar.to(device)] if isinstance(scalar, torch.Tensor) else [scalar]:
        same(foreach.mul(xs, s), [(x * s).to(x.dtype) for x in xs])
        same(foreach.add_scaled(xs, s, ys), [(x + s * y).to(x.dtype) for x, y in zip(xs, ys)])
        same(foreach.add_scalar(xs, s), [(x + s).to(x.dtype) for x in xs])
        same(foreach.lerp(xs, ys, s), [torch.lerp(x, y, torch.as_tensor(s, dtype=x.dtype, device=x.device))
                                       for x, y in zip(xs, ys)])


def test_binary_and_unary_ops(device):
    xs, ys = on(device)
    same(foreach.add(xs, ys), [x + y for x, y in zip(xs, ys)])
    same(foreach.sub(xs, ys), [x - y for x, y in zip(xs, ys)])
    same(foreach.div(xs, ys), [x / y for x, y in zip(xs, ys)])
    same(foreach.mul_list(xs, ys), [x * y for x, y in zip(xs, ys)])
    same(foreach.addcmul(xs, ys, ys, 0.5), [x + 0.5 * y * y for x, y in zip(xs, ys)])
    same(foreach.sqrt(ys), [y.sqrt() for y in ys])
    same(foreach.neg(xs), [-x for x in xs])
    same(foreach.abs(xs), [x.abs() for x in xs])
    signs = [x.clone() for x in xs]
    assert foreach.sign_(signs) is signs
    same(signs, [x.sign() for x in xs])
    same(foreach.maximum(xs, ys), [torch.maximum(x, y) for x, y in zip(xs, ys)])
    same(foreach.clamp(xs, -1.0, 1.0), [x.clamp(-1.0, 1.0) for x in xs])
    same(foreach.clamp(xs, torch.tensor(-1.0), torch.tensor(1.0)), [x.clamp(-1.0, 1.0) for x in xs])


def test_inputs_are_not_changed_and_div_into_writes_only_its_buffers(device):
    xs, ys = on(device)
    before = [x.clone() for x in xs]
    foreach.add_scaled(xs, 2.0, ys)
    bufs = [y.clone() for y in ys]
    out = foreach.div_into(xs, bufs)
    same(out, [x / y for x, y in zip(xs, ys)])
    same(xs, before)
    if device == "cpu":  # into the buffers; an accelerator returns the foreach kernel's fresh quotients
        assert out is bufs
    else:
        same(bufs, ys)


def test_where_zeros_full_cast(device):
    xs, ys = on(device)
    same(foreach.where(torch.tensor(True, device=device), xs, ys), xs)
    same(foreach.where(torch.tensor(False, device=device), xs, ys), ys)
    same(foreach.where_zero(torch.tensor(False, device=device), xs), [torch.zeros_like(x) for x in xs])
    same(foreach.zeros_like(xs), [torch.zeros_like(x) for x in xs])
    same(foreach.full_like(xs, torch.tensor(0.5)), [torch.full_like(x, 0.5) for x in xs])
    same(foreach.cast(xs, torch.float64), [x.double() for x in xs])
    ints = [torch.tensor([1, 2])]
    assert foreach.cast(ints, torch.float64)[0].dtype == torch.int64  # only floating leaves are cast


def test_every_op_accepts_the_empty_list():
    for out in (foreach.mul([], 2.0), foreach.add([], []), foreach.sub([], []), foreach.add_scaled([], 1.0, []),
                foreach.lerp([], [], 0.5), foreach.addcmul([], [], []), foreach.div([], []), foreach.sqrt([]),
                foreach.maximum([], []), foreach.neg([]), foreach.clamp([], 0.0, 1.0), foreach.zeros_like([]),
                foreach.mul_list([], []), foreach.add_scalar([], 1.0), foreach.div_into([], [])):
        assert out == []
    assert foreach.global_norm([]).item() == 0.0
    assert bool(foreach.all_finite([]))


def test_norms_accumulate_half_precision_in_float32_and_match_float64(device):
    big = [torch.full((4,), 60000.0, dtype=torch.float16), torch.tensor([3.0, 4.0], dtype=torch.float64)]
    big = to_device(big, device)
    norms = foreach.norms(big)
    assert all(n.dtype == torch.float64 for n in norms)
    assert norms[0].item() == pytest.approx(120000.0) and norms[1].item() == 5.0  # no fp16 overflow
    expected = math.sqrt(4 * 60000.0**2 + 25.0)
    assert foreach.global_norm(big).item() == pytest.approx(expected, rel=1e-12)


def test_all_finite_sees_nan_and_inf_in_any_dtype(device):
    xs, ys = on(device)
    assert bool(foreach.all_finite(xs))
    for bad in (math.nan, math.inf, -math.inf):
        leaves = [x.clone() for x in xs]
        leaves[2] = torch.tensor(bad, dtype=torch.float16, device=device)
        assert not bool(foreach.all_finite(leaves))


def test_leaves_without_elements_have_norm_zero_and_are_finite(device):
    leaves = to_device([torch.zeros(0), torch.tensor([3.0, -4.0]), torch.zeros(2, 0, dtype=torch.float64)], device)
    for ord_, expected in ((2.0, [0.0, 5.0, 0.0]), (math.inf, [0.0, 4.0, 0.0])):
        norms = foreach.norms(leaves, ord_)
        assert [n.item() for n in norms] == expected
        assert all(n.dtype == torch.float64 and n.device == leaves[0].device for n in norms)
    assert bool(foreach.all_finite(leaves)) and bool(foreach.all_finite(leaves[::2]))
    leaves[1] = leaves[1] * math.nan
    assert not bool(foreach.all_finite(leaves))
    assert foreach.global_norm(leaves[::2]).item() == 0.0


def test_a_meta_scalar_goes_through_the_list_overloads():
    xs = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]
    scalar = torch.empty((), device="meta")
    assert foreach.per_leaf(scalar, xs) == [scalar, scalar]
    out = foreach.add_scalar_(foreach.mul(xs, scalar), scalar)  # the scalar overloads would read its value
    assert [tuple(x.shape) for x in out] == [(3,), (2, 2)] and all(x.is_meta for x in out)


def test_for_leaves_keeps_float64_only_when_a_leaf_needs_it():
    s = torch.tensor(0.1, dtype=torch.float64)
    assert foreach.for_leaves(s, [torch.zeros(1)]).dtype == torch.float32
    assert foreach.for_leaves(s, [torch.zeros(1), torch.zeros(1, dtype=torch.float64)]).dtype == torch.float64
    assert foreach.for_leaves(0.5, [torch.zeros(1)]) == 0.5


def test_add_scaled_into_writes_add_scaled_into_the_buffers(device):
    xs = [torch.randn(5, device=device), torch.randn(2, 3, dtype=torch.float64, device=device)]
    bufs = [torch.randn(5, device=device), torch.randn(2, 3, dtype=torch.float64, device=device)]
    expected = foreach.add_scaled(xs, 0.9, bufs)
    ptrs = [b.data_ptr() for b in bufs]
    out = foreach.add_scaled_into(xs, 0.9, bufs)
    assert out is bufs and [b.data_ptr() for b in bufs] == ptrs
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out, expected))


def test_the_accelerator_forms_of_the_into_kernels_give_the_same_numbers(monkeypatch):
    """Eagerly off the CPU, div_into and add_scaled_into use foreach kernels (forced here on the CPU)."""
    xs, ys = on("cpu")
    per_leaf_div = foreach.div_into(xs, [y.clone() for y in ys])
    per_leaf_add = foreach.add_scaled_into(xs, 0.5, [y.clone() for y in ys])
    monkeypatch.setattr(foreach, "eager_accelerator", lambda x: True)
    same(foreach.div_into(xs, [y.clone() for y in ys]), per_leaf_div)
    bufs = [y.clone() for y in ys]
    assert foreach.add_scaled_into(xs, 0.5, bufs) is bufs  # written into the buffers (the state) all the same
    same(bufs, per_leaf_add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tensor_scalar_on_the_leaves_device_is_never_read_on_the_host(dtype):
    """``torch._foreach_add(xs, t)`` binds a 0-d ``t`` to its ``Scalar`` overload, which calls ``.item()``."""
    xs = [x.clone() for x in LEAVES]
    s = torch.tensor(0.25, dtype=dtype)
    with CaptureBlockers():
        out = [foreach.add_scalar(xs, s), foreach.add_scalar_([x.clone() for x in xs], s), foreach.mul(xs, s),
               foreach.mul_([x.clone() for x in xs], s), foreach.add_scaled(xs, s, xs), foreach.div_scalar(xs, s)]
    same(out[0], [(x + 0.25).to(x.dtype) for x in xs])
    same(out[1], out[0])
