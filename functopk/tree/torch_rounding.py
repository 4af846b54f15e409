"""Where ``torch.optim``'s implementations round their scalars, for the optimizers at its parity.

torch computes step sizes in Python floats (float64), except where a tensor
learning rate takes part: ``tensor_lr / 0.9`` is a tensor of ``lr``'s dtype
(float32 for ``lr=torch.tensor(0.01)``), which rounds the step size before it
meets float64 parameters. Which expressions see the tensor also depends on the
implementation torch runs, the for-loop or the foreach kernels
(:func:`torch_foreach`). The helpers here compute the same scalars on device,
without reading anything back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functopk.tree.foreach import scalar_dtype

__all__ = ["decoupled_decay", "lr_divided", "lr_in_float64", "lr_times", "torch_foreach", "torch_scalar_dtype"]

Leaves = Sequence[torch.Tensor]
Scalar = float | torch.Tensor


def lr_times(lr: Scalar, x: torch.Tensor) -> torch.Tensor:
    """``lr * x`` as ``torch.optim`` computes it with ``x`` one of its Python floats (here a float64 tensor).

    A tensor ``lr`` keeps its dtype: torch rounds the float to it and
    multiplies there (``tensor_lr * 0.9`` is a float32 tensor); a number ``lr``
    multiplies in float64.

    Example:
        >>> third = torch.tensor(1 / 3, dtype=torch.float64)
        >>> lr_times(torch.tensor(0.1), third).dtype, lr_times(0.1, third).dtype
        (torch.float32, torch.float64)
    """
    return lr * x.to(lr.dtype) if isinstance(lr, torch.Tensor) else lr * x


def lr_divided(lr: Scalar, x: torch.Tensor) -> torch.Tensor:
    """``lr / x`` as ``torch.optim`` computes it with ``x`` one of its Python floats: see :func:`lr_times`.

    Example:
        >>> lr_divided(torch.tensor(0.1), torch.tensor(0.3, dtype=torch.float64)).dtype
        torch.float32
    """
    return lr / x.to(lr.dtype) if isinstance(lr, torch.Tensor) else lr / x


def decoupled_decay(lr: Scalar, weight_decay: Scalar) -> Scalar:
    """``-lr * weight_decay``, the factor of the parameters in a decoupled decay, as ``torch.optim`` applies it.

    torch multiplies the parameters by ``1 - lr * weight_decay``: a Python float
    (float64), or, where ``lr`` or ``weight_decay`` is a tensor, a tensor of its
    dtype (float32 for ``lr=torch.tensor(0.01)``). The factor minus one is that
    rounding, exactly.

    Example:
        >>> decoupled_decay(0.01, 0.1)
        -0.001
        >>> decoupled_decay(torch.tensor(0.01), 0.1).item()   # 1 - 1e-3 in float32, minus 1
        -0.0009999871253967285
    """
    if not isinstance(lr, torch.Tensor) and not isinstance(weight_decay, torch.Tensor):
        return -lr * weight_decay
    factor = 1.0 - lr * weight_decay
    assert isinstance(factor, torch.Tensor)
    return factor.to(scalar_dtype(factor.device)) - 1.0


def torch_foreach(flag: object, leaves: Leaves) -> bool:
    """Whether ``torch.optim`` runs its foreach (multi-tensor) implementation for these leaves.

    ``foreach=None`` lets torch pick: the foreach kernels when every leaf is a
    plain tensor on a device with them (CUDA, XPU, MTIA, the private-use
    backend), the for-loop otherwise (the CPU); any other value is taken as
    torch takes it, for its truth. Where the two implementations round
    differently, functopk follows the one torch would run.

    Example:
        >>> torch_foreach(None, [torch.zeros(2)]), torch_foreach(True, [torch.zeros(2)])
        (False, True)
    """
    if flag is not None:
        return bool(flag)
    devices = ("cuda", "xpu", "mtia", torch._C._get_privateuse1_backend_name())
    return bool(leaves) and all(type(x) in _FOREACH_TYPES and x.device.type in devices for x in leaves)


_FOREACH_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The tensor types torch.optim's foreach=None gives its foreach kernels (its ``_foreach_supported_types``)."""


def lr_in_float64(lr: Scalar, flag: object, leaves: Leaves, rounded_by_foreach: bool) -> bool:
    """Whether torch computes a step size from ``lr`` in float64: a number, or a tensor it reads on the host.

    Where torch's for-loop implementation (``rounded_by_foreach=False``) or its
    foreach one (``True``) computes with a tensor ``lr`` in its dtype, the other
    reads it with ``.item()`` into Python floats (NAdam, Adamax, RAdam).

    Example:
        >>> lr_in_float64(torch.tensor(0.1), None, [torch.zeros(2)], rounded_by_foreach=False)
        False
    """
    return not isinstance(lr, torch.Tensor) or torch_foreach(flag, leaves) != rounded_by_foreach


def torch_scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``torch.optim`` keeps per-parameter scalars in (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``).

    float64 under a float64 default dtype (but on MPS), float32 otherwise.

    Example:
        >>> torch_scalar_dtype(torch.device("cpu"))
        torch.float32
    """
    if device.type != "mps" and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32
