"""One transformation over a list of ``ParamGroupOptimizer`` parameters, in torch's per-parameter entries.

:class:`Part` runs a transformation (a param group's, or ``sparsify``) on the
parameters and per-parameter state dicts as ``opt.state`` keeps them;
:func:`cohorts` groups the parameters that can step together (those sharing
their step counts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    dense real views of them (:mod:`functopk.adapter.views`: complex parameters as real pairs).
    ``class_name`` is the torch class whose complex-parameter refusal it applies.
    """

    def __init__(
        self, tx: GradientTransformation, rename: Mapping[str, str], prefix: str = "", class_name: str = ""
    ) -> None:
        self.tx, self.rename, self.prefix, self.class_name = tx, rename, prefix, class_name
        self._layouts: dict[int, per_param.EntryLayout] = {}

    def reuse_layouts(self, other: Part) -> None:
        """Take ``other``'s layouts: a part for the same hyperparameters up to values has the same structure."""
        self._layouts = other._layouts

    def _real_template(self, params: list[torch.Tensor]) -> OptState:
        """The maths' state for ``params`` seen as real tensors: on the meta device when ``init`` allows."""
        views.check_complex(self.class_name, params)
        real = [views.real(p) for p in params]
        try:
            return self.tx.init(per_param.as_tree(_meta(real)))
        except Exception:  # an init that reads values: build it for real
            return self.tx.init(per_param.as_tree(real))

    def template(self, params: list[torch.Tensor]) -> OptState:
        """A state for ``params`` to read structure and dtypes from (complex parts for complex parameters)."""
        state = self._real_template(params)
        if not any(p.is_complex() for p in params):
            return state
        layout = self.layout(params)
        return per_param.join(self._param_form(params, per_param.split(state, layout)), layout)

    def layout(self, params: list[torch.Tensor]) -> per_param.EntryLayout:
        n = len(params)
        if n not in self._layouts:
            self._layouts[n] = per_param.layout_of(self._real_template(params), n, self.rename, self.prefix)
        return self._layouts[n]

    def _part_names(self, params: list[torch.Tensor]) -> list[str]:
        layout = self.layout(params)
        return [n for n, is_part in zip(layout.names, layout.is_part) if is_part]

    def _param_form(self, params: list[torch.Tensor], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return views.param_entries(params, entries, self._part_names(params))

    def fresh(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """New entries for ``params`` (their shared leaves shared among them)."""
        state = self.tx.init(per_param.as_tree([views.real(p) for p in params]))
        return self._param_form(params, per_param.split(state, self.layout(params)))

    def entries(self, params: list[torch.Tensor], stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each parameter's entries, with fresh values where it has none of a name (late joiners, new buffers)."""
        names = self.layout(params).names
        missing = [i for i, s in enumerate(stored) if any(n not in s for n in names)]
        if not missing:
            return [{n: s[n] for n in names} for s in stored]
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
        real_gs, real_ps = [views.real(g) for g in grads], per_param.as_tree([views.real(p) for p in params])
        state: OptState = per_param.join(views.real_entries(entries, names), layout)
        step = plan_step(self.tx, per_param.as_tree(real_gs), state, real_ps)
        written = [t for planned in step.plans for t in planned.written]
        if len({id(t) for t in (*written, *real_gs, *real_ps.values())}) < len(written) + 2 * len(params):
            # a state tensor twice, or one that is a gradient or a parameter (put there by hand): the pure path
            step = plan_step(self.tx, per_param.as_tree(real_gs), state, real_ps, in_place=False)

        def run(add: bool, writer: Writer) -> tuple[list[torch.Tensor] | None, list[dict[str, Any]]]:
            updates = run_step(step, add=add, writer=writer)
            new = views.param_entries(params, per_param.split(step.new_state, layout), names)
            return (None if updates is None else views.param_updates(params, updates)), new

        return run, step.sparse


def cohorts(entries: list[dict[str, Any]], layout: per_param.EntryLayout) -> list[list[int]]:
    """Positions grouped by the identity of their shared leaves (the parameters that can step together)."""
    shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple(id(e[n]) for n in shared), []).append(i)
    return list(groups.values())
