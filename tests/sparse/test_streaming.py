"""StreamingTopK: the selection made during backward is ft.topk_indices on the dense gradients, bit for bit."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse import KernelConfig, StreamingTopK
from tests.helpers import bits, to_device, trees_st

# the eager exact kernel's sampled scan on tiny leaves (its production constants need 2**16 coordinates)
SCAN = KernelConfig(exact_min_numel=0, segment=24, sample_size=8, band_min=4)


def assert_same_sparse(got: ft.SparseUpdates, expected: ft.SparseUpdates, nan_payload: bool = True) -> None:
    """Bit for bit; with ``nan_payload=False``, a NaN's payload bits aside (StreamingTopK's docstring says when)."""
    assert got.numel == expected.numel and got.sizes == expected.sizes
    assert got.indices.device == expected.indices.device and got.values.device == expected.values.device
    assert torch.equal(got.indices, expected.indices)
    assert got.values.dtype == expected.values.dtype
    g, e = got.values.cpu(), expected.values.cpu()
    if not nan_payload:
        assert torch.equal(g.isnan(), e.isnan())
        g, e = g[~g.isnan()], e[~e.isnan()]
    assert torch.equal(bits(g), bits(e))


def as_params(grads):
    """Zero parameters shaped like ``grads`` (None stays None)."""
    return optree.tree_map(lambda g: torch.zeros_like(g, requires_grad=True), grads)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))  # never gets a gradient
    return model


def mlp_loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    return (model(x) - y).square().mean()


def dense_grads(model: torch.nn.Module, seeds=(0,)):
    """The gradients of the same steps without a stream (None where a parameter has none)."""
    for seed in seeds:
        mlp_loss(model, seed).backward()
    return {name: p.grad for name, p in model.named_parameters()}


# --------------------------------------------------------------------------- properties


def test_a_nan_through_a_wider_dtype_without_gradient_is_nan_at_its_index():
    """The documented exception: a float64 parameter without a gradient; a float16 NaN goes through float64."""
    grads = {"h": torch.tensor([float("nan"), 1.0], dtype=torch.float16), "w": torch.tensor([0.5, -2.0])}
    params = {**as_params(grads), "wide": torch.zeros(3, dtype=torch.float64, requires_grad=True)}
    stream = StreamingTopK(params, k=2)
    for name in ("h", "w"):
        params[name].backward(grads[name])
    assert_same_sparse(stream.result(), ft.topk_indices({**grads, "wide": None}, 2), nan_payload=False)


@settings(max_examples=25)
@given(tree=trees_st(allow_nonfinite=True), data=st.data())
def test_equals_topk_indices_in_any_finishing_order(device, tree, data):
    """Random trees (ties, NaN, ±inf, zero-size, mixed dtypes), leaves without a gradient, k, density, tensor k."""
    leaves, treedef = optree.tree_flatten(to_device(tree, device))
    has_grad = data.draw(st.lists(st.booleans(), min_size=len(leaves), max_size=len(leaves)), label="has_grad")
    order = data.draw(st.permutations(range(len(leaves))), label="order")
    config = data.draw(st.sampled_from([None, SCAN]), label="config")
    params = [torch.zeros_like(g, requires_grad=True) for g in leaves]
    seen = optree.tree_unflatten(treedef, [g if on else None for g, on in zip(leaves, has_grad)])
    n_all, n_seen = sum(g.numel() for g in leaves), sum(g.numel() for g, on in zip(leaves, has_grad) if on)
    if n_all == 0:
        with pytest.raises(ValueError, match="params has no coordinates"):
            StreamingTopK(params, k=1)
        return
    kind = data.draw(st.sampled_from(["k", "density", "tensor"]), label="kind")
    count = data.draw(st.integers(1, max(n_seen, 1)), label="k")
    density = data.draw(st.floats(1e-3, 1.0), label="density")
    args = {"k": count} if kind == "k" else {"density": density} if kind == "density" else {"k": torch.tensor(count)}
    stream = StreamingTopK(optree.tree_unflatten(treedef, params), **args, config=config)
    for i in order:  # each leaf's gradient arrives alone, in a drawn order
        if has_grad[i]:
            params[i].backward(leaves[i])
            assert params[i].grad is None
    if n_seen == 0:
        with pytest.raises(ValueError, match="the gradients has no coordinates"):
            stream.result()
        return
    ref_k = args["k"] if "k" in args else ft.sparse.k_from_density(density, n_seen)
    # NaN payloads are kept when the gradients that arrived promote to the dtype of all of params
    widest = functools.reduce(torch.promote_types, [g.dtype for g in leaves])
    arrived = functools.reduce(torch.promote_types, [g.dtype for g, on in zip(leaves, has_grad) if on])
    assert_same_sparse(stream.result(), ft.topk_indices(seen, ref_k), nan_payload=arrived == widest)
    stream.remove()


@pytest.mark.parametrize("config", [None, SCAN], ids=["default", "scan"])
def test_a_tie_with_the_kth_magnitude_goes_to_the_lower_index_folded_later(config):
    """Once k are held, a later leaf is scanned for |g| >= the k-th magnitude: equal ones may still win by index."""
    grads = [torch.tensor([2.0, -5.0, 1.0]), torch.tensor([5.0, 0.5]), torch.tensor([-5.0, 5.0, 3.0, 5.0])]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for k in (1, 2, 3, 4):
        stream = StreamingTopK(params, k=k, config=config)
        for i in (2, 1, 0):  # the highest indices first: they fill the k, then lose their ties
            params[i].backward(grads[i])
        assert_same_sparse(stream.result(), ft.topk_indices(grads, k))
        stream.remove()


@pytest.mark.parametrize("k", [1, 10, None, "n"], ids=["k=1", "k=10", "density", "k=n"])
def test_mlp_backward_frees_every_gradient_and_holds_one_at_a_time(k):
    """A real backward: autograd finishes the last layer first; one gradient alive per hook, O(k) candidates."""
    model, reference = mlp(), mlp()
    params = dict(model.named_parameters())
    sizes = [p.numel() for name, p in params.items() if name != "unused"]
    k = sum(sizes) if k == "n" else k
    live, order = [], []

    def measure(p):  # registered before the stream's hook: sees the gradient before it is folded
        order.append(next(name for name, q in params.items() if q is p))
        live.append((sum(q.grad.numel() for q in params.values() if q.grad is not None), stream.nbytes))

    for p in params.values():
        p.register_post_accumulate_grad_hook(measure)
    stream = StreamingTopK(params, k=k, density=None if k else 0.1)
    mlp_loss(model).backward()
    assert all(p.grad is None for p in params.values())
    assert order[0].startswith("2.") and order != [name for name in params if name != "unused"]  # not tree order
    k_run = k or ft.sparse.k_from_density(0.1, sum(p.numel() for p in params.values()))
    assert max(g for g, _ in live) == max(sizes)  # one gradient at a time, never two
    assert max(b for _, b in live) <= 3 * k_run * (8 + 4)  # at most 3k candidates: int64 indices, fp32 values
    expected = ft.topk_indices(dense_grads(reference), k or ft.sparse.k_from_density(0.1, sum(sizes)))
    assert_same_sparse(stream.result(), expected)
    stream.remove()  # (measure, a hook the parameters hold, holds the stream: a cycle through autograd's C++)


def test_training_step_with_apply_sparse_updates_matches_dense_selection():
    """Three SGD steps on the selected coordinates equal the same steps selected from dense gradients."""
    model, reference = mlp(), mlp()
    params, ref_params = dict(model.named_parameters()), dict(reference.named_parameters())
    with StreamingTopK(params, density=0.2) as stream:
        for seed in range(3):
            mlp_loss(model, seed).backward()
            sparse = stream.result()
            assert stream.selected_from["unused"] is None and stream.selected_from["0.bias"] is params["0.bias"]
            ft.apply_sparse_updates_(stream.selected_from, sparse, -0.1)
            sparse = ft.topk_indices(dense_grads(reference, (seed,)), stream_k(ref_params))
            ft.apply_sparse_updates_({**ref_params, "unused": None}, sparse, -0.1)
            reference.zero_grad(set_to_none=True)
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name


def stream_k(params):
    """The k that density 0.2 gives over the parameters that get a gradient (all but "unused")."""
    return ft.sparse.k_from_density(0.2, sum(p.numel() for name, p in params.items() if name != "unused"))


# --------------------------------------------------------------------------- accumulation, repeats, scaling


def test_gradient_accumulation_under_paused_selects_from_the_sum():
    model, reference = mlp(), mlp()
    params = dict(model.named_parameters())
    stream = StreamingTopK(params, k=7)
    with stream.paused():
        mlp_loss(model, 0).backward()
    assert params["0.weight"].grad is not None  # kept for accumulation
    mlp_loss(model, 1).backward()
    assert all(p.grad is None for p in params.values())
    assert_same_sparse(stream.result(), ft.topk_indices(dense_grads(reference, (0, 1)), 7))


def test_result_folds_gradients_left_by_paused_backward_passes():
    """A parameter used only in an earlier micro-batch is not lost: result() folds every .grad still set."""
    a, b = torch.tensor([1.0, -5.0], requires_grad=True), torch.tensor([2.0], requires_grad=True)
    stream = StreamingTopK({"a": a, "b": b}, k=2)
    with stream.paused():
        (a * a).sum().backward()  # only a, kept
    (3.0 * b).sum().backward()  # only b, folded
    sparse = stream.result()
    assert a.grad is None and b.grad is None
    assert_same_sparse(sparse, ft.topk_indices({"a": torch.tensor([2.0, -10.0]), "b": torch.tensor([3.0])}, 2))


def test_a_second_backward_before_result_raises():
    model = mlp()
    stream = StreamingTopK(dict(model.named_parameters()), k=3)
    mlp_loss(model).backward()
    with pytest.raises(RuntimeError, match=r"second gradient of .* before result\(\)"):
        mlp_loss(model).backward()
    model.zero_grad(set_to_none=True)
    mlp_loss(model).backward()  # the step run again
    assert stream.result().indices.numel() == 3


def test_result_ends_the_step():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    stream = StreamingTopK([w], k=1)
    (w * w).sum().backward()
    assert stream.result().indices.tolist() == [1]
    with pytest.raises(ValueError, match="no coordinates"):
        stream.result()
    (w * w).sum().backward()  # the next step
    assert stream.result().values.tolist() == [-4.0]


def test_scaled_loss_selects_the_same_coordinates_and_nonfinite_values_are_seen():
    """GradScaler's power-of-two scale: same indices, values scaled exactly; a NaN anywhere is in the selection."""
    model, reference = mlp(), mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    stream = StreamingTopK(dict(model.named_parameters()), k=9)
    scaler.scale(mlp_loss(model)).backward()
    scaled = stream.result()
    expected = ft.topk_indices(dense_grads(reference), 9)
    assert torch.equal(scaled.indices, expected.indices)
    assert torch.equal(scaled.values / scaler.get_scale(), expected.values)
    w = torch.zeros(1000, requires_grad=True)
    stream = StreamingTopK([w], k=3)
    grad = torch.randn(1000)
    grad[617] = math.nan
    w.backward(grad)
    assert not torch.isfinite(stream.result().values).all()


