"""The ranks of ``test_fsdp_compress.py``: a tiny MLP under ``fully_shard`` with ``compress_fsdp``.

``fsdp`` (2 ranks): training steps whose every unit reduction is recorded (the
unit's input, the residual before and after, the reduced shard), one step with
an Inf injected in rank 1's input, a DCP checkpoint resumed into a fresh model,
two steps under a halved loss scale, a fingerprint mismatch, and rank 1 dying before a step. ``hsdp`` (4 ranks, a
2x2 ``(replicate, shard)`` mesh): the same recording of the replica hook. The
workers only record; the assertions live in the test module.
"""

from __future__ import annotations

import os
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from functopk.distributed import compress_fsdp
from functopk.distributed.fsdp_compress import _replica_hook, _topk_reduce_scatter
from functopk.distributed.fsdp_torch import fully_shard
from tests.distributed.common import DEATH_EXIT_CODE, start_gloo

DENSITY, STEPS, SAVE_AT, BAD = 0.25, 4, 2, (3, 1, 3)  # BAD: (step, rank, coordinate of the first unit)
WATCHDOG_S = 90.0


def model(seed: int, mesh, reshard: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(net[0], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(net[2], mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(net, mesh=mesh, reshard_after_forward=reshard)


def _record(state, name: str, flat: torch.Tensor, log: list, step: list, rank: int):
    """Log one reduction's input and residual before; inject the Inf at BAD. Returns the residual's buffer."""
    if (step[0], rank, name) == (BAD[0], BAD[1], "0"):
        flat[BAD[2]] = float("inf")
    log.append({"step": step[0], "unit": name, "input": flat.clone(),
                "before": state.units[name].residual.clone()})  # fmt: skip
    return state.units[name].residual


def recording(net, state, log: list, step: list, rank: int, hsdp: bool) -> None:
    """Replace the installed comms (or hooks) by ones that log every reduction."""
    for name, unit in (("0", net[0]), ("2", net[2])):
        if hsdp:
            inner = _replica_hook(state, name)

            def hook(out, name=name, inner=inner):
                res = _record(state, name, out, log, step, rank)
                inner(out)
                log[-1].update(after=res.clone(), output=out.clone())

            unit.set_all_reduce_hook(hook)
        else:

            class Recording(_topk_reduce_scatter()):
                def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                    res = _record(self.state, self.name, input_tensor, log, step, rank)
                    super().__call__(output_tensor, input_tensor, group, op, async_op)
                    log[-1].update(after=res.clone(), output=output_tensor.clone(), op=str(op))

            unit.set_custom_reduce_scatter(Recording(state, name))


def train(net, state, opt, steps, rank: int, step: list) -> None:
    for s in steps:
        step[0] = s
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad()
        net(x).square().mean().backward()
        bad = torch.tensor([float(any(not torch.isfinite(p.grad.to_local()).all() for p in net.parameters()))])
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # as a GradScaler skips the step
        if not bad.item():
            opt.step()


def snapshot(net, state) -> dict:
    out = {n: p.detach().to_local().clone() for n, p in net.named_parameters()}
    out.update({n: r.residual.clone() for n, r in state.units.items()})
    return out


def _fsdp(rank: int, world: int, out_dir: str, results: dict) -> None:
    mesh = init_device_mesh("cpu", (world,))
    net = model(0, mesh)
    state = compress_fsdp(net, density=DENSITY)
    results["layout"] = {k: (tuple(v.shape), [str(p) for p in v.placements]) for k, v in state.state_dict().items()}
    results["residual_numel"] = state.residual_numel()
    results["shard_numel"] = sum(p.to_local().numel() for p in net.parameters())
    log: list = []
    step = [0]
    recording(net, state, log, step, rank, hsdp=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, state, opt, range(SAVE_AT), rank, step)
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd, "fsdpc": state}, checkpoint_id=os.path.join(out_dir, "ckpt"))
    train(net, state, opt, range(SAVE_AT, STEPS), rank, step)
    results["log"], results["through"] = log, snapshot(net, state)
    # Fresh objects from another initialisation, loaded from the checkpoint, train the same last steps.
    net2 = model(1, mesh)
    state2 = compress_fsdp(net2, density=DENSITY)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    msd2, osd2 = get_state_dict(net2, opt2)
    loaded = {"model": msd2, "optim": osd2, "fsdpc": state2}
    dcp.load(loaded, checkpoint_id=os.path.join(out_dir, "ckpt"))
    set_state_dict(net2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    log2: list = []
    recording(net2, state2, log2, step, rank, hsdp=False)
    train(net2, state2, opt2, range(SAVE_AT, STEPS), rank, step)
    results["resumed"], results["resumed_log"] = snapshot(net2, state2), log2
    # A loss scale halved between two steps: the residual follows it (a stand-in for GradScaler's _scale).
    scaler = SimpleNamespace(_enabled=True, _scale=torch.tensor(256.0))
    net4 = model(0, mesh)
    state4 = compress_fsdp(net4, density=DENSITY, grad_scaler=scaler)
    log4: list = []
    recording(net4, state4, log4, step, rank, hsdp=False)
    for s in range(2):
        step[0] = 10 + s
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7 * s + rank))
        net4(x).sum().mul(scaler._scale).backward()
        scaler._scale = scaler._scale / 2
    results["scaled_log"] = log4
    results["amp"] = _amp(rank, mesh)
    # Ranks configured differently: every rank raises at the first reduction.
    net3 = model(0, mesh)
    compress_fsdp(net3, density=(0.25, 0.5)[rank])
    try:
        net3(torch.ones(2, 5)).sum().backward()
        results["mismatch"] = "no error"
    except ValueError as exc:
        results["mismatch"] = str(exc)


