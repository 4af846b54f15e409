"""The Triton top-k kernel on a GPU: the CPU kernel's selection bit for bit, sync-free, compiled, captured.

Skipped without CUDA (``make gpu-check`` runs them first). The same checks as the interpreter's
(``tests/sparse/triton_interpreted.py``) plus what only a GPU shows: bfloat16, concurrent programs
(determinism run to run), production-sized trees, no host synchronisation, ``torch.compile`` and
CUDA graph capture and replay.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse.kernels import triton_layout, triton_select
from tests.helpers import assert_compiles_like_eager, bits, no_sync, numel, to_device, trees_st
from tests.sparse.triton_checks import ATEN, CONFIGS, LeafReads, assert_selects_like_cpu, path_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not triton_select.available(), reason="triton is not installed"),
]

TRITON = ft.sparse.KernelConfig(backend="triton")


@given(tree=trees_st(allow_nonfinite=True, max_leaves=6), data=st.data())
def test_selects_like_the_cpu_kernel(tree, data):
    n = numel(tree)
    if n == 0:
        return
    config = data.draw(st.sampled_from([TRITON, *CONFIGS.values()]), label="config")
    k = data.draw(st.integers(1, n), label="k")
    if data.draw(st.booleans(), label="tensor k"):
        k = ("tensor", float(k))
    assert_selects_like_cpu(tree, k, config, "cuda")


def _big_tree(zeros: float = 0.0) -> dict:
    """About 3M coordinates over 30 leaves in fp32, bf16 and fp16; a share ``zeros`` of them exactly 0."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tree = {f"w{i:02d}": torch.randn(1000 + 7919 * i, generator=g, device="cuda") for i in range(24)}
    tree |= {f"h{i}": torch.randn(30_000 + i, generator=g, device="cuda").to(torch.bfloat16) for i in range(3)}
    tree |= {f"f{i}": torch.randn(20_000, generator=g, device="cuda").half() for i in range(3)}
    if zeros:
        tree = {key: torch.where(torch.rand(x.shape, generator=g, device="cuda") < zeros, 0.0, x).to(x.dtype)
                for key, x in tree.items()}
    return tree