def test_remove_and_context_manager_leave_gradients_alone():
    w = torch.ones(3, requires_grad=True)
    with StreamingTopK([w], k=1):
        w.sum().backward()
        assert w.grad is None
    w.sum().backward()
    assert torch.equal(w.grad, torch.ones(3))
    v = torch.ones(2, requires_grad=True)
    stream = StreamingTopK([v], k=1)
    stream.remove()
    v.sum().backward()
    assert v.grad is not None


def test_frozen_parameters_are_skipped():
    """requires_grad=False and None nodes count as leaves without a gradient."""
    w, frozen = torch.tensor([1.0, 4.0], requires_grad=True), torch.ones(3)
    stream = StreamingTopK({"frozen": frozen, "none": None, "w": w}, k=1)
    (w * w).sum().backward()
    assert_same_sparse(stream.result(), ft.topk_indices({"frozen": None, "none": None, "w": w.detach() * 2}, 1))


def test_values_take_the_dtype_of_the_gradients_that_arrived():
    """A float64 parameter without a gradient does not widen the float16 values (as topk_indices on the grads)."""
    h = torch.tensor([0.5, -3.0], dtype=torch.float16, requires_grad=True)
    wide = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    stream = StreamingTopK({"h": h, "wide": wide}, k=1)
    h.backward(torch.tensor([0.5, -3.0], dtype=torch.float16))
    assert_same_sparse(stream.result(), ft.topk_indices({"h": h.detach(), "wide": None}, 1))


