"""``ft.sparse_optimizer_from_torch``: a ``torch.optim`` optimizer training ``k`` coordinates, with state of size ``k``.

The adapter form of :func:`functopk.sparse.sparse_optimizer`. A
:class:`~functopk.sparse.StreamingTopK` over all the optimizer's parameters
(flat order: the ``param_groups`` order) folds each gradient during backward
and frees it, so no dense gradient and no dense optimizer state ever exists:

* on a refresh step (steps ``0, M, 2M, ...``, counted by a Python int) the
  stream's exact global top-``k`` of ``|g|`` becomes the coordinate set;
* on the other steps the stream gathers the gradient at the current set;
* then each param group's transformation (``ft.from_torch``'s maths for the
  group's current hyperparameters) runs on the ``k`` gathered values through
  ``sparse_optimizer``, and each coordinate keeps the result of its own group
  (a ``torch.where`` on its membership); the ``k`` updates are written into the
  parameters in place.

The state is kept once for the ``k`` coordinates, as named ``k``-vectors
(torch's names: ``exp_avg``, ``step``, ...): groups whose transformations keep
different state (SGD with and without weight decay chain different pieces)
share the names they have in common, and a coordinate only ever reads the
names of its own group.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopk._checks import (
    check_choice,
    check_int,
    check_k_or_density,
    one_device,
)
from functopk.adapter import checkpoint, per_param
from functopk.adapter.classes import shadows
from functopk.adapter.registry import (
    add_checked_group,
    check_implementation_flags,
    spec_for,
    torch_hyperparams,
)
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.optimizer import (
    SCORES,
    TORCH_COORDINATEWISE,
    SparseOptimizer,
    SparseOptState,
    sparse_optimizer,
)
from functopk.sparse.streaming import StreamingTopK
from functopk.sparse.updates import SparseUpdates, apply_sparse_updates_

__all__ = ["SparseStateOptimizer", "sparse_optimizer_from_torch"]

_NOT_HYPER = ("params", "param_names")


def over_all(sparse: SparseUpdates, present: list[bool], sizes: list[int]) -> SparseUpdates:
    """A selection over the leaves that had a gradient (``present``), re-indexed over all the leaves."""
    if all(present):
        return sparse
    compact_starts, shifts, at, offset = [], [], 0, 0
    for here, size in zip(present, sizes):
        if here:
            compact_starts.append(at)
            shifts.append(offset - at)
            at += size
        offset += size
    idx = sparse.indices
    leaf = torch.searchsorted(torch.tensor(compact_starts, device=idx.device), idx, right=True) - 1
    idx = idx + torch.tensor(shifts, device=idx.device).index_select(0, leaf)
    return SparseUpdates(idx, sparse.values, offset, tuple(sizes))


class SparseStateOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` on ``k`` coordinates of all its parameters, with state of size ``k``.

    Made by :func:`functopk.sparse_optimizer_from_torch`; see there.

    What differs from ``torch.optim``:

    * a step with no backward since the last one does nothing (as torch
      without gradients); a second backward before ``step()`` raises
      ``RuntimeError`` out of ``backward``: for gradient accumulation run
      every micro-batch but the last under ``with opt.paused():``;
      ``zero_grad()`` clears ``.grad`` (already ``None``) but does not undo a
      backward already folded (call it before the backward, or after ``step()``);
    * a parameter without a gradient in a step between refreshes counts as a
      zero gradient at its coordinates of the set (they still step, with their
      momentum and weight decay), where ``torch.optim`` skips the parameter;
    * gradient clipping and ``GradScaler.unscale_`` see no gradients (they are
      freed): with the HF Trainer set ``max_grad_norm=0``;
    * ``state_dict()["state"]`` is the sparse state (``count``, ``indices``,
      ``inner``), not one entry per parameter; the optimizer does not pickle;
      ``add_param_group`` after construction raises ``NotImplementedError``.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any],
        *,
        k: Any = None,
        density: Any = None,
        refresh_every: int = 1,
        score: str = "gradient",
        **defaults: Any,
    ) -> None:
        spec = spec_for(optimizer_class)  # TypeError / ValueError for a class functopk does not cover
        if optimizer_class.__name__ not in TORCH_COORDINATEWISE:
            raise ValueError(
                f"optimizer_class torch.optim.{optimizer_class.__name__} is not coordinate-wise (its update of a "
                "coordinate reads other coordinates), so it cannot run on the selected coordinates alone; use one "
                f"of {', '.join(sorted(TORCH_COORDINATEWISE))}"
            )
        k, density = check_k_or_density(k, density, allow_tensor=False)
        self.optimizer_class, self._spec = optimizer_class, spec
        self.refresh_every = check_int(refresh_every, "refresh_every", minimum=1)
        self.score = check_choice(score, "score", SCORES)
        self._stream: StreamingTopK | None = None  # set once the groups are: add_param_group refuses after that
        super().__init__(params, torch_hyperparams(optimizer_class, defaults))
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._device = one_device(self._params, "params")
        self._sizes = [p.numel() for p in self._params]
        n = sum(self._sizes)
        self.k = k_on_host(resolve_k(k, density, n, name="params"), n)
        # checks: float leaves, listed once, autograd leaves; with score="accumulated" it keeps the n-sized sum
        self._stream = StreamingTopK(self._params, k=self.k, score=self.score)
        self._steps = 0  # step() calls that stepped: refresh when a multiple of refresh_every (no host read)
        self._sparse = self._init_state(self.param_groups)

    # ------------------------------------------------------------------ the groups' transformations

    def _optimizer(self, group: dict[str, Any]) -> tuple[SparseOptimizer, per_param.EntryLayout]:
        """``sparse_optimizer`` of ``group``'s transformation for its current hyperparameters, and its state's names.

        Built at every step (about 20 us), so a scheduler's or a hand edit's new value is used at once.
        """
        tx = self._spec.build({**group, **{key: self.defaults[key] for key in self._spec.from_defaults}})
        # the names of the inner state's k-vectors (torch's: exp_avg, step); the structure does not depend on k
        layout = per_param.layout_of(tx.init([torch.zeros(1)]), 1, self._spec.state_names)
        return sparse_optimizer(tx, k=self.k), layout

    def _init_state(self, groups: list[dict[str, Any]]) -> SparseOptState:
        """The state before the first step: every group's fresh state, by name (the groups share equal names)."""
        named: dict[str, torch.Tensor] = {}
        state = None
        for group in groups:
            opt, layout = self._optimizer(group)
            state = opt.init(self._params)
            for name, value in per_param.split(state.inner, layout)[0].items():
                named.setdefault(name, value)
        assert state is not None  # torch refuses an optimizer without param groups
        return state._replace(inner=named)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group while constructing (as ``torch.optim``); refused afterwards.

        Raises:
            TypeError, ValueError: a hyperparameter of the group is invalid, or the group lists a parameter twice.
            NotImplementedError: called after construction (the coordinate set spans the parameters given
                then); make a new optimizer instead.
        """
        if self._stream is not None:
            raise NotImplementedError(
                "add_param_group after construction: the coordinate set and the streaming selection span the "
                "parameters given to the constructor; make a new optimizer over all the parameters instead"
            )
        add_checked_group(self, self.optimizer_class, param_group)

    # ------------------------------------------------------------------ stepping

    def _memberships(self, indices: torch.Tensor) -> list[torch.Tensor | None]:
        """For each group, which of the ``k`` coordinates are its parameters' (``None``: all, one group)."""
        if len(self.param_groups) == 1:
            return [None]
        out: list[torch.Tensor | None] = []
        lo = 0
        for group in self.param_groups:
            hi = lo + sum(p.numel() for p in group["params"])
            out.append((indices >= lo) & (indices < hi))
            lo = hi
        return out

    def _gradients(self) -> SparseUpdates | None:
        """The step's gradient at ``k`` coordinates over all parameters; ``None`` when no backward ran."""
        stream = self._stream
        assert stream is not None
        if not stream.started and all(p.grad is None for p in self._params):
            return None
        sparse = stream.result()
        return over_all(sparse, [x is not None for x in stream.selected_from], self._sizes)

    def _entries(self, opt: SparseOptimizer, layout: per_param.EntryLayout) -> dict[str, torch.Tensor]:
        """The named state, with a fresh value for each name of ``layout`` it lacks (a group's new structure)."""
        named = self._sparse.inner
        missing = [name for name in layout.names if name not in named]
        if not missing:
            return named
        fresh = per_param.split(opt.init(self._params).inner, layout)[0]
        return {**named, **{name: fresh[name] for name in missing}}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step on the ``k`` coordinates: refresh the set on steps ``0, M, 2M, ...``, then update them.

        Does nothing (as ``torch.optim`` without gradients) when no backward ran since the last step.

        Args:
            closure: Optional; re-evaluates the model and returns the loss (run with gradients enabled first).

        Returns:
            The closure's loss, or ``None``.
        """
        for group in self.param_groups:
            check_implementation_flags(group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._gradients()
        if grads is None:
            return loss
        refresh = self._steps % self.refresh_every == 0
        values: torch.Tensor | None = None
        named: dict[str, torch.Tensor] = {}
        new, update = self._sparse, None
        for group, member in zip(self.param_groups, self._memberships(grads.indices)):
            opt, layout = self._optimizer(group)
            inner = per_param.join([self._entries(opt, layout)], layout)
            update, new = opt.update(grads, self._sparse._replace(inner=inner), self._params, refresh=refresh)
            # each coordinate keeps its own group's update and state
            if values is None or member is None:
                values = update.values
            else:
                values = torch.where(member, update.values, values)
            for name, value in per_param.split(new.inner, layout)[0].items():
                if name in named and member is not None:
                    value = torch.where(member, value, named[name])
                named[name] = value
        assert values is not None and update is not None
        apply_sparse_updates_(self._params, update._replace(values=values))
        self._sparse = new._replace(inner=named)
        self._steps += 1
        self._arm()
        return loss

    def _arm(self) -> None:
        """Between refreshes, make the next backward gather the gradient at the coordinate set."""
        assert self._stream is not None
        if self._steps % self.refresh_every:
            self._stream.gather(self._sparse.indices)

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose backward passes keep their gradients in ``.grad``: gradient accumulation.

        Run every micro-batch but the last under it; the last backward folds the
        accumulated gradients (:meth:`functopk.sparse.StreamingTopK.paused`).

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(3, requires_grad=True)
            >>> opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, [w], k=1, lr=1.0)
            >>> with opt.paused():
            ...     (w * torch.tensor([1.0, 2.0, 0.0])).sum().backward()   # micro-batch 1: kept in w.grad
            >>> (w * torch.tensor([0.0, 2.0, 1.0])).sum().backward()       # the last one: folded and freed
            >>> opt.step(); w
            tensor([ 0., -4.,  0.], requires_grad=True)
        """
        assert self._stream is not None
        return self._stream.paused()

    # ------------------------------------------------------------------ checkpoints

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"a {type(self).__name__} made by ft.sparse_optimizer_from_torch does not pickle or deep-copy (its "
            "backward hooks belong to the parameters); save opt.state_dict() and load it into a new optimizer"
        )

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """``param_groups`` in torch's layout; under ``"state"`` the sparse state.

        ``"state"`` holds ``"count"`` (steps done), ``"indices"`` (the ``k``
        ascending flat indices of the coordinate set, over the parameters in
        ``param_groups`` order) and ``"inner"``: the optimizer's state of those
        coordinates, one ``k``-vector per name (torch's names: ``exp_avg``,
        ``step``, ...; step counts per coordinate). Tensors are the optimizer's
        own (as ``torch.optim`` returns them): save or copy them before the next step.
        With ``score="accumulated"``, ``"score"`` also holds the sums of ``|g|``
        since the last refresh, one tensor per parameter (``n`` numbers).
        """
        saved = super().state_dict()  # its "state" is empty: nothing lives in self.state
        s, stream = self._sparse, self._stream
        state: dict[str, Any] = {"count": s.count, "indices": s.indices, "inner": dict(s.inner)}
        if stream is not None and stream.scores is not None:  # the n-sized sum of |g| since the last refresh
            state["score"] = list(stream.scores)
        return {**saved, "state": state}

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; everything is checked before anything changes.

        Param groups are read as ``torch.optim`` reads them (keys an older torch
        did not save get the class's defaults). Tensors move to the parameters'
        device. The next step continues the saved run's refresh schedule
        (``count`` steps done), bit for bit.

        Raises:
            TypeError: ``state_dict`` or a part of it has the wrong type.
            ValueError: the param groups differ in number or size or do not make the class's optimizer, or
                the sparse state differs from this optimizer's (its keys, ``k``, a name, a shape or dtype, indices
                not ascending or out of range), naming what differs.
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError("state_dict must be a dict with keys 'state' and 'param_groups'")
        if not isinstance(state_dict["param_groups"], list):
            raise TypeError("state_dict['param_groups'] must be a list")
        keys = [k for k in self.defaults if k not in _NOT_HYPER]
        groups = [
            checkpoint.filled_group(self.optimizer_class, i, s, keys) for i, s in enumerate(state_dict["param_groups"])
        ]
        checkpoint.check_group_sizes(groups, self.param_groups)
        accepted = inspect.signature(self.optimizer_class.__init__).parameters
        for i, group in enumerate(groups):
            try:  # torch's constructor checks (a negative lr), then functopk's build
                torch_hyperparams(self.optimizer_class, {k: group[k] for k in self.defaults if k in accepted})
                self._optimizer(group)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"param group {i} does not make a torch.optim.{self.optimizer_class.__name__}: {err!r}"
                ) from err
        keys = ["count", "indices", "inner"] + (["score"] if self.score == "accumulated" else [])
        owner = f"torch.optim.{self.optimizer_class.__name__} for these param groups (score={self.score!r})"
        like = self._init_state(groups)
        loaded = checkpoint.loaded_sparse_state(state_dict["state"], like, keys, sum(self._sizes), owner)
        assert self._stream is not None
        scores = checkpoint.loaded_scores(state_dict["state"].get("score"), self._stream.scores)
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        self._sparse = loaded
        assert self._stream is not None
        self._stream.remove()  # a fresh stream: one armed to gather for the old schedule would be wrong now
        self._stream = StreamingTopK(self._params, k=self.k, score=self.score)
        for live, saved in zip(self._stream.scores or [], scores):
            live.copy_(saved)
        self._steps = int(loaded.count)  # once, on load: the refresh schedule goes on from the saved step
        self._arm()