def _amp(rank: int, mesh) -> list:
    """A real GradScaler; rank 1's input holds an Inf at the second step. Per step: (parameters unchanged,
    the first unit's residual unchanged, the scale after the step)."""
    net = model(0, mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    state = compress_fsdp(net, density=DENSITY, grad_scaler=scaler)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    for s in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank + 10 * s))
        x[0, 2] = float("inf") if (s, rank) == (1, 1) else x[0, 2]
        params, residual = [p.detach().to_local().clone() for p in net.parameters()], state.units["0"].residual.clone()
        opt.zero_grad()
        scaler.scale(net(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        seen.append((all(torch.equal(a, p.detach().to_local()) for a, p in zip(params, net.parameters())),
                     torch.equal(residual, state.units["0"].residual), scaler.get_scale()))  # fmt: skip
    return seen


def _dead(rank: int, mesh, results: dict, path: str) -> None:
    """Rank 1 dies after a forward pass; rank 0 reports how its backward (the first reduction) failed, and when.

    Parameters stay gathered after the forward, so the backward's only collectives are compress_fsdp's."""
    net = model(0, mesh, reshard=False)
    compress_fsdp(net, density=DENSITY)
    loss = net(torch.ones(2, 5)).sum()
    if rank == 1:
        torch.save(results, path)
        os._exit(DEATH_EXIT_CODE)
    t0 = time.monotonic()
    try:
        loss.backward()
        results["dead"] = "no error"
    except RuntimeError as exc:
        results["dead"] = str(exc)
    results["dead_s"] = time.monotonic() - t0


def _hsdp(rank: int, out_dir: str, results: dict) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = model(0, mesh["shard"])
    state = compress_fsdp(net, density=DENSITY, mesh=mesh)
    results["layout"] = {k: (tuple(v.shape), [str(p) for p in v.placements]) for k, v in state.state_dict().items()}
    results["coords"] = (mesh.get_local_rank(0), mesh.get_local_rank(1))
    log: list = []
    step = [0]
    recording(net, state, log, step, rank, hsdp=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train(net, state, opt, range(STEPS), rank, step)
    results["log"], results["final"] = log, snapshot(net, state)
    dcp.save({"fsdpc": state}, checkpoint_id=os.path.join(out_dir, "hsdp"))
    for unit in state.units.values():
        unit.residual.zero_()
    dcp.load({"fsdpc": state}, checkpoint_id=os.path.join(out_dir, "hsdp"))
    results["reloaded"] = {n: r.residual.clone() for n, r in state.units.items()}


def fsdpc_worker(rank: int, world: int, mode: str, store: str, out_dir: str) -> None:
    path = os.path.join(out_dir, f"{mode}-rank{rank}.pt")
    results: dict = {}
    try:
        start_gloo(rank, world, store, WATCHDOG_S, timeout_s=10.0)
        if mode == "fsdp":
            _fsdp(rank, world, out_dir, results)
            _dead(rank, init_device_mesh("cpu", (world,)), results, path)
        else:
            _hsdp(rank, out_dir, results)
            torch.distributed.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, path)
    os._exit(0)
