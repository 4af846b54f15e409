"""Maths over lists of tensors (a tree's leaves), one ``torch._foreach_*`` kernel per operation.

These are what transformations are written with (see :func:`functopk.leafwise`):
every function takes and returns plain lists, never changes its inputs, keeps
each result in the dtype of the corresponding input (undoing the promotion a
0-d tensor scalar can cause), accepts a Python number or a 0-d tensor as the
scalar without reading it back to the host, and returns ``[]`` for ``[]``
(the foreach kernels themselves reject empty lists).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from functopk._compat import DTENSOR_FOREACH_TENSOR_SCALAR, FOREACH_TENSOR_SCALARS_TRACE, is_dtensor

Leaves = Sequence[torch.Tensor]
Scalar = float | torch.Tensor


def keep_dtypes(results: Leaves, like: Leaves) -> list[torch.Tensor]:
    """Cast each result to the dtype of its counterpart in ``like`` where an op promoted it."""
    return [r if r.dtype == x.dtype else r.to(x.dtype) for r, x in zip(results, like)]


def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype for scalar maths (bias corrections, step sizes) on ``device``: float64, float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


def for_leaves(scalar: Scalar, leaves: Leaves) -> Scalar:
    """A float64 tensor scalar cast to float32 unless some leaf is float64.

    Scalars are computed in float64, as torch.optim computes them in Python
    floats; its kernels then use them in float32 for float32 (and narrower)
    tensors, and so does this. Keeping them float64 would make ``torch.compile``
    run the whole update in float64 (twice as slow on CPU).
    """
    if isinstance(scalar, torch.Tensor) and scalar.dtype == torch.float64:
        if not any(x.dtype == torch.float64 for x in leaves):
            return scalar.to(torch.float32)
    return scalar


def per_leaf(scalar: Scalar, xs: Leaves) -> Scalar | list[torch.Tensor]:
    """What a foreach kernel takes as ``scalar``: itself, or one copy per leaf if it is a tensor of coordinates.

    A scalar tensor with dimensions (one value per coordinate, as
    :func:`functopk.sparse.sparse_optimizer` keeps step counts) goes through
    the list overloads, which broadcast it against each leaf; the scalar
    overloads take only 0-d tensors. So does a 0-d tensor on the meta device
    (the scalar overloads read its value there, which a meta tensor has not),
    and a 0-d tensor while torch 2.10 compiles (its dynamo cannot trace the
    scalar overloads with a tensor).
    """
    if isinstance(scalar, torch.Tensor) and (
        scalar.dim()
        or scalar.device.type == "meta"
        or (not FOREACH_TENSOR_SCALARS_TRACE and torch.compiler.is_compiling())
    ):
        return [scalar] * len(xs)
    return scalar


def mul(xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
    """``scalar * x`` for each ``x``."""
    return keep_dtypes(torch._foreach_mul(list(xs), per_leaf(scalar, xs)), xs) if xs else []


def mul_list(xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """``x * y`` leaf by leaf (``ys`` may hold 0-d tensors, one per leaf)."""
    return keep_dtypes(torch._foreach_mul(list(xs), list(ys)), xs) if xs else []


def add(xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """``x + y`` leaf by leaf."""
    return keep_dtypes(torch._foreach_add(list(xs), list(ys)), xs) if xs else []


def add_scalar(xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
    """``x + scalar`` for each ``x``."""
    return keep_dtypes(torch._foreach_add(list(xs), per_leaf(scalar, xs), **_as_tensor(scalar, xs)), xs) if xs else []


def _as_tensor(scalar: Scalar, xs: Leaves) -> dict[str, int]:
    """``alpha=1`` where ``scalar`` is a tensor on the leaves' device, so that ``_foreach_add`` takes it as a tensor.

    Without ``alpha``, ``torch._foreach_add(xs, t)`` binds a 0-d tensor to its
    ``Scalar`` overload, which reads it on the host (``.item()``: on a GPU a
    synchronisation, and an error while a CUDA graph is being captured); the
    tensor overload reads it on the device, with the same bits on the CPU. A
    CPU tensor beside leaves elsewhere keeps the ``Scalar`` overload (a host
    read of host memory; CUDA's tensor overload wants the scalar on its device),
    and so do ``DTensor`` leaves on a torch whose DTensor cannot propagate the tensor overload.
    """
    if not isinstance(scalar, torch.Tensor) or scalar.device != xs[0].device:
        return {}
    return {} if not DTENSOR_FOREACH_TENSOR_SCALAR and is_dtensor(xs[0]) else {"alpha": 1}


def sub(xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """``x - y`` leaf by leaf."""
    return keep_dtypes(torch._foreach_sub(list(xs), list(ys)), xs) if xs else []


def add_scaled(xs: Leaves, scalar: Scalar, ys: Leaves) -> list[torch.Tensor]:
    """``x + scalar * y`` leaf by leaf: one fused kernel for a Python scalar, two for a tensor."""
    if not xs:
        return []
    if isinstance(scalar, torch.Tensor):  # the foreach ``alpha`` must be a Python number
        return keep_dtypes(torch._foreach_add(list(xs), torch._foreach_mul(list(ys), per_leaf(scalar, ys))), xs)
    return keep_dtypes(torch._foreach_add(list(xs), list(ys), alpha=scalar), xs)


def lerp(xs: Leaves, ys: Leaves, weight: Scalar) -> list[torch.Tensor]:
    """``x + weight * (y - x)`` with one ``lerp`` kernel, as torch.optim computes running means."""
    if not xs:
        return []
    if isinstance(weight, torch.Tensor):  # no foreach overload takes one tensor weight: a list of them
        return keep_dtypes(torch._foreach_lerp(list(xs), list(ys), [weight] * len(xs)), xs)
    return list(torch._foreach_lerp(list(xs), list(ys), weight))


def addcmul(xs: Leaves, ys: Leaves, zs: Leaves, value: float = 1.0) -> list[torch.Tensor]:
    """``x + value * y * z`` leaf by leaf."""
    return keep_dtypes(torch._foreach_addcmul(list(xs), list(ys), list(zs), value=value), xs) if xs else []


def div(xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """``x / y`` leaf by leaf."""
    return keep_dtypes(torch._foreach_div(list(xs), list(ys)), xs) if xs else []


def div_into(xs: Leaves, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x / b``, written into ``buffers`` (fresh tensors the caller owns) where that is cheaper; returned.

    Saves allocating a tree per step: on CPU a fresh tree costs page faults as
    well as memory, since glibc hands large freed blocks back to the system.
    Eagerly on CPU it is one ``div(out=)`` per leaf, since ``_foreach_div.List_out``
    computes into fresh tensors and copies them over (a tree allocated and one
    more pass); compiled, the foreach kernel (inductor plans the buffers
    itself). Eagerly on an accelerator it returns a fresh list from the plain
    foreach kernel instead: there ``List_out``'s per-leaf copies cost a copy
    call each (measured on an H200: 161 device-to-device copies per Adam step
    on the resnet50 tree), and one ``div`` per leaf a launch each, while a
    fresh tensor from the caching allocator costs less than either. All give
    the same quotients, bit for bit.
    """
    if not xs:
        return buffers
    if eager_accelerator(buffers[0]):
        return list(torch._foreach_div(list(xs), buffers))
    if torch.compiler.is_compiling():
        torch.ops.aten._foreach_div.List_out(list(xs), buffers, out=buffers)
    else:
        for x, b in zip(xs, buffers):
            torch.div(x, b, out=b)
    return buffers


def eager_accelerator(x: torch.Tensor) -> bool:
    """Whether ``x`` is off the CPU and the code runs eagerly: where one kernel per leaf costs a launch each."""
    return x.device.type != "cpu" and not torch.compiler.is_compiling()


def sqrt(xs: Leaves) -> list[torch.Tensor]:
    """``sqrt(x)`` for each ``x``."""
    return list(torch._foreach_sqrt(list(xs))) if xs else []


def maximum(xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """Elementwise ``max(x, y)`` leaf by leaf."""
    return list(torch._foreach_maximum(list(xs), list(ys))) if xs else []


def neg(xs: Leaves) -> list[torch.Tensor]:
    """``-x`` for each ``x``."""
    return list(torch._foreach_neg(list(xs))) if xs else []


def abs(xs: Leaves) -> list[torch.Tensor]:  # noqa: A001 (the module's namespace: foreach.abs)
    """``|x|`` for each ``x``."""
    return list(torch._foreach_abs(list(xs))) if xs else []


def clamp(xs: Leaves, low: Scalar, high: Scalar) -> list[torch.Tensor]:
    """``x`` clamped to ``[low, high]`` (NaN stays NaN)."""
    if not xs:
        return []
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):  # no foreach clamp takes tensor bounds
        lo, hi = torch.as_tensor(low), torch.as_tensor(high)
        return keep_dtypes([torch.clamp(x, lo.to(x.device), hi.to(x.device)) for x in xs], xs)
    return keep_dtypes(torch._foreach_clamp_max(torch._foreach_clamp_min(list(xs), low), high), xs)


def clamp_(buffers: list[torch.Tensor], low: Scalar, high: Scalar) -> list[torch.Tensor]:
    """:func:`clamp` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if not buffers:
        return buffers
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
        lo, hi = torch.as_tensor(low), torch.as_tensor(high)
        for x in buffers:
            x.clamp_(lo.to(x.device), hi.to(x.device))
    else:
        torch._foreach_clamp_min_(buffers, low)
        torch._foreach_clamp_max_(buffers, high)
    return buffers


def where(cond: torch.Tensor, xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
    """``x`` where the 0-d bool ``cond`` holds, else ``y``, leaf by leaf, without a host sync.

    There is no foreach ``where`` kernel: one ``torch.where`` per leaf, which
    ``torch.compile`` fuses.
    """
    return [torch.where(cond, x, y) for x, y in zip(xs, ys)]


def where_zero(cond: torch.Tensor, xs: Leaves) -> list[torch.Tensor]:
    """``x`` where the 0-d bool ``cond`` holds, else zeros."""
    return [torch.where(cond, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in xs]


def zeros_like(xs: Leaves, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Fresh zeros shaped like each ``x``."""
    return [torch.zeros_like(x, dtype=dtype, memory_format=torch.contiguous_format) for x in xs]


def full_like(xs: Leaves, value: Scalar) -> list[torch.Tensor]:
    """Fresh tensors shaped like each ``x`` filled with ``value`` (a number or a 0-d tensor)."""
    if isinstance(value, torch.Tensor):
        return [torch.zeros_like(x, memory_format=torch.contiguous_format).add_(value) for x in xs]
    return [torch.full_like(x, value, memory_format=torch.contiguous_format) for x in xs]


def cast(xs: Leaves, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Each ``x`` in ``dtype`` (``None``: unchanged); floating leaves only are cast."""
    if dtype is None:
        return list(xs)
    return [x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x for x in xs]


def norm_dtype(xs: Leaves) -> torch.dtype:
    """The dtype norms of ``xs`` are accumulated in: their promoted dtype, float32 at least."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def norms(xs: Leaves, ord: float = 2.0) -> list[torch.Tensor]:
    """The ``ord``-norm of each leaf as 0-d tensors, accumulated in float32 at least (no overflow in fp16).

    Grouped by (device, dtype) as ``torch.nn.utils.clip_grad_norm_`` does; the
    norms come back in the leaves' order, each in ``norm_dtype(xs)``. A leaf
    without elements has norm 0 (the foreach kernel refuses it for ``ord=inf``).
    """
    out: list[torch.Tensor | None] = [None] * len(xs)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    dtype = norm_dtype(xs)
    for i, x in enumerate(xs):
        if x.numel():
            groups.setdefault((x.device, x.dtype), []).append(i)
        else:
            out[i] = torch.zeros((), dtype=dtype, device=x.device)
    for (_, group_dtype), idx in groups.items():
        acc = torch.promote_types(group_dtype, torch.float32)
        for i, n in zip(idx, torch._foreach_norm([xs[i] for i in idx], ord, dtype=acc)):
            out[i] = n.to(dtype)
    return out  # type: ignore[return-value]


def global_norm(xs: Leaves) -> torch.Tensor:
    """The L2 norm of all leaves together (a 0-d tensor; float32 zero for no leaves)."""
    if not xs:
        return torch.zeros(())
    device = xs[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms(xs)]))


