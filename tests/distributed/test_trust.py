"""What a DDP user relies on: non-finite steps, checkpoints, agreement across ranks, unused parameters.

The multi-process checks read the spawned run of ``conftest.py`` (phases in
``workers.py``); the resume-after-a-crash check of the DDP example under
``torchrun --max-restarts`` is in ``tests/test_demo.py``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from functopk.distributed import TopKHookState, distributed_topk
from tests.distributed.common import (
    AMP_BAD_STEP,
    AMP_STEPS,
    GROUPS,
    TX_BAD,
    TX_K,
    flat,
    hook_module,
    members,
    phase,
    reference_ef_topk,
    tx_grads,
)
from tests.helpers import bits

# --------------------------------------------------------------------------- 1. non-finite steps


@pytest.mark.parametrize("gname", GROUPS)
def test_distributed_topk_keeps_every_residual_through_a_nonfinite_step(run, gname):
    got = [phase(run, "transform", r)[(gname, "nonfinite")] for r in members(gname)]
    residuals = [torch.zeros(flat(tx_grads(0, 0)).numel(), dtype=torch.float64) for _ in members(gname)]
    for step in range(3):
        trees = [tx_grads(r, step) for r in members(gname)]
        if step == TX_BAD[0]:
            trees[1][TX_BAD[1]].view(-1)[TX_BAD[2]] = math.inf
        expected, new = reference_ef_topk([flat(t) for t in trees], residuals, TX_K, False)
        if step != TX_BAD[0]:
            residuals = new
        for r in members(gname):
            upd, st = flat(got[r][step]["updates"]), got[r][step]["state"]
            torch.testing.assert_close(upd.double(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)
            assert torch.equal(bits(upd), bits(flat(got[0][step]["updates"])))
            torch.testing.assert_close(st.residual.double(), residuals[r], rtol=1e-5, atol=1e-6)
            assert int(st.skipped) == (step >= TX_BAD[0])
    assert flat(got[0][TX_BAD[0]]["updates"]).isinf().any()  # the update still carries the Inf
    for r in members(gname):  # every rank, the one that sent the Inf and those that received it
        assert torch.equal(bits(got[r][TX_BAD[0]]["state"].residual), bits(got[r][TX_BAD[0] - 1]["state"].residual))


def test_amp_inf_on_one_rank_skips_exactly_the_steps_dense_ddp_skips(run):
    got = [phase(run, "amp", r) for r in (0, 1)]
    expected = [step != AMP_BAD_STEP for step in range(AMP_STEPS)]
    for r in (0, 1):
        for mode in ("dense", "topk", "topk_unaware"):
            assert [s["stepped"] for s in got[r][mode]] == expected, (r, mode)
        topk = got[r]["topk"]
        assert [s["skipped"] for s in topk] == [int(step >= AMP_BAD_STEP) for step in range(AMP_STEPS)]
        before, after = topk[AMP_BAD_STEP - 1]["residuals"], topk[AMP_BAD_STEP]["residuals"]
        assert sorted(before) == sorted(after) and any(t.abs().sum() > 0 for t in before.values())
        for name in before:  # the bad step left every bucket's residual as it was, on both ranks
            assert torch.equal(bits(before[name]), bits(after[name])), name
        assert torch.equal(bits(topk[-1]["params"]), bits(got[0]["topk"][-1]["params"]))
        # The skipped step leaves no trace: the same as never taking it (the residual, kept at the loss
        # scale, is rescaled exactly when the scale halves after the skip).
        skip = got[r]["topk_skip"]
        assert torch.equal(bits(topk[-1]["params"]), bits(skip[-1]["params"]))
        for name, t in topk[-1]["residuals"].items():
            assert torch.equal(bits(t), bits(skip[-1]["residuals"][name])), name


def test_amp_with_momentum_correction_skips_the_bad_step_without_a_trace(run):
    """The same with TopKHookState(momentum=0.9): velocities, like residuals, are kept, rescaled and restored."""
    got = [phase(run, "amp", r) for r in (0, 1)]
    for r in (0, 1):
        mc, skip = got[r]["mc"], got[r]["mc_skip"]
        assert [s["stepped"] for s in mc] == [step != AMP_BAD_STEP for step in range(AMP_STEPS)]
        assert [s["skipped"] for s in mc] == [int(step >= AMP_BAD_STEP) for step in range(AMP_STEPS)]
        before, after = mc[AMP_BAD_STEP - 1]["velocities"], mc[AMP_BAD_STEP]["velocities"]
        assert sorted(before) == sorted(after) and any(t.abs().sum() > 0 for t in before.values())
        for name in before:
            assert torch.equal(bits(before[name]), bits(after[name])), name
        assert torch.equal(bits(mc[-1]["params"]), bits(skip[-1]["params"]))
        assert torch.equal(bits(mc[-1]["params"]), bits(got[0]["mc"][-1]["params"]))
        assert not torch.equal(mc[-1]["params"], got[r]["topk"][-1]["params"])  # momentum did something
        for key in ("residuals", "velocities"):
            for name, t in mc[-1][key].items():
                assert torch.equal(bits(t), bits(skip[-1][key][name])), (key, name)


def test_amp_without_the_scaler_in_the_hook_replays_the_residual_at_the_old_scale(run):
    """The control of the test above: without grad_scaler=, the halved scale leaves the residual 2x too big."""
    for r in (0, 1):
        unaware, skip = phase(run, "amp", r)["topk_unaware"], phase(run, "amp", r)["topk_skip"]
        assert not torch.equal(unaware[-1]["params"], skip[-1]["params"])


# --------------------------------------------------------------------------- 2. checkpoints


def test_distributed_topk_state_dict_round_trips_by_leaf_path():
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(4)}
    tx = distributed_topk(2)
    state = tx.init(params)._replace(residual=torch.arange(10.0), count=torch.tensor(7), skipped=torch.tensor(1))
    saved = state.state_dict(params)
    assert sorted(saved["residual"]) == ["['b']", "['w']"]
    assert torch.equal(saved["residual"]["['w']"], torch.arange(4.0, 10.0).view(2, 3))
    f = io.BytesIO()
    torch.save(saved, f)
    f.seek(0)
    loaded = torch.load(f, weights_only=True)
    restored = tx.init(params).load_state_dict(loaded, params)
    assert torch.equal(restored.residual, state.residual) and int(restored.count) == 7 and int(restored.skipped) == 1
    assert torch.equal(saved["residual"]["['b']"], torch.arange(4.0))  # a copy: the state is untouched
    other = {"w": torch.zeros(2, 3), "x": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"missing \[\"\['x'\]\"\], unknown \[\"\['b'\]\"\]"):
        tx.init(other).load_state_dict(loaded, other)
    bigger = {"w": torch.zeros(2, 3), "b": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"of another size \[\"\['b'\]\"\]"):
        tx.init(bigger).load_state_dict(loaded, bigger)
    with pytest.raises(ValueError, match="not a DistributedTopKState.state_dict"):
        state.load_state_dict({"residual": {}}, params)
    with pytest.raises(ValueError, match="params have 9 coordinates but the state's residual has 10"):
        state.state_dict({"w": torch.zeros(9)})


def test_hook_state_dict_without_model_says_how_to_name_the_parameters(run):
    for gname in GROUPS:
        for r in members(gname):
            msg, _ = phase(run, "hook", r)[(gname, "anonymous")]
            assert msg.startswith("ValueError: TopKHookState.state_dict needs the parameters' names") and \
                "model=" in msg, msg  # fmt: skip


def test_hook_load_state_dict_checks_names_and_sizes():
    module = hook_module()
    fresh = TopKHookState(model=module).state_dict()
    assert fresh["residuals"] == {} and fresh["iter"] == 0 and fresh["format"] == "functopk.topk_hook"
    saved = dict(fresh, iter=12, residuals={"a": torch.ones(4, 5), "b": torch.ones(30)})
    state = TopKHookState(model=module)
    state.load_state_dict(saved)
    assert state.iter == 12 and sorted(state.state_dict()["residuals"]) == ["a", "b"]  # kept until placed
    with pytest.raises(ValueError, match=r"match no parameter of the model 'module\.a'"):
        TopKHookState(model=module).load_state_dict(dict(saved, residuals={"module.a": torch.ones(20)}))
    with pytest.raises(ValueError, match=r"shape differs from it 'c'"):
        TopKHookState(model=module).load_state_dict(dict(saved, residuals={"c": torch.ones(11)}))
    with pytest.raises(ValueError, match="needs the parameters' names"):
        TopKHookState().load_state_dict(saved)
    with pytest.raises(ValueError, match="not a TopKHookState.state_dict"):
        TopKHookState(model=module).load_state_dict({"iter": 3})


def test_hook_load_state_dict_with_velocities_needs_momentum_and_checks_them():
    module = hook_module()
    fresh = TopKHookState(model=module, momentum=0.9).state_dict()
    assert fresh["velocities"] == {} and fresh["momentum"] == 0.9
    saved = dict(fresh, residuals={"a": torch.ones(4, 5)}, velocities={"a": torch.full((4, 5), 2.0)})
    state = TopKHookState(model=module, momentum=0.9)
    state.load_state_dict(saved)
    again = state.state_dict()
    assert torch.equal(again["velocities"]["a"], saved["velocities"]["a"]) and sorted(again["residuals"]) == ["a"]
    no_momentum = TopKHookState(model=module)
    with pytest.raises(ValueError, match=r"holds momentum-correction velocities but this state has momentum=0"):
        no_momentum.load_state_dict(saved)
    assert no_momentum.iter == 0 and no_momentum.state_dict()["residuals"] == {}  # nothing half-loaded
    with pytest.raises(ValueError, match=r"velocities that match no parameter of the model 'z'"):
        TopKHookState(model=module, momentum=0.9).load_state_dict(dict(saved, velocities={"z": torch.ones(3)}))
    # A checkpoint saved without momentum correction loads into a state with it: velocities start at zero.
    plain = dict(TopKHookState(model=module).state_dict(), residuals={"a": torch.ones(4, 5)})
    switched = TopKHookState(model=module, momentum=0.9)
    switched.load_state_dict(plain)
    assert switched.state_dict()["velocities"] == {}


def test_hook_load_state_dict_checks_the_bucket_layout_before_changing_anything():
    module = hook_module()
    fresh = TopKHookState(model=module).state_dict()
    assert fresh["version"] == 2 and fresh["layout"] is None  # no iteration yet: DDP's buckets are not known
    state = TopKHookState(model=module)
    state.load_state_dict(dict(fresh, iter=5, layout=[["b", "a"], ["d", "c"]]))
    assert state.state_dict()["layout"] == [["b", "a"], ["d", "c"]]  # what the next iteration will use
    old = {k: v for k, v in fresh.items() if k not in ("layout", "version")}  # a checkpoint from before layouts
    state.load_state_dict(dict(old, version=1))
    assert state.state_dict()["layout"] is None
    for layout, exc, match in [("ab", TypeError, "list of lists of parameter names"),
                               ([["a", 3]], TypeError, "list of lists"),
                               ([["a", "zz"]], ValueError, r"does not have \['zz'\]"),
                               ([["a"], ["b", "a"]], ValueError, "a parameter twice")]:  # fmt: skip
        with pytest.raises(exc, match=match):
            state.load_state_dict(dict(fresh, iter=9, layout=layout))
        assert state.iter == 0
    with pytest.raises(ValueError, match=r"\(model=\) does not have"):
        TopKHookState().load_state_dict(dict(fresh, layout=[["a"]]))


def _same(a, b) -> bool:
    """Nested dicts/lists of tensors (compared bit for bit) and plain values, equal?"""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return type(a) is type(b) and a == b


def test_hook_load_state_dict_checks_every_key_before_changing_anything():
    """Each key of a saved state, missing or of a wrong type (or a wrong shape), raises an error naming it and
    leaves the loading state as it was: iteration count, statistics, residuals, velocities and layout."""
    module = hook_module()
    stats = {"bytes_sent": 8, "bytes_gathered": 16, "bytes_dense": 80, "coords_sent": 1, "coords": 10}
    good = dict(TopKHookState(model=module, momentum=0.5).state_dict(), iter=7, skipped_iters=1, last_step=stats,
                total=stats, residuals={"a": torch.ones(4, 5)}, velocities={"b": torch.ones(30)},
                layout=[["b", "a"], ["d", "c"]])  # fmt: skip
    state = TopKHookState(model=module, momentum=0.5)
    state.load_state_dict(dict(good, iter=3, residuals={"c": torch.full((10,), 2.0)}))
    before = state.state_dict()
    optional = {"momentum", "exchange", "velocities"}  # absent from checkpoints saved before they existed
    wrong = {"format": 1, "version": "2", "density": "0.1", "warmup_iters": 1.0, "reselect": 1, "momentum": "0",
             "exchange": 0, "iter": 7.0, "skipped_iters": None, "last_step": [8, 16, 80, 1, 10],
             "total": dict(stats, coords=1.5), "residuals": {"a": [1.0] * 20}, "velocities": {"b": torch.ones(30, 1)},
             "layout": "b a d c"}  # fmt: skip
    assert set(wrong) == set(good)  # every key of a state dict is tried
    for key in good:
        cases = [("wrong", dict(good, **{key: wrong[key]}))]
        if key not in optional:
            cases.append(("missing", {k: v for k, v in good.items() if k != key}))
        for how, bad in cases:
            with pytest.raises((TypeError, ValueError), match=key) as info:
                state.load_state_dict(bad)
            assert _same(state.state_dict(), before), (key, how, info.value)
    with pytest.raises(ValueError, match="unknown keys 'velocites'"):  # a misspelled key is no older checkpoint
        state.load_state_dict({("velocites" if k == "velocities" else k): v for k, v in good.items()})
    assert _same(state.state_dict(), before)
    state.load_state_dict(good)  # the good dict loads
    assert state.iter == 7 and state.skipped_iters == 1 and state.total.coords == 10
    assert sorted(state.state_dict()["velocities"]) == ["b"]


# --------------------------------------------------------------------------- 3. agreement across ranks


@pytest.mark.parametrize("gname", GROUPS)
@pytest.mark.parametrize(
    ("field", "detail"),
    [
        ("warmup_iters", "warmup_iters is 1 on rank 0 but 2 on rank 1"),
        ("reselect", "reselect is False on rank 0 but True on rank 1"),
        ("density", "density is 0.1 on rank 0 but 0.2 on rank 1"),
        ("exchange", "exchange is 'allgather' on rank 0 but 'tree' on rank 1"),
        ("tree", "the number of coordinates is 39 on rank 0 but 40 on rank 1"),
    ],
)
def test_ranks_configured_differently_all_fail_at_once_naming_the_field(run, gname, field, detail):
    for r in members(gname):
        msg, seconds = phase(run, "agreement", r)[(gname, field)]
        assert msg.startswith("ValueError: functopk.distributed:") and detail in msg, msg
        assert seconds < 5, f"rank {r} took {seconds:.1f} s"
        assert phase(run, "agreement", r)[(gname, "agree")][0] == "no error"


def test_a_long_text_setting_is_shown_where_the_ranks_differ():
    """A loaded bucket layout is a long text: the mismatch message shows both ranks' texts around the first
    character that differs, each cut to about 120 characters."""
    from functopk.distributed.agree import _excerpts

    names = [f"'layer{i}.weight'" for i in range(40)]
    texts = [f"(({', '.join(names[:30] + [tail] + names[30:])}),)" for tail in ("'head.bias'", "'head.weight'")]
    shown = _excerpts(texts, 0, 1)
    assert "'head.bias'" in shown[0] and "'head.weight'" in shown[1], shown
    assert all(t.startswith("...") and t.endswith("...") and len(t) <= 126 for t in shown), shown
    assert _excerpts(["'tree'", "'allgather'"], 0, 1) == ["'tree'", "'allgather'"]  # short texts whole


# --------------------------------------------------------------------------- 4. unused parameters


def conservation_error(got) -> dict[str, float]:
    """Per parameter, max |sum over ranks of (residual + mass sent and applied) - sum of gradients fed|."""
    errors = {}
    for name in got[0]["fed"]:
        assert torch.equal(got[0]["applied"][name], got[1]["applied"][name])  # replicas agree
        held = sum(g["residuals"][name] for g in got) + len(got) * got[0]["applied"][name]
        errors[name] = float((held - sum(g["fed"][name] for g in got)).abs().max())
    return errors


def test_find_unused_parameters_keeps_the_residual_of_unused_parameters(run):
    got = [phase(run, "unused", r)["model"] for r in (0, 1)]
    assert got[0]["find_unused"]
    errors = conservation_error(got)
    assert max(errors.values()) < 1e-8, errors
    for g in got:  # no rank used "right" at steps 4 and 5: its residual did not move
        for name in ("right.weight", "right.bias"):
            assert torch.equal(g["held"][3][name], g["held"][5][name]) and g["held"][3][name].abs().sum() > 0


@pytest.mark.parametrize("model_arg", ["no_model", "wrapped"])
def test_find_unused_parameters_without_the_ddp_model_fails_at_the_first_backward(run, model_arg):
    """Without model= (or with the module DDP wraps) the hook cannot hold the unused parameters' residuals
    back, and DDP would drop the gradient mass sent for them: every rank raises instead, before any exchange."""
    for r in (0, 1):
        msg, seconds = phase(run, "unused", r)[model_arg]
        assert msg.startswith("ValueError: topk_hook:") and "find_unused_parameters=True" in msg, msg
        assert "TopKHookState(..., model=ddp_model)" in msg and seconds < 5, (msg, seconds)


def test_reselect_puts_dropped_values_back_without_overwriting_a_held_back_residual():
    """gTop-k's put-back adds the dropped values: an index that named a held-back coordinate (an unused
    parameter's, sent as 0 because the bucket had fewer than k eligible values) keeps its residual."""
    from functopk.distributed.wire import reselect_

    residual = torch.tensor([0.0, 5.0, 0.0, 0.0])  # coordinate 1 is held back with residual 5; 0 and 2 were sent
    idx, vals = torch.tensor([0, 1, 2]), torch.tensor([3.0, 0.0, -1.0])
    total = torch.tensor([3.0, 0.0, -1.0, 0.5])  # the mean over ranks: its top 2 are coordinates 0 and 2
    total, residual = reselect_(total, idx, vals, residual, k=2)
    assert total.tolist() == [3.0, 0.0, -1.0, 0.0]
    assert residual.tolist() == [0.0, 5.0, 0.0, 0.0]
    total, residual = reselect_(torch.tensor([3.0, 0.0, -1.0, 2.0]), idx, vals, torch.tensor([0.0, 5.0, 0.0, 0.0]), 2)
    assert total.tolist() == [3.0, 0.0, 0.0, 2.0] and residual.tolist() == [0.0, 5.0, -1.0, 0.0]  # -1 dropped, back


