"""``topk_hook`` with ``exchange="tree"`` on gloo, P = 2, 3, 4, 6, 8, against the tree's brute-force reference.

The ranks are those of ``test_tree.py``'s forked 8-rank run (the ``tree_run``
fixture of ``conftest.py``); ``hook_tree_workers.py`` drives the hook and
records. The reference is ``tree_reference.py`` (dense merges over the same
tree, the one ``distributed_topk(exchange="tree")`` is tested against) with
the hook's error feedback kept per parameter here: residuals, the held-back
parameter, the saved and loaded state, the skipped iteration.
"""

from __future__ import annotations

import math

import pytest
import torch

import functopk as ft
from functopk.distributed import TopKHookState
from functopk.distributed.tree import tree_wire_bytes
from functopk.sparse import k_from_density
from tests.distributed.common import group_result
from tests.distributed.hook_tree_workers import (
    HT_BAD,
    HT_DDP_DENSITY,
    HT_DDP_GROUP,
    HT_DDP_STEPS,
    HT_DDP_WARMUP,
    HT_DENSITY,
    HT_ITERS,
    HT_LAYOUT,
    HT_MOMENTUM,
    HT_PARAMS,
    HT_UNUSED,
    HT_WARMUP,
    ht_grad,
)
from tests.distributed.tree_reference import tree_reference
from tests.distributed.tree_workers import TREE_GROUPS
from tests.helpers import bits

GROUPS = list(TREE_GROUPS)


def _hook(run, gname: str, rank: int) -> dict:
    return group_result(run, gname, rank)["hook"]


def _cat(tree: dict, names) -> torch.Tensor:
    return torch.cat([tree[n].reshape(-1) for n in names])


def _split(flat: torch.Tensor, names) -> dict:
    return dict(zip(names, torch.split(flat, [math.prod(HT_PARAMS[n]) for n in names])))


def _expected(world: int, momentum: float = 0.0):
    """Per iteration: ``(bucket means, residuals per rank by name, skipped, velocities)``; ``None`` means for
    dense ones. With ``momentum``, ``u = momentum * u + g`` takes the gradient's place (dense iterations
    send it) and is cleared where this rank's residual was spent (sent by it, not put back)."""
    zeros = {n: torch.zeros(math.prod(s)) for n, s in HT_PARAMS.items()}
    residuals, velocities = [dict(zeros) for _ in range(world)], [dict(zeros) for _ in range(world)]
    out = []
    for it in range(HT_ITERS):
        new, new_u = [dict(r) for r in residuals], [dict(u) for u in velocities]
        means = []
        for names in HT_LAYOUT:
            grads = [torch.cat([ht_grad(r, it, n, world) for n in names]) for r in range(world)]
            if momentum:
                grads = [torch.add(g, _cat(velocities[r], names), alpha=momentum) for r, g in enumerate(grads)]
                for r in range(world):
                    new_u[r].update(_split(grads[r], names))
            if it < HT_WARMUP:
                continue
            accs = [g + _cat(residuals[r], names) for r, g in enumerate(grads)]
            # A parameter whose gradient is all zero on a rank is held back: not sent, residual kept.
            keeps = [torch.cat([(ht_grad(r, it, n, world) != 0).any().expand(math.prod(HT_PARAMS[n])) for n in names])
                     for r in range(world)]  # fmt: skip
            eligible = [torch.where(m, a, 0.0) for m, a in zip(keeps, accs)]
            mean, res, _ = tree_reference(eligible, _k(names))
            means.append(mean)
            for r in range(world):
                flat = torch.where(keeps[r], res[r], accs[r])
                new[r].update(_split(flat, names))
                if momentum:
                    spent = ft.topk_mask(eligible[r], _k(names)) & keeps[r] & (flat == 0)
                    new_u[r].update(_split(torch.where(spent, 0.0, grads[r]), names))
        bad = it == HT_BAD[0]
        residuals, velocities = (residuals, velocities) if bad else (new, new_u)
        out.append((means or None, [dict(r) for r in residuals], bad, [dict(u) for u in velocities]))
    return out


def _k(names) -> int:
    k = k_from_density(HT_DENSITY, sum(math.prod(HT_PARAMS[n]) for n in names))
    assert isinstance(k, int)
    return k


@pytest.mark.parametrize("gname", GROUPS)
def test_tree_hook_equals_the_reference_bitwise_on_every_rank(tree_run, gname):
    world = TREE_GROUPS[gname]
    got = [_hook(tree_run, gname, r)["iters"] for r in range(world)]
    skipped = 0
    for it, (means, residuals, bad, _) in enumerate(_expected(world)):
        skipped += bad
        for r in range(world):
            step = got[r][it]
            assert step["skipped"] == skipped, (it, r)
            for name, res in residuals[r].items():
                saved = step["residuals"].get(name, torch.zeros(HT_PARAMS[name]))  # zero ones saved after warm-up
                assert saved.shape == HT_PARAMS[name]
                assert torch.equal(bits(saved.reshape(-1)), bits(res)), (it, r, name)
            if means is None:  # dense warm-up: the same on every rank, the mean up to rounding
                grads = [torch.cat([ht_grad(q, it, n, world) for n in HT_LAYOUT[0]]) for q in range(world)]
                torch.testing.assert_close(step["buckets"][0], sum(grads) / world)
                assert torch.equal(bits(step["buckets"][0]), bits(got[0][it]["buckets"][0]))
            elif bad:  # the Inf reaches every rank's bucket; every residual stayed as it was
                assert not torch.isfinite(step["buckets"][1]).all(), (it, r)
            else:
                for b, mean in enumerate(means):
                    assert torch.equal(bits(step["buckets"][b]), bits(mean)), (it, r, b)