@pytest.mark.parametrize("zeros", [0.0, 0.999])
def test_production_sized_trees_select_like_the_cpu_kernel(zeros):
    tree = _big_tree(zeros)
    n = numel(tree)
    nonzero = sum(int(x.count_nonzero()) for x in tree.values())
    for k in (1000, n // 100):
        assert_selects_like_cpu(tree, k, TRITON, "cuda")
        stats = path_of(tree, k, TRITON, "cuda")
        # the k-th largest is 0 beyond the non-zeros: the first zeros in flat order are kept, no fallback
        assert stats.path == ("ties" if k > nonzero else "candidates"), stats


def _resnet_like(dtype: torch.dtype = torch.float32) -> dict:
    """Gradients of a few ResNet layers trained channels_last: 4-d conv weights in that layout, vectors, a matrix."""
    g = torch.Generator(device="cuda").manual_seed(4)
    shapes = {"conv1": (64, 3, 7, 7), "layer1": (64, 64, 3, 3), "layer2": (128, 64, 3, 3), "down": (256, 64, 1, 1),
              "layer3": (256, 256, 3, 3), "bn": (256,), "fc": (1000, 512)}
    tree = {key: torch.randn(shape, generator=g, device="cuda").to(dtype) for key, shape in shapes.items()}
    return {key: x.to(memory_format=torch.channels_last) if x.dim() == 4 else x for key, x in tree.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_gradients_are_read_in_place(dtype):
    tree = _resnet_like(dtype)
    strided = [x for x in tree.values() if not x.is_contiguous()]
    assert len(strided) == 4  # (a 1x1 conv is contiguous in either format)
    ft.topk_indices(tree, 1000, config=TRITON)  # (the first call also compiles the kernels a capture may need)
    with LeafReads(strided) as reads:
        plan = triton_layout.plan(list(tree.values()))
        ft.topk_indices(tree, 1000, config=TRITON)
    assert reads.ops == [] and plan.source == "table" and plan.held == (), reads.ops
    n = numel(tree)
    for k in (1000, n // 100):
        assert_selects_like_cpu(tree, k, TRITON, "cuda")
        assert path_of(tree, k, TRITON, "cuda").path == "candidates"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_thousands_of_programs_place_their_output_in_flat_order(name):
    """Small programs on a 200K tree: 3000+ programs, so each sums its predecessors' counts in several blocks."""
    g = torch.Generator(device="cuda").manual_seed(1)
    tree = {"a": torch.randn(150_000, generator=g, device="cuda"), "b": torch.randn(50_000, generator=g, device="cuda")}
    for k in (100, 20_000):
        assert_selects_like_cpu(tree, k, CONFIGS[name], "cuda")


def test_results_do_not_depend_on_the_order_programs_run_in():
    tree = _big_tree()
    tree = {key: torch.round(x * 4) / 4 for key, x in tree.items()}  # heavy ties across programs
    sparse = _big_tree(0.999)  # many zeros: the tied path (k beyond the non-zeros)
    for t, config in ((tree, TRITON), (tree, dataclasses.replace(TRITON, margin=-10.0)), (sparse, TRITON)):
        first = ft.topk_indices(t, 50_000, config=config)
        for _ in range(3):
            again = ft.topk_indices(t, 50_000, config=config)
            assert torch.equal(again.indices, first.indices) and torch.equal(bits(again.values), bits(first.values))


def test_bfloat16_trees_keep_their_dtype_and_bits():
    g = torch.Generator(device="cuda").manual_seed(3)
    tree = {"a": torch.randn(5000, generator=g, device="cuda").bfloat16(),
            "b": torch.zeros(7, device="cuda").bfloat16()}
    for k in (1, 300, 5007):
        assert_selects_like_cpu(tree, k, TRITON, "cuda")
        assert ft.topk_indices(tree, k, config=TRITON).values.dtype == torch.bfloat16


def test_no_host_synchronisation():
    tree = _big_tree()
    shared = torch.randn(1_000_000, device="cuda")
    flat_tree = {"a": shared[:400_000].view(400, 1000), "b": shared[400_000:]}
    k_dev = torch.tensor(777, device="cuda")
    for t in (tree, flat_tree, _resnet_like(), _big_tree(0.9999)):  # (the last: the tied path)
        for k in (777, k_dev):
            ft.topk_sparsify(t, k, config=TRITON)  # warm up: compile, build the leaf table
        with no_sync():
            for k in (777, k_dev):
                ft.topk_sparsify(t, k, config=TRITON)
                ft.topk_mask(t, k, config=TRITON)
            assert ft.topk_indices(t, 777, config=TRITON).indices.shape == (777,)


def test_compiles_fullgraph_without_recompiling(fresh_dynamo):
    def step(tree, k):
        sparse = ft.topk_indices(tree, 1000, config=TRITON)
        return ft.topk_sparsify(tree, k, config=TRITON), sparse.indices, sparse.values

    trees = [{key: torch.randn_like(x) for key, x in _big_tree().items()} for _ in range(2)]
    assert_compiles_like_eager(step, [(t, torch.tensor(5000, device="cuda")) for t in trees], bitwise=True)


def _static_grads(kind: str) -> list[torch.Tensor]:
    """Gradient buffers: separate tensors (a conv weight channels_last) or views of one buffer (``"shared"``)."""
    shapes = [(256, 64), (64,), (64, 32, 3, 3), (1000, 50), (10,)]
    if kind == "shared":
        buffer = torch.zeros(sum(torch.Size(s).numel() for s in shapes), device="cuda")
        grads = list(torch.split(buffer, [torch.Size(s).numel() for s in shapes]))
        return [g.view(s) for g, s in zip(grads, shapes)]
    grads = [torch.zeros(s, device="cuda") for s in shapes]
    return [g.to(memory_format=torch.channels_last) if g.dim() == 4 else g for g in grads]


@pytest.mark.parametrize("kind", ["separate", "shared", "unseen"])
def test_a_captured_cuda_graph_replays_the_selection(kind):
    """Gradients in static buffers: capture once, replay on new values. The capture reads the leaf table the
    warm-up cached, or the shared buffer; ``"unseen"``: the warm-up ran on other buffers, so the capture
    copies its leaves into one buffer (no table can be copied in while capturing)."""
    grads = _static_grads(kind)
    warm = _static_grads(kind) if kind == "unseen" else grads
    k_dev = torch.tensor(2000, device="cuda")

    def select(leaves):
        return ft.topk_indices(leaves, 1000, config=TRITON), ft.topk_sparsify(leaves, k_dev, config=TRITON)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
        for g in warm:
            g.normal_()
        select(warm)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse, dense = select(grads)
        source = triton_layout.plan(grads).source
    assert source == {"separate": "table", "shared": "flat", "unseen": "copy"}[kind]
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=gen, device="cuda"))
        graph.replay()
        want_sparse = ft.topk_indices(to_device(grads, "cpu"), 1000, config=ATEN)
        assert torch.equal(sparse.indices.cpu(), want_sparse.indices)
        assert torch.equal(sparse.values.cpu(), want_sparse.values)
        want_dense = ft.topk_sparsify(to_device(grads, "cpu"), 2000, config=ATEN)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(dense, want_dense))


