"""``compress_fsdp`` on real process groups against single-process references.

Two forkserver runs (``fsdp_compress_workers.py``): FSDP on 2 gloo ranks and
HSDP on a 2x2 mesh of 4. Every recorded reduction is checked against top-k
with error feedback computed here from the recorded inputs: the residual plus
what was sent equals what was fed, bit for bit, and the reduced shard equals
the mean of every rank's sent pairs. No process group is created in the pytest
process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import functopk as ft
from functopk.distributed.config import ExchangeConfig
from tests.distributed.common import DEATH_EXIT_CODE, FORKSERVER_PRELOAD, run_ranks
from tests.distributed.fsdp_compress_workers import BAD, DENSITY, STEPS, WATCHDOG_S, fsdpc_worker
from tests.helpers import bits


def _launch(tmp_path_factory, mode: str, world: int):
    out = tmp_path_factory.mktemp(f"fsdpc-{mode}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    codes = run_ranks(ctx, fsdpc_worker, lambda r: (r, world, mode, str(out / "store"), str(out)), world, WATCHDOG_S)
    results = [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return SimpleNamespace(results=results, exitcodes=codes)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _launch(tmp_path_factory, "fsdp", 2)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    return _launch(tmp_path_factory, "hsdp", 4)


def _reference(entries: list[dict], lo: int, size: int, ratio: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean over ranks of each one's top-k of ``input + residual`` (in fp64), sliced to ``[lo, lo+size)``,
    and each rank's new residual; a step with a non-finite value sent keeps the residuals."""
    sent, residuals = [], []
    for e in entries:
        acc = e["input"] + e["before"] * ratio  # fp32, as the comm forms it (ratio: a power of two, exact)
        k = ExchangeConfig(density=DENSITY).k_for(acc.numel())
        mask = ft.topk_mask(acc, k)
        sent.append(torch.where(mask, acc, 0.0))
        residuals.append(torch.where(mask, 0.0, acc))
    if not all(torch.isfinite(s).all() for s in sent):
        residuals = [e["before"] for e in entries]
    mean = sum(s.double() for s in sent) / len(entries)
    return mean[lo : lo + size], residuals


def _check_reductions(logs: list[list[dict]], offsets, size_of) -> int:
    """Check every recorded reduction against :func:`_reference`; the number checked."""
    checked = 0
    for j in range(len(logs[0])):
        entries = [log[j] for log in logs]
        assert len({(e["step"], e["unit"]) for e in entries}) == 1
        for r, e in enumerate(entries):
            acc = e["input"] + e["before"]
            mean, residuals = _reference(entries, offsets[r] * size_of(e), size_of(e))
            assert torch.equal(bits(e["after"]), bits(residuals[r])), (e["step"], e["unit"], r)
            if all(torch.isfinite(x["input"]).all() for x in entries):  # bit for bit: residual + sent == fed
                assert torch.equal(e["after"] + torch.where(e["after"] == 0, acc, 0.0), acc)
            torch.testing.assert_close(e["output"].double(), mean, rtol=1e-6, atol=1e-7, equal_nan=True)
            checked += 1
    return checked


def test_fsdp_reduced_shards_and_residuals_match_the_reference(fsdp_run):
    logs = [res["log"] for res in fsdp_run.results]
    assert len(logs[0]) == 2 * STEPS and all(e["op"].endswith("AVG") for e in logs[0])
    assert _check_reductions(logs, [0, 1], lambda e: e["output"].numel()) == 4 * STEPS
    bad = [e for e in logs[0] if (e["step"], e["unit"]) == (BAD[0], "0")][0]
    assert not torch.isfinite(bad["output"]).all()  # the Inf reaches the owner's reduced shard
    # Memory: a unit-sized residual per rank, twice the parameter shard on 2 ranks (7 rows padded to 8).
    res = fsdp_run.results[0]
    assert res["residual_numel"] == 48 + 32 and res["shard_numel"] == 4 * 5 + 4 + 2 * 7 + 2
    assert res["layout"]["residual/0"] == ((2, 48), ["S(0)"])


def test_fsdp_residuals_follow_the_loss_scale(fsdp_run):
    logs = [res["scaled_log"] for res in fsdp_run.results]
    assert [e["step"] for e in logs[0]] == [10, 10, 11, 11]
    for j in (2, 3):  # the second step's scale is half the first's
        entries = [log[j] for log in logs]
        for r, e in enumerate(entries):
            mean, residuals = _reference(entries, r * e["output"].numel(), e["output"].numel(), ratio=0.5)
            assert torch.equal(e["after"], residuals[r]) and e["before"].abs().sum() > 0
            torch.testing.assert_close(e["output"].double(), mean, rtol=1e-6, atol=1e-6)


def test_fsdp_grad_scaler_skips_the_step_with_an_inf_on_every_rank(fsdp_run):
    for res in fsdp_run.results:
        assert res["amp"] == [(False, False, 256.0), (True, True, 128.0)]


def test_compress_fsdp_rejects_bad_arguments():
    from torch import nn

    from functopk.distributed import compress_fsdp

    with pytest.raises(ValueError, match="density"):
        compress_fsdp(nn.Linear(2, 2), density=1.5)
    with pytest.raises(TypeError, match="k"):
        compress_fsdp(nn.Linear(2, 2), k=1.5)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        compress_fsdp("model", k=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no FSDP unit"):
        compress_fsdp(nn.Linear(2, 2), k=1)


def test_fsdp_resume_from_dcp_is_bitwise(fsdp_run):
    for r, res in enumerate(fsdp_run.results):
        for name, expected in res["through"].items():
            assert torch.equal(bits(res["resumed"][name]), bits(expected)), f"rank {r}: {name}"
        tail = [e for e in res["log"] if e["step"] >= 2]
        assert len(tail) == len(res["resumed_log"])
        for a, b in zip(tail, res["resumed_log"]):
            assert torch.equal(bits(a["output"]), bits(b["output"]))


def test_fsdp_fingerprint_mismatch_and_dead_rank(fsdp_run):
    for res in fsdp_run.results:
        assert "configured differently across ranks: density is 0.25 on rank 0 but 0.5 on rank 1" in res["mismatch"]
    assert fsdp_run.exitcodes == [0, DEATH_EXIT_CODE]
    dead = fsdp_run.results[0]
    assert "another rank probably died" in dead["dead"] and dead["dead_s"] < 15, dead


def test_hsdp_dense_in_shard_groups_sparse_across_replicas(hsdp_run):
    res = hsdp_run.results
    coords = [r["coords"] for r in res]
    assert res[0]["layout"]["residual/0"] == ((2, 48), ["S(0)", "S(1)"])
    for shard in (0, 1):
        ranks = [r for r in range(4) if coords[r][1] == shard]  # the replicas of one shard
        logs = [res[r]["log"] for r in ranks]
        assert _check_reductions(logs, [0, 0], lambda e: e["output"].numel()) == 2 * 2 * STEPS
        for a, b in zip(*logs):  # replicas reduce to identical shards
            assert torch.equal(bits(a["output"]), bits(b["output"]))
        for name, value in res[ranks[0]]["final"].items():
            if not name.isdigit():
                assert torch.equal(bits(value), bits(res[ranks[1]]["final"][name])), name
    for r in res:
        for name, value in r["reloaded"].items():
            assert torch.equal(bits(value), bits(r["final"][name]))
