"""``ParamGroupOptimizer``'s ``sparsify``: one transformation over the gradients of all groups together.

:class:`Sparsify` runs it as a :class:`~functopk.adapter.part.Part` over every
parameter with a gradient (its state kept per parameter, under keys starting
with ``"sparsify."``). A constant exact top-k (``ft.topk(k)`` or
``ft.topk(density=d)``, no schedule, ``method="exact"``) on gradients of one
dtype and device, selected by the eager exact kernel (the CPU), takes a faster
road with the same bits: the kept values are written into one flat gradient
buffer kept between steps, which is re-zeroed only at the previous step's
indices, and the optimizer reads leaf-shaped views of it as the gradients; no
new dense tree is built per step. Anything else (a schedule, another method
or transformation, mixed dtypes, DTensor or complex gradients, the static
kernel) builds the dense tree as :func:`functopk.topk` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from functopk.adapter.part import Part
from functopk.base import GradientTransformation
from functopk.compress.topk import topk
from functopk.sparse import dispatch
from functopk.sparse.k import k_at_step
from functopk.sparse.kernels.base import SUPPORTED_DTYPES
from functopk.sparse.selection import Indices
from functopk.tree.writer import IN_PLACE

__all__ = ["PREFIX", "Sparsify", "constant_topk"]

PREFIX = "sparsify."
"""The prefix of ``sparsify``'s keys in a parameter's state entry."""


def constant_topk(tx: GradientTransformation) -> tuple[Any, Any] | None:
    """``(k, density)`` when ``tx`` is ``ft.topk`` with a constant number and ``method="exact"``, else ``None``.

    Example:
        >>> import functopk as ft
        >>> constant_topk(ft.topk(3)), constant_topk(ft.topk(density=0.5)), constant_topk(ft.topk(lambda c: 1))
        ((3, None), (None, 0.5), None)
    """
    recipe = getattr(tx, "__dict__", {}).get("recipe")
    if recipe is None or recipe[0] is not topk:
        return None
    bound = inspect.signature(topk).bind(*recipe[1], **recipe[2])
    bound.apply_defaults()
    k, density, method = bound.arguments["k"], bound.arguments["density"], bound.arguments["method"]
    number = (int, float)
    if method != "exact" or isinstance(k, bool) or isinstance(density, bool):
        return None
    if (k is None or isinstance(k, int)) and (density is None or isinstance(density, number)):
        return k, density
    return None


class Sparsify(Part):
    """``sparsify`` over the parameters of all groups; a constant exact top-k through a kept buffer.

    Memory: with the buffer, one gradient-sized flat tensor per optimizer, kept
    between steps (and the ``k`` indices of the last step).

    Example:
        >>> import torch, functopk as ft
        >>> sp = Sparsify(ft.topk(1))
        >>> p = torch.zeros(3)
        >>> sp.step({}, [[p]], [[torch.tensor([1.0, -3.0, 2.0])]], {})
        [[tensor([ 0., -3.,  0.])]]
        >>> sp.step({}, [[p]], [[torch.tensor([4.0, 0.0, 0.0])]], {})   # -3.0 zeroed, 4.0 written
        [[tensor([4., 0., 0.])]]
    """

    def __init__(self, tx: GradientTransformation) -> None:
        super().__init__(tx, {}, PREFIX)
        self.constant = constant_topk(tx)
        self._buffer: torch.Tensor | None = None
        self._last: torch.Tensor | None = None  # where the buffer is not zero: the last step's indices
        self._views: tuple[Any, list[torch.Tensor]] = ((), [])

    def step(
        self,
        state: Mapping[torch.Tensor, dict[str, Any]],
        active: list[list[torch.Tensor]],
        grads: list[list[torch.Tensor]],
        written: dict[torch.Tensor, Any],
    ) -> list[list[torch.Tensor]]:
        """The new gradients of each group's ``active`` parameters (``grads``: dense); new entries into ``written``.

        ``state`` is the optimizer's (read, never written). The returned
        gradients may be views of the kept buffer: valid until the next step.
        """
        flat_ps = [p for ps in active for p in ps]
        flat_gs = [g for gs in grads for g in gs]
        layout = self.layout(flat_ps)  # checks k against the parameters, as the generic road's init does
        if self.constant is not None and self._plain(flat_ps, flat_gs):
            updates = self._buffered(flat_gs)
        else:
            updates = self._generic(state, flat_ps, flat_gs, layout, written)
        out, i = [], 0
        for ps in active:
            out.append(updates[i : i + len(ps)])
            i += len(ps)
        return out

    @staticmethod
    def _plain(params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """Plain real tensors of one supported dtype, on one device: what the buffer serves."""
        first = grads[0]
        return all(
            type(g) is torch.Tensor and g.dtype == first.dtype and g.device == first.device and not p.is_complex()
            for p, g in zip(params, grads)
        ) and first.dtype in SUPPORTED_DTYPES

    def _buffered(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The top-k written into the kept buffer; views of it (the static kernel: a new dense tree)."""
        assert self.constant is not None
        n = sum(g.numel() for g in grads)
        sel = dispatch.select(grads, k_at_step(*self.constant, None, n, name="updates"), "exact")
        if not isinstance(sel, Indices):
            return sel.dense(grads)
        buf = self._buffer
        if buf is None or buf.numel() < n or buf.dtype != grads[0].dtype or buf.device != grads[0].device:
            buf = self._buffer = torch.zeros(n, dtype=grads[0].dtype, device=grads[0].device)
            self._last = None
        if self._last is not None:
            buf.index_fill_(0, self._last, 0)
        buf.index_copy_(0, sel.indices, sel.values)
        self._last = sel.indices
        key = (buf.data_ptr(), tuple(g.shape for g in grads))
        if self._views[0] != key:
            pieces = torch.split(buf[:n], [g.numel() for g in grads])
            self._views = (key, [x.view(g.shape) for x, g in zip(pieces, grads)])
        return list(self._views[1])

    def unshared(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``entries`` with copies of the tensors that live in the kept buffer (which the next step rewrites)."""
        if self._buffer is None:
            return entries
        ptr = self._buffer.untyped_storage().data_ptr()

        def own(v: Any) -> Any:
            return v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == ptr else v

        return [{n: own(v) for n, v in e.items()} for e in entries]

    def _generic(
        self,
        state: Mapping[torch.Tensor, dict[str, Any]],
        flat_ps: list[torch.Tensor],
        flat_gs: list[torch.Tensor],
        layout: Any,
        written: dict[torch.Tensor, Any],
    ) -> list[torch.Tensor]:
        """The transformation run on the gradients as one tree, its state read from and written to the entries."""
        shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
        entries = self.entries(flat_ps, [state.get(p, {}) for p in flat_ps])
        # Shared leaves (a step count) come from any parameter that has them, so a late joiner resets nothing.
        donor = next((s for s in state.values() if shared and all(n in s for n in shared)), None)
        if donor is not None:
            entries = [{**e, **{n: donor[n] for n in shared}} for e in entries]
        updates, new = self.plan(flat_gs, flat_ps, entries)(False, IN_PLACE)
        assert updates is not None
        for p, e in zip(flat_ps, new):  # (merged: with sparsify_on="update" the optimizer's entries are there)
            written.setdefault(p, {}).update(e)
        if shared:  # parameters without a gradient now keep their sparsify entries, with the new shared leaves
            stepped = set(map(id, flat_ps))
            for p, s in state.items():
                if id(p) not in stepped and all(n in s for n in shared):
                    written.setdefault(p, {}).update({n: new[0][n] for n in shared})
        return updates