DDP_RUN = """
import sys, torch, torch.distributed as dist, functopk as ft
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
ddp = torch.nn.parallel.DistributedDataParallel(model)
params = dict(model.named_parameters())
x = torch.randn(5, 4)
model(x).sum().backward()                  # the local gradients, without DDP and without a stream
local = ft.topk_indices({name: p.grad for name, p in params.items()}, 3)
model.zero_grad(set_to_none=True)
stream = ft.sparse.StreamingTopK(params, k=3)
with ddp.no_sync():
    ddp(x).sum().backward()
assert all(p.grad is None for p in params.values())
sparse = stream.result()
assert torch.equal(sparse.indices, local.indices) and torch.equal(sparse.values, local.values)
ddp(x).sum().backward()                    # synchronised: DDP writes the averaged gradients back
assert all(p.grad is not None for p in params.values())
try:
    stream.result()
except RuntimeError as error:
    assert "DDP is not supported" in str(error), error
    print("refused")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_is_refused_at_result_and_no_sync_selects_the_local_gradient(tmp_path):
    """In a fresh process (no process group in the pytest process): one gloo rank."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    script = tmp_path / "ddp_run.py"
    script.write_text(textwrap.dedent(DDP_RUN))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("refused")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda w: StreamingTopK(iter([w]), k=1), TypeError, "iterator"),
        (lambda w: StreamingTopK([w], k=1, density=0.5), ValueError, "exactly one of k or density"),
        (lambda w: StreamingTopK([w]), ValueError, "exactly one of k or density"),
        (lambda w: StreamingTopK([w], k=1.5), TypeError, "k must be an int"),
        (lambda w: StreamingTopK([w], k=4), ValueError, r"k=4 exceeds the number of coordinates in params \(3\)"),
        (lambda w: StreamingTopK([w], density=2.0), ValueError, r"density must be in \(0, 1\]"),
        (lambda w: StreamingTopK([w, w], k=1), ValueError, r"one tensor twice, at \[0\] and \[1\]"),
        (lambda w: StreamingTopK({"x": w * 2}, k=1), ValueError, r"\['x'\] is not a leaf of the autograd graph"),
        (lambda w: StreamingTopK([torch.ones(2, dtype=torch.int64)], k=1), TypeError, "dtype torch.int64"),
        (lambda w: StreamingTopK([w], k=1, config={}), TypeError, "config must be a functopk.sparse.KernelConfig"),
        (lambda w: StreamingTopK({}, k=1), ValueError, "params has no coordinates"),
    ],
)
def test_bad_input_raises_clearly(make, error, match):
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(error, match=match):
        make(w)
    w.sum().backward()
    assert w.grad is not None  # no hook left behind by a failed construction


