"""What several test modules share: assertions, small models, drivers, and the compile check.

Everything a test compares against lives here or in the test itself: bit
patterns, tolerances, the canonical functional step, and
:func:`assert_compiles_like_eager`.
"""

from __future__ import annotations

import contextlib
import math

import optree
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn
from torch.func import grad
from torch.utils._python_dispatch import TorchDispatchMode

import functopk as ft

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (so NaN == NaN and -0.0 != 0.0)."""
    return x.contiguous().view(_INT_VIEW[x.dtype]) if x.dtype in _INT_VIEW else x


def bits_any_nan(x: torch.Tensor) -> torch.Tensor:
    """:func:`bits` with every NaN made the canonical quiet NaN.

    For values converted between float dtypes: the payload of a converted NaN
    depends on the hardware and the torch build (a float16 NaN becomes
    ``0x7fc00000`` on the CPU and ``0x7fffffff`` on a GPU).
    """
    return bits(torch.where(x.isnan(), torch.full((), float("nan"), dtype=x.dtype, device=x.device), x))


def assert_tree_bitwise_equal(a, b) -> None:
    """Same structure, shapes, dtypes, devices and bit patterns."""
    la, da = optree.tree_flatten(a)
    lb, db = optree.tree_flatten(b)
    assert da == db, f"structures differ: {da} vs {db}"
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        assert torch.equal(bits(x), bits(y)), f"values differ:\n{x}\n{y}"


def assert_tree_close(a, b, rtol: float = 1e-6, atol: float = 0.0) -> None:
    la, da = optree.tree_flatten(a)
    lb, db = optree.tree_flatten(b)
    assert da == db, f"structures differ: {da} vs {db}"
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@contextlib.contextmanager
def no_sync():
    """Every synchronising CUDA call (``.item()``, ``nonzero``, a device-to-host copy) is an error inside."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class CaptureBlockers(TorchDispatchMode):
    """Inside, the first op a CUDA graph could not capture as it is raises ``AssertionError`` naming it.

    Such an op reads a tensor on the host (``.item()``, ``bool(t)``, ``float(t)``: ``_local_scalar_dense``),
    has an output whose shape depends on the data (``nonzero``, boolean indexing, ``unique``: torch's own op
    tags), or mixes devices (a CPU tensor copied to the device or met by a device op, a device tensor copied
    to the host). CPU tensors show the first two; fake CUDA tensors (``FakeTensorMode``, no GPU needed) all
    three. What does not dispatch (a Triton launch, Python maths on sizes) is not seen.
    """

    DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(tag in func.tags for tag in self.DATA_DEPENDENT):
            raise AssertionError(f"{func} reads the device or has a data-dependent shape")
        out = func(*args, **kwargs)
        tensors = [x for x in optree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        devices = {x.device.type for x in tensors}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices: {sorted(devices)}")
        return out
class OpsSeen(TorchDispatchMode):
    """The names of the aten operators a block runs (``with OpsSeen() as seen: ...; seen.names``)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def force_accelerator_path(monkeypatch) -> None:
    """functopk's eager accelerator kernels on CPU tensors (foreach kernels, the momentum written in place, no
    sliced pass), for the tests that check those kernels' bits without a GPU."""
    monkeypatch.setattr(ft.tree.foreach, "eager_accelerator", lambda x: True)
    monkeypatch.setattr(ft.tree.chunked, "applies", lambda params: False)


def clone_tree(tree):
    return optree.tree_map(lambda x: x.clone(), tree)


