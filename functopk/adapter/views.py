"""Sparse and complex parameters seen as dense real tensors, as ``torch.optim`` sees them.

functopk's maths runs on dense real trees. :class:`~functopk.adapter.groups.ParamGroupOptimizer`
takes the two kinds of tensor ``torch.optim`` accepts beyond those as torch does:

* a **sparse gradient** (``nn.Embedding(..., sparse=True)``) is coalesced and made
  dense before the maths, which then equals torch's sparse paths (``SGD``,
  ``Adagrad``): the coordinates it does not touch get a zero gradient. The cost
  is one dense gradient per sparse parameter per step, and the coalesce's host
  sync. Where torch refuses a sparse gradient (every other class, and ``SGD`` or
  ``Adagrad`` with ``weight_decay``), :func:`check_sparse` refuses it too;
* a **complex parameter** is stepped through its ``torch.view_as_real`` view, as
  torch does: its real and imaginary parts are two real coordinates (two
  coordinates of a global top-k too). Its gradient and its state are viewed the
  same way for the maths, while ``opt.state[p]`` keeps complex tensors shaped like
  ``p`` (torch's checkpoint layout). ``Adafactor`` and ``Muon`` refuse complex
  parameters in torch; :func:`check_complex` refuses them here.

The conversions are views (no copies) except the densified sparse gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "check_complex", "check_sparse", "dense", "param_entries", "param_updates", "real", "real_entries",
]  # fmt: skip

SPARSE_CLASSES = ("SGD", "Adagrad")
"""The ``torch.optim`` classes that take sparse gradients (as long as ``weight_decay`` is zero)."""

NO_COMPLEX_CLASSES = ("Adafactor", "Muon")
"""The ``torch.optim`` classes (of those functopk covers) that refuse complex parameters."""

_COMPLEX_PARTS = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a dense tensor: a sparse one coalesced (duplicate indices summed) and densified."""
    if grad.layout == torch.strided:
        return grad
    return (grad.coalesce() if grad.layout == torch.sparse_coo else grad).to_dense()


def real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's ``torch.view_as_real`` view (a trailing dimension of 2); a real one as is."""
    return torch.view_as_real(t) if t.is_complex() else t


def check_sparse(
    class_name: str, groups: Sequence[Mapping[str, Any]], active: Sequence[Sequence[Any]], defaults: Mapping[str, Any]
) -> None:
    """Refuse a sparse gradient where ``torch.optim.<class_name>`` refuses it, before anything changes.

    ``defaults``: the constructor's arguments (Adagrad's ``initial_accumulator_value`` is read there, as torch does).

    Raises:
        NotImplementedError: a parameter of ``active`` (per group) has a sparse
            gradient and the class, or its group's ``weight_decay``, does not allow
            one (a ``RuntimeError`` subclass, as torch raises ``RuntimeError``), or ``Adagrad`` has
            ``eps`` and ``initial_accumulator_value`` both zero.
    """
    for i, (group, ps) in enumerate(zip(groups, active)):
        if all(p.grad.layout == torch.strided for p in ps):
            continue
        if class_name not in SPARSE_CLASSES:
            raise NotImplementedError(
                f"{class_name} does not support sparse gradients (param group {i} has one), as in torch.optim; "
                f"the classes that do are {' and '.join(SPARSE_CLASSES)} (or torch.optim.SparseAdam)"
            )
        if bool(group["weight_decay"] != 0):  # reads a tensor's value: a sparse step syncs (coalesce) anyway
            raise NotImplementedError(
                f"{class_name}'s weight_decay option is not compatible with sparse gradients, as in torch.optim: "
                f"param group {i} has weight_decay={group['weight_decay']} and a sparse gradient"
            )
        if class_name == "Adagrad" and bool(group["eps"] == 0) and bool(defaults["initial_accumulator_value"] == 0):
            raise NotImplementedError(
                f"Adagrad with eps=0, initial_accumulator_value=0 and a sparse gradient (param group {i}): the dense "
                "step would divide 0 by 0 at the coordinates no gradient has touched yet, which torch's sparse step "
                "leaves alone; give eps > 0 or initial_accumulator_value > 0"
            )


def check_complex(class_name: str, params: Sequence[torch.Tensor]) -> None:
    """Refuse complex parameters where ``torch.optim.<class_name>`` refuses them.

    Raises:
        TypeError: a parameter is complex and the class is one of :data:`NO_COMPLEX_CLASSES`.
    """
    if class_name not in NO_COMPLEX_CLASSES:
        return
    for i, p in enumerate(params):
        if p.is_complex():
            raise TypeError(
                f"{class_name} does not support complex parameters (torch.optim.{class_name} refuses them at its "
                f"first step); parameter {i} of the param group has dtype {p.dtype}"
            )


def _to_complex(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(t if t.stride(-1) == 1 and t.storage_offset() % 2 == 0 else t.contiguous())


def _is_pair_view(v: Any, p: torch.Tensor) -> bool:
    """Whether ``v`` is a real tensor shaped like ``real(p)`` for a complex ``p`` (so it stands for a complex one)."""
    return isinstance(v, torch.Tensor) and v.dtype in _COMPLEX_PARTS and v.shape == p.shape + (2,)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_layout = torch.Tensor.layout.__get__  # type: ignore[attr-defined]


def _real_and_dense(values: list[Any]) -> bool:
    """Whether every value is a plain real strided tensor (a few C-level passes; ``False`` may be too cautious)."""
    return (
        set(map(type, values)) <= _PLAIN and not any(map(torch.Tensor.is_complex, values))
        and set(map(_layout, values)) <= {torch.strided}
    )  # fmt: skip


def real_entries(entries: Sequence[dict[str, Any]], part_names: Sequence[str]) -> list[dict[str, Any]]:
    """The entries as the maths reads them: complex and sparse parts (``part_names``) as dense real tensors.

    (A sparse part comes from a ``torch.optim.SGD`` checkpoint: torch's momentum buffer of a sparse gradient.)
    """
    part_names = [n for n in part_names if not _real_and_dense([e.get(n) for e in entries])]
    if not part_names:  # (the usual step: nothing to view)
        return list(entries)
    out = []
    for e in entries:
        fixed = {}
        for n in part_names:
            v = e.get(n)
            if isinstance(v, torch.Tensor) and (v.is_complex() or v.layout != torch.strided):
                fixed[n] = real(dense(v))
        out.append({**e, **fixed} if fixed else e)
    return out


def param_entries(
    params: Sequence[torch.Tensor], entries: Sequence[dict[str, Any]], part_names: Sequence[str]
) -> list[dict[str, Any]]:
    """The entries as ``opt.state`` keeps them: a complex parameter's parts (``part_names``) complex, like it."""
    out = []
    for p, e in zip(params, entries):
        if p.is_complex():
            e = {n: _to_complex(v) if n in part_names and _is_pair_view(v, p) else v for n, v in e.items()}
        out.append(e)
    return out


def param_updates(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The updates shaped like ``params``: a complex parameter's real-pair update as a complex tensor."""
    return [_to_complex(u) if p.is_complex() else u for p, u in zip(params, updates)]
