"""functopk._checks: the one validator layer and its exception policy (TypeError for types, ValueError for values)."""

from __future__ import annotations

import importlib
import math
from typing import NamedTuple

import optree
import pytest
import torch

from functopk import _checks as C
from functopk._overlap import check_writable


def test_numbers_bools_ints():
    assert C.check_number(2, "x") == 2.0
    with pytest.raises(TypeError, match=r"lr must be a real number, got bool True"):
        C.check_number(True, "lr")
    with pytest.raises(TypeError, match="lr must be a real number, got str"):
        C.check_number("0.1", "lr")
    with pytest.raises(ValueError, match="lr must not be NaN"):
        C.check_number(math.nan, "lr")
    with pytest.raises(ValueError, match=r"b1 must be < 1.0, got 1.0"):
        C.check_number(1.0, "b1", minimum=0.0, below=1.0)
    with pytest.raises(ValueError, match=r"eps must be >= 0.0, got -1.0"):
        C.check_number(-1, "eps", minimum=0.0)
    assert C.check_int(3, "n", minimum=1) == 3
    with pytest.raises(TypeError, match="n must be an int, got float 3.0"):
        C.check_int(3.0, "n")
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        C.check_int(0, "n", minimum=1)
    with pytest.raises(TypeError, match="flag must be a bool, got int 1"):
        C.check_bool(1, "flag")


def test_hyperparams_accept_0d_float_tensors_unread():
    t = torch.tensor(-5.0)  # out of range, but reading it would be a host sync: accepted as it is
    assert C.check_hyperparam(t, "lr", minimum=0.0) is t
    expected = r"lr must be a real number or a 0-d float tensor, got a tensor of shape \(2,\)"
    with pytest.raises(TypeError, match=expected):
        C.check_hyperparam(torch.ones(2), "lr")
    # an int injected by inject_hyperparams arrives as int64 and is used as the float it stands for
    as_float = C.check_hyperparam(torch.tensor(0), "weight_decay")
    assert as_float.dtype == torch.float32 and as_float.item() == 0.0
    with pytest.raises(TypeError, match="0-d float tensor"):
        C.check_hyperparam(torch.tensor(True), "lr")
    sched = C.check_scalar_or_schedule(lambda c: 0.1, "lr")
    assert callable(sched)


@pytest.mark.parametrize(
    "k, density, exc, match",
    [
        (None, None, ValueError, "exactly one of k or density"),
        (3, 0.5, ValueError, "exactly one of k or density"),
        (0, None, ValueError, "k must be >= 1, got 0"),
        (2.0, None, TypeError, "k must be an int or a 0-d tensor, got float"),
        (True, None, TypeError, "k must be an int"),
        (None, 0.0, ValueError, r"density must be in \(0, 1\], got 0.0"),
        (None, math.nan, ValueError, r"density must be in \(0, 1\], got nan"),
        (None, "0.1", TypeError, "density must be a number"),
        (torch.ones(2), None, TypeError, "k must be an int or a 0-d real tensor"),
        (None, torch.tensor(1), TypeError, "density must be a number in \\(0, 1\\] or a 0-d float tensor"),
    ],
)
def test_k_or_density(k, density, exc, match):
    with pytest.raises(exc, match=match):
        C.check_k_or_density(k, density)


def test_k_or_density_accepts_tensors_and_schedules_where_allowed():
    assert C.check_k_or_density(5, None) == (5, None)
    assert C.check_k_or_density(None, 1) == (None, 1.0)
    t = torch.tensor(7)
    assert C.check_k_or_density(t, None)[0] is t
    with pytest.raises(TypeError, match="k must be an int, got a tensor"):
        C.check_k_or_density(t, None, allow_tensor=False)
    fn = lambda c: 3  # noqa: E731
    assert C.check_k_or_density(fn, None, allow_schedule=True)[0] is fn
    with pytest.raises(TypeError):
        C.check_k_or_density(fn, None)


def test_iterators_are_refused_with_the_named_parameters_hint():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"params must be a pytree.*dict\(model.named_parameters\(\)\)"):
        C.check_tree(model.parameters(), "params")
    with pytest.raises(TypeError, match="iterator"):
        C.check_leaves((x for x in [torch.ones(1)]), "updates")


