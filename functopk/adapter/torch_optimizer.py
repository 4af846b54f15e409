"""``TorchOptimizer``: any functopk transformation in an imperative training loop, over one tree of all parameters.

A :class:`~functopk.adapter.ParamGroupOptimizer` whose all-groups transformation
is ``tx`` itself and whose groups add no maths of their own (a group's ``lr`` is a
factor on its updates): it plugs into ``loss.backward(); opt.step(); opt.zero_grad()``
loops, learning-rate schedulers and AMP's ``GradScaler``, while the update is
computed by one functopk transformation over *one tree of all parameters of all
groups*, so ``topk(k)`` selects the ``k`` largest gradient coordinates across the
whole model::

    opt = ft.TorchOptimizer(model.parameters(), ft.chain(ft.topk(1000), ft.sgd(0.1)))

Its state lives in one entry per parameter in ``opt.state`` (:mod:`functopk.adapter.per_param`),
stepped by the in-place engine (:mod:`functopk.inplace`); :attr:`TorchOptimizer.transform_state`
puts it back together as the transformation's state, and its checkpoints hold that state
(:func:`functopk.state_to_dict`), guarded by a digest of the param groups (:mod:`~functopk.adapter.group_digest`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch

from functopk._checks import check_distinct_params, check_hyperparam, torch_duplicate_warning_ignored
from functopk._compat import EagerUnderCompile
from functopk.adapter import per_param
from functopk.adapter.checkpoint import check_group_sizes
from functopk.adapter.group_digest import check_groups_digest, groups_digest
from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.sparsify import Sparsify
from functopk.base import GradientTransformation, OptState
from functopk.checkpoint import CheckpointError, state_from_dict, state_to_dict
from functopk.optim.inject import inject_hyperparams

__all__ = ["TorchOptimizer", "param_names"]

Factory = Callable[[Any], GradientTransformation]
_STATE_KEY = "functopk"
_ENTRY_KEYS = frozenset({"transform", "params_with_state", "digest"})

_eager_step = EagerUnderCompile(ParamGroupOptimizer.step)  # (armed by the optimizers)


def param_names(groups: list[dict[str, Any]]) -> list[str] | None:
    """All parameter names in group order, or ``None`` when the parameters have no names.

    Raises:
        ValueError: a name appears twice.
    """
    if not all("param_names" in g for g in groups):
        return None
    names = [n for g in groups for n in g["param_names"]]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in the param groups; names must be unique")
        seen.add(name)
    return names


def _lr_key(lr: Any) -> Any:
    """A hashable identity for a group's lr: its value for numbers, the object for tensors."""
    return ("tensor", id(lr)) if isinstance(lr, torch.Tensor) else ("number", float(lr))


def _checked_build(factory: Factory, learning_rate: Any) -> GradientTransformation:
    """``factory(learning_rate)``, checked to be a transformation."""
    out = factory(learning_rate)
    if not isinstance(out, GradientTransformation):
        raise TypeError(
            f"tx must be a GradientTransformation or a factory returning one; the factory returned {type(out).__name__}"
        )
    return out


class _Tree(Sparsify):
    """``tx`` over the parameters of all groups, in the tree :class:`TorchOptimizer` documents: a dict by
    parameter name when they have names, else a list in group order; ``None`` for a parameter not taking part."""

    def __init__(self, tx: GradientTransformation) -> None:
        super().__init__(tx, prefix="")
        self.slots: list[torch.Tensor] = []
        self.names: list[str] | None = None

    def tree(self, params: list[torch.Tensor], values: list[Any]) -> Any:
        at = {id(p): v for p, v in zip(params, values)}
        leaves = [at.get(id(p)) for p in self.slots]
        return dict(zip(self.names, leaves)) if self.names is not None else leaves

    def _key(self, params: list[torch.Tensor]) -> Any:
        ids = set(map(id, params))
        return tuple(self.names or ()), tuple(id(p) in ids for p in self.slots)


