"""FSDP2 with a compressed gradient reduction: top-k pairs with error feedback instead of a dense reduce-scatter.

:func:`compress_fsdp` installs itself on every FSDP unit of a model sharded
with ``torch.distributed.fsdp.fully_shard`` and returns the
:class:`FSDPCompressState` that owns the residuals. Two layouts:

* **FSDP** (a 1-d mesh of ``P`` ranks): each unit's reduce-scatter is replaced
  by a custom comm (``FSDPModule.set_custom_reduce_scatter``). A rank adds its
  residual to the unit's full flat gradient, sends the top ``k`` of it as
  ``(index, value)`` pairs in one all-gather (:mod:`functopk.distributed.wire`,
  the DDP hook's format) and sums, rank by rank, the received pairs that fall in
  its own shard. Each rank sends ``O(k)`` bytes per unit instead of the unit's
  size. The residual is what this rank computed but did not send: a gradient
  of the *whole unit* (any coordinate may be selected by the sender), so it
  cannot be sharded; each rank keeps one unit-sized residual, ``P`` times its
  parameter shard (measured in ``docs/distributed.md``).
* **HSDP** (``mesh`` a 2-d ``(replicate, shard)`` mesh, the model sharded with
  ``fully_shard(mesh=mesh["shard"])``): the reduce-scatter inside a shard
  group stays dense (fast links within a node), and the reduction across
  replicas, done by an all-reduce hook (``FSDPModule.set_all_reduce_hook``),
  sends top-k pairs of the reduced shard with error feedback. Here the residual
  is sharded: each rank keeps one of its shard's size.

**Checkpoints.** :meth:`FSDPCompressState.state_dict` gives each unit's
residual as a ``DTensor`` on the training mesh (global shape ``(P, unit)``,
``Shard(0)``, or ``(R, unit)``, ``(Shard(0), Shard(1))`` for HSDP), viewing the
live buffers, so ``torch.distributed.checkpoint`` saves and restores them
bitwise alongside the sharded model and optimizer.

**Safety.** The first reduction compares a fingerprint of the settings and the
units' sizes across ranks (:mod:`functopk.distributed.agree`). Top-k ranks NaN
and Inf first, so a non-finite gradient is sent and reaches the reduced
gradient (where a ``GradScaler`` sees it); a unit whose exchange carries one
keeps its residual on every rank (the verdict is per unit: the step's other,
finite units keep their unsent part). With ``grad_scaler``, residuals (kept
in scaled units) follow loss-scale changes exactly. A collective that fails
(a rank died, or the process-group timeout passed) raises a ``RuntimeError``
saying so.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from functopk._checks import describe
from functopk.distributed import fsdp_torch
from functopk.distributed.agree import check_agreement, layout_code
from functopk.distributed.config import ExchangeConfig
from functopk.distributed.wire import comm_error, local_topk, nonfinite, start_exchange, unpack, wire_bytes

__all__ = ["FSDPCompressState", "compress_fsdp"]


class _Unit:
    """One FSDP unit's memory: its residual and the loss scale the residual is in."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.residual = torch.zeros(numel, dtype=dtype, device=device)  # what this rank has not sent yet
        self.scale_at: torch.Tensor | None = None  # the loss scale ``residual`` is in (with a GradScaler)