def test_structure_errors_name_the_first_differing_path_only():
    big = {f"layer{i:02d}.weight": torch.zeros(1) for i in range(60)}
    other = dict(big)
    other["layer37.wieght"] = other.pop("layer37.weight")
    with pytest.raises(ValueError) as info:
        C.check_same_structure(big, other, name="updates", expected_name="params")
    msg = str(info.value)
    assert "layer37" in msg and len(msg) < 300, msg
    fewer = dict(big)
    del fewer["layer59.weight"]
    with pytest.raises(ValueError, match=r"59 leaves where 60 were expected; first missing: \['layer59.weight'\]"):
        C.check_same_structure(big, fewer, name="updates", expected_name="params")


def test_leaf_checks_name_the_path():
    with pytest.raises(TypeError, match=r"updates leaf at \['b'\]\[0\] is int 3; expected a torch.Tensor"):
        C.check_leaves({"a": torch.ones(1), "b": [3]}, "updates")
    with pytest.raises(TypeError, match=r"updates leaf at \['i'\] has dtype torch.int64; expected a floating-point"):
        C.check_leaves({"i": torch.ones(1, dtype=torch.int64)}, "updates", floating=True)
    leaves, treedef = C.check_leaves({"a": torch.ones(2, 3)}, "updates")
    expected = r"updates leaf at \['a'\] has shape \(1, 3\), but the trace has shape \(2, 3\)"
    with pytest.raises(ValueError, match=expected):
        C.check_shapes(treedef, [torch.ones(1, 3)], leaves, name="updates", expected_name="the trace")
    with pytest.raises(ValueError, match="several devices"):
        C.one_device([torch.ones(1), torch.ones(1, device="meta")], "tree")


def test_state_type_errors_say_whose_state_was_expected():
    class TraceState(NamedTuple):
        trace: object

    with pytest.raises(TypeError, match=r"state must be a TraceState \(the state trace's init returns\), got tuple"):
        C.check_state((1, 2), TraceState, "trace")
    with pytest.raises(ValueError, match="needs the parameters"):
        C.require_params(None, "adamw")


def test_first_difference_for_node_type_changes():
    a = optree.tree_structure({"x": (torch.ones(1),)})
    b = optree.tree_structure({"x": [torch.ones(1)]})
    assert "node types differ" in C.first_difference(a, b)


def test_check_choice_names_the_argument_and_the_allowed_values():
    assert C.check_choice("tree", "exchange", ("allgather", "tree")) == "tree"
    assert C.check_choice(None, "fn", (None, "a")) is None
    with pytest.raises(ValueError, match=r"^exchange must be one of \('allgather', 'tree'\), got str 'ring'$"):
        C.check_choice("ring", "exchange", ("allgather", "tree"))
    with pytest.raises(TypeError, match=r"^exchange must be one of \('allgather', 'tree'\), got NoneType None$"):
        C.check_choice(None, "exchange", ("allgather", "tree"))
    with pytest.raises(TypeError, match=r"^flag must be one of \(0, 1\), got bool True$"):
        C.check_choice(True, "flag", (0, 1))  # a bool is not the int 1