def to_device(tree, device):
    """A copy of ``tree`` with every tensor leaf on ``device`` (bits, dtypes and ``None`` nodes kept).

    Device tests build their inputs on the CPU, move them with this, and compare
    the outputs with ``to_device(out, "cpu")`` against CPU references.
    """
    return optree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def small_cnn(num_classes: int = 3) -> nn.Module:
    """A CNN with BatchNorm, small enough for fast (and compiled) tests."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, num_classes),
    )


def batch(n: int = 8, size: int = 8, num_classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.randint(0, num_classes, (n,), generator=g)


def make_step(model_fn, tx, *, autocast: torch.dtype | None = None):
    """The canonical functional training step: grad -> update -> apply (the forward pass under ``autocast``)."""

    def loss_fn(params, buffers, x, y):
        # cache_enabled=False: autocast's cache of cast weights must not outlive a CUDA graph capture
        cast = torch.autocast(x.device.type, autocast, cache_enabled=False) if autocast else contextlib.nullcontext()
        with cast:
            out, new_buffers = model_fn(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    def step(params, buffers, opt_state, x, y):
        grads, buffers = grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ft.apply_updates(params, updates), buffers, opt_state

    return step


TOPK_STEPS = {
    "topk-sgd-momentum": lambda topk: ft.chain(topk, ft.sgd(0.1, momentum=0.9)),
    "momentum-topk": lambda topk: ft.chain(
        ft.trace(0.9), topk, ft.scale_by_learning_rate(lambda count: 0.1 * 0.9**count)
    ),
    "topk-adamw": lambda topk: ft.chain(topk, ft.adamw(0.01, weight_decay=0.1)),
}
"""The top-k training steps a CUDA graph must capture, around a given ``ft.topk(...)``: SGD with momentum after
the selection, momentum before it with a scheduled learning rate, and AdamW."""


def captured_step(step, carry, batch, *, warmup: int = 2):
    """``carry = step(*carry, *batch)`` captured in a CUDA graph: ``(graph, carry, batch)``, with static copies.

    Each ``graph.replay()`` runs one step on the static tensors and writes the new carry into them (the copies
    are captured too); copy each new batch into the static ``batch`` first. The warm-up calls (on a side
    stream, as ``torch.cuda.graph`` asks) drop their results: the step is pure, so the carry stays as given.
    """
    carry, batch = optree.tree_map(torch.clone, (carry, batch))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step(*carry, *batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new = step(*carry, *batch)
        for old, fresh in zip(optree.tree_leaves(carry), optree.tree_leaves(new)):
            old.copy_(fresh)
    return graph, carry, batch


def assert_compiles_like_eager(
    fn, calls, *, rtol: float = 1e-6, atol: float = 1e-7, bitwise: bool = False, backend: str = "inductor"
):
    """Compile ``fn`` with ``fullgraph=True`` and check it against eager over a sequence of calls.

    ``calls`` is a list of argument tuples. Each call's output must equal the
    eager output (bit for bit with ``bitwise``, else to ``rtol``/``atol``); the
    calls after the first must not recompile (``error_on_recompile``). Returns
    the compiled outputs. Callers reset dynamo first (the ``fresh_dynamo`` fixture).
    ``backend="aot_eager"`` checks the graph capture (no break, no recompile)
    without inductor's code generation, at a fraction of the compile time.
    """
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    outs = []
    for i, args in enumerate(calls):
        expected = fn(*args)
        if i == 0:
            got = compiled(*args)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled(*args)
        if bitwise:
            assert_tree_bitwise_equal(got, expected)
        else:
            assert_tree_close(got, expected, rtol=rtol, atol=atol)
        outs.append(got)
    return outs


# --------------------------------------------------------------------------- references and strategies

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 1, 2), (4, 0), (7,), (2, 2, 2), (9, 5), (33,)]
TIE_VALUES = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.0]




def reference_mask(tree, k):
    """Brute force: rank every coordinate by (-|x| with NaN as inf, flat index) with a Python sort."""
    leaves, treedef = optree.tree_flatten(tree)
    mags = []
    for leaf in leaves:
        for v in leaf.reshape(-1).double().tolist():
            mags.append(math.inf if math.isnan(v) else abs(v))
    order = sorted(range(len(mags)), key=lambda i: (-mags[i], i))
    keep = torch.zeros(len(mags), dtype=torch.bool)
    keep[order[:k]] = True
    out, start = [], 0
    for leaf in leaves:
        out.append(keep[start : start + leaf.numel()].reshape(leaf.shape))
        start += leaf.numel()
    return optree.tree_unflatten(treedef, out)


def reference_sparsify(tree, k):
    mask = reference_mask(tree, k)

    def keep(x, m):
        y = x.clone()
        y[~m] = 0.0
        return y

    return optree.tree_map(keep, tree, mask)




@st.composite
def leaves_st(draw, dtype):
    shape = draw(st.sampled_from(SHAPES))
    n = math.prod(shape)
    values = draw(
        st.one_of(
            st.lists(st.sampled_from(TIE_VALUES), min_size=n, max_size=n),
            st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=16), min_size=n, max_size=n),
            st.lists(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=n, max_size=n),
        )
    )
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)


@st.composite
def trees_st(draw, allow_nonfinite=False, dtypes=tuple(FLOAT_DTYPES), max_leaves=20):
    """Random trees: 1-``max_leaves`` leaves, odd shapes, one or mixed ``dtypes``, nesting and None nodes."""
    num_leaves = draw(st.integers(1, max_leaves))
    mixed = draw(st.booleans())
    base_dtype = draw(st.sampled_from(dtypes))
    tree = {}
    for i in range(num_leaves):
        dtype = draw(st.sampled_from(dtypes)) if mixed else base_dtype
        leaf = draw(leaves_st(dtype))
        if allow_nonfinite and leaf.numel() and draw(st.booleans()):
            pos = draw(st.integers(0, leaf.numel() - 1))
            leaf.view(-1)[pos] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        kind = draw(st.integers(0, 2))
        tree[f"p{i:02d}"] = leaf if kind == 0 else (leaf,) if kind == 1 else {"w": leaf, "frozen": None}
    if draw(st.booleans()):  # all-zero gradients
        tree = optree.tree_map(torch.zeros_like, tree)
    return tree


def numel(tree):
    return sum(x.numel() for x in optree.tree_leaves(tree))


def ref_leaf_topk_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """Brute force for one leaf: sort by (-|x| with NaN as inf, index)."""
    vals = x.reshape(-1).double().tolist()
    mags = [math.inf if math.isnan(v) else abs(v) for v in vals]
    order = sorted(range(len(mags)), key=lambda i: (-mags[i], i))
    keep = torch.zeros(len(mags), dtype=torch.bool)
    keep[order[:k]] = True
    return keep.reshape(x.shape)


# --------------------------------------------------------------------------- the mixed tree of the contract tests

# every float dtype class (fp32 matrix, fp16 vector, 0-d scalar) and a frozen None leaf: 9 coordinates
MIXED = {
    "w": torch.tensor([[1.0, -2.0], [3.0, 0.5]]),
    "h": torch.tensor([0.5, -1.5, 2.0], dtype=torch.float16),
    "s": torch.tensor(0.25),
    "frozen": None,
}


def mixed_grads(i):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype), MIXED)


# --------------------------------------------------------------------------- compiled steps against eager


def assert_steps_compile_like_eager(step, carry, inputs, *, backend="inductor", compare=None):
    """A step function compiled with ``fullgraph=True`` follows its eager twin, and compiles once.

    Both run ``carry = step(*carry, *args)`` for each ``args`` in ``inputs``
    from the same starting ``carry``; after every step ``compare(compiled,
    eager)`` (default: bit for bit) checks the carries; from the second step
    on a recompilation is an error. Returns the compiled run's last carry.
    """
    compare = compare or assert_tree_bitwise_equal
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager = comp = carry
    for i, args in enumerate(inputs):
        eager = step(*eager, *args)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            comp = compiled(*comp, *args)
        compare(comp, eager)
    return comp


def assert_updates_compile_like_eager(txs, params, grads, *, steps=3, backend="aot_eager", compare=None):
    """Compiled updates of transformations equal eager ones, step after step, and compile once.

    One step function runs ``tx.update`` of every transformation in ``txs``
    side by side (one compilation for all keeps this fast: dynamo's cost is per
    traced op) through :func:`assert_steps_compile_like_eager`; ``compare``
    sees ``(states, updates)`` pairs. ``grads(i)`` is step ``i``'s gradient
    tree. Returns the compiled run's final states, one per transformation.
    """

    def run_all(states, updates, g):
        outs = [tx.update(g, s, params) for tx, s in zip(txs, states)]
        return [o[1] for o in outs], [o[0] for o in outs]

    start = ([tx.init(params) for tx in txs], None)
    states, _ = assert_steps_compile_like_eager(
        run_all, start, [(grads(i),) for i in range(steps)], backend=backend, compare=compare
    )
    return states


# --------------------------------------------------------------------------- leaves that cannot be written in place


UNWRITABLE = ["expanded", "as_strided", "broadcast_to", "inference", "alias"]
"""The cases of :func:`unwritable_params`."""


def unwritable_params(case: str):
    """``(params, message)``: a tree whose last leaf (in flat order) refuses an in-place add, and the error."""
    cases, base = unwritable_cases()
    bad, message = cases[case]
    first = base if case == "alias" else torch.arange(6.0)
    return {"a": first, "m": torch.ones(4, dtype=torch.bfloat16), "z": bad}, message


def unwritable_cases():
    """Leaves an in-place add must refuse, with the message expected: ``({case: (leaf, message)}, base)``."""
    base = torch.zeros(6)
    return {
        "expanded": (torch.zeros(3).expand(2, 3), "share memory"),
        "as_strided": (torch.zeros(6).as_strided((2, 3), (1, 1)), "share memory"),
        "broadcast_to": (torch.zeros(1, 3).broadcast_to(4, 3), "share memory"),
        "inference": (inference_zeros(2, 3), "inference tensor"),
        "alias": (base.view(2, 3), r"leaves at \['a'\] and \['z'\] share memory"),
    }, base


def inference_zeros(*shape):
    with torch.inference_mode():
        return torch.zeros(*shape)


# --------------------------------------------------------------------------- bad counts (5-coordinate trees)


def bad_k_cases(where: str):
    """``pytest.param(k, exception, message)`` rows of invalid ``k`` for a tree of 5 coordinates.

    ``where`` is how the too-large message names the tree (``"the tree"``, ``"params"``).
    """
    rows = [
        ("float", 2.0, TypeError, "k must be an int"),
        ("bool", True, TypeError, "k must be an int"),
        ("1d-tensor", torch.tensor([2]), TypeError, "k must be an int or a 0-d"),
        ("complex-tensor", torch.tensor(2.0 + 1j), TypeError, "k must be an int or a 0-d"),
        ("str", "3", TypeError, "k must be an int"),
        ("zero", 0, ValueError, "k must be >= 1"),
        ("negative", -1, ValueError, "k must be >= 1"),
        ("too-large", 6, ValueError, rf"k=6 exceeds the number of coordinates in {where} \(5\)"),
    ]
    return [pytest.param(k, exc, match, id=name) for name, k, exc, match in rows]


def non_float_leaves():
    """``pytest.param`` leaves that are not gradients: integer, bool and complex tensors."""
    return [
        pytest.param(torch.ones(3, dtype=torch.int64), id="int"),
        pytest.param(torch.ones(3, dtype=torch.bool), id="bool"),
        pytest.param(torch.ones(3, dtype=torch.complex64), id="complex"),
    ]


def per_coordinate_reference(make_opt, params, grads, k, refresh, score="gradient"):
    """Training ``k`` coordinates with one optimizer per coordinate: the reference of the sparse-state optimizers.

    ``make_opt(c, value) -> (parameter, optimizer)`` makes coordinate ``c``'s own one-element
    parameter and optimizer when it joins the set; it is dropped (state and all) when it leaves.
    ``refresh[step]`` reselects the set as the top ``k`` of ``|g|`` (or of ``|g|`` summed since the
    last refresh); before the first refresh it is the first ``k`` coordinates. The gradients must
    have no ties at the ``k``-th magnitude (continuous random values).
    """
    values = torch.cat([x.reshape(-1) for x in ft.tree.leaves(params)]).clone()
    members, live = list(range(k)), {}
    total = torch.zeros_like(values)
    for step, g in enumerate(grads):
        g = torch.cat([x.reshape(-1) for x in ft.tree.leaves(g)])
        total += g.abs()
        if refresh[step]:
            ranked = g.abs() if score == "gradient" else total
            members = sorted(torch.topk(ranked, k).indices.tolist())
            total = torch.zeros_like(values)
        live = {c: live.get(c) or make_opt(c, values[c]) for c in members}
        for c in members:
            p, opt = live[c]
            p.grad = g[c : c + 1].clone()
            opt.step()
            values[c] = p.detach()[0]
    return values


def torch_coordinate(cls, kwargs):
    """``make_opt`` for :func:`per_coordinate_reference`: ``cls`` with ``kwargs`` (and torch's choice of kernels)."""

    def make(c, value):
        p = torch.nn.Parameter(value.clone().reshape(1))
        return p, cls([p], **kwargs)  # functopk rounds as the implementation torch picks (the for-loop on CPU)

    return make


def real_device(device) -> torch.device:
    """The device that tensors made with ``device=device`` report: ``"cuda"`` becomes ``cuda:0`` (the current one).

    ``torch.device("cuda") != torch.device("cuda:0")``, so a test comparing a tensor's device with the
    ``device`` fixture's name would fail on every GPU.
    """
    return torch.empty(0, device=device).device