class FSDPCompressState:
    """The residuals and settings of :func:`compress_fsdp` (a DCP ``Stateful``).

    Attributes:
        config: The checked ``k`` / ``density`` (an ``ExchangeConfig``).
        hsdp: Whether the sparse reduction runs across replicas (HSDP) or replaces the reduce-scatter.
        sent_bytes: Bytes this rank has put on the wire for the sparse exchanges so far.

    Example:
        >>> from functopk.distributed import FSDPCompressState
        >>> FSDPCompressState.__name__
        'FSDPCompressState'
    """

    def __init__(self, config: ExchangeConfig, mesh: DeviceMesh, hsdp: bool, grad_scaler: Any) -> None:
        self.config, self.mesh, self.hsdp, self.grad_scaler = config, mesh, hsdp, grad_scaler
        self.units: dict[str, _Unit] = {}
        self.sent_bytes = 0
        self._checked = False
        # The group the pairs travel in: replicas for HSDP, the shard group for FSDP.
        self.group = mesh.get_group(0)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every unit's residual as a DTensor viewing the live buffer (and its loss scale, with a scaler)."""
        out: dict[str, Any] = {}
        world = self.mesh.size(0)
        for name, unit in self.units.items():
            local = unit.residual.view(1, -1)
            if self.hsdp:
                shards = self.mesh.size(1)
                shape, placements = (world, local.shape[1] * shards), [fsdp_torch.Shard(0), fsdp_torch.Shard(1)]
            else:
                shape, placements = (world, local.shape[1]), [fsdp_torch.Shard(0)]
            residual = fsdp_torch.DTensor.from_local(local, self.mesh, placements, run_check=False,
                                                     shape=torch.Size(shape), stride=(shape[1], 1))  # fmt: skip
            out[f"residual/{name}"] = residual
            if unit.scale_at is not None:
                out[f"scale/{name}"] = unit.scale_at
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy residuals (DTensors or their local tensors) into the live buffers, checking their sizes."""
        for name, unit in self.units.items():
            got = state.get(f"residual/{name}")
            if got is None:
                raise ValueError(f"state has no residual for FSDP unit {name!r}")
            local = got.to_local() if isinstance(got, fsdp_torch.DTensor) else got
            if local.numel() != unit.residual.numel():
                raise ValueError(f"residual of unit {name!r}: expected {unit.residual.numel()} coordinates, "
                                 f"got {local.numel()}")  # fmt: skip
            if local.data_ptr() != unit.residual.data_ptr():
                unit.residual.copy_(local.reshape(-1))
            scale = state.get(f"scale/{name}")
            if scale is not None:
                unit.scale_at = scale.detach().clone()

    def residual_numel(self) -> int:
        """Coordinates of residual this rank holds, over all units."""
        return sum(u.residual.numel() for u in self.units.values())

    # ------------------------------------------------------------------ the step

    def _check_once(self, group: dist.ProcessGroup, device: torch.device) -> None:
        if self._checked:
            return
        sizes = [(u.residual.numel(),) for u in self.units.values()]
        fields = {"k": -1 if self.config.k is None else self.config.k,
                  "density": -1.0 if self.config.density is None else float(self.config.density),
                  "hsdp": self.hsdp, "units": layout_code(sizes, [u.residual.dtype for u in self.units.values()],
                                                          list(self.units))}  # fmt: skip
        check_agreement("compress_fsdp", fields, group, dist.get_rank(group), group.size(), device)
        self._checked = True

    def exchange(self, name: str, flat: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
        """Error feedback and the sparse all-gather for one unit: ``(gathered, k)``; ``flat`` becomes scratch.

        ``flat + residual`` (brought to the current loss scale) is formed in ``flat``, its top ``k``
        go on the wire, the rest becomes the new residual unless a gathered value is non-finite.
        """
        unit = self.units[name]
        if flat.numel() != unit.residual.numel() or flat.dtype != unit.residual.dtype:
            raise ValueError(f"compress_fsdp: FSDP unit {name!r} reduced {describe(flat)}, expected "
                             f"{unit.residual.numel()} coordinates of {unit.residual.dtype}")  # fmt: skip
        self._check_once(group, flat.device)
        scale = None if self.grad_scaler is None else getattr(self.grad_scaler, "_scale", None)
        if scale is not None and unit.scale_at is not None:
            flat.addcmul_(unit.residual, scale / unit.scale_at)  # exact: loss scales are powers of two
        else:
            flat.add_(unit.residual)
        k = self.config.k_for(flat.numel())
        idx, vals = local_topk(flat, k)
        flat.index_fill_(0, idx, 0)  # what was not sent: the candidate residual
        world = group.size()
        try:
            _, gathered = start_exchange(idx, vals, flat.numel(), group, world, False)
        except RuntimeError as exc:
            raise comm_error(f"the sparse exchange of FSDP unit {name!r}", group, exc) from exc
        bad = nonfinite(gathered, world, k, flat.numel(), flat.dtype)
        torch.where(bad, unit.residual, flat, out=unit.residual)  # a skipped step keeps every residual
        if scale is not None:
            unit.scale_at = scale.detach().clone() if unit.scale_at is None else torch.where(bad, unit.scale_at, scale)
        self.sent_bytes += wire_bytes(k, flat.numel(), flat.dtype)
        return gathered, k


def _sum_pairs(out: torch.Tensor, gathered: torch.Tensor, world: int, k: int, numel: int, lo: int,
               scale: float) -> None:  # fmt: skip
    """``out`` = ``scale`` times every rank's pairs with index in ``[lo, lo + len(out))``, rank 0's first."""
    size = out.numel()
    acc = torch.zeros(size + 1, dtype=out.dtype, device=out.device)  # the last slot takes the others' pairs
    for idx, vals in unpack(gathered, world, k, numel, out.dtype):
        local = idx.to(torch.int64) - lo
        local = torch.where((local >= 0) & (local < size), local, size)
        acc.index_add_(0, local, vals, alpha=scale)
    out.copy_(acc[:size])


@functools.cache
def _topk_reduce_scatter() -> type:
    """The custom comm's class, made at the first ``compress_fsdp``: its base is FSDP2's ``ReduceScatter``."""

    class _TopKReduceScatter(fsdp_torch.ReduceScatter):
        """One FSDP unit's reduce-scatter, as top-k pairs with error feedback (see the module docstring)."""

        def __init__(self, state: FSDPCompressState, name: str) -> None:
            self.state, self.name = state, name

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> None:  # fmt: skip
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                raise ValueError(f"compress_fsdp supports the SUM and AVG reductions, got {op}: do not combine it "
                                 "with set_gradient_divide_factor")  # fmt: skip
            world, rank = group.size(), dist.get_rank(group)
            gathered, k = self.state.exchange(self.name, input_tensor, group)
            size = output_tensor.numel()
            _sum_pairs(output_tensor, gathered, world, k, input_tensor.numel(), rank * size,
                       1.0 / world if op == dist.ReduceOp.AVG else 1.0)  # fmt: skip
            return None

    return _TopKReduceScatter