@pytest.mark.parametrize("gname", GROUPS)
def test_tree_hook_conserves_mass(tree_run, gname):
    """``P * update + sum of new residuals = sum of (grads + old residuals)`` in every compressed iteration."""
    world = TREE_GROUPS[gname]
    got = [_hook(tree_run, gname, r)["iters"] for r in range(world)]
    for it in range(HT_WARMUP + 1, HT_ITERS):
        if it == HT_BAD[0]:
            continue
        for names in HT_LAYOUT:
            b = HT_LAYOUT.index(names)
            before = sum(_cat(got[r][it - 1]["residuals"], names).double() + torch.cat(
                [ht_grad(r, it, n, world) for n in names]).double() for r in range(world))  # fmt: skip
            after = world * got[0][it]["buckets"][b].double() + sum(
                _cat(got[r][it]["residuals"], names).double() for r in range(world))  # fmt: skip
            torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
            assert torch.count_nonzero(got[0][it]["buckets"][b]) <= _k(names)


@pytest.mark.parametrize("gname", GROUPS)
def test_a_parameter_with_an_all_zero_gradient_keeps_its_residual(tree_run, gname):
    """``find_unused_parameters``: the held-back parameter's residual is its old one (not sent, not zeroed)."""
    it, rank, name = HT_UNUSED
    steps = _hook(tree_run, gname, rank)["iters"]
    old = steps[it - 1]["residuals"][name]
    assert torch.count_nonzero(old) > 0 and torch.equal(bits(steps[it]["residuals"][name]), bits(old))


@pytest.mark.parametrize("gname", GROUPS)
def test_tree_hook_stats_count_the_bytes_on_the_wire(tree_run, gname):
    world = TREE_GROUPS[gname]
    for r in range(world):
        for it, step in enumerate(_hook(tree_run, gname, r)["iters"]):
            stats = step["last_step"]
            if it < HT_WARMUP:
                assert stats.bytes_sent == stats.bytes_dense == 4 * 70 and step["wire"] == (0, 0)
                continue
            sent = received = 0
            for names in HT_LAYOUT:
                n = sum(math.prod(HT_PARAMS[p]) for p in names)
                s, g = tree_wire_bytes(_k(names), n, torch.float32, world, r)
                sent, received = sent + s, received + g
            assert (stats.bytes_sent, stats.bytes_gathered) == (sent, received) == step["wire"], (it, r)
            assert stats.coords_sent == sum(_k(names) for names in HT_LAYOUT) and stats.coords == 70
            if world & (world - 1) == 0:
                assert sent == int(math.log2(world)) * stats.coords_sent * 8


@pytest.mark.parametrize("gname", GROUPS)
def test_ranks_with_different_exchanges_fail_naming_the_field(tree_run, gname):
    for r in range(TREE_GROUPS[gname]):
        assert "exchange" in _hook(tree_run, gname, r)["mismatch"]


def test_tree_hook_trains_ddp_and_keeps_replicas_identical(tree_run):
    """DDP (several buckets, P = 3: a surplus rank) with the tree hook: replicas stay bit-identical, loss falls."""
    world = TREE_GROUPS[HT_DDP_GROUP]
    got = [tree_run.results[r][HT_DDP_GROUP]["ddp"]["steps"] for r in range(world)]
    for step in range(HT_DDP_STEPS):
        for r in range(1, world):
            assert torch.equal(bits(got[r][step]["params"]), bits(got[0][step]["params"])), (step, r)
        for r in range(world):
            cur = got[r][step]
            assert cur["skipped"] == 0
            if step >= HT_DDP_WARMUP:  # DDP rebuilt its buckets after the first step
                assert len(cur["sizes"]) >= 2, cur["sizes"]
                ks = [k_from_density(HT_DDP_DENSITY, n) for n in cur["sizes"]]
                wire = [tree_wire_bytes(k, n, torch.float32, world, r) for k, n in zip(ks, cur["sizes"])]
                assert cur["wire"] == tuple(map(sum, zip(*wire))) == cur["last_step"][:2], (step, r)
    losses = [s["loss"] for s in got[0]]
    assert losses[-1] < losses[0], losses


def test_exchange_argument_is_checked():
    with pytest.raises(ValueError, match="exchange"):
        TopKHookState(exchange="ring")
    with pytest.raises(TypeError, match="exchange"):
        TopKHookState(exchange=None)  # type: ignore[arg-type]
    assert "exchange='tree'" in repr(TopKHookState(exchange="tree"))


@pytest.mark.parametrize("gname", GROUPS)
def test_tree_hook_with_momentum_correction_equals_the_reference_bitwise(tree_run, gname):
    """TopKHookState(momentum=...) with the tree: velocities and residuals through warm-up, a save and load,
    a held-back parameter and an Inf, bit for bit against the reference on every rank."""
    world = TREE_GROUPS[gname]
    got = [_hook(tree_run, gname, r)["mc_iters"] for r in range(world)]
    for it, (means, residuals, bad, velocities) in enumerate(_expected(world, HT_MOMENTUM)):
        for r in range(world):
            step = got[r][it]
            for key, expected_memory in (("residuals", residuals[r]), ("velocities", velocities[r])):
                for name, expected in expected_memory.items():
                    saved = step[key][name]
                    assert torch.equal(bits(saved.reshape(-1)), bits(expected)), (it, r, name)
            if means is not None and not bad:
                for b, mean in enumerate(means):
                    assert torch.equal(bits(step["buckets"][b]), bits(mean)), (it, r, b)
    assert any(t.abs().sum() > 0 for t in got[0][-1]["velocities"].values())