def all_finite(xs: Leaves) -> torch.Tensor:
    """A 0-d bool tensor: no NaN and no infinity in any leaf (the inf-norm of each, never an overflow)."""
    if not xs:
        return torch.ones((), dtype=torch.bool)
    device = xs[0].device
    return torch.stack([n.to(device) for n in norms(xs, math.inf)]).isfinite().all()


# --------------------------------------------------------------------------- appended for functopk.optim
# In-place variants work on buffers the caller owns (fresh results of an earlier op in the same
# update): they save one allocation per step, which on CPU also saves the page faults of a fresh tree.


def add_scalar_(buffers: list[torch.Tensor], scalar: Scalar) -> list[torch.Tensor]:
    """``b += scalar`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if buffers:
        torch._foreach_add_(buffers, per_leaf(scalar, buffers), **_as_tensor(scalar, buffers))
    return buffers


def sign_(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """``sign(b)`` in place, in ``buffers`` (fresh tensors the caller owns; ``sign(0) == 0``, NaN stays NaN)."""
    if buffers:
        torch._foreach_sign_(buffers)
    return buffers


def add_(buffers: list[torch.Tensor], ys: Leaves) -> list[torch.Tensor]:
    """``b += y`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if buffers:
        torch._foreach_add_(buffers, list(ys))
    return buffers


def maximum_(buffers: list[torch.Tensor], ys: Leaves) -> list[torch.Tensor]:
    """``b = max(b, y)`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if buffers:
        torch._foreach_maximum_(buffers, list(ys))
    return buffers


