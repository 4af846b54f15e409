"""``TorchOptimizer.from_torch``: a ``torch.optim`` optimizer with torch's param-group semantics, sparsified.

:class:`ParamGroupOptimizer` behaves like ``optimizer_class(params, **defaults)``
(per-group hyperparameters read at every step, per-parameter state and step
counts, ``add_param_group``, ``state_dict`` in torch's layout, schedulers,
``GradScaler``), while the maths is functopk's (:func:`functopk.from_torch`) and
an optional ``sparsify`` transformation first runs on the gradients of *all*
groups together (so ``sparsify=ft.topk(1000)`` is one global top-k).

State lives where torch keeps it, in ``opt.state[p]`` as one dict per parameter
(:mod:`functopk.adapter.per_param`); each step rebuilds the functopk states
from it. Parameters whose step counts (and other per-parameter scalars) are the
*same tensor objects* are updated together, as one tree: after a normal step
every parameter of a group shares them, so a group costs one ``update`` call;
a parameter skipped for lack of a gradient, or added late, keeps its own count
and forms its own cohort, which is how torch's per-parameter steps come out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from functopk.adapter import per_param
from functopk.adapter.registry import spec_for, torch_hyperparams
from functopk.base import GradientTransformation, OptState, check_transformation

__all__ = ["ParamGroupOptimizer"]

_SPARSIFY = "sparsify."
_NOT_HYPER = ("params", "param_names")


def _key(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter value: tensors by identity (schedulers change them in place)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)):
        return tuple(_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


def _shape(key: Any) -> Any:
    """A hyperparameter key with numbers reduced to zero / non-zero: what decides a state's structure.

    (A zero momentum or weight decay drops a part of the chain; other values change only the maths.)
    """
    if isinstance(key, tuple):
        return tuple(_shape(k) for k in key)
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return ("number", key == 0)
    return key


def _meta(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(p, device="meta") for p in params]


class _Part:
    """One transformation over a list of parameters: builds layouts and fresh per-parameter entries."""

    def __init__(self, tx: GradientTransformation, rename: Mapping[str, str], prefix: str = "") -> None:
        self.tx, self.rename, self.prefix = tx, rename, prefix
        self._layouts: dict[int, per_param.Layout] = {}

    def reuse_layouts(self, other: _Part) -> None:
        """Take ``other``'s layouts: a part for the same hyperparameters up to values has the same structure."""
        self._layouts = other._layouts

    def template(self, params: list[torch.Tensor]) -> OptState:
        """A state for ``params`` to read structure and dtypes from: on the meta device when ``init`` allows."""
        try:
            return self.tx.init(per_param.as_tree(_meta(params)))
        except Exception:  # an init that reads values: build it for real
            return self.tx.init(per_param.as_tree(params))

    def layout(self, params: list[torch.Tensor]) -> per_param.Layout:
        n = len(params)
        if n not in self._layouts:
            self._layouts[n] = per_param.layout_of(self.template(params), n, self.rename, self.prefix)
        return self._layouts[n]

    def fresh(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """New entries for ``params`` (their shared leaves shared among them)."""
        return per_param.split(self.tx.init(per_param.as_tree(params)), self.layout(params))

    def entries(self, params: list[torch.Tensor], stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each parameter's entries, with fresh values where it has none of a name (late joiners, new buffers)."""
        names = self.layout(params).names
        missing = [i for i, s in enumerate(stored) if any(n not in s for n in names)]
        if not missing:
            return [{n: s[n] for n in names} for s in stored]
        # init over all of this part's parameters (not the newcomers alone: a top-k's k may exceed their size)
        fresh = self.fresh(params)
        return [{n: s[n] if n in s else fresh[i][n] for n in names} for i, s in enumerate(stored)]

    def run(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], entries: list[dict[str, Any]]
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """One update of ``params`` whose entries share their shared leaves; the updates and the new entries."""
        layout = self.layout(params)
        state: OptState = per_param.join(entries, layout)
        updates, new_state = self.tx.update(per_param.as_tree(grads), state, per_param.as_tree(params))
        return [updates[i] for i in range(len(params))], per_param.split(new_state, layout)


def _cohorts(entries: list[dict[str, Any]], layout: per_param.Layout) -> list[list[int]]:
    """Positions grouped by the identity of their shared leaves (the parameters that can step together)."""
    shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple(id(e[n]) for n in shared), []).append(i)
    return list(groups.values())


class ParamGroupOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` computed by functopk, with an optional global ``sparsify`` first.

    Made by :meth:`functopk.TorchOptimizer.from_torch`; see there. Everything a
    torch user relies on behaves as in ``optimizer_class``:

    * ``param_groups`` hold torch's keys and defaults (``lr`` is the real
      learning rate); every hyperparameter is read at every step, so schedulers
      (every ``torch.optim.lr_scheduler`` class, ``OneCycleLR``'s momentum
      cycling included) and hand edits take effect at the next step;
    * ``state[p]`` is one dict per parameter with torch's keys (``step``,
      ``exp_avg``, ...; functopk's field name where torch has no such entry);
      a parameter whose ``.grad`` is ``None`` is skipped and keeps its step
      count; a parameter added later starts fresh;
    * ``state_dict()``/``load_state_dict()`` are torch's own layout (so
      ``torch.distributed.checkpoint.state_dict`` works) and resume bit for bit;
      loading keeps each saved tensor's dtype, except that a saved value whose
      dtype differs from what the transformation keeps (torch's float ``step``)
      is converted;
    * ``sparsify``'s state is kept per parameter too, under keys starting
      with ``"sparsify."``;
    * ``from_torch`` makes it of a subclass named as, and subclassing,
      ``optimizer_class`` (:mod:`functopk.adapter.classes`), for loggers and
      ``isinstance``;
    * ``pickle``/``torch.save``/``copy.deepcopy`` copy groups, state and
      ``sparsify`` (which pickles as the factory call that made it: a lambda
      among its arguments raises ``TypeError``).

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = ft.TorchOptimizer.from_torch(torch.optim.AdamW, model.parameters(), lr=0.01)
        >>> model(torch.randn(4, 3)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight]), opt.param_groups[0]["lr"]
        (['exp_avg', 'exp_avg_sq', 'step'], 0.01)
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        sparsify: GradientTransformation | None = None,
        **defaults: Any,
    ) -> None:
        self.optimizer_class = optimizer_class
        self._spec = spec_for(optimizer_class)
        self._sparsify = None if sparsify is None else _Part(check_transformation(sparsify, "sparsify"), {}, _SPARSIFY)
        self._parts: dict[int, tuple[Any, _Part]] = {}
        super().__init__(params, torch_hyperparams(optimizer_class, defaults))

    def __getstate__(self) -> dict[str, Any]:
        # torch's groups and state, the torch class and sparsify; the rest (spec, transformations) is rebuilt
        state = super().__getstate__()
        state["optimizer_class"] = self.optimizer_class
        state["sparsify"] = self.sparsify
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (or deep-copy); ``load_state_dict`` also calls this, with groups and state only."""
        state = dict(state)
        unpickled = "sparsify" in state
        sparsify = state.pop("sparsify", None)
        super().__setstate__(state)
        if unpickled:  # the torch class's TorchSpec is looked up again (its build functions do not pickle)
            self._spec = spec_for(self.optimizer_class)
            self._sparsify = None if sparsify is None else _Part(sparsify, {}, _SPARSIFY)
            self._parts = {}

    @property
    def sparsify(self) -> GradientTransformation | None:
        """The transformation applied to the gradients of all groups together (``None``: none)."""
        return None if self._sparsify is None else self._sparsify.tx

    def _part(self, group: dict[str, Any]) -> _Part:
        """The transformation for ``group``'s current hyperparameters (rebuilt when one changed)."""
        key = tuple((k, _key(v)) for k, v in sorted(group.items()) if k not in _NOT_HYPER)
        cached = self._parts.get(id(group))
        if cached is None or cached[0] != key:
            part = _Part(self._spec.build(group), self._spec.state_names)
            if cached is not None and _shape(cached[0]) == _shape(key):
                part.reuse_layouts(cached[1])  # only a value changed (a scheduler's lr): the same state structure
            cached = self._parts[id(group)] = (key, part)
        return cached[1]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim``); missing hyperparameters take the defaults.

        Raises:
            TypeError, ValueError: a hyperparameter of the group is invalid (checked now, not at the next step).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            accepted = inspect.signature(self.optimizer_class.__init__).parameters
            torch_hyperparams(self.optimizer_class, {k: group[k] for k in self.defaults if k in accepted})
            self._part(group).layout(list(group["params"]))
        except (TypeError, ValueError):
            self.param_groups.pop()
            self._parts.pop(id(group), None)
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient, as ``optimizer_class.step``.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (run with gradients enabled first).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        if any(p.grad.is_sparse for ps in active for p in ps):
            raise TypeError(f"{self.optimizer_class.__name__} through functopk does not support sparse gradients")
        if not any(active):
            return loss
        grads = [[p.grad for p in ps] for ps in active]
        written: dict[torch.Tensor, dict[str, Any]] = {}  # committed only when every group has been computed
        if self._sparsify is not None:
            grads = self._sparsify_step(active, grads, written)
        all_ps: list[torch.Tensor] = []
        all_us: list[torch.Tensor] = []
        for group, ps, gs in zip(self.param_groups, active, grads):
            if not ps:
                continue
            part = self._part(group)
            entries = part.entries(ps, [self.state.get(p, {}) for p in ps])
            for idx in _cohorts(entries, part.layout(ps)):
                cohort = [ps[i] for i in idx]
                updates, new = part.run([gs[i] for i in idx], cohort, [entries[i] for i in idx])
                all_ps += cohort
                all_us += updates
                for p, e in zip(cohort, new):
                    written.setdefault(p, {}).update(e)
        for p, e in written.items():
            self.state[p].update(e)
        torch._foreach_add_(all_ps, all_us)
        return loss

    def _sparsify_step(
        self, active: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], written: dict[torch.Tensor, Any]
    ) -> list[list[torch.Tensor]]:
        """Run ``sparsify`` on the gradients of all groups as one tree; the new gradients, per group."""
        sp = self._sparsify
        assert sp is not None
        flat_ps = [p for ps in active for p in ps]
        layout = sp.layout(flat_ps)
        shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
        entries = sp.entries(flat_ps, [self.state.get(p, {}) for p in flat_ps])
        # Shared leaves (a step count) come from any parameter that has them, so a late joiner resets nothing.
        donor = next((s for s in self.state.values() if shared and all(n in s for n in shared)), None)
        if donor is not None:
            entries = [{**e, **{n: donor[n] for n in shared}} for e in entries]
        updates, new = sp.run([g for gs in grads for g in gs], flat_ps, entries)
        for p, e in zip(flat_ps, new):
            written[p] = dict(e)
        if shared:  # parameters without a gradient now keep their sparsify entries, with the new shared leaves
            for p, s in self.state.items():
                if p not in written and all(n in s for n in shared):
                    written[p] = {n: new[0][n] for n in shared}
        out, i = [], 0
        for ps in active:
            out.append(updates[i : i + len(ps)])
            i += len(ps)
        return out

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (torch's layout); everything is checked before anything changes.

        Tensors move to their parameter's device and keep their saved dtype, except
        where the transformation keeps another dtype for that entry (a float ``step``
        written by ``torch.optim`` becomes functopk's integer count).

        Raises:
            ValueError: the param groups differ in number or size, or a state entry names no parameter.
            TypeError: ``state_dict`` or a per-parameter entry is not a dict.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict must be a dict with keys 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                f"loaded state dict has param groups of sizes {[len(s['params']) for s in saved_groups]}, this "
                f"optimizer has {[len(g['params']) for g in self.param_groups]}"
            )
        owner, wanted = {}, self._state_dtypes(saved_groups)
        for s, g in zip(saved_groups, self.param_groups):
            for key, p in zip(s["params"], g["params"]):
                owner[key] = p
        loaded = {}
        for key, entries in state_dict["state"].items():
            if key not in owner:
                raise ValueError(f"state_dict['state'] has an entry for parameter {key!r}, which no param group lists")
            if not isinstance(entries, dict):
                raise TypeError(f"state_dict['state'][{key!r}] must be a dict, got {type(entries).__name__}")
            p = owner[key]
            loaded[p] = {
                n: v.to(device=p.device, dtype=wanted[p].get(n, v.dtype)) if isinstance(v, torch.Tensor) else v
                for n, v in entries.items()
            }
        super().load_state_dict({**state_dict, "state": {}})
        self._parts.clear()
        for p, e in loaded.items():
            self.state[p] = e
        self._share_equal_scalars()

    def _state_dtypes(self, saved_groups: list[dict[str, Any]]) -> dict[torch.Tensor, dict[str, torch.dtype]]:
        """For each parameter, the dtype of each state entry the transformations would create (on meta tensors)."""
        wanted: dict[torch.Tensor, dict[str, torch.dtype]] = {}
        lists = []
        for s, g in zip(saved_groups, self.param_groups):
            hyper = {**g, **{k: v for k, v in s.items() if k not in _NOT_HYPER}}
            lists.append((list(g["params"]), _Part(self._spec.build(hyper), self._spec.state_names)))
        if self._sparsify is not None:
            lists.append(([p for ps, _ in lists for p in ps], self._sparsify))
        for ps, part in lists:
            if ps:
                template = per_param.split(part.template(ps), part.layout(ps))
                for p, entries in zip(ps, template):
                    wanted.setdefault(p, {}).update({n: v.dtype for n, v in entries.items() if hasattr(v, "dtype")})
        return wanted

    def _share_equal_scalars(self) -> None:
        """After loading, let parameters whose shared leaves are equal share one object (one cohort again).

        A load gives every parameter its own copy of its step count; equal counts
        (compared once, here, on the host) become one tensor again, so that a group
        keeps stepping as one tree.
        """
        groups = [(list(g["params"]), self._part(g)) for g in self.param_groups]
        if self._sparsify is not None:
            groups.append(([p for ps, _ in groups for p in ps], self._sparsify))
        for ps, part in groups:
            if not ps:
                continue
            layout = part.layout(ps)
            shared = {n for n, is_part in zip(layout.names, layout.is_part) if not is_part}
            pool: dict[Any, Any] = {}
            for p in ps:
                entries = self.state.get(p, {})
                for name, value in entries.items():
                    if name in shared and isinstance(value, torch.Tensor) and value.dim() == 0:
                        key = (name, value.dtype, value.device, value.tolist())
                        entries[name] = pool.setdefault(key, value)