def _replica_hook(state: FSDPCompressState, name: str):
    """The HSDP all-reduce hook: the mean over replicas of the reduced shard, as top-k pairs."""

    def hook(reduce_output: torch.Tensor) -> None:
        group = state.group
        gathered, k = state.exchange(name, reduce_output, group)
        _sum_pairs(reduce_output, gathered, group.size(), k, reduce_output.numel(), 0, 1.0 / group.size())

    return hook


def _units(module: nn.Module) -> list[tuple[str, Any, list[torch.Tensor]]]:
    """Every FSDP unit of ``module`` with the parameters it manages (those of no nested unit)."""
    found = [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, fsdp_torch.FSDPModule)]
    out: list[tuple[str, Any, list[torch.Tensor]]] = []
    for name, m in found:
        assert isinstance(m, nn.Module)  # fully_shard makes a module an FSDPModule too
        nested = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, fsdp_torch.FSDPModule)
                  for p in sub.parameters()}  # fmt: skip
        out.append((name, m, [p for p in m.parameters() if id(p) not in nested]))
    return out


def _padded_numel(p: torch.Tensor, world: int) -> int:
    """The coordinates FSDP's reduce-scatter input holds for ``p``: dim 0 padded to a multiple of ``world``."""
    if not isinstance(p, fsdp_torch.DTensor):
        raise ValueError(f"compress_fsdp: a parameter is not sharded by fully_shard ({describe(p)})")
    shape = p.shape
    if not shape:
        return world
    rows = -(-shape[0] // world) * world if p.placements[0] == fsdp_torch.Shard(0) else shape[0]
    return rows * (p.numel() // shape[0] if shape[0] else 0)


def compress_fsdp(
    module: nn.Module,
    k: int | None = None,
    density: float | None = None,
    *,
    mesh: DeviceMesh | None = None,
    grad_scaler: Any = None,
) -> FSDPCompressState:
    """Reduce the gradients of a ``fully_shard`` model as top-k pairs with error feedback, on every FSDP unit.

    Call it once after ``fully_shard``, on every rank, with the same settings.
    Each unit sends its top ``k`` (or ``density`` times its size) per rank and step.

    Args:
        module: The model, sharded with ``fully_shard`` (the root and its sub-units).
        k, density: Exactly one: pairs per rank and unit, or the fraction of each unit's coordinates.
        mesh: For HSDP only, the 2-d ``(replicate, shard)`` mesh whose ``mesh["shard"]`` (dimension 1)
            the model is sharded on; ``None``: FSDP on the parameters' own 1-d mesh.
        grad_scaler: The ``torch.amp.GradScaler`` of the loop, if any (residuals follow its scale).

    Returns:
        The :class:`FSDPCompressState` holding the residuals (save it with DCP alongside the model).

    Raises:
        TypeError, ValueError: bad arguments, a model not sharded by ``fully_shard``, or a mesh that
            does not match the parameters'.

    Example:
        >>> import torch
        >>> from functopk.distributed import compress_fsdp
        >>> compress_fsdp(torch.nn.Linear(2, 2), density=0.1)
        Traceback (most recent call last):
        ...
        ValueError: compress_fsdp: module has no FSDP unit: shard it with torch.distributed.fsdp.fully_shard first
    """
    config = ExchangeConfig(k=k, density=density)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {describe(module)}")
    units = [u for u in _units(module) if u[2]]
    if not units:
        raise ValueError("compress_fsdp: module has no FSDP unit: shard it with torch.distributed.fsdp.fully_shard "
                         "first")  # fmt: skip
    first = units[0][2][0]
    if not isinstance(first, fsdp_torch.DTensor):
        raise ValueError(f"compress_fsdp: a parameter is not sharded by fully_shard ({describe(first)})")
    shard_mesh = first.device_mesh
    if shard_mesh.ndim != 1:
        raise ValueError("compress_fsdp: parameters are sharded on a 2-d mesh (native HSDP, whose dense all-reduce "
                         "cannot be replaced); shard on mesh['shard'] and pass the 2-d mesh as mesh=")  # fmt: skip
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            raise TypeError(f"mesh must be a 2-d (replicate, shard) DeviceMesh or None, got {describe(mesh)}")
        if shard_mesh.mesh.tolist() not in mesh.mesh.tolist():  # a shard group is a row of the 2-d mesh
            raise ValueError(f"mesh: the parameters are sharded on ranks {shard_mesh.mesh.tolist()}, which is not "
                             f"a shard group (a row) of the given mesh {mesh.mesh.tolist()}")  # fmt: skip
    if grad_scaler is not None and not isinstance(getattr(grad_scaler, "_enabled", None), bool):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {describe(grad_scaler)}")
    state = FSDPCompressState(config, mesh if mesh is not None else shard_mesh, mesh is not None, grad_scaler)
    shards = shard_mesh.size(0)
    for name, unit, params in units:
        numel = sum(_padded_numel(p, shards) for p in params)
        size = numel // shards if mesh is not None else numel
        state.units[name] = _Unit(size, params[0].dtype, params[0].device)
        if mesh is not None:
            unit.set_all_reduce_hook(_replica_hook(state, name))
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no AVG/PREMUL_SUM reduce-scatter
        else:
            unit.set_custom_reduce_scatter(_topk_reduce_scatter()(state, name))
    return state
