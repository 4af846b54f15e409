"""One transformation over a list of ``ParamGroupOptimizer`` parameters, in torch's per-parameter entries.

:class:`Part` runs a transformation (a param group's, or ``sparsify``) on the
parameters and per-parameter state dicts as ``opt.state`` keeps them;
:func:`cohorts` groups the parameters that can step together (those sharing
their step counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functopk.adapter import inplace, per_param, views
from functopk.base import GradientTransformation, OptState

__all__ = ["Part", "cohorts"]


def _meta(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(p, device="meta") for p in params]


class Part:
    """One transformation over a list of parameters: builds layouts and fresh per-parameter entries.

    Its methods take the parameters and entries as ``opt.state`` keeps them, and run the maths on
    dense real views of them (:mod:`functopk.adapter.views`: complex parameters as real pairs).
    ``class_name`` is the torch class whose complex-parameter refusal it applies; ``inplace`` the
    same maths written into the state (:mod:`functopk.adapter.inplace`), where there is one.
    """

    def __init__(
        self,
        tx: GradientTransformation,
        rename: Mapping[str, str],
        prefix: str = "",
        class_name: str = "",
        inplace: inplace.InplaceStep | None = None,
    ) -> None:
        self.tx, self.rename, self.prefix, self.class_name = tx, rename, prefix, class_name
        self.inplace = inplace
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

    def run_inplace(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], entries: list[dict[str, Any]]
    ) -> inplace.Run | None:
        """The in-place step of ``params`` (run later: checking changes nothing), or ``None``: use :meth:`run`."""
        if self.inplace is None or any(p.is_complex() for p in params):
            return None
        return self.inplace(grads, params, entries)

    def run(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], entries: list[dict[str, Any]]
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """One update of ``params`` whose entries share their shared leaves; the updates and the new entries.

        ``grads`` are dense; the updates and entries come back shaped like ``params`` (complex for complex ones).
        """
        names = self._part_names(params)
        entries = views.real_entries(entries, names)
        if not any(p.is_complex() for p in params):  # the usual case: nothing to view
            return self._update(grads, params, entries)
        real_ps = [views.real(p) for p in params]
        updates, new = self._update([views.real(g) for g in grads], real_ps, entries)
        return views.param_updates(params, updates), views.param_entries(params, new, names)

    def _update(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], entries: list[dict[str, Any]]
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        layout = self.layout(params)
        state: OptState = per_param.join(entries, layout)
        updates, new_state = self.tx.update(per_param.as_tree(grads), state, per_param.as_tree(params))
        return [updates[i] for i in range(len(params))], per_param.split(new_state, layout)


def cohorts(entries: list[dict[str, Any]], layout: per_param.EntryLayout) -> list[list[int]]:
    """Positions grouped by the identity of their shared leaves (the parameters that can step together)."""
    shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple(id(e[n]) for n in shared), []).append(i)
    return list(groups.values())