class TorchOptimizer(ParamGroupOptimizer):
    """A ``torch.optim.Optimizer`` that applies a functopk transformation to ``.grad``.

    At each :meth:`step` the gradients of all parameters of all groups form one
    tree (a dict keyed by parameter name when the parameters were given with
    names, e.g. ``model.named_parameters()``; otherwise a list in group order),
    the transformation turns it into updates, and the updates are added to the
    parameters in place. A parameter whose ``.grad`` is ``None`` appears as
    ``None`` in the tree: it takes no part (top-k ignores it) and is not changed.
    The step runs on :mod:`functopk.inplace`'s engine, as :func:`functopk.update_`:
    the parts of ``tx`` that can write their new state into the old do (the
    same numbers as ``tx.update``, bit for bit).

    **Learning rate.** Two forms, chosen by what ``tx`` is:

    * ``tx`` a :class:`~functopk.GradientTransformation` with its own learning
      rate (``ft.sgd(0.1)``), without ``lr=`` (it would multiply that rate: a
      ``TypeError``): each group's ``lr`` (from ``1.0``) is a *factor on that
      group's updates*, which a scheduler scales (one global top-k, then
      per-group step sizes). Exact where the learning rate is the last, linear
      factor (sgd, adam, ...).
    * ``tx`` a *factory* ``lr -> GradientTransformation`` with ``lr=`` given,
      e.g. ``TorchOptimizer(params, lambda lr: ft.chain(ft.topk(1000), ft.sgd(lr)), lr=0.1)``:
      the learning rate lives *inside* the transformation (a 0-d tensor in the
      state, through :func:`~functopk.inject_hyperparams`), which sees the
      ``param_groups`` value at every step (this matters when something follows
      it in the chain, e.g. error feedback). All groups with gradients must then
      hold the same ``lr`` (the same number, or the same tensor object: values
      are not compared, which would sync), else :meth:`step` raises.

    **State.** As every adapter keeps it: one entry per parameter in
    ``opt.state``, named by the state's fields (``trace``, ``count``, ...);
    :attr:`transform_state` is it put together, the transformation's state for the
    parameters that have one. A parameter gets its entry when it first has a
    gradient: parameters that get gradients later (unfreezing,
    :meth:`add_param_group`) start from ``init``'s values, while leaves not shaped
    like the parameters (step counts, which count optimizer steps) are kept. A step
    without gradients for some parameters runs on the others and leaves theirs as
    they are, as ``torch.optim`` does. A state sized by the whole parameter set
    (not per parameter) cannot be extended or restricted: ``ValueError``.

    **Checkpoints.** :meth:`state_dict` is ``torch.optim``'s format with the
    transformation state under ``state["functopk"]`` as a plain dict
    (:func:`functopk.state_to_dict`): ``torch.save`` and
    ``torch.load(weights_only=True)`` round-trip it. :meth:`load_state_dict`
    checks structure, shapes and dtypes first and changes nothing on error.

    **Pickling.** ``pickle``/``torch.save``/``copy.deepcopy`` copy it with its
    transformation and state (pickle the model with it). A factory ``tx`` must be a
    module-level function to pickle: a lambda raises ``TypeError`` naming it.

    **AMP.** ``GradScaler.step(opt)`` unscales the gradients, checks them for
    inf/NaN and calls :meth:`step` only when all are finite (one host sync,
    inside the scaler, as for ``torch.optim.SGD``); a skipped step leaves the
    parameters and the transformation state exactly as they were.

    **Compile.** The step writes the state in place, which is eager work:
    ``torch.compile(opt.step)`` runs it eagerly (dynamo skips it), with the same
    result. A compiled step is the functional one (``tx.update`` in a compiled
    function). Sparse gradients raise ``TypeError`` (the tree is dense).

    Args:
        params: Parameters, ``(name, parameter)`` pairs, or param-group dicts, as
            for any ``torch.optim`` optimizer.
        tx: A transformation, or a factory ``lr -> transformation``.
        lr: The default group ``lr``: required with a factory; a factor (default
            ``1.0``) with a transformation.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = ft.TorchOptimizer(model.parameters(), ft.chain(ft.topk(2), ft.sgd(0.1)))
        >>> before = [p.detach().clone() for p in model.parameters()]
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
        2
    """

    def __init__(
        self,
        params: Iterable[Any],
        tx: Union[GradientTransformation, Factory],
        *,
        lr: float | torch.Tensor | None = None,
    ) -> None:
        if isinstance(tx, GradientTransformation):
            if lr is not None:  # it would be a silent factor on tx's own learning rate (0.1 x 0.1)
                raise TypeError(
                    "lr= goes with a factory lr -> GradientTransformation (e.g. lambda lr: ft.sgd(lr)); tx has its "
                    "own learning rate, which lr would multiply. Leave lr out: group lr is then a factor from 1.0"
                )
            self._injected, self._tx, lr = False, tx, 1.0
        elif callable(tx):
            if lr is None:
                raise TypeError("lr is required when tx is a factory lr -> GradientTransformation")
            build = functools.partial(_checked_build, tx)  # picklable when tx is a module-level function
            self._injected, self._factory = True, build
            self._tx = inject_hyperparams(build)(learning_rate=check_hyperparam(lr, "lr", minimum=0.0))
        else:
            raise TypeError(
                f"tx must be a functopk.GradientTransformation or a factory lr -> GradientTransformation, "
                f"got {type(tx).__name__}"
            )
        torch.optim.Optimizer.__init__(self, params, {"lr": check_hyperparam(lr, "lr", minimum=0.0)})
        _eager_step.arm()
        self._lr_dtype = torch.float32
        if self._injected and any(p.dtype == torch.float64 for g in self.param_groups for p in g["params"]):
            self._lr_dtype = torch.float64
            # the injected rate in float64, so that float64 models step exactly as with torch.optim's Python lr
            exact = torch.tensor(float(lr) if not isinstance(lr, torch.Tensor) else lr.item(), dtype=torch.float64)
            self._tx = inject_hyperparams(self._factory)(learning_rate=exact)
        self._setup()

    _empty_entries = True  # (an entry, empty for a stateless tx, says the parameter has stepped)

    def _setup(self) -> None:
        """What is rebuilt rather than pickled: ``tx`` as the all-groups transformation, no group maths."""
        self._sparsify, self._sparsify_on = _Tree(self._tx), "gradient"
        self.__dict__["_joined"] = None  # the state put together, until the next step or load

    # The optimizer door's older names (transformers' Trainer took a from_torch_class class): deprecated.

    @classmethod
    def from_torch(cls, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any], *args: Any,
                   **kwargs: Any) -> ParamGroupOptimizer:  # fmt: skip
        """Deprecated: :func:`functopk.optimizer_from_torch` (this name goes in the next release).

        Example:
            >>> import warnings, torch, functopk as ft
            >>> with warnings.catch_warnings(record=True):
            ...     opt = ft.TorchOptimizer.from_torch(torch.optim.SGD, torch.nn.Linear(4, 1).parameters(), lr=0.1)
            >>> type(opt).__name__, isinstance(opt, ft.ParamGroupOptimizer)
            ('SGD', True)
        """
        from functopk.adapter.classes import deprecated, optimizer_from_torch

        deprecated("ft.TorchOptimizer.from_torch", "ft.optimizer_from_torch")
        return optimizer_from_torch(optimizer_class, params, *args, **kwargs)

    @classmethod
    def from_torch_class(cls, optimizer_class: type[torch.optim.Optimizer], *args: Any,
                         **kwargs: Any) -> type[ParamGroupOptimizer]:  # fmt: skip
        """Deprecated: :func:`functopk.optimizer_class_from_torch` (this name goes in the next release).

        Example:
            >>> import warnings, torch, functopk as ft
            >>> with warnings.catch_warnings(record=True):
            ...     C = ft.TorchOptimizer.from_torch_class(torch.optim.AdamW)
            >>> C is ft.optimizer_class_from_torch(torch.optim.AdamW), C.__name__
            (True, 'AdamW')
        """
        from functopk.adapter.classes import deprecated, optimizer_class_from_torch

        deprecated("ft.TorchOptimizer.from_torch_class", "ft.optimizer_class_from_torch")
        return optimizer_class_from_torch(optimizer_class, *args, **kwargs)

    # -- the public view of the state ------------------------------------------------------------

    @property
    def transformation(self) -> GradientTransformation:
        """The transformation applied (with a factory: its ``inject_hyperparams`` wrapper)."""
        return self._tx

    @property
    def transform_state(self) -> OptState | None:
        """The transformation's state for the parameters that have one (``None`` before the first step).

        Put together from ``opt.state``'s entries (the same tensors); read it, do not mutate it.
        """
        if self.__dict__["_joined"] is None:
            with_state = [p for p in self._slots() if p in self.state]
            if with_state:
                part = self._tree()
                entries = [{n: self.state[p][n] for n in part.layout(with_state).names} for p in with_state]
                self.__dict__["_joined"] = per_param.join(entries, part.layout(with_state))
        return self.__dict__["_joined"]

    def _slots(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _tree(self, groups: list[dict[str, Any]] | None = None) -> _Tree:
        """The all-groups part, set to the current parameters and names (those of ``groups`` if given)."""
        part = self._sparsify
        assert isinstance(part, _Tree)
        part.slots, part.names = self._slots(), param_names(groups or self.param_groups)
        return part

    def __getstate__(self) -> dict[str, Any]:
        state = torch.optim.Optimizer.__getstate__(self)
        for name in ("_injected", "_tx", "_lr_dtype", "_factory"):
            if hasattr(self, name):  # _factory: with a factory only
                state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (or deep-copy); ``load_state_dict`` also calls this, with groups and state only."""
        torch.optim.Optimizer.__setstate__(self, state)
        _eager_step.arm()
        if "_tx" in state:
            self._setup()
        self.__dict__["_joined"] = None

    # -- parameter groups --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim``); its parameters join the global tree at the next step.

        Raises:
            ValueError: the group's ``lr`` is invalid, a parameter name is used twice, or the group
                lists a parameter twice.
        """
        with torch_duplicate_warning_ignored():  # a repeated parameter is refused below, by position
            torch.optim.Optimizer.add_param_group(self, param_group)
        try:
            group = self.param_groups[-1]
            check_distinct_params(group, len(self.param_groups) - 1)
            group["lr"] = check_hyperparam(group["lr"], "lr", minimum=0.0)
            param_names(self.param_groups)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # -- the step ----------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the transformation to the current gradients and update the parameters in place.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (run with
                gradients enabled before the update, as in ``torch.optim``).

        Returns:
            The closure's loss, or ``None``.
        """
        return _eager_step(self, closure)  # (the in-place engine is eager: a compiled caller runs it as it is)

    def _check_step(self) -> None:
        pass  # (no torch class: no flags of its to refuse)

    def _gradients(self, active: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        grads: list[list[torch.Tensor]] = [[p.grad for p in ps] for ps in active]  # type: ignore[misc]
        if any(g.is_sparse for gs in grads for g in gs):
            raise TypeError(
                "TorchOptimizer(params, tx) does not support sparse gradients (its tree is dense); "
                "ft.optimizer_from_torch(torch.optim.SGD or torch.optim.Adagrad, ...) takes them as torch does"
            )
        return grads

    def _step(
        self, active: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], written: dict[torch.Tensor, Any]
    ) -> None:
        """``tx`` over all groups; its updates added, times each group's ``lr`` unless that is the number 1."""
        part, flat = self._tree(), [p for ps in active for p in ps]
        shared = None
        if self._injected:  # the groups' lr into the state, where the transformation reads it
            lr_name = next(n for n in part.layout(flat).names if n.split(".")[-1] == "learning_rate")
            shared = {lr_name: self._injected_lr(active)}
        lrs = [g["lr"] for g in self.param_groups]
        unit = self._injected or all(not isinstance(lr, torch.Tensor) and lr == 1.0 for lr in lrs)
        self.__dict__["_joined"] = None
        updates, _ = part.step(self.state, [flat], [[g for gs in grads for g in gs]], written, add=unit, shared=shared)
        if not unit:
            self._add_times_lr(flat, updates[0])

    def _injected_lr(self, active: list[list[torch.Tensor]]) -> torch.Tensor:
        groups = [g for g, ps in zip(self.param_groups, active) if ps]
        if len({_lr_key(g["lr"]) for g in groups}) > 1:
            raise ValueError(
                "with a factory tx, the learning rate lives in the one global transformation, so all param "
                f"groups with gradients must have the same lr; got {[g['lr'] for g in groups]}. Pass a "
                "GradientTransformation instead to use group lrs as per-group factors on the updates"
            )
        lr, device, dtype = groups[0]["lr"], next(p for ps in active for p in ps).device, self._lr_dtype
        if isinstance(lr, torch.Tensor):
            # A copy: schedulers update tensor lrs in place, and the state must not change behind our back.
            return lr.detach().to(device=device, dtype=dtype, copy=True)
        key, cached = (float(lr), device, dtype), self.__dict__.get("_lr")
        if cached is None or cached[0] != key:
            # torch.full writes the value with a kernel: no host-to-device copy, no sync.
            cached = self.__dict__["_lr"] = (key, torch.full((), float(lr), dtype=dtype, device=device))
        return cached[1]

    def _add_times_lr(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """``p += lr * u``, each group's ``lr`` a factor on its updates: one foreach call per distinct factor."""
        factor = {id(p): g["lr"] for g in self.param_groups for p in g["params"]}
        buckets: dict[Any, tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = {}
        for p, u in zip(params, updates):
            lr = factor[id(p)]
            bucket = buckets.setdefault(_lr_key(lr), (lr, [], []))
            bucket[1].append(p)
            bucket[2].append(u if u.dtype == p.dtype else u.to(p.dtype))
        for lr, bps, bus in buckets.values():
            if isinstance(lr, torch.Tensor):
                torch._foreach_add_(bps, torch._foreach_mul(bus, lr.to(bps[0].device)))
            elif lr == 1.0:
                torch._foreach_add_(bps, bus)
            else:
                torch._foreach_add_(bps, bus, alpha=lr)

    # -- checkpoints -------------------------------------------------------------------------------

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s state dict, with the transformation state under ``state["functopk"]``.

        ``state["functopk"]`` holds ``"transform"`` (a :func:`functopk.state_to_dict`
        dict of :attr:`transform_state`, with the digest of its leaves),
        ``"params_with_state"`` (the indices, in ``param_groups`` order, of the
        parameters the state covers) and ``"digest"`` (SHA-256 digests of every key
        of every param group and of ``params_with_state``, checked by
        :meth:`load_state_dict`). Empty before the first step.
        """
        state, entries = self.transform_state, self.state
        kept: dict[Any, Any] = {}
        if state is not None:
            slots = self._slots()
            with_state = [i for i, p in enumerate(slots) if p in self.state]
            index = {id(p): i for i, p in enumerate(slots)}
            packed = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                      for g in self.param_groups]  # fmt: skip  # (the groups as torch's state_dict writes them)
            kept[_STATE_KEY] = {
                "transform": state_to_dict(state),
                "params_with_state": with_state,
                "digest": groups_digest(packed, with_state),
            }
        # In self.state for the duration of the call, so that state-dict hooks see it.
        self.state = defaultdict(dict, kept)
        try:
            return torch.optim.Optimizer.state_dict(self)
        finally:
            self.state = entries

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; everything is checked before anything changes.

        Raises:
            ValueError: the param groups differ in number or size from this optimizer's,
                a group lacks ``lr`` or has an invalid one, or a parameter name repeats.
            CheckpointError: the transformation state has another structure, shape or
                dtype than this optimizer's transformation would have (or is malformed), or a
                param group or the state differs from the digest saved with it (a changed byte).
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise CheckpointError("state_dict must be a dict with keys 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        self._check_saved_groups(saved_groups)
        saved_state = dict(state_dict["state"])
        entry = saved_state.pop(_STATE_KEY, None)
        if saved_state:
            raise CheckpointError(
                f"state_dict['state'] has entries {sorted(map(str, saved_state))[:5]} that TorchOptimizer does "
                f"not know (it keeps its whole state under {_STATE_KEY!r})"
            )
        loaded = {} if entry is None else self._parse_entry(entry, saved_groups)
        torch.optim.Optimizer.load_state_dict(self, {**state_dict, "state": {}})
        self.state.update(loaded)
        self.__dict__["_joined"] = None

    def _check_saved_groups(self, saved_groups: Any) -> None:
        """What :meth:`step` needs of the groups a load puts in place: sizes, a valid ``lr``, unique names."""
        if not isinstance(saved_groups, list) or not all(
            isinstance(s, dict) and isinstance(s.get("params"), list) for s in saved_groups
        ):
            raise CheckpointError("state_dict['param_groups'] must be a list of dicts, each with a list 'params'")
        check_group_sizes(saved_groups, self.param_groups)
        for i, s in enumerate(saved_groups):
            if "lr" not in s:
                raise ValueError(f"param group {i} lacks 'lr', which every TorchOptimizer group keeps")
            check_hyperparam(s["lr"], f"state_dict['param_groups'][{i}]['lr']", minimum=0.0)
        param_names(_saved_names(self.param_groups, saved_groups))  # after loading, the saved names replace ours

    def _parse_entry(self, entry: Any, saved_groups: list[dict[str, Any]]) -> dict[torch.Tensor, dict[str, Any]]:
        """The per-parameter entries of a saved ``state["functopk"]``, checked whole."""
        if not isinstance(entry, dict) or not {"transform", "params_with_state"} <= set(entry) <= _ENTRY_KEYS:
            raise CheckpointError(
                f"state_dict['state'][{_STATE_KEY!r}] must be a dict with keys 'transform', 'params_with_state' "
                "and 'digest'"
            )
        check_groups_digest(entry, saved_groups, f"state_dict['state'][{_STATE_KEY!r}]")
        slots, indices = self._slots(), entry["params_with_state"]
        if (
            not isinstance(indices, list)
            or not all(isinstance(i, int) and 0 <= i < len(slots) for i in indices)
            or len(set(indices)) != len(indices)
        ):
            raise CheckpointError(
                f"state_dict params_with_state must be a list of distinct parameter indices in [0, {len(slots)}), "
                f"got {indices!r}"
            )
        # After loading, the saved names (if any) replace the current ones, as in torch.optim.
        part, chosen = self._tree(_saved_names(self.param_groups, saved_groups)), set(indices)
        with_state = [p for i, p in enumerate(slots) if i in chosen]
        template = self._tx.init(part.tree(with_state, with_state))
        state = state_from_dict(template, entry["transform"])
        return dict(zip(with_state, per_param.split(state, part.layout(with_state))))


def _saved_names(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with the names a checkpoint's groups carry (a load replaces them, as in ``torch.optim``)."""
    return [{**g, "param_names": s["param_names"]} if "param_names" in s else g for g, s in zip(groups, saved)]
