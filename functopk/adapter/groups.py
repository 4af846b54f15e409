"""``ft.optimizer_from_torch``'s optimizer: a ``torch.optim`` optimizer with torch's param-group semantics, sparsified.

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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from functopk.adapter import checkpoint, inplace, per_param, views
from functopk.adapter.registry import (
    add_checked_group,
    check_implementation_flags,
    spec_for,
    torch_hyperparams,
)
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


_NOT_COMPILED = (
    "torch.compile(opt.step) is not supported for TorchOptimizer.from_torch optimizers (their step rebuilds "
    "per-parameter state on the host). Compile the functional step instead (tx = ft.from_torch(cls, **kwargs); "
    "tx.update inside the compiled function), or use ft.TorchOptimizer(params, tx), whose step compiles"
)


@torch.compiler.disable(reason=_NOT_COMPILED)
def _refuse_compiled_step() -> None:
    raise NotImplementedError(_NOT_COMPILED)


def _check_step_allowed(groups: list[dict[str, Any]]) -> None:
    """Refuse a compiled step, and a flag set by hand since the last step (cheap: no tensor is read).

    Under ``torch.compile`` the raise is in a disabled function: dynamo runs it
    eagerly, so the caller gets the ``NotImplementedError`` (a raise traced by
    dynamo would fall back to running the step eagerly, silently).
    """
    if torch.compiler.is_compiling():
        _refuse_compiled_step()
    for group in groups:
        check_implementation_flags(group)


class _Part:
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

    def reuse_layouts(self, other: _Part) -> None:
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


def _cohorts(entries: list[dict[str, Any]], layout: per_param.EntryLayout) -> list[list[int]]:
    """Positions grouped by the identity of their shared leaves (the parameters that can step together)."""
    shared = [n for n, part in zip(layout.names, layout.is_part) if not part]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(tuple(id(e[n]) for n in shared), []).append(i)
    return list(groups.values())


class ParamGroupOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` computed by functopk, with an optional global ``sparsify`` first.

    Made by :func:`functopk.optimizer_from_torch`; see there. Everything a
    torch user relies on behaves as in ``optimizer_class``:

    * ``param_groups`` hold torch's keys and defaults (``lr`` is the real
      learning rate); every hyperparameter is read at every step, so schedulers
      (every ``torch.optim.lr_scheduler`` class, ``OneCycleLR``'s momentum
      cycling included) and hand edits take effect at the next step;
    * ``state[p]`` is one dict per parameter with torch's keys (``step``,
      ``exp_avg``, ...; functopk's field name where torch has no such entry);
      a parameter whose ``.grad`` is ``None`` is skipped and keeps its step
      count; a parameter added later starts fresh; as in ``torch.optim``'s
      foreach implementations, ``step()`` writes the new state into these
      tensors (every class but Adafactor and Muon, SGD with momentum, in float32 and
      float64, with number hyperparameters; :mod:`functopk.adapter.inplace`),
      with the same results as the pure transformation, bit for bit;
    * sparse gradients (``SGD`` and ``Adagrad`` without weight decay, as in
      torch) are made dense first, at the cost of one dense gradient per sparse
      parameter; complex parameters step as their real pairs (torch's
      ``view_as_real``; two coordinates each in a global top-k) and keep complex
      state shaped like them (:mod:`functopk.adapter.views`);
    * ``state_dict()``/``load_state_dict()`` are torch's own layout (so
      ``torch.distributed.checkpoint.state_dict`` works) and resume bit for bit;
      ``torch.optim`` checkpoints of the class load (torch's float ``step``
      becomes functopk's count) and ``torch.optim`` loads ``state_dict()``;
      both copy the tensors (the next step changes neither the saved dict nor the loaded one);
      see :meth:`load_state_dict` for the checks;
    * ``sparsify``'s state is kept per parameter too, under keys starting
      with ``"sparsify."``;
    * ``optimizer_from_torch`` makes it of a subclass named as, and subclassing,
      ``optimizer_class`` (:mod:`functopk.adapter.classes`), for loggers and
      ``isinstance``;
    * ``pickle``/``torch.save``/``copy.deepcopy`` copy groups, state and
      ``sparsify`` (which pickles as the factory call that made it: a lambda
      among its arguments raises ``TypeError``).

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(), lr=0.01)
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

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group``'s hyperparameters, with what torch reads from the constructor's arguments instead."""
        return {**group, **{k: self.defaults[k] for k in self._spec.from_defaults}}

    def _build(self, group: dict[str, Any]) -> GradientTransformation:
        """The transformation for ``group``."""
        return self._spec.build(self._hyper(group))

    def _part(self, group: dict[str, Any]) -> _Part:
        """The transformation for ``group``'s current hyperparameters (rebuilt when one changed)."""
        key = tuple((k, _key(v)) for k, v in sorted(group.items()) if k not in _NOT_HYPER)
        cached = self._parts.get(id(group))
        if cached is None or cached[0] != key:
            step_ = None if self._spec.inplace is None else self._spec.inplace(self._hyper(group))
            part = _Part(self._build(group), self._spec.state_names, class_name=self.optimizer_class.__name__,
                         inplace=step_)  # fmt: skip
            if cached is not None and _shape(cached[0]) == _shape(key):
                part.reuse_layouts(cached[1])  # only a value changed (a scheduler's lr): the same state structure
            cached = self._parts[id(group)] = (key, part)
        return cached[1]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim``); missing hyperparameters take the defaults.

        Raises:
            TypeError, ValueError: a hyperparameter of the group is invalid (checked now, not at the next
                step), or the group lists a parameter twice.
            RuntimeError: torch refuses the group's ``fused=True`` (checked now; torch checks at its first step).
            NotImplementedError: the group sets ``capturable`` or ``differentiable``.
        """
        add_checked_group(self, self.optimizer_class, param_group, self._check_layout)

    def _check_layout(self, group: dict[str, Any]) -> None:
        """The new group's state can be laid out in torch's per-parameter entries."""
        try:
            self._part(group).layout(list(group["params"]))
        except Exception:
            self._parts.pop(id(group), None)
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient, as ``optimizer_class.step``.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (run with gradients enabled first).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            NotImplementedError: the step is compiled (``torch.compile(opt.step)``), a group's
                ``capturable`` or ``differentiable`` was set to ``True`` by hand, or a sparse gradient comes
                where ``optimizer_class`` refuses one (a ``RuntimeError``, as torch's); all checked before
                anything changes.
        """
        _check_step_allowed(self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        views.check_sparse(self.optimizer_class.__name__, self.param_groups, active, self.defaults)
        if not any(active):
            return loss
        grads = [[views.dense(p.grad) for p in ps] for ps in active]  # sparse: see functopk.adapter.views
        written: dict[torch.Tensor, dict[str, Any]] = {}  # committed only when every group has been computed
        if self._sparsify is not None:
            grads = self._sparsify_step(active, grads, written)
        all_ps: list[torch.Tensor] = []
        all_us: list[torch.Tensor] = []
        # The in-place cohorts run once every pure one has been computed: a failing step changes nothing.
        results: list[tuple[list[torch.Tensor], Any]] = []
        for group, ps, gs in zip(self.param_groups, active, grads):
            if not ps:
                continue
            part = self._part(group)
            entries = part.entries(ps, [self.state.get(p, {}) for p in ps])
            for idx in _cohorts(entries, part.layout(ps)):
                cohort, cohort_gs, cohort_es = [ps[i] for i in idx], [gs[i] for i in idx], [entries[i] for i in idx]
                run = part.run_inplace(cohort_gs, cohort, cohort_es)
                results.append((cohort, run if run is not None else part.run(cohort_gs, cohort, cohort_es)))
        for cohort, result in results:
            updates, new = result() if callable(result) else result
            all_ps += cohort
            all_us += updates
            for p, e in zip(cohort, new):
                written.setdefault(p, {}).update(e)
        for p, e in written.items():
            if e:  # no empty entries (SGD without momentum keeps nothing, and torch has no entry then)
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
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (:meth:`torch.optim.Optimizer.state_dict`), every parameter with its own tensors.

        In memory, the parameters that step together share one step count; here
        each has its own copy, as in ``torch.optim``'s state dicts, so that a
        ``torch.optim`` optimizer loading it counts each parameter's steps right.
        Every tensor is a copy (``torch.optim`` hands out its own, which its next
        step changes): the next step, which writes into the optimizer's state, leaves it as it is.
        """
        saved = super().state_dict()
        return {**saved, "state": checkpoint.unshared(saved["state"])}

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` or a ``torch.optim`` one; everything is checked before anything changes.

        As in ``torch.optim``: keys that older torch versions did not save
        (``maximize``, ``foreach``, ...) get the class's defaults, a number
        ``step`` becomes a tensor, and keys torch writes for the class but
        functopk does not keep load as given. Tensors move to their
        parameter's device and take the dtype the transformation keeps (a
        float ``step`` written by ``torch.optim`` becomes functopk's integer
        count). A loaded SGD ``momentum_buffer`` without
        functopk's ``count`` has stepped: the next step is damped, as in torch.

        Raises:
            TypeError: ``state_dict``, a group or a per-parameter entry is not a dict, or a value not a tensor.
            ValueError: the param groups differ in number or size, a group lacks one of the class's keys
                (another class's checkpoint), a state entry names no parameter, has a key the optimizer
                does not keep, or a tensor of another shape.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict must be a dict with keys 'state' and 'param_groups'")
        if not isinstance(state_dict["param_groups"], list) or not isinstance(state_dict["state"], dict):
            raise TypeError("state_dict['param_groups'] must be a list and state_dict['state'] a dict")
        keys = [k for k in self.defaults if k not in _NOT_HYPER]
        groups = [
            checkpoint.filled_group(self.optimizer_class, i, s, keys) for i, s in enumerate(state_dict["param_groups"])
        ]
        checkpoint.check_group_sizes(groups, self.param_groups)
        expected = self._expected(groups)
        owner = {key: p for s, g in zip(groups, self.param_groups) for key, p in zip(s["params"], g["params"])}
        loaded = {}
        for key, entries in state_dict["state"].items():
            if key not in owner:
                raise ValueError(f"state_dict['state'] has an entry for parameter {key!r}, which no param group lists")
            entry = checkpoint.loaded_entry(key, entries, owner[key], expected[owner[key]], self._owner_name())
            given = {id(v) for v in entries.values()}  # the step writes into its state: never into the caller's
            entry = {n: v.clone() if id(v) in given else v for n, v in entry.items()}
            if entry:  # torch keeps no empty entries (SGD without momentum)
                loaded[owner[key]] = entry
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        self._parts.clear()
        self.state.update(loaded)
        checkpoint.share_equal_scalars_(self.state, self._layouts())

    def _owner_name(self) -> str:
        return f"torch.optim.{self.optimizer_class.__name__} through functopk"

    def _expected(self, groups: list[dict[str, Any]]) -> dict[torch.Tensor, checkpoint.Expected]:
        """What each parameter's loaded entry may hold, for the saved groups' hyperparameters."""
        parts: list[tuple[list[torch.Tensor], _Part, bool]] = []
        for i, (s, g) in enumerate(zip(groups, self.param_groups)):
            try:
                part = _Part(self._build(s), self._spec.state_names)
                part.layout(list(g["params"]))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"param group {i} does not make a {self._owner_name()}: {err!r}") from err
            parts.append((list(g["params"]), part, True))
        if self._sparsify is not None:
            parts.append(([p for ps, _, _ in parts for p in ps], self._sparsify, False))
        templates = [(ps, per_param.split(part.template(ps), part.layout(ps)), part.layout(ps), main)
                     for ps, part, main in parts if ps]
        return checkpoint.expected_entries(templates, self._spec.state_names.values())

    def _layouts(self) -> list[tuple[list[torch.Tensor], per_param.EntryLayout]]:
        """Each transformation's parameters and layout: each group's, then ``sparsify``'s over all of them."""
        out = [(list(g["params"]), self._part(g).layout(list(g["params"]))) for g in self.param_groups if g["params"]]
        if self._sparsify is not None and out:
            every = [p for ps, _ in out for p in ps]
            out.append((every, self._sparsify.layout(every)))
        return out

