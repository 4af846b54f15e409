"""The Triton kernel on CPU tensors under Triton's interpreter, bit for bit against the CPU kernel.

Not collected by the suite itself: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported, so ``tests/sparse/test_kernels_triton_select.py`` runs this file in its own pytest process
with it set (and checks that every test here ran). By hand:

    TRITON_INTERPRET=1 python -m pytest -q tests/sparse/triton_interpreted.py

The interpreter runs one program at a time in numpy: trees are small and the configurations
(:data:`tests.sparse.triton_checks.CONFIGS`) shrink the programs, the sample and the candidate
buffer so that small trees reach every path. It has no bfloat16: that dtype is checked on a GPU
(``tests/sparse/test_kernels_triton_cuda.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse.kernels import triton_layout, triton_select
from functopk.sparse.ops import TritonTopK
from tests.helpers import (
    TOPK_STEPS,
    CaptureBlockers,
    assert_compiles_like_eager,
    assert_tree_bitwise_equal,
    batch,
    make_step,
    numel,
    small_cnn,
    trees_st,
)
from tests.sparse.triton_checks import ATEN, CONFIGS, SMALL, LeafReads, assert_selects_like_cpu, path_of

pytestmark = pytest.mark.skipif(not triton_select.interpreting(), reason="needs TRITON_INTERPRET=1")

DTYPES = (torch.float32, torch.float64, torch.float16)
SPECIAL = [0.0, -0.0, 1e-45, -1e-40, 6e-8, -6e-8, 1.0, -1.0, 2.0, math.inf, -math.inf, math.nan, 65504.0]
"""Ties, signed zeros, subnormals of fp32 and fp16, infinities and NaN."""


@st.composite
def special_trees(draw):
    """A few leaves of ``SPECIAL`` values (rounded into each leaf's dtype), some empty."""
    tree = {}
    for i in range(draw(st.integers(1, 4))):
        size = draw(st.sampled_from([0, 1, 7, 40]))
        values = draw(st.lists(st.sampled_from(SPECIAL), min_size=size, max_size=size))
        tree[f"p{i}"] = torch.tensor(values, dtype=torch.float64).to(draw(st.sampled_from(DTYPES)))
    return tree


def _relayout(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x`` (same shape and values) laid out in memory with its dimensions in ``order``, outermost first."""
    return x.permute(order).contiguous().permute([order.index(i) for i in range(x.dim())])


@settings(max_examples=10)
@given(tree=trees_st(allow_nonfinite=True, dtypes=DTYPES, max_leaves=4) | special_trees(), data=st.data())
def test_selects_like_the_cpu_kernel(tree, data):
    n = numel(tree)
    if n == 0:
        return
    # leaves of two or more dimensions in any memory layout: read where they lie, in flat order
    tree = optree.tree_map(lambda x: _relayout(x, data.draw(st.permutations(range(x.dim())), label="layout")), tree)
    config = CONFIGS[data.draw(st.sampled_from(sorted(CONFIGS)), label="config")]
    k = data.draw(st.integers(1, n), label="k")
    if data.draw(st.booleans(), label="tensor k"):
        k = ("tensor", float(k) + data.draw(st.sampled_from([0.0, 0.4, -0.4]), label="fraction"))
    assert_selects_like_cpu(tree, k, config, "cpu")


def _tree() -> dict:
    """239 coordinates in three dtypes (flat order a, b, c, d), with ties across leaves; d is a transpose.

    The systematic sample of :data:`SMALL` reads every 14th coordinate (``239 // 16``) of the first 227:
    those hold the largest magnitudes, so a threshold at the sample's top keeps 1 coordinate (too few
    for ``k > 1``).
    """
    flat = torch.randn(239, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat[20:24] = flat[130:134] = flat[228:230] = -1.5
    flat[:227:14] = 100.0 + torch.arange(17, dtype=torch.float64)
    d = flat[227:].view(3, 4).t().contiguous().t()  # (3, 4) in column-major memory
    return {"a": flat[:117].float().view(9, 13), "b": flat[117:177].half(), "c": flat[177:227].clone(), "d": d}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_path_is_reached_and_exact(name):
    tree = _tree()
    # (k = 37 has too few candidates with the production margin too: the sample is the 17 largest)
    for k in (3, 117) if name == "candidates" else (3, 37, 117):
        stats = path_of(tree, k, CONFIGS[name], "cpu")
        assert stats.source == "table"
        assert stats.path == ("candidates" if name == "candidates" else "fallback"), (k, stats)
    for k in (1, 37, numel(tree)):
        assert_selects_like_cpu(tree, k, CONFIGS[name], "cpu")


def test_nan_and_infinities_tie_and_go_first():
    tree = {"a": torch.tensor([1.0, math.nan, -math.inf, 3.0]), "b": torch.tensor([math.inf, -0.0, math.nan]).half()}
    for k in (1, 2, 4, 7):
        assert_selects_like_cpu(tree, k, SMALL, "cpu")
    for name in ("overflow", "too-few"):
        assert_selects_like_cpu(tree, 3, CONFIGS[name], "cpu")


def test_leaves_of_one_flat_buffer_are_read_in_place():
    flat = torch.randn(300, generator=torch.Generator().manual_seed(1))
    flat[::7] = -2.0  # ties
    tree = {"a": flat[:120].view(10, 12), "b": flat[120:121], "c": flat[121:]}
    assert path_of(tree, 50, SMALL, "cpu").source == "flat"
    for k in (1, 299, ("tensor", 77.0)):
        assert_selects_like_cpu(tree, k, SMALL, "cpu")


def test_wide_keys_of_float64_trees_rank_by_every_bit():
    """fp64 magnitudes that agree in their top 40 bits: the 8 radix passes of 64-bit keys see the rest."""
    base = torch.full((200,), 1.0, dtype=torch.float64)
    noise = torch.randperm(200, generator=torch.Generator().manual_seed(2)).double()
    tree = {"a": (base + noise * 2.0**-50)[:120] * -1.0, "b": (base + noise * 2.0**-50)[120:]}
    for name in sorted(CONFIGS):
        assert_selects_like_cpu(tree, 33, CONFIGS[name], "cpu")


def test_half_and_single_leaves_rank_in_single_precision():
    """fp16 subnormals and their fp32 neighbours: converted exactly, ranked together."""
    tree = {"h": torch.tensor([6e-8, 1.2e-7, -6e-8, 0.0, 3e-5], dtype=torch.float16),
            "s": torch.tensor([5.9604645e-08, -1.1920929e-07, 1e-45, -0.0])}
    for k in (1, 4, 9):
        assert_selects_like_cpu(tree, k, SMALL, "cpu")


def test_dispatch_picks_the_triton_kernel_when_asked():
    from functopk.sparse import dispatch

    leaves = [torch.randn(5)]
    assert isinstance(dispatch.select(leaves, 2, "exact", SMALL), TritonTopK)
    assert not isinstance(dispatch.select(leaves, 2, "exact", None), TritonTopK)  # "auto", CPU tensors: CPU kernel
    assert not isinstance(dispatch.select(leaves, 2, "torch", SMALL), TritonTopK)
    with torch.enable_grad():  # the differentiable selection stays the static kernel's
        grad_leaves = [torch.randn(5, requires_grad=True)]
        assert not isinstance(dispatch.select(grad_leaves, 2, "exact", SMALL), TritonTopK)
    with pytest.raises(ValueError, match="at most 2147483647 coordinates"):  # its counts are int32
        triton_select.serves(leaves, 2**31, "triton")


@pytest.mark.compile
def test_compiles_fullgraph_without_recompiling(fresh_dynamo):
    def step(tree, k):
        return ft.topk_sparsify(tree, k, config=SMALL), ft.topk_indices(tree, 5, config=SMALL).values

    trees = [{"w": torch.randn(6, 7, generator=torch.Generator().manual_seed(i)), "b": torch.randn(20)}
             for i in range(2)]
    assert_compiles_like_eager(step, [(t, torch.tensor(9)) for t in trees], backend="aot_eager", bitwise=True)


STEP = ft.sparse.KernelConfig(backend="triton", sample_size=16)
"""One program over the small CNN's 315 gradients (the interpreter's cost is per program)."""


@pytest.mark.parametrize("name", sorted(TOPK_STEPS))
def test_a_training_step_dispatches_nothing_a_cuda_graph_refuses_and_trains_as_on_the_cpu_kernel(name):
    """The Triton kernel's host side within a whole step (``tests/test_capture.py`` checks the rest of it)."""
    model_fn, params, buffers = ft.nn.functionalize(small_cnn())
    runs = []
    for config in (STEP, ATEN):
        tx = TOPK_STEPS[name](ft.topk(20, config=config))
        step, carry = make_step(model_fn, tx), (params, buffers, tx.init(params))
        for i in range(2):
            with CaptureBlockers() if config is STEP else contextlib.nullcontext():
                carry = step(*carry, *batch(seed=i))
        runs.append(carry)
    assert_tree_bitwise_equal(runs[0], runs[1])



def _strided_tree() -> dict:
    """Leaves in memory layouts other than row-major: channels_last, channels_last_3d, a permutation of four
    unmergeable dimensions, a half transpose; a contiguous leaf and one with gaps (a slice with a step)."""
    g = torch.Generator().manual_seed(5)
    four = torch.randn(3, 4, 2, 2, generator=g).permute(2, 0, 3, 1)  # memory order (1, 3, 0, 2)
    return {"conv": torch.randn(3, 5, 3, 3, generator=g).to(memory_format=torch.channels_last),
            "conv3d": torch.randn(2, 3, 2, 1, 3, generator=g).to(memory_format=torch.channels_last_3d),
            "four": four, "half": torch.randn(3, 5, generator=g).half().t(), "bias": torch.randn(6, generator=g),
            "gaps": torch.randn(3, 8, generator=g)[:, ::2]}


def test_strided_leaves_are_read_where_they_lie_in_flat_order():
    tree = _strided_tree()
    strided = [tree[key] for key in ("conv", "conv3d", "four", "half")]
    assert not any(x.is_contiguous() for x in strided)
    with LeafReads(strided) as dense_reads, LeafReads([tree["gaps"]]) as gap_reads:
        ft.topk_indices(tree, 50, config=SMALL)
    assert dense_reads.ops == [], dense_reads.ops  # read in place: no copy of a dense strided leaf
    assert "aten.clone.default" in gap_reads.ops  # a leaf with gaps is copied (and the check sees copies)
    assert_selects_like_cpu(tree, 50, SMALL, "cpu")  # (the fallback's reads: test_each_path_is_reached_and_exact)


@pytest.mark.parametrize("x", [
    torch.zeros(64, 3, 7, 7).to(memory_format=torch.channels_last),
    torch.zeros(8, 64, 3, 3).to(memory_format=torch.channels_last),
    torch.zeros(2, 16, 3, 3, 3).to(memory_format=torch.channels_last_3d),
    torch.zeros(3, 40, 5, 7).permute(2, 0, 3, 1),
    torch.zeros(1_000_003, 3).t(),
], ids=["conv7x7", "conv3x3", "conv3d", "four", "transpose"])
def test_memory_offsets_of_production_sized_tiles(x):
    """Tiles of 2048 flat indices (the default), starting anywhere: each lane's offset is torch's."""
    from tests.sparse.triton_offsets import tile_offsets

    want = torch.arange(x.numel()).as_strided(x.shape, x.stride()).reshape(-1)
    row = triton_layout.plan([x]).table[: triton_layout.ROW]
    for start in (0, 1, 2047, x.numel() // 2 + 5, x.numel() - 2048):
        start = min(max(start, 0), x.numel() - 1)
        got = tile_offsets(row, start, 2048)[: x.numel() - start]  # (lanes past the leaf: masked in the kernels)
        assert torch.equal(got, want[start:start + 2048]), (start, got, want[start:start + 2048])


def test_a_strided_view_inside_one_flat_buffer_is_read_in_its_own_order():
    """Back to back in memory, but the middle leaf's flat order is not its memory order: no flat read."""
    flat = torch.randn(300, generator=torch.Generator().manual_seed(6))
    tree = {"a": flat[:60], "b": flat[60:180].view(2, 4, 5, 3).permute(0, 3, 1, 2), "c": flat[180:]}
    assert path_of(tree, 100, SMALL, "cpu").source == "table"
    assert_selects_like_cpu(tree, 100, SMALL, "cpu")


def test_mostly_zero_trees_keep_their_first_zeros_without_the_fallback():
    """The k-th largest magnitude is 0 (k beyond the non-zeros) or another value many coordinates share: the
    threshold is the k-th largest key, no radix pass runs, and the first ties in flat order are kept."""
    g = torch.Generator().manual_seed(7)
    sparse = torch.where(torch.rand(200, generator=g) < 0.05, torch.randn(200, generator=g), 0.0)
    tree = {"zeros": torch.zeros(40, dtype=torch.float16), "sparse": sparse.view(8, 25).t(), "tail": torch.zeros(9)}
    nonzero = int((sparse != 0).sum())
    for k in (nonzero + 30, ("tensor", 249.0)):  # (249: all but the last zero)
        assert_selects_like_cpu(tree, k, SMALL, "cpu")
    stats = path_of(tree, nonzero + 30, SMALL, "cpu")
    assert stats.path == "ties" and stats.candidates == nonzero and stats.ties == numel(tree) - nonzero, stats
    # 30 of 2.0, 60 ties at 1.0: the sample's threshold (without the margin) is 1.0, the 40th largest
    steps = {"w": torch.tensor([2.0, 1.0, -1.0, 0.0] * 30).view(10, 12)}
    config = dataclasses.replace(SMALL, margin=0.0)
    stats = path_of(steps, 40, config, "cpu")
    assert stats.path == "ties" and (stats.candidates, stats.ties) == (30, 60), stats
    assert_selects_like_cpu(steps, 40, config, "cpu")
