"""``ft.optimizer_from_torch``'s optimizer: a ``torch.optim`` optimizer with torch's param-group semantics, sparsified.

:class:`ParamGroupOptimizer` behaves like ``optimizer_class(params, **defaults)``
(per-group hyperparameters read at every step, per-parameter state and step
counts, ``add_param_group``, ``state_dict`` in torch's layout, schedulers,
``GradScaler``), while the maths is functopk's (:func:`functopk.from_torch`) and
an optional ``sparsify`` transformation runs on the gradients of *all* groups
together before the optimizer (so ``sparsify=ft.topk(1000)`` is one global
top-k), or on the optimizer's updates of all groups after it (``sparsify_on="update"``).

State lives where torch keeps it, in ``opt.state[p]`` as one dict per parameter
(:mod:`functopk.adapter.per_param`); each step rebuilds the functopk states
from it. Parameters whose step counts (and other per-parameter scalars) are the
*same tensor objects* are updated together, as one tree: after a normal step
every parameter of a group shares them, so a group costs one ``update`` call;
a parameter skipped for lack of a gradient, or added late, keeps its own count
and forms its own cohort, which is how torch's per-parameter steps come out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopk._checks import check_choice
from functopk._compat import EagerUnderCompile
from functopk.adapter import checkpoint, per_param, registry, views
from functopk.adapter.part import Part, cohorts
from functopk.adapter.registry import NOT_HYPER, TorchClassGroups, check_implementation_flags, check_torch_step_accepts
from functopk.adapter.sparsify import Sparsify, storages, unshared
from functopk.base import GradientTransformation, check_transformation
from functopk.tree.writer import IN_PLACE, IN_PLACE_SPARSE, Writer

__all__ = ["ParamGroupOptimizer"]

SPARSIFY_ON = ("gradient", "update")
"""What ``sparsify`` may be applied to: the gradients (before the optimizer) or the optimizer's updates (after)."""


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


_NOT_COMPILED = (
    "torch.compile(opt.step) is not supported for optimizer_from_torch optimizers (their step rebuilds "
    "per-parameter state on the host and writes it in place). Compile the functional step instead "
    "(tx = ft.from_torch(cls, **kwargs); tx.update inside the compiled function)"
)


def _refuse() -> None:
    raise NotImplementedError(_NOT_COMPILED)


_refuse_compiled_step = EagerUnderCompile(_refuse, reason=_NOT_COMPILED)  # (armed by the optimizers)


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


def _fused_kinds_accepted(opt: ParamGroupOptimizer) -> set[tuple[torch.device, torch.dtype]]:
    """The parameter devices and dtypes torch's ``fused=True`` step has accepted for ``opt`` (kept on it)."""
    kinds: set[tuple[torch.device, torch.dtype]] | None = opt.__dict__.get("_fused_kinds")
    if kinds is None:
        kinds = opt.__dict__["_fused_kinds"] = set()
    return kinds