_CLASSES: dict[type[torch.optim.Optimizer], type[SparseStateOptimizer]] = {}


def sparse_optimizer_class(optimizer_class: type[torch.optim.Optimizer]) -> type[SparseStateOptimizer]:
    """The class of :func:`sparse_optimizer_from_torch`'s optimizers: named as, and subclassing, ``optimizer_class``.

    ``C(params, k=..., refresh_every=..., **defaults)`` makes one. None of the torch class's code runs
    (:func:`functopk.adapter.classes.shadows`).
    """
    spec_for(optimizer_class)
    if optimizer_class in _CLASSES:
        return _CLASSES[optimizer_class]

    def __init__(self: SparseStateOptimizer, params: Iterable[Any], **kwargs: Any) -> None:
        SparseStateOptimizer.__init__(self, optimizer_class, params, **kwargs)

    name = optimizer_class.__name__
    namespace = {
        **shadows(optimizer_class, SparseStateOptimizer),
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``torch.optim.{name}`` on k coordinates (see :func:`sparse_optimizer_from_torch`).",
    }
    cls = _CLASSES[optimizer_class] = type(name, (optimizer_class, SparseStateOptimizer), namespace)
    return cls


def sparse_optimizer_from_torch(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any],
    *,
    k: Any = None,
    density: Any = None,
    refresh_every: int = 1,
    score: str = "gradient",
    **defaults: Any,
) -> SparseStateOptimizer:
    """``optimizer_class(params, **defaults)`` training only ``k`` coordinates of ``params``, with state of size ``k``.

    The adapter form of :func:`functopk.sparse.sparse_optimizer`, for loops,
    LR schedulers and trainers written for ``torch.optim``. Every ``refresh_every``
    steps (``M``; steps ``0, M, 2M, ...``) the coordinate set becomes the exact
    global top-``k`` of ``|g|`` over all parameters of all groups (or of ``|g|`` summed since
    the last refresh: ``score="accumulated"``); on the steps
    between, the gradient is gathered at that set. Only those ``k``
    coordinates are updated, with ``optimizer_class``'s maths
    (:func:`functopk.from_torch`) and each coordinate's own param group's
    hyperparameters; coordinates that stay in the set keep their state, new
    ones start from fresh state with their own step count (Adam's bias
    correction is that of their first step), dropped ones keep their values.

    Memory: the gradients are folded during backward and freed
    (:class:`~functopk.sparse.StreamingTopK`): after ``loss.backward()`` every
    ``p.grad`` is ``None``, and the state is ``k`` indices plus one value per
    coordinate and buffer (16 bytes per coordinate for AdamW in float32).

    What differs from ``torch.optim`` is listed in :class:`SparseStateOptimizer`.

    Args:
        optimizer_class: A coordinate-wise ``torch.optim`` class: ``SGD``, ``Adam``, ``AdamW``,
            ``RMSprop``, ``Adagrad``, ``Adadelta``, ``Adamax``, ``NAdam``, ``RAdam``, ``ASGD``, ``Rprop``.
        params: Parameters, ``(name, parameter)`` pairs or param-group dicts, as for torch; float
            tensors on one device, leaves of the autograd graph.
        k: How many coordinates to train (an int; give exactly one of ``k`` and ``density``).
        density: The fraction of the coordinates to train, in ``(0, 1]``.
        refresh_every: ``M``: choose the coordinate set again every ``M`` steps (1: every step).
        score: What a refresh ranks: ``"gradient"`` (``|g|`` of the refresh step) or
            ``"accumulated"`` (``|g|`` summed over the steps since the last refresh, this one
            included: one more ``n``-sized tensor, kept by the stream and saved in the state dict).
        **defaults: ``optimizer_class``'s keyword arguments (torch's defaults and checks).

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass, a keyword is unknown to it,
            or ``k``/``density``/``refresh_every`` has the wrong type.
        ValueError: ``optimizer_class`` is not coordinate-wise (``Adafactor``, ``Muon``, ``LBFGS``,
            ``SparseAdam``), torch rejects a value, ``refresh_every < 1``, or ``k`` exceeds the coordinates.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=3, lr=0.01)
        >>> isinstance(opt, torch.optim.AdamW), opt.param_groups[0]["lr"]
        (True, 0.01)
        >>> before = [p.detach().clone() for p in model.parameters()]
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> model.weight.grad is None                 # folded into the selection and freed
        True
        >>> opt.step()
        >>> sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
        3
        >>> sorted(opt.state_dict()["state"]["inner"]), opt.state_dict()["state"]["indices"].shape
        (['exp_avg', 'exp_avg_sq', 'step'], torch.Size([3]))
    """
    cls: Any = sparse_optimizer_class(optimizer_class)
    return cls(params, k=k, density=density, refresh_every=refresh_every, score=score, **defaults)