def test_reduce_overhead_compile_replays_the_selection(fresh_dynamo):
    fn = torch.compile(lambda t: ft.topk_sparsify(t, 1000, config=TRITON), mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        tree = {key: x * (seed + 1) for key, x in _big_tree().items()}
        got = fn(tree)
        want = ft.topk_sparsify(tree, 1000, config=TRITON)
        assert all(torch.equal(bits(got[key]), bits(want[key])) for key in tree)


def test_auto_backend_runs_triton_on_cuda_and_aten_matches():
    tree = _big_tree()
    from functopk.sparse import dispatch
    from functopk.sparse.ops import TritonTopK

    leaves = list(tree.values())
    assert isinstance(dispatch.select(leaves, 10, "exact", None), TritonTopK)
    assert not isinstance(dispatch.select(leaves, 10, "exact", ATEN), TritonTopK)
    a, b = ft.topk_indices(tree, 4321), ft.topk_indices(tree, 4321, config=ATEN)
    assert torch.equal(a.indices, b.indices) and torch.equal(bits(a.values), bits(b.values))


def test_the_sparse_apply_adds_like_the_cpu_path_in_one_launch_and_is_captured():
    """bf16 and fp16 leaves, a channels_last weight: the CPU ATen path's bits; one kernel; and a CUDA graph of the
    apply (its index checks are skipped while capturing) replays it on new values."""
    tree = _big_tree() | {"conv": torch.randn(64, 32, 3, 3, device="cuda").to(memory_format=torch.channels_last)}
    n = numel(tree)
    sparse = ft.topk_indices(tree, 5000, config=TRITON)
    want = ft.apply_sparse_updates_(to_device(tree, "cpu"), to_device(sparse, "cpu"), -0.5, config=ATEN)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ft.apply_sparse_updates_(tree, sparse, -0.5)  # (auto: the kernel)
        torch.cuda.synchronize()
    launched = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("scatter_add_kernel" in name for name in launched) == 1, launched
    for key in tree:
        assert tree[key].stride() == want[key].stride() and torch.equal(bits(tree[key].cpu()), bits(want[key]))
    values = torch.zeros(5000, device="cuda")
    static = sparse._replace(values=values)
    ft.apply_sparse_updates_(tree, static)  # warm-up: the table is cached before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ft.apply_sparse_updates_(tree, static)
    before = to_device(tree, "cpu")
    values.copy_(torch.randn(5000, device="cuda"))
    graph.replay()
    again = ft.apply_sparse_updates_(before, to_device(static, "cpu"), config=ATEN)
    assert all(torch.equal(bits(tree[key].cpu()), bits(again[key])) for key in tree), n