def _call(module: str, name: str, *args, **kwargs):
    """A call of ``module.name`` (imported when called: only its choice check is under test here)."""
    return lambda: getattr(importlib.import_module(module), name)(*args, **kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_call("functopk.distributed", "TopKHookState", selection="fast"),
         r"selection must be one of \('exact', 'threshold'\), got str 'fast'"),
        (_call("functopk.distributed", "distributed_topk", 1, exchange="fast"),
         r"exchange must be one of \('allgather', 'tree'\), got str 'fast'"),
        (_call("functopk.optim.muon", "muon", adjust_lr_fn="fast"),
         r"adjust_lr_fn must be one of \(None, 'original', .*\), got str 'fast'"),
        (_call("functopk.compress.layerwise", "layerwise_topk", 1, method="fast"),
         r"method must be one of \('exact', 'torch', 'approx', 'gaussian'\), got str 'fast'"),
        (_call("functopk.sparse.dispatch", "check_method", "fast"),
         r"method must be one of \('exact', 'torch', 'approx', 'gaussian'\), got str 'fast'"),
    ],  # fmt: skip
    ids=["topk_hook", "distributed_topk", "muon", "layerwise_topk", "dispatch"],
)
def test_every_choice_is_checked_with_one_message(call, message):
    """The five choice checks of the package share :func:`functopk._checks.check_choice`'s message."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        call()


def _element_offsets(t: torch.Tensor) -> set[int]:
    """Brute force: the storage offsets of ``t``'s elements."""
    size = t.untyped_storage().nbytes() // t.element_size()
    return set(torch.as_strided(torch.arange(size), t.shape, t.stride(), t.storage_offset()).flatten().tolist())


def test_check_writable_refuses_exactly_the_views_that_share_an_element():
    """Strided views of one buffer, drawn at random, against brute force over their elements' offsets."""
    import random

    rng = random.Random(0)
    base = torch.zeros(300)

    def view() -> torch.Tensor:
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        stride = [rng.choice([1, 2, 3, 5, 7, 10, 16]) for _ in shape]
        span = sum((n - 1) * s for n, s in zip(shape, stride))
        return torch.as_strided(base, shape, stride, rng.randint(0, 299 - span))

    refused = 0
    for _ in range(3000):
        a, b = view(), view()
        shares = bool(_element_offsets(a) & _element_offsets(b))
        try:
            check_writable([a, b], "params", lambda i: f"[{i}]")
        except ValueError as err:
            assert shares or "elements that share memory" in str(err), (a.stride(), b.stride())
            refused += shares
            continue
        assert not shares, (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(), b.storage_offset())
    assert refused > 100
    check_writable([base[::2], base[1::2]], "params", str)  # disjoint: passes
    with pytest.raises(ValueError, match=r"leaves at \[0\] and \[1\] share memory"):
        check_writable([base[::2], base[2::2]], "params", lambda i: f"[{i}]")


def test_check_writable_names_the_first_leaf_that_refuses_a_write():
    """An inference tensor and a self-overlapping one in either order: the error names the earlier leaf; empty
    leaves at one address share nothing."""
    with torch.inference_mode():
        frozen = torch.zeros(3)
    expanded, ok = torch.zeros(3).expand(2, 3), torch.zeros(3)
    with pytest.raises(ValueError, match=r"leaf at 1 has elements that share memory"):
        check_writable([ok, expanded, frozen], "params", str)
    with pytest.raises(ValueError, match=r"leaf at 1 is an inference tensor"):
        check_writable([ok, frozen, expanded], "params", str)
    base = torch.zeros(4)
    check_writable([base[2:2], base[2:2], base[:2], base[2:]], "params", str)


def test_check_writable_finds_a_shared_element_among_many_ranges():
    """Several views at once (a range that reaches past others it does not touch, then one it does): refused
    exactly when some pair shares an element (brute force), whatever the order of the leaves."""
    import random

    rng = random.Random(1)
    base = torch.zeros(400)
    refused = 0
    for _ in range(600):
        views = []
        for _ in range(rng.randint(3, 6)):
            step, n = rng.choice([1, 2, 3, 8]), rng.randint(1, 12)
            views.append(base[rng.randint(0, 399 - step * (n - 1)) :: step][:n])
        offsets = [_element_offsets(v) for v in views]
        shares = any(offsets[i] & offsets[j] for i in range(len(views)) for j in range(i))
        try:
            check_writable(views, "params", str)
        except ValueError:
            assert shares
            refused += 1
            continue
        assert not shares, [(v.storage_offset(), v.stride(), v.numel()) for v in views]
    assert 100 < refused < 550
    long, inside, touching = base[0:100:3], base[10:20:3], base[40:50]  # ``inside`` shares none with ``long``
    check_writable([long, inside], "params", str)
    with pytest.raises(ValueError, match=r"leaves at 0 and 2 share memory"):
        check_writable([long, inside, touching], "params", str)
