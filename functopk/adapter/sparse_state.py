""":class:`SparseStateOptimizer`: a ``torch.optim`` optimizer training ``k`` coordinates, with state of size ``k``.

What :func:`~functopk.sparse_optimizer_from_torch` makes
(:mod:`functopk.adapter.sparse_classes`): the adapter form of
:func:`functopk.sparse.sparse_optimizer`. A
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
different state (SGD with and without momentum) share the names they have in
common. A coordinate only ever holds its own group's values: where its group
keeps no such name (SGD without momentum has no ``momentum_buffer``), the
value is the fresh one, as if the name were not there, so that a group that
gains the name later starts it afresh, as ``torch.optim`` does.

Lifetime: the stream's hooks hold it weakly (:mod:`functopk.sparse.hooks`), so
an optimizer that is deleted leaves the parameters as it found them;
:meth:`SparseStateOptimizer.remove` (or the end of a ``with`` block) removes
them at once.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from functopk._checks import (
    check_bool,
    check_choice,
    check_int,
    check_k_or_density,
    check_number,
    one_device,
)
from functopk.adapter import checkpoint, per_param
from functopk.adapter.registry import TorchClassGroups, check_implementation_flags, spec_for, torch_hyperparams
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.opt_state import SparseOptState
from functopk.sparse.optimizer import SCORES, TORCH_COORDINATEWISE, SparseOptimizer, trusted_sparse_optimizer
from functopk.sparse.streaming import StreamingTopK
from functopk.sparse.updates import SparseUpdates, apply_sparse_updates_, shift_indices

__all__ = ["SparseStateOptimizer"]

class SparseStateOptimizer(TorchClassGroups, torch.optim.Optimizer):
    """``optimizer_class`` on ``k`` coordinates of all its parameters, with state of size ``k``.

    Made by :func:`functopk.sparse_optimizer_from_torch`; see there.

    What differs from ``torch.optim``:

    * a step with no backward since the last one does nothing (as torch
      without gradients); a second backward before ``step()`` raises
      ``RuntimeError`` out of ``backward`` unless the optimizer was made with
      ``grad_accumulation=True`` (or the earlier micro-batches run under
      ``with opt.paused():``); ``zero_grad()`` discards a backward already
      folded, as torch discards ``.grad`` (skip a batch with ``backward(); zero_grad()``);
    * between refreshes the weight gradients of ``nn.Linear``, ``Conv1D``,
      ``nn.Embedding`` and ``nn.Conv2d`` layers are computed at the coordinate
      set only (``sampled=True``): the same numbers within rounding, no dense
      weight gradient;
    * its gradient hooks live as long as the optimizer: :meth:`remove` (or
      ``with ... as opt:``) removes them, and so does deleting the optimizer;
      one per parameter: a second one on the same parameters raises ``ValueError``
      until the first is removed or deleted;
    * a parameter without a gradient in a step between refreshes counts as a
      zero gradient at its coordinates of the set (they still step, with their
      momentum and weight decay), where ``torch.optim`` skips the parameter;
    * ``torch.nn.utils.clip_grad_norm_`` and ``GradScaler.unscale_`` see no
      gradients (they are freed): clip with :meth:`clip_grad_norm_`, which
      clips the ``k`` values the step uses (``docs/sparse_training.md`` shows
      how to point the HF Trainer and Lightning at it);
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
        grad_accumulation: bool = False,
        sampled: bool = True,
        **defaults: Any,
    ) -> None:
        spec_for(optimizer_class)  # TypeError / ValueError for a class functopk does not cover
        if optimizer_class.__name__ not in TORCH_COORDINATEWISE:
            raise ValueError(
                f"optimizer_class torch.optim.{optimizer_class.__name__} is not coordinate-wise (its update of a "
                "coordinate reads other coordinates), so it cannot run on the selected coordinates alone; use one "
                f"of {', '.join(sorted(TORCH_COORDINATEWISE))}"
            )
        k, density = check_k_or_density(k, density, allow_tensor=False)
        self.refresh_every = check_int(refresh_every, "refresh_every", minimum=1)
        self.score = check_choice(score, "score", SCORES)
        self._streaming = {
            "score": self.score,
            "grad_accumulation": check_bool(grad_accumulation, "grad_accumulation"),
            "sampled": check_bool(sampled, "sampled"),
        }
        self._clipped: SparseUpdates | None = None  # clip_grad_norm_() ended the backward: the step's gradient
        self._stream: StreamingTopK | None = None  # set once the groups are: add_param_group refuses after that
        self._removed = False  # remove() was called: the stream's hooks are gone
        self._init_groups(optimizer_class, params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._device = one_device(self._params, "params")
        self._sizes = [p.numel() for p in self._params]
        n = sum(self._sizes)
        self.k = k_on_host(resolve_k(k, density, n, name="params"), n)
        self._steps = 0  # step() calls that stepped: refresh when a multiple of refresh_every (no host read)
        self._sparse = self._init_state(self.param_groups)
        # last (hooks on the parameters): float leaves, listed once, autograd leaves, no other live stream on them;
        # with score="accumulated" it keeps the n-sized sum
        self._stream = StreamingTopK(self._params, k=self.k, **self._streaming)

    # ------------------------------------------------------------------ the groups' transformations

    def _optimizer(self, group: dict[str, Any]) -> tuple[SparseOptimizer, per_param.EntryLayout]:
        """``sparse_optimizer`` of ``group``'s transformation for its current hyperparameters, and its state's names.

        Built at every step (about 20 us), so a scheduler's or a hand edit's new value is used at once.
        """
        tx = self._build(group)
        # the names of the inner state's k-vectors (torch's: exp_avg, step); the structure does not depend on k
        layout = per_param.layout_of(tx.init([torch.zeros(1)]), 1, self._spec.state_names)
        # the class was checked to be coordinate-wise; its pieces (a step counter) are not all recorded as such
        return trusted_sparse_optimizer(tx, k=self.k), layout

    def _init_state(self, groups: list[dict[str, Any]]) -> SparseOptState:
        """The state before the first step: each coordinate's own group's fresh state, by name."""
        built = [self._optimizer(group) for group in groups]
        states = [opt.init(self._params) for opt, _ in built]  # torch refuses an optimizer without param groups
        fresh = [per_param.split(state.inner, layout)[0] for state, (_, layout) in zip(states, built)]
        return states[0]._replace(inner=self._merged(states[0].indices, built, fresh))

    def _merged(
        self,
        indices: torch.Tensor,
        built: list[tuple[SparseOptimizer, per_param.EntryLayout]],
        named: list[dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Each group's named state (``named``) as one: every coordinate of ``indices`` holds its own group's values.

        Where a coordinate's group keeps no such name, the name's fresh value (from a group that keeps it).
        """
        if len(named) == 1:
            return dict(named[0])
        members = self._memberships(indices)
        out = {}
        for name in dict.fromkeys(n for entries in named for n in entries):
            having = [(m, entries[name]) for m, entries in zip(members, named) if name in entries]
            if len(having) == len(named):  # every coordinate is covered: start from any group's
                value, rest = having[0][1], having[1:]
            else:
                opt, layout = next(b for b, entries in zip(built, named) if name in entries)
                value, rest = per_param.split(opt.init(self._params).inner, layout)[0][name], having
            for member, v in rest:
                value = torch.where(member, v, value)
            out[name] = value
        return out

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
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ stepping

    def _memberships(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """For each group, which of the ``k`` coordinates are its parameters'."""
        out: list[torch.Tensor] = []
        lo = 0
        for group in self.param_groups:
            hi = lo + sum(p.numel() for p in group["params"])
            out.append((indices >= lo) & (indices < hi))
            lo = hi
        return out

    def _live_stream(self, method: str) -> StreamingTopK:
        """The stream, unless :meth:`remove` took it (``RuntimeError``)."""
        if self._removed or self._stream is None:
            raise RuntimeError(
                f"{type(self).__name__}.{method}() after remove(): its gradient hooks are gone; make a new optimizer "
                "(load this one's state_dict() into it to continue)"
            )
        return self._stream

    def _gradients(self, stream: StreamingTopK) -> SparseUpdates | None:
        """The step's gradient at ``k`` coordinates over all parameters; ``None`` when no backward ran."""
        if self._clipped is not None:
            grads, self._clipped = self._clipped, None
            if stream.started:
                raise RuntimeError(
                    f"{type(self).__name__}.step(): a backward ran after clip_grad_norm_(), which had ended the "
                    "step's backward; clip once, after the last backward of the step"
                )
            return grads
        if not stream.started:
            return None
        sparse = stream.result()
        present = [x is not None for x in stream.selected_from]
        idx = shift_indices(sparse.indices, self._sizes, present, to_all=True)
        return SparseUpdates(idx, sparse.values, sum(self._sizes), tuple(self._sizes))

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
        stream = self._live_stream("step")
        for group in self.param_groups:
            check_implementation_flags(group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._gradients(stream)
        if grads is None:
            return loss
        refresh = self._steps % self.refresh_every == 0
        built: list[tuple[SparseOptimizer, per_param.EntryLayout]] = []
        named: list[dict[str, torch.Tensor]] = []
        values: list[torch.Tensor] = []
        for group in self.param_groups:  # each group's maths on all k coordinates; each coordinate keeps its own
            opt, layout = self._optimizer(group)
            inner = per_param.join([self._entries(opt, layout)], layout)
            update, new = opt.update(grads, self._sparse._replace(inner=inner), self._params, refresh=refresh)
            built.append((opt, layout))
            named.append(per_param.split(new.inner, layout)[0])
            values.append(update.values)
        members = self._memberships(update.indices) if len(values) > 1 else []
        for member, v in zip(members[1:], values[1:]):
            values[0] = torch.where(member, v, values[0])
        apply_sparse_updates_(self._params, update._replace(values=values[0]))
        self._sparse = new._replace(inner=self._merged(update.indices, built, named))
        self._steps += 1
        self._arm()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the step's gradient as ``torch.nn.utils.clip_grad_norm_`` would: the ``k`` values the step uses.

        Call it after the step's last backward and before :meth:`step`: it ends
        the backward (the selection is made, or the set's values gathered),
        scales the ``k`` values by ``max_norm / (norm + 1e-6)`` where that is
        below 1, and returns their norm before clipping (a 0-d tensor, as torch).
        The norm is that of the gradient restricted to the coordinates the step
        trains, not of the dense gradient (which is never formed). ``0`` when no
        backward ran. ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        sees no gradient (they are freed) and does nothing: point the trainer at
        this method instead (``docs/sparse_training.md``).

        Args:
            max_norm: The largest norm kept.
            norm_type: The norm's order, as for ``torch.linalg.vector_norm``.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(3, requires_grad=True)
            >>> opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, [w], k=2, lr=1.0)
            >>> (w * torch.tensor([3.0, 0.0, 4.0])).sum().backward()
            >>> opt.clip_grad_norm_(1.0)
            tensor(5.)
            >>> opt.step(); w
            tensor([-0.6000,  0.0000, -0.8000], requires_grad=True)
        """
        max_norm = check_number(max_norm, "max_norm", minimum=0.0)
        grads = self._gradients(self._live_stream("clip_grad_norm_"))
        if grads is None:
            return torch.zeros((), device=self._device)
        norm = torch.linalg.vector_norm(grads.values, norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self._clipped = grads._replace(values=grads.values * coef.to(grads.values.dtype))
        return norm

    def _arm(self) -> None:
        """Between refreshes, make the next backward gather the gradient at the coordinate set."""
        assert self._stream is not None
        if self._steps % self.refresh_every:
            self._stream.gather(self._sparse.indices)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the step's gradients: ``.grad`` as ``torch.optim`` does, and what backward has folded.

        So ``loss.backward(); opt.zero_grad()`` without a ``step()`` skips the
        batch, as with ``torch.optim``. A coordinate set kept between refreshes
        stays (:meth:`functopk.sparse.StreamingTopK.discard`).

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(3, requires_grad=True)
            >>> opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, [w], k=1, lr=1.0)
            >>> (w * torch.tensor([9.0, 0.0, 0.0])).sum().backward()     # a batch to skip
            >>> opt.zero_grad()
            >>> (w * torch.tensor([0.0, 2.0, 0.0])).sum().backward()
            >>> opt.step(); w
            tensor([ 0., -2.,  0.], requires_grad=True)
        """
        if not self._removed and self._stream is not None:
            self._stream.discard()
        self._clipped = None
        super().zero_grad(set_to_none)

    def remove(self) -> None:
        """Remove the gradient hooks from the parameters: later backward passes leave ``.grad`` to autograd.

        What the end of a ``with`` block does, and what deleting the optimizer
        does (its hooks hold it weakly). Frees the parameters for another
        optimizer or stream; ``step()`` and ``paused()`` raise ``RuntimeError``
        afterwards, ``state_dict()`` still works. A second call does nothing.

        Example:
            >>> import torch, functopk as ft
            >>> model = torch.nn.Linear(2, 1)
            >>> with ft.sparse_optimizer_from_torch(torch.optim.SGD, model.parameters(), k=1, lr=0.1) as opt:
            ...     model(torch.ones(1, 2)).sum().backward()
            ...     opt.step()
            >>> saved = opt.state_dict()
            >>> dense = torch.optim.SGD(model.parameters(), lr=0.1)   # the parameters are free again
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> model.bias.grad
            tensor([1.])
        """
        if self._stream is not None:
            self._stream.remove()
        self._removed = True

    def __enter__(self) -> SparseStateOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

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
        return self._live_stream("paused").paused()

    # ------------------------------------------------------------------ checkpoints

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"a {type(self).__name__} made by ft.sparse_optimizer_from_torch does not pickle or deep-copy (its "
            "backward hooks belong to the parameters); save opt.state_dict(), opt.remove() (or del opt), then "
            "load it into a new optimizer"
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
        stream = self._live_stream("load_state_dict")
        groups = self._saved_groups(state_dict)
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
        scores = checkpoint.loaded_scores(state_dict["state"].get("score"), stream.scores)
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        self._sparse = loaded
        stream.remove()  # a fresh stream: one armed to gather for the old schedule would be wrong now
        self._stream = StreamingTopK(self._params, k=self.k, **self._streaming)
        for live, saved in zip(self._stream.scores or [], scores):
            live.copy_(saved)
        self._steps = int(loaded.count)  # once, on load: the refresh schedule goes on from the saved step
        self._arm()