def test_gather_copies_the_gradient_at_given_indices_zero_where_a_parameter_had_none():
    params = {
        "a": torch.zeros(3, requires_grad=True),
        "unused": torch.zeros(2, requires_grad=True),
        "b": torch.zeros(2, requires_grad=True),
    }
    stream = StreamingTopK(params, k=2)
    stream.gather(torch.tensor([1, 4, 5]))  # flat order: a, b, unused (sorted keys)
    ((params["a"] * torch.tensor([1.0, 2.0, 3.0])).sum() + (params["b"] * torch.tensor([4.0, 5.0])).sum()).backward()
    assert all(p.grad is None for p in params.values())
    got = stream.result()
    assert torch.equal(got.indices, torch.tensor([1, 4, 5])) and torch.equal(got.values, torch.tensor([2.0, 5.0, 0.0]))
    assert got.numel == 7 and got.sizes == (3, 2, 2)
    (params["a"].sum() * 2).backward()  # back to selecting
    assert torch.equal(stream.result().indices, torch.tensor([0, 1]))
    stream.remove()


def test_gather_checks_its_indices_and_comes_before_the_backward():
    w = torch.zeros(4, requires_grad=True)
    stream = StreamingTopK({"w": w}, k=2)
    for bad, error, match in [
        (torch.tensor([1.0]), TypeError, "int64 or int32"),
        (torch.tensor([[1]]), ValueError, "1-d"),
        (torch.tensor([2, 1]), ValueError, "strictly ascending"),
        (torch.tensor([1, 4]), ValueError, "lie in"),
    ]:
        with pytest.raises(error, match=match):
            stream.gather(bad)
    with stream.paused():
        w.sum().backward()
    stream.result()
    stream.remove()
    w2 = torch.zeros(4, requires_grad=True)
    stream2 = StreamingTopK([w, w2], k=1)
    hook = w2.register_post_accumulate_grad_hook(lambda p: stream2.gather(torch.tensor([0])))
    with pytest.raises(RuntimeError, match="before the step's backward"):
        (w.sum() + w2.sum()).backward()
    hook.remove()
    stream2.remove()