class ParamGroupOptimizer(TorchClassGroups, torch.optim.Optimizer):
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
      tensors (every class but Adafactor and Muon, in float32 and float64, where
      no state kernel takes a tensor hyperparameter), through the engine of
      :func:`functopk.update_` (:mod:`functopk.inplace`) and each class's one
      formula, with the same results as the pure transformation, bit for bit
      (not ``torch.optim``'s: its fused kernels round once where
      update-then-add rounds twice); on CPU, SGD, RMSprop, Adagrad and Adamax
      run their whole step batch by batch into the parameters, without an
      update tree;
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
    * ``sparsify`` runs on the gradients of all groups before the optimizer,
      or, with ``sparsify_on="update"``, on the optimizer's updates after it
      (exactly ``k`` parameters move under ``ft.topk(k)``; see
      :func:`functopk.optimizer_from_torch`); its state is kept per parameter too, under keys starting
      with ``"sparsify."``; it is the transformation given, run as it is: a
      constant exact ``ft.topk(k)`` or ``ft.topk(density=d)`` on gradients of
      one dtype and device (CPU) writes its values into the flat
      gradient-sized buffer it keeps between steps, re-zeroed at the last
      step's indices, instead of a new dense tree per step, with the same
      results bit for bit (:class:`functopk.compress.topk.KeptBuffer`);
      ``p.grad`` is left as it is;
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
        *,
        sparsify_on: str = "gradient",
        **defaults: Any,
    ) -> None:
        self._sparsify = None if sparsify is None else Sparsify(check_transformation(sparsify, "sparsify"))
        self._sparsify_on = check_choice(sparsify_on, "sparsify_on", SPARSIFY_ON)
        self._parts: dict[int, tuple[Any, Part]] = {}
        self._init_groups(optimizer_class, params, defaults)
        _refuse_compiled_step.arm()

    def __getstate__(self) -> dict[str, Any]:
        # torch's groups and state, the torch class and sparsify; the rest (spec, transformations) is rebuilt
        state = super().__getstate__()
        state["optimizer_class"] = self.optimizer_class
        state["sparsify"] = self.sparsify
        state["sparsify_on"] = self._sparsify_on
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (or deep-copy); ``load_state_dict`` also calls this, with groups and state only."""
        state = dict(state)
        unpickled = "sparsify" in state
        sparsify = state.pop("sparsify", None)
        sparsify_on = state.pop("sparsify_on", "gradient")
        super().__setstate__(state)
        _refuse_compiled_step.arm()
        if unpickled:  # the torch class's TorchSpec is looked up again (its build functions do not pickle)
            self._spec = registry.spec_for(self.optimizer_class)
            self._sparsify = None if sparsify is None else Sparsify(sparsify)
            self._sparsify_on = sparsify_on
            self._parts = {}

    @property
    def sparsify(self) -> GradientTransformation | None:
        """The transformation applied to the gradients of all groups together (``None``: none)."""
        return None if self._sparsify is None else self._sparsify.tx

    @property
    def sparsify_on(self) -> str:
        """``"gradient"``: ``sparsify`` runs on the gradients, before the optimizer; ``"update"``: on its updates."""
        return self._sparsify_on

    def _part(self, group: dict[str, Any]) -> Part:
        """The transformation for ``group``'s current hyperparameters (rebuilt when one changed)."""
        key = tuple((k, _key(v)) for k, v in sorted(group.items()) if k not in NOT_HYPER)
        cached = self._parts.get(id(group))
        if cached is None or cached[0] != key:
            part = Part(self._build(group), self._spec.state_names, class_name=self.optimizer_class.__name__)
            if cached is not None and _shape(cached[0]) == _shape(key):
                part.reuse_layouts(cached[1])  # only a value changed (a scheduler's lr): the same state structure
            cached = self._parts[id(group)] = (key, part)
        return cached[1]

    def _check_group(self, group: dict[str, Any]) -> None:
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
            RuntimeError: torch's own error for ``fused=True`` on parameters its fused kernel refuses
                (a device or dtype), as torch raises it at its step, before anything changes.
        """
        self._check_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        grads = self._gradients(active)
        if not any(active):
            return loss
        written: dict[torch.Tensor, dict[str, Any]] = {}  # committed only when every group has stepped
        self._step(active, grads, written)
        for p, e in written.items():
            if e or self._empty_entries:  # (SGD without momentum keeps nothing, and torch has no entry then)
                self.state[p].update(e)
        return loss

    _empty_entries = False
    """Whether a parameter that stepped gets an entry in ``state`` even when it holds nothing."""

    def _check_step(self) -> None:
        """What a step refuses before anything runs: a compiled step, a refused flag set by hand."""
        _check_step_allowed(self.param_groups)

    def _gradients(self, active: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The active parameters' gradients, dense, once torch's checks of them passed (sparse ones, ``fused``)."""
        views.check_sparse(self.optimizer_class.__name__, self.param_groups, active, self.defaults)
        for group, ps in zip(self.param_groups, active):  # torch's fused=True checks, as its step runs them
            if ps:
                check_torch_step_accepts(self.optimizer_class, self._hyper(group), ps, _fused_kinds_accepted(self))
        return [[views.dense(p.grad) for p in ps] for ps in active]  # type: ignore[arg-type]  # (sparse: views)

    def _step(
        self, active: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], written: dict[torch.Tensor, Any]
    ) -> None:
        """The maths: ``sparsify`` (on the gradients, or on the updates) and each group's transformation; the
        parameters written, the new entries into ``written``."""
        on_updates = self._sparsify is not None and self._sparsify_on == "update"
        writer, kept = IN_PLACE, set()
        if self._sparsify is not None:
            if on_updates:  # its checks (k against the parameters) before any in-place step writes
                self._sparsify.layout([p for ps in active for p in ps])
            else:
                given = grads
                grads, sparse = self._sparsify.step(self.state, active, grads, written)
                writer = IN_PLACE_SPARSE if sparse else IN_PLACE
                kept = storages(grads) - storages(given) if sparse else set()  # (a kept buffer's)
        updates = self._updates(active, grads, written, add=not on_updates, writer=writer, kept=kept)
        if on_updates:
            assert self._sparsify is not None
            flat, _ = self._sparsify.step(self.state, active, [[updates[p] for p in ps] for ps in active], written)
            torch._foreach_add_([p for ps in active for p in ps], [u for us in flat for u in us])

    def _updates(
        self,
        active: list[list[torch.Tensor]],
        grads: list[list[torch.Tensor]],
        written: dict[torch.Tensor, dict[str, Any]],
        *,
        add: bool,
        writer: Writer,
        kept: set[int],
    ) -> dict[torch.Tensor, torch.Tensor]:
        """Each group's step of its ``active`` parameters (through :mod:`functopk.inplace`: in place where its
        transformation can), the new entries into ``written``; with ``add`` the updates are added into the
        parameters, else returned. ``kept``: the storages of a buffer ``sparsify`` keeps (not for entries)."""
        # Every cohort is checked and its pure parts computed before any writes: a failing step changes nothing.
        runs = []
        for group, ps, gs in zip(self.param_groups, active, grads):
            if not ps:
                continue
            part = self._part(group)
            entries = part.entries(ps, [self.state.get(p, {}) for p in ps])
            for idx in cohorts(entries, part.layout(ps)):
                cohort = [ps[i] for i in idx]
                runs.append((cohort, part.plan([gs[i] for i in idx], cohort, [entries[i] for i in idx])[0]))
        out: dict[torch.Tensor, torch.Tensor] = {}
        for cohort, run in runs:
            updates, new = run(add, writer)
            new = unshared(new, kept)  # pure maths may keep a gradient (a view of sparsify's buffer) as state
            if not add:
                assert updates is not None
                out.update(zip(cohort, updates))
            if written.keys().isdisjoint(cohort):  # (the usual step: its entries are new dicts, taken as they are)
                written.update(zip(cohort, new))
                continue
            for p, e in zip(cohort, new):
                written.setdefault(p, {}).update(e)
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
        groups = self._saved_groups(state_dict)
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

    def _expected(self, groups: list[dict[str, Any]]) -> dict[torch.Tensor, checkpoint.Expected]:
        """What each parameter's loaded entry may hold, for the saved groups' hyperparameters."""
        parts: list[tuple[list[torch.Tensor], Part, bool]] = []
        for i, (s, g) in enumerate(zip(groups, self.param_groups)):
            try:
                part = Part(self._build(s), self._spec.state_names)
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

