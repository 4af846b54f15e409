"""``fsdp_topk`` on FSDP2 shards (2 and 4 forked gloo ranks) against single-process references.

The ranks (``fsdp_topk_workers.py``, the ``fsdp_run`` fixture of
``conftest.py``) record each result with its reference, computed from the
unsharded tensors: ``functopk.topk_indices`` on the full averaged gradient,
then ``torch.optim`` on an unsharded copy of the model.
"""

from __future__ import annotations

import pytest
import torch

from functopk.distributed import FSDPTopKState, fsdp_topk
from tests.distributed.common import DEATH_EXIT_CODE
from tests.distributed.fsdp_topk_workers import FSDP_STEPS, NAN_AT
from tests.helpers import assert_tree_bitwise_equal


def _rank(run, r: int) -> dict:
    res = run.results[r]
    assert "error" not in res, res["error"]
    return res


def test_the_runs_finished(fsdp_run):
    expected = [0, DEATH_EXIT_CODE] if fsdp_run.world == 2 else [0] * fsdp_run.world
    errors = [r.get("error") for r in fsdp_run.results]
    assert fsdp_run.exitcodes == expected, (fsdp_run.exitcodes, errors)


def test_exact_global_topk_with_ties_across_shards_and_a_nan(fsdp_run):
    for r in range(fsdp_run.world):
        ties = _rank(fsdp_run, r)["ties"]
        for case in ("ties", "nan"):
            assert_tree_bitwise_equal(ties[case]["got"], ties[case]["expected"])
            assert ties[case]["local_is_shard"]
        assert ties["ties"]["nonfinite_steps"] == 0
        assert ties["nan"]["nonfinite_steps"] == 1  # on every rank, not only the one holding the NaN
        assert torch.isnan(ties["nan"]["got"][NAN_AT[0]].view(-1)[NAN_AT[1]])


@pytest.mark.parametrize("how", ["chain", "adapter"])
def test_fsdp_training_equals_topk_of_the_full_gradient(fsdp_run, how):
    for r in range(fsdp_run.world):
        rec = _rank(fsdp_run, r)[how]
        assert len(rec["got"]) == FSDP_STEPS
        for got, expected in zip(rec["got"], rec["expected"]):
            # functopk's SGD or AdamW against torch's, which adds lr * update into the parameters with one fused
            # multiply-add where its CPU kernel vectorises (whether that rounds like functopk's separate multiply
            # and add depends on the CPU and the leaf's size): equal to the last bits; a coordinate selected
            # wrongly would be off by lr * g
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
        assert any(not torch.equal(a, b) for a, b in zip(rec["got"][0], rec["got"][-1]))


def test_grad_scaler_skips_the_step_with_an_inf_on_one_rank_on_every_rank(fsdp_run):
    for r in range(fsdp_run.world):
        amp = _rank(fsdp_run, r)["amp"]
        assert amp == {"changed": [True, False, True], "scales": [256.0, 128.0, 128.0]}, (r, amp)


def test_ranks_with_different_k_fail_naming_it(fsdp_run):
    for r in range(fsdp_run.world):
        msg = _rank(fsdp_run, r)["mismatch"]
        assert "fsdp_topk is configured differently" in msg and "k is 3 on rank 0 but 4 on rank 1" in msg, msg


def test_a_dead_rank_raises_naming_the_exchange(fsdp_run):
    if fsdp_run.world != 2:
        pytest.skip("the 2-rank run kills its rank 1")
    msg = fsdp_run.results[0]["death"]
    assert "candidate all-gather of fsdp_topk" in msg and "another rank probably died" in msg, msg


def test_plain_tensors_are_refused_naming_the_leaf():
    grads = {"w": torch.zeros(4, 2)}
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] is a plain tensor; fsdp_topk expects DTensors"):
        fsdp_topk(2).update(grads, FSDPTopKState(torch.tensor(0), torch.tensor(0)))
    with pytest.raises(ValueError, match="exactly one of k or density"):
        fsdp_topk()
    assert isinstance(fsdp_topk(density=0.5).init({"w": torch.zeros(4, 2, device="meta")}), FSDPTopKState)
