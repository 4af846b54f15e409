"""``ParamGroupOptimizer``'s ``sparsify``: one transformation over the gradients (or updates) of all groups.

:class:`Sparsify` runs it as a :class:`~functopk.adapter.part.Part` over every
parameter with a gradient, through the in-place engine (:mod:`functopk.inplace`),
its state kept per parameter under keys starting with ``"sparsify."``. The
transformation the user passes is the one that runs: a constant exact
``ft.topk(k)`` (or ``ft.topk(density=d)``) writes its selection into the flat
buffer it keeps between steps (:class:`functopk.compress.topk.KeptBuffer`), so
the optimizer reads leaf-shaped views of it as the gradients and no dense tree
is built per step; anything else runs as it would in ``update_``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functopk.adapter.part import Part
from functopk.base import GradientTransformation
from functopk.tree.writer import IN_PLACE

__all__ = ["PREFIX", "Sparsify"]

PREFIX = "sparsify."
"""The prefix of ``sparsify``'s keys in a parameter's state entry."""


class Sparsify(Part):
    """``sparsify`` over the parameters of all groups, its state kept in the parameters' entries.

    Example:
        >>> import torch, functopk as ft
        >>> sp = Sparsify(ft.topk(1))
        >>> p = torch.zeros(3)
        >>> sp.step({}, [[p]], [[torch.tensor([1.0, -3.0, 2.0])]], {})
        ([[tensor([ 0., -3.,  0.])]], True)
        >>> sp.step({}, [[p]], [[torch.tensor([4.0, 0.0, 0.0])]], {})   # -3.0 zeroed, 4.0 written
        ([[tensor([4., 0., 0.])]], True)
    """

    def __init__(self, tx: GradientTransformation, prefix: str = PREFIX) -> None:
        super().__init__(tx, {}, prefix)

    def step(
        self,
        state: Mapping[torch.Tensor, dict[str, Any]],
        active: list[list[torch.Tensor]],
        grads: list[list[torch.Tensor]],
        written: dict[torch.Tensor, Any],
        *,
        add: bool = False,
        shared: Mapping[str, Any] | None = None,
    ) -> tuple[list[list[torch.Tensor]], bool]:
        """The new gradients of each group's ``active`` parameters (``grads``: dense), and whether they are
        mostly zero (a top-k's); the new entries into ``written``. With ``add``, the transformation is the
        whole step: its updates are added into the parameters (and ``[]`` returned).

        ``state`` is the optimizer's (read, never written; ``shared`` replaces shared leaves of it, an
        injected learning rate). The returned gradients may be views of a kept buffer: valid until the next step.

        Raises:
            ValueError: the state is sized by another set of parameters than those with a gradient now.
        """
        flat_ps = [p for ps in active for p in ps]
        flat_gs = [g for gs in grads for g in gs]
        layout = self.layout(flat_ps)  # checks k against the parameters, as the pure road's init does
        names = [n for n, part in zip(layout.names, layout.is_part) if not part]
        entries = self.entries(flat_ps, [state.get(p, {}) for p in flat_ps])
        # Shared leaves (a step count) come from any parameter that has them, so a late joiner resets nothing.
        donor = next((s for s in state.values() if names and all(n in s for n in names)), None)
        if donor is not None or shared:
            kept = {**({n: donor[n] for n in names} if donor is not None else {}), **(shared or {})}
            entries = [{**e, **kept} for e in entries]
            self.check_shared(flat_ps, entries[0])
        run, sparse = self.plan(flat_gs, flat_ps, entries)
        updates, new = run(add, IN_PLACE)
        for p, e in zip(flat_ps, new):  # (merged: with sparsify_on="update" the optimizer's entries are there)
            written.setdefault(p, {}).update(e)
        if names:  # parameters without a gradient now keep their sparsify entries, with the new shared leaves
            stepped = set(map(id, flat_ps))
            for p, s in state.items():
                if id(p) not in stepped and all(n in s for n in names):
                    written.setdefault(p, {}).update({n: new[0][n] for n in names})
        if add:
            return [], sparse
        assert updates is not None
        out, i = [], 0
        for ps in active:
            out.append(updates[i : i + len(ps)])
            i += len(ps)
        return out, sparse


def storages(grads: list[list[torch.Tensor]]) -> set[int]:
    """Where the plain tensors among ``grads`` keep their data (a tensor subclass, a ``DTensor``, has no storage
    of its own here, and is never a view of a kept buffer)."""
    return {g.untyped_storage().data_ptr() for gs in grads for g in gs if type(g) in (torch.Tensor, torch.nn.Parameter)}


def unshared(entries: list[dict[str, Any]], kept: set[int]) -> list[dict[str, Any]]:
    """``entries`` with copies of the tensors whose storage is in ``kept`` (a buffer the next step rewrites)."""

    def own(v: Any) -> Any:
        plain = type(v) in (torch.Tensor, torch.nn.Parameter)
        return v.clone() if plain and v.untyped_storage().data_ptr() in kept else v

    return [{n: own(v) for n, v in e.items()} for e in entries] if kept else entries
