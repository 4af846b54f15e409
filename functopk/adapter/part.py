"""One transformation over a list of ``ParamGroupOptimizer`` parameters, in torch's per-parameter entries.

:class:`Part` runs a transformation (a param group's, or ``sparsify``) on the
parameters and per-parameter state dicts as ``opt.state`` keeps them;
:func:`cohorts` groups the parameters that can step together (those sharing
their step counts).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any

import torch

from functopk.adapter import per_param, views
from functopk.base import GradientTransformation, OptState
from functopk.inplace import plan_step, run_step
from functopk.tree.writer import Writer

__all__ = ["Part", "cohorts"]


def _meta(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(p, device="meta") for p in params]


class Part:
    """One transformation over a list of parameters: builds layouts and fresh per-parameter entries.

    Its methods take the parameters and entries as ``opt.state`` keeps them, and run the maths on
    dense real views of them (:mod:`functopk.adapter.views`: complex parameters as real pairs), in
    the tree :meth:`tree` makes of them. ``class_name`` is the torch class whose complex-parameter
    refusal it applies.
    """

    def __init__(
        self, tx: GradientTransformation, rename: Mapping[str, str], prefix: str = "", class_name: str = ""
    ) -> None:
        self.tx, self.rename, self.prefix, self.class_name = tx, rename, prefix, class_name
        self._layouts: dict[Any, tuple[per_param.EntryLayout, dict[str, Any]]] = {}

    def tree(self, params: list[torch.Tensor], values: list[Any]) -> Any:
        """The tree the transformation sees, ``values`` standing for ``params``: ``{0: v0, 1: v1, ...}``."""
        return per_param.as_tree(values)

    def _key(self, params: list[torch.Tensor]) -> Any:
        """What the layout of ``params`` depends on (their tree's structure): their number here."""
        return len(params)

    def reuse_layouts(self, other: Part) -> None:
        """Take ``other``'s layouts: a part for the same hyperparameters up to values has the same structure."""
        self._layouts = other._layouts

    def _real_template(self, params: list[torch.Tensor]) -> OptState:
        """The maths' state for ``params`` seen as real tensors: on the meta device when ``init`` allows."""
        views.check_complex(self.class_name, params)
        real = [views.real(p) for p in params]
        try:
            return self.tx.init(self.tree(params, _meta(real)))
        except Exception:  # an init that reads values: build it for real
            return self.tx.init(self.tree(params, real))

    def template(self, params: list[torch.Tensor]) -> OptState:
        """A state for ``params`` to read structure and dtypes from (complex parts for complex parameters)."""
        state = self._real_template(params)
        if not any(p.is_complex() for p in params):
            return state
        layout = self.layout(params)
        return per_param.join(self._param_form(params, per_param.split(state, layout)), layout)

    def layout(self, params: list[torch.Tensor]) -> per_param.EntryLayout:
        return self._layout(params)[0]

    def _layout(self, params: list[torch.Tensor]) -> tuple[per_param.EntryLayout, dict[str, Any]]:
        """The layout of ``params``, and the kind (shape and dtype) of each shared tensor leaf of a fresh state."""
        key = self._key(params)
        if key not in self._layouts:
            template = self._real_template(params)
            positions = self.tree(params, list(range(len(params))))
            layout = per_param.layout_of(template, positions, self.rename, self.prefix)
            items = layout.spec.flatten_up_to(template)
            kinds = {n: (x.shape, x.dtype) for n, x, part in zip(layout.names, items, layout.is_part)
                     if not part and isinstance(x, torch.Tensor)}  # fmt: skip
            self._layouts[key] = (layout, kinds)
        return self._layouts[key]

    def check_shared(self, params: list[torch.Tensor], entry: dict[str, Any]) -> None:
        """``ValueError`` where a shared tensor of ``entry`` (kept from a step over other parameters) is not of
        the kind a state for ``params`` has: a state sized by the set of parameters cannot be carried over."""
        for name, (shape, dtype) in self._layout(params)[1].items():
            x = entry.get(name)
            if isinstance(x, torch.Tensor) and (x.shape, x.dtype) != (shape, dtype):
                raise ValueError(
                    "the set of parameters with gradients changed, but the transformation keeps state sized by the "
                    f"whole parameter set ({name!r} is {x.dtype} of shape {tuple(x.shape)}, a state for these "
                    f"parameters has {dtype} of shape {tuple(shape)}), so its state cannot be carried over to the new "
                    "set; give the same parameters a gradient at every step (e.g. zero_grad(set_to_none=False)) and "
                    "freeze parameters (no gradient) from the first step"
                )

    def _part_names(self, params: list[torch.Tensor]) -> list[str]:
        layout = self.layout(params)
        return [n for n, is_part in zip(layout.names, layout.is_part) if is_part]

    def _param_form(self, params: list[torch.Tensor], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return views.param_entries(params, entries, self._part_names(params))

    def fresh(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """New entries for ``params`` (their shared leaves shared among them)."""
        state = self.tx.init(self.tree(params, [views.real(p) for p in params]))
        return self._param_form(params, per_param.split(state, self.layout(params)))

    def entries(self, params: list[torch.Tensor], stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each parameter's entries, with fresh values where it has none of a name (late joiners, new buffers);
        where none is missing, the ``stored`` dicts themselves (read, never written, by :meth:`plan`)."""
        names = self.layout(params).names
        if all(map(frozenset(names).issubset, stored)):  # (the usual step: the stored dicts, read only)
            return list(stored)
        # init over all of this part's parameters (not the newcomers alone: a top-k's k may exceed their size)
        fresh = self.fresh(params)
        return [{n: s[n] if n in s else fresh[i][n] for n in names} for i, s in enumerate(stored)]

    def plan(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], entries: list[dict[str, Any]]
    ) -> tuple[Callable[[bool, Writer], tuple[list[torch.Tensor] | None, list[dict[str, Any]]]], bool]:
        """One update of ``params`` whose entries share their shared leaves, checked and its pure part done:
        ``run(add, writer) -> (updates, new entries)`` then writes it (:func:`functopk.inplace.run_step`); and
        whether its updates are mostly zero (a top-k's).

        The in-place engine (:mod:`functopk.inplace`) runs the transformation: where its parts can, they
        write into the entries' own tensors (and, with ``add``, add their updates into the parameters,
        returning ``None`` for the updates); the rest runs purely. ``grads`` are dense; the updates and
        entries come back shaped like ``params`` (complex for complex ones: the maths sees their real pairs).
        """
        names = self._part_names(params)
        layout = self.layout(params)
        plain = not any(map(torch.Tensor.is_complex, params))
        real_gs = grads if plain else [views.real(g) for g in grads]
        real_ps = params if plain else [views.real(p) for p in params]
        state: OptState = per_param.join(views.real_entries(entries, names), layout)
        args = (self.tx, self.tree(params, real_gs), state, self.tree(params, real_ps))
        step = plan_step(*args, checked=True)
        written = [t for planned in step.plans for t in planned.written]
        if len(set(map(id, (*written, *real_gs, *real_ps)))) < len(written) + 2 * len(params):
            # a state tensor twice, or one that is a gradient or a parameter (put there by hand): the pure path
            step = plan_step(*args, in_place=False, checked=True)

        def run(add: bool, writer: Writer) -> tuple[list[torch.Tensor] | None, list[dict[str, Any]]]:
            updates = run_step(step, add=add, writer=writer)
            new = per_param.split(step.new_state, layout)
            if plain:
                return updates, new
            return (None if updates is None else views.param_updates(params, updates)), views.param_entries(
                params, new, names
            )

        return run, step.sparse


def cohorts(entries: list[dict[str, Any]], layout: per_param.EntryLayout) -> list[list[int]]:
    """Positions grouped by the identity of their shared leaves (the parameters that can step together)."""
    if not entries:
        return []
    shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
    if all(all(map(operator.is_, map(operator.itemgetter(n), entries), repeat(entries[0][n]))) for n in shared):
        return [list(range(len(entries)))]  # (the usual step: nothing shared, or one step count for all)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple([id(e[n]) for n in shared]), []).append(i)
    return list(groups.values())
