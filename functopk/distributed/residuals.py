"""``topk_hook``'s memory across buckets, and everything that reads or writes it.

A :class:`ResidualStore` owns each bucket's :class:`BucketMemory` (residual,
velocity and their candidates, see :mod:`functopk.distributed.memory`), the
checkpoint's tensors not yet placed in a bucket, the loss scale the memory is
kept at, and the running iteration's verdict: one non-finite flag per
compressed bucket, committed (or not) at the start of the next iteration,
on device, without a host sync (:meth:`ResidualStore.settle`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functopk.distributed.memory import BucketMemory, assemble, bucket_slots, commit
from functopk.distributed.names import by_name

__all__ = ["ResidualStore"]

Key = tuple[Any, ...]  # a bucket: its parameters' ids (in order), size, dtype and device


class ResidualStore:
    """Every bucket's error-feedback memory, and the running iteration's verdict on it.

    Args:
        momentum: Momentum correction's factor (0: no velocities are kept).
        scaler: The training loop's ``GradScaler`` or ``None`` (memory is then unscaled).
        names: ``{id(param): name}``, for checkpoints.
    """

    def __init__(self, momentum: float, scaler: Any, names: Mapping[int, str]) -> None:
        self.momentum = momentum
        self.scaler = scaler
        self.names = dict(names)
        self.buckets: dict[Key, BucketMemory] = {}
        self.seen: set[Key] = set()  # buckets of the running iteration (the others are dropped at its end)
        self.loaded: dict[str, torch.Tensor] = {}  # residuals from a checkpoint not yet placed in a bucket
        self.loaded_velocity: dict[str, torch.Tensor] = {}  # the same for velocities (momentum correction)
        self.flags: list[torch.Tensor] = []  # per bucket of the running iteration (after warm-up): non-finite?
        self.expect = 0  # how many flags the running iteration's buckets will append
        self.commit_due = False  # an iteration has ended and its candidates wait for settle()
        self.threshold_fallbacks = 0  # selection="threshold": buckets ranked whole (see TopKHookState)
        self.skipped: torch.Tensor | None = None  # committed iterations skipped, on device
        self.skipped_before = 0  # skipped iterations from a checkpoint
        self.scale_now: torch.Tensor | None = None  # the loss scale of the running iteration
        self.unit: torch.Tensor | float | None = None  # the loss scale the memory is in (None: unscaled)

    # ------------------------------------------------------------------ reading

    def residuals(self) -> dict[Key, torch.Tensor]:
        """Each bucket's committed residual (after :meth:`settle`)."""
        self.settle()
        return {key: mem.residual for key, mem in self.buckets.items()}

    def skipped_iters(self) -> int:
        """Compressed iterations whose memory update was skipped (reading it syncs)."""
        self.settle()
        return self.skipped_before + (0 if self.skipped is None else int(self.skipped))

    def by_name(self, field: str) -> dict[str, torch.Tensor]:
        """``"residual"`` or ``"velocity"`` by parameter name, in gradient units, for a checkpoint."""
        self.settle()
        loaded = self.loaded if field == "residual" else self.loaded_velocity
        return by_name(self.buckets.values(), field, loaded, self.names, self.unit)

    # ------------------------------------------------------------------ one iteration

    def expect_flag(self, expected: bool = True) -> None:
        """A bucket of the running iteration will report whether its values were finite (see :meth:`add_flag`)."""
        self.expect += expected

    def add_flag(self, nonfinite: torch.Tensor) -> None:
        """A bucket's verdict, once its exchange has finished: a 0-d bool on device, the same on every rank."""
        self.flags.append(nonfinite)

    def memory(self, bucket: Any, buf: torch.Tensor) -> tuple[Key, BucketMemory]:
        """The bucket's memory, marked as used this iteration; a new one is assembled from the old buckets' and
        the loaded tensors."""
        key = (tuple(id(p) for p in bucket.parameters()), buf.numel(), buf.dtype, buf.device)
        self.seen.add(key)
        mem = self.buckets.get(key)
        if mem is None:
            slots = bucket_slots(bucket, buf.numel())
            residual = torch.zeros_like(buf)
            velocity = torch.zeros_like(buf) if self.momentum else None
            if slots is not None:
                for field, target, loaded in (("residual", residual, self.loaded),
                                              ("velocity", velocity, self.loaded_velocity)):  # fmt: skip
                    if target is not None:
                        assemble(target, field, slots, self.buckets.values(), self.names, loaded, self.unit)
            mem = self.buckets[key] = BucketMemory(residual, slots, velocity)
        return key, mem

    def rescale(self) -> torch.Tensor | None:
        """The factor that brings the memory to the running iteration's loss scale (``None``: 1)."""
        scale = None if self.scaler is None else getattr(self.scaler, "_scale", None)
        if scale is None:
            return None
        if self.scale_now is None:
            self.scale_now = scale.detach().clone()  # GradScaler.update changes _scale in place
        return None if self.unit is None else self.scale_now / self.unit

    def velocity(self, mem: BucketMemory, buf: torch.Tensor, ratio: torch.Tensor | None) -> torch.Tensor:
        """``mem.vscratch = momentum * velocity + buf``: the candidate velocity (momentum correction)."""
        assert mem.velocity is not None and mem.vscratch is not None
        mem.vpending = True
        if ratio is None:
            return torch.add(buf, mem.velocity, alpha=self.momentum, out=mem.vscratch)
        return torch.addcmul(buf, mem.velocity, ratio * self.momentum, out=mem.vscratch)

    def accumulate(self, mem: BucketMemory, buf: torch.Tensor) -> torch.Tensor:
        """``mem.scratch = buf (or the new velocity) + residual`` (brought to the current loss scale): the candidate."""
        mem.pending = True
        ratio = self.rescale()
        new = buf if mem.velocity is None else self.velocity(mem, buf, ratio)
        if ratio is not None:
            return torch.addcmul(new, mem.residual, ratio, out=mem.scratch)
        return torch.add(new, mem.residual, out=mem.scratch)

    def end_iteration(self) -> None:
        """The iteration's last bucket has passed: drop the buckets it did not use; commit at the next settle."""
        for stale in set(self.buckets) - self.seen:  # (none during a warm-up without momentum correction)
            del self.buckets[stale]
        self.seen = set()
        self.commit_due = True

    def settle(self) -> None:
        """Commit the finished iteration: each bucket's candidate memory, unless a value was non-finite."""
        if not self.commit_due:
            return
        pending = [mem for mem in self.buckets.values() if mem.pending or mem.vpending]
        flags, expected, scale = self.flags, self.expect, self.scale_now
        self.commit_due, self.flags, self.expect, self.scale_now = False, [], 0, None
        if not pending:
            return
        if len(flags) < expected:  # an exchange never finished: keep the old memory
            bad = torch.ones((), dtype=torch.bool, device=pending[0].residual.device)
        else:
            bad = torch.stack(flags).any()
        commit(pending, bad)
        self.skipped = bad.long() if self.skipped is None else self.skipped + bad
        if scale is not None:
            self.unit = scale if self.unit is None else torch.where(bad, self.unit, scale)

    # ------------------------------------------------------------------ checkpoints

    def load(
        self, residuals: Mapping[str, torch.Tensor], velocities: Mapping[str, torch.Tensor], skipped: int
    ) -> None:
        """Start over from a checkpoint's (checked) tensors, placed into buckets as they arrive."""
        self.skipped_before, self.skipped = skipped, None
        self.buckets, self.flags, self.expect, self.seen = {}, [], 0, set()
        self.commit_due, self.scale_now = False, None
        self.unit = None if self.scaler is None else 1.0
        self.loaded = {name: t.detach().clone() for name, t in residuals.items()}
        self.loaded_velocity = {name: t.detach().clone() for name, t in velocities.items()}