def mul_(buffers: list[torch.Tensor], scalar: Scalar) -> list[torch.Tensor]:
    """``b *= scalar`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if buffers:
        torch._foreach_mul_(buffers, per_leaf(scalar, buffers))
    return buffers


def addcmul_(buffers: list[torch.Tensor], ys: Leaves, zs: Leaves, value: float = 1.0) -> list[torch.Tensor]:
    """``b += value * y * z`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if buffers:
        torch._foreach_addcmul_(buffers, list(ys), list(zs), value=value)
    return buffers


def add_scaled_(buffers: list[torch.Tensor], scalar: Scalar, ys: Leaves) -> list[torch.Tensor]:
    """``b += scalar * y`` in place, in ``buffers`` (fresh tensors the caller owns), which are returned."""
    if not buffers:
        return buffers
    if isinstance(scalar, torch.Tensor):  # the foreach ``alpha`` must be a Python number
        torch._foreach_add_(buffers, torch._foreach_mul(list(ys), per_leaf(scalar, ys)))
    else:
        torch._foreach_add_(buffers, list(ys), alpha=scalar)
    return buffers


def div_scalar(xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
    """``x / scalar`` for each ``x`` (a true division, not a multiplication by the reciprocal)."""
    return keep_dtypes(torch._foreach_div(list(xs), per_leaf(scalar, xs)), xs) if xs else []


def nan_to_zero(xs: Leaves) -> list[torch.Tensor]:
    """Each ``x`` with its NaNs replaced by 0 (infinities kept); one ``nan_to_num`` per leaf (no foreach kernel)."""
    return [torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf) for x in xs]


def where_positive(conds: Leaves, xs: Leaves) -> list[torch.Tensor]:
    """``x`` where ``c > 0``, else 0, elementwise, leaf by leaf (one ``torch.where`` per leaf)."""
    return [torch.where(c > 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) for c, x in zip(conds, xs)]


def add_scaled_into(xs: Leaves, scalar: float, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x + scalar * b`` written into ``buffers`` (``b`` read first), returned: :func:`add_scaled`'s numbers.

    On the CPU (and compiled) one ``add(out=)`` per leaf: ``_foreach_add.List_out``
    computes into fresh tensors and copies. Eagerly on an accelerator, where each
    per-leaf kernel costs a launch, :func:`add_scaled`'s own foreach kernel and one
    ``_foreach_copy_`` into the buffers (the same numbers by construction).
    """
    if buffers and eager_accelerator(buffers[0]):
        torch._foreach_copy_(buffers, torch._foreach_add(list(xs), buffers, alpha=scalar))
        return buffers
    for x, b in zip(xs, buffers):
        torch.add(x, b, alpha=scalar, out=b)
    return buffers