# --------------------------------------------------------------------------- overlap


def test_overlap_takes_the_same_steps_as_the_backward_thread(run):
    """TopKHookState(overlap=True): several buckets, momentum correction, dense warm-up then top-k; the
    parameters equal those of the hook run on the backward thread, bit for bit, on both ranks."""
    from tests.distributed.common import OVERLAP_STEPS

    got = [phase(run, "overlap", r) for r in (0, 1)]
    for r in (0, 1):
        inline, offloaded = got[r][False], got[r][True]
        assert len(offloaded) == OVERLAP_STEPS and len(offloaded[-1]["sizes"]) >= 2
        assert offloaded[-1]["worker"] and not inline[-1]["worker"]  # the offloaded run used its worker thread
        for step in range(OVERLAP_STEPS):
            assert torch.equal(bits(offloaded[step]["params"]), bits(inline[step]["params"])), (r, step)
            assert torch.equal(bits(offloaded[step]["params"]), bits(got[0][True][step]["params"])), (r, step)
            assert offloaded[step]["last_step"] == inline[step]["last_step"]


def test_overlap_with_unused_parameters_keeps_the_collectives_in_order(run):
    """With find_unused_parameters=True DDP allreduces its used-parameter map after the last bucket: the
    offloaded run must not interleave with it (it would hang or mix up data); the result equals the inline run."""
    for r in (0, 1):
        inline, offloaded = phase(run, "unused", r)["model"], phase(run, "unused", r)["overlap"]
        for name, t in inline["applied"].items():
            assert torch.equal(bits(t), bits(offloaded["applied"][name])), name
        for name, t in inline["residuals"].items():
            assert torch.equal(bits(t), bits(offloaded["residuals"][name])), name
