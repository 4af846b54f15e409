"""``torch.optim`` adapter: any functopk transformation in an imperative training loop.

:class:`TorchOptimizer` is a real :class:`torch.optim.Optimizer`: it plugs into
``loss.backward(); opt.step(); opt.zero_grad()`` loops, learning-rate schedulers,
AMP's ``GradScaler`` and ``torch.compile``, while the update itself is computed
by one pure functopk transformation over *one tree of all parameters of all
groups*, so ``topk(k)`` selects the ``k`` largest gradient coordinates across
the whole model::

    opt = ft.TorchOptimizer(model.parameters(), ft.chain(ft.topk(1000), ft.sgd(0.1)))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Union

import optree
import torch

from functopk._checks import check_distinct_params, check_hyperparam, torch_duplicate_warning_ignored
from functopk._compat import replace
from functopk.adapter.checkpoint import check_group_sizes
from functopk.adapter.classes import optimizer_class_from_torch, optimizer_from_torch
from functopk.adapter.group_digest import check_groups_digest, groups_digest
from functopk.adapter.groups import ParamGroupOptimizer
from functopk.adapter.recut import LastStepParams, make_tree, param_names, remap, same_ptree, saved_names
from functopk.base import GradientTransformation, OptState
from functopk.checkpoint import CheckpointError, state_from_dict, state_to_dict
from functopk.optim.inject import inject_hyperparams
from functopk.tree.maths import PyTree
from functopk.update import paired_leaves

__all__ = ["TorchOptimizer"]

Factory = Callable[[Any], GradientTransformation]
_STATE_KEY = "functopk"
_ENTRY_KEYS = frozenset({"transform", "params_with_state", "digest"})


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


class TorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that applies a functopk transformation to ``.grad``.

    At each :meth:`step` the gradients of all parameters of all groups form one
    tree (a dict keyed by parameter name when the parameters were given with
    names, e.g. ``model.named_parameters()``; otherwise a list in group order),
    the transformation turns it into updates, and the updates are added to the
    parameters in place. A parameter whose ``.grad`` is ``None`` appears as
    ``None`` in the tree: it takes no part (top-k ignores it) and is not changed.

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

    **State.** One state for the whole tree, created at the first step from the
    parameters with gradients. Parameters that get gradients later (unfreezing,
    :meth:`add_param_group`) extend it: state subtrees shaped like the parameter
    tree get fresh ``init`` values for them; other leaves (step counts, which
    count optimizer steps) are kept. A step without gradients for some covered
    parameters runs on the others and carries their state over, as
    ``torch.optim`` does. A state sized by the whole parameter set (not per
    parameter) cannot be extended or restricted: ``ValueError``.

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

    **Compile.** ``torch.compile(opt.step)`` works (and equals the eager step);
    the learning rates pass as values, so a scheduled ``lr`` may recompile the
    step when it changes unless it is a 0-d tensor (``lr=torch.tensor(0.1)``), as
    for ``torch.optim``. The fully compiled path is the functional one
    (``tx.update`` in a compiled step). The optimizers made by
    :func:`~functopk.optimizer_from_torch` do not compile: their compiled step
    raises ``NotImplementedError``.

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
            self._injected = False
            self._tx = tx
            lr = 1.0
        elif callable(tx):
            if lr is None:
                raise TypeError("lr is required when tx is a factory lr -> GradientTransformation")
            build = functools.partial(_checked_build, tx)  # picklable when tx is a module-level function
            self._injected = True
            self._tx = inject_hyperparams(build)(learning_rate=check_hyperparam(lr, "lr", minimum=0.0))
            self._factory = build  # rebuilt below with a float64 rate when a parameter is float64
        else:
            raise TypeError(
                f"tx must be a functopk.GradientTransformation or a factory lr -> GradientTransformation, "
                f"got {type(tx).__name__}"
            )
        # Everything step() changes lives in this dict and is changed by item assignment:
        # torch.compile (dynamo) replays mutations of a dict, but silently drops attribute
        # assignments on torch.optim.Optimizer subclasses (torch 2.14; cf. pytorch/pytorch#171590).
        self._mutable: dict[str, Any] = {"state": None, "ptree": None, "last_step": None, "lr": None}
        super().__init__(params, {"lr": check_hyperparam(lr, "lr", minimum=0.0)})
        self._lr_dtype = torch.float32
        if self._injected and any(p.dtype == torch.float64 for g in self.param_groups for p in g["params"]):
            self._lr_dtype = torch.float64
            # the injected rate in float64, so that float64 models step exactly as with torch.optim's Python lr
            exact = torch.tensor(float(lr) if not isinstance(lr, torch.Tensor) else lr.item(), dtype=torch.float64)
            self._tx = inject_hyperparams(self._factory)(learning_rate=exact)

    # The optimizer door's older names, kept because user code depends on them (transformers' Trainer
    # takes a from_torch_class class); they return what functopk.optimizer_from_torch returns.

    @classmethod
    def from_torch(
        cls,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        sparsify: GradientTransformation | None = None,
        *,
        sparsify_on: str = "gradient",
        **defaults: Any,
    ) -> ParamGroupOptimizer:
        """:func:`functopk.optimizer_from_torch` (a kept alias): a drop-in ``optimizer_class(params, **defaults)``.

        The result is an instance of ``optimizer_class`` and of
        :class:`~functopk.adapter.ParamGroupOptimizer`, not of :class:`TorchOptimizer`.

        Example:
            >>> import torch, functopk as ft
            >>> opt = ft.TorchOptimizer.from_torch(torch.optim.SGD, torch.nn.Linear(4, 1).parameters(), lr=0.1)
            >>> type(opt).__name__, isinstance(opt, ft.ParamGroupOptimizer)
            ('SGD', True)
        """
        return optimizer_from_torch(optimizer_class, params, sparsify, sparsify_on=sparsify_on, **defaults)

    @classmethod
    def from_torch_class(
        cls,
        optimizer_class: type[torch.optim.Optimizer],
        sparsify: GradientTransformation | None = None,
        *,
        sparsify_on: str = "gradient",
    ) -> type[ParamGroupOptimizer]:
        """:func:`functopk.optimizer_class_from_torch` (a kept alias): the class of :meth:`from_torch`'s optimizer.

        Example:
            >>> import torch, functopk as ft
            >>> C = ft.TorchOptimizer.from_torch_class(torch.optim.AdamW)
            >>> C is ft.optimizer_class_from_torch(torch.optim.AdamW), C.__name__
            (True, 'AdamW')
        """
        return optimizer_class_from_torch(optimizer_class, sparsify, sparsify_on=sparsify_on)

    # -- the public view of the state ------------------------------------------------------------

    @property
    def transformation(self) -> GradientTransformation:
        """The transformation applied (with a factory: its ``inject_hyperparams`` wrapper)."""
        return self._tx

    @property
    def transform_state(self) -> OptState | None:
        """The current transformation state (``None`` before the first step). Read it; do not mutate it."""
        return self._mutable["state"]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("_injected", "_tx", "_mutable", "_lr_dtype", "_factory"):
            if hasattr(self, name):  # _factory: with a factory only
                state[name] = getattr(self, name)
        return state

    # -- parameter groups --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim``); its parameters join the global tree at the next step.

        Raises:
            ValueError: the group's ``lr`` is invalid, a parameter name is used twice, or the group
                lists a parameter twice.
        """
        with torch_duplicate_warning_ignored():  # a repeated parameter is refused below, by position
            super().add_param_group(param_group)
        try:
            group = self.param_groups[-1]
            check_distinct_params(group, len(self.param_groups) - 1)
            group["lr"] = check_hyperparam(group["lr"], "lr", minimum=0.0)
            param_names(self.param_groups)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # -- the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the transformation to the current gradients and update the parameters in place.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (run with
                gradients enabled before the update, as in ``torch.optim``).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slots = [p for g in self.param_groups for p in g["params"]]
        grads = []
        for p in slots:
            g = p.grad
            if g is not None and g.is_sparse:
                raise TypeError(
                    "TorchOptimizer(params, tx) does not support sparse gradients (its tree is dense); "
                    "ft.optimizer_from_torch(torch.optim.SGD or torch.optim.Adagrad, ...) takes them as torch does"
                )
            grads.append(g)
        if all(g is None for g in grads):
            return loss
        names = param_names(self.param_groups)
        mask = tuple(g is not None for g in grads)
        active = make_tree([p if m else None for p, m in zip(slots, mask)], names)
        grad_tree = make_tree(grads, names)

        # Work on locals and commit at the end, so that an error leaves the state as it was.
        box = self._mutable
        state, ptree, last_step = box["state"], box["ptree"], box["last_step"]
        if state is not None and last_step is not None and last_step.fits(slots, mask, names):
            full, union = True, ptree  # the common case: the same parameters have gradients as last time
        else:
            last_step = None
            if state is None:
                state, ptree = self._tx.init(active), active
            covered = {id(p) for p in optree.tree_leaves(ptree)}
            union = make_tree([p if m or id(p) in covered else None for p, m in zip(slots, mask)], names)
            if not same_ptree(union, ptree):
                grows = any(id(p) not in covered for p in optree.tree_leaves(active))
                state = remap(state, ptree, union, self._tx.init(union) if grows else None)
            full = same_ptree(active, union)

        run_state = state if full else remap(state, union, active, self._shape_template(active))
        if self._injected:
            lr = self._injected_lr(active)
            run_state = replace(run_state, hyperparams={**run_state.hyperparams, "learning_rate": lr})
        updates, new_state = self._tx.update(grad_tree, run_state, active)
        if not full:
            new_state = remap(new_state, active, union, state)
        self._apply_updates(active, updates)
        if last_step is None and full:
            last_step = LastStepParams(tuple(slots), mask, names)
        box.update(state=new_state, ptree=union, last_step=last_step)
        return loss

    def _shape_template(self, ptree: PyTree) -> OptState:
        """A state for ``ptree`` to check shapes against; on the meta device when ``init`` allows."""
        try:
            meta = optree.tree_map(lambda p: torch.empty_like(p, device="meta"), ptree)
            return self._tx.init(meta)
        except Exception:  # an init that reads values: build a real one
            return self._tx.init(ptree)

    def _injected_lr(self, active: PyTree) -> torch.Tensor:
        groups = [g for g in self.param_groups if any(p.grad is not None for p in g["params"])]
        lrs = {_lr_key(g["lr"]) for g in groups}
        if len(lrs) > 1:
            raise ValueError(
                "with a factory tx, the learning rate lives in the one global transformation, so all param "
                f"groups with gradients must have the same lr; got {[g['lr'] for g in groups]}. Pass a "
                "GradientTransformation instead to use group lrs as per-group factors on the updates"
            )
        lr = groups[0]["lr"]
        device = optree.tree_leaves(active)[0].device
        dtype = self._lr_dtype
        if isinstance(lr, torch.Tensor):
            # A copy: schedulers update tensor lrs in place, and the state must not change behind our back.
            return lr.detach().to(device=device, dtype=dtype, copy=True)
        key = (float(lr), device, dtype)
        cached = self._mutable["lr"]
        if cached is None or cached[0] != key:
            # torch.full writes the value with a kernel: no host-to-device copy, no sync.
            cached = self._mutable["lr"] = (key, torch.full((), float(lr), dtype=dtype, device=device))
        return cached[1]

    def _apply_updates(self, active: PyTree, updates: PyTree) -> None:
        """Add the updates into the parameters of ``active`` (``None`` where no gradient)."""
        try:
            p_leaves, pairs, _ = paired_leaves(active, updates, in_place=False)
        except (TypeError, ValueError) as err:
            raise type(err)(f"the transformation's updates do not fit the parameters with gradients: {err}") from err
        ps, us = [p_leaves[i] for i, _ in pairs], [u for _, u in pairs]
        if not ps:
            return
        if self._injected or all(
            not isinstance(g["lr"], torch.Tensor) and g["lr"] == 1.0 for g in self.param_groups
        ):
            torch._foreach_add_(ps, us)  # updates exactly as the transformation computed them
            return
        # group lrs are factors on the updates: one foreach call per distinct factor
        factor = {id(p): g["lr"] for g in self.param_groups for p in g["params"]}
        buckets: dict[Any, tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = {}
        for p, u in zip(ps, us):
            lr = factor[id(p)]
            bucket = buckets.setdefault(_lr_key(lr), (lr, [], []))
            bucket[1].append(p)
            bucket[2].append(u)
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
        dict, with the digest of its leaves), ``"params_with_state"`` (the indices,
        in ``param_groups`` order, of the parameters the state covers) and
        ``"digest"`` (SHA-256 digests of every key of every param group and of
        ``params_with_state``, checked by :meth:`load_state_dict`). Empty before
        the first step.
        """
        box = self._mutable
        if box["state"] is None:
            return super().state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        with_state = sorted(index[id(p)] for p in optree.tree_leaves(box["ptree"]))
        packed = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]  # fmt: skip  # (the groups as torch's state_dict writes them)
        entry = {
            "transform": state_to_dict(box["state"]),
            "params_with_state": with_state,
            "digest": groups_digest(packed, with_state),
        }
        # Placed in self.state for the duration of the call, so that state-dict hooks see it.
        state: dict[Any, Any] = self.state
        state[_STATE_KEY] = entry
        try:
            return super().state_dict()
        finally:
            del state[_STATE_KEY]

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
        new_state = new_ptree = None
        if entry is not None:
            new_state, new_ptree = self._parse_entry(entry, saved_groups)
        if saved_state:
            raise CheckpointError(
                f"state_dict['state'] has entries {sorted(map(str, saved_state))[:5]} that TorchOptimizer does "
                f"not know (it keeps its whole state under {_STATE_KEY!r})"
            )
        super().load_state_dict({**state_dict, "state": {}})
        self._mutable.update(state=new_state, ptree=new_ptree, last_step=None, lr=None)

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
        # after loading, the saved names (if any) replace the current ones, as in torch.optim
        param_names(saved_names(self.param_groups, saved_groups))

    def _parse_entry(self, entry: Any, saved_groups: list[dict[str, Any]]) -> tuple[OptState, PyTree]:
        if not isinstance(entry, dict) or not {"transform", "params_with_state"} <= set(entry) <= _ENTRY_KEYS:
            raise CheckpointError(
                f"state_dict['state'][{_STATE_KEY!r}] must be a dict with keys 'transform', 'params_with_state' "
                "and 'digest'"
            )
        check_groups_digest(entry, saved_groups, f"state_dict['state'][{_STATE_KEY!r}]")
        slots = [p for g in self.param_groups for p in g["params"]]
        indices = entry["params_with_state"]
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
        groups = saved_names(self.param_groups, saved_groups)
        names = param_names(groups)
        chosen = set(indices)
        ptree = make_tree([p if i in chosen else None for i, p in enumerate(slots)], names)
        return state_from_dict(self._tx.init(ptree), entry["transform"]), ptree
