"""randk and randk_mask: the counter-based hash against Python integers, selection laws, errors, compile."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import optree
import pytest
import torch

import functopk as ft
from functopk.compress.randk import _fmix32, _mul32, randk_keys
from tests.compress.helpers import check_compiled, tree_of
from tests.helpers import assert_tree_bitwise_equal, clone_tree, real_device, to_device

ROOT = Path(__file__).resolve().parents[2]


def flat_true_indices(mask_tree) -> list[int]:
    return torch.cat([m.reshape(-1) for m in optree.tree_leaves(mask_tree)]).nonzero().reshape(-1).tolist()


# --------------------------------------------------------------------------- the hash


def test_mul32_and_fmix32_match_python_integer_arithmetic(device):
    rng = random.Random(0)
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    cs = [0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF, 1, 0]
    t = torch.tensor(xs, dtype=torch.int64, device=device)
    for c in cs:
        assert t.__class__ is torch.Tensor
        assert _mul32(t, c).tolist() == [(x * c) % 2**32 for x in xs]

    def fmix_ref(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)

    assert _fmix32(t).tolist() == [fmix_ref(x) for x in xs]


def test_keys_are_distinct_32_bit_values(device):
    keys = randk_keys(1 << 17, seed=123, step=9, device=torch.device(device))
    assert keys.dtype == torch.int64 and keys.device == real_device(device)
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32
    assert keys.unique().numel() == keys.numel()  # a bijection of the index: no ties, a unique top-k set
    # identical on every device, with the step an int or a tensor on the device
    assert torch.equal(keys.cpu(), randk_keys(1 << 17, seed=123, step=9))
    assert torch.equal(randk_keys(1 << 17, seed=123, step=torch.tensor(9, device=device)), keys)


# --------------------------------------------------------------------------- randk


def test_randk_mask_is_a_function_of_seed_step_and_layout(device):
    tree = to_device(tree_of((7, 5), (3,), (2, 2, 3)), device)
    other_values = ft.tree.map(lambda x: x * 100 + 1, tree)
    m = flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=3))
    assert len(m) == 6
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=3)) == m
    assert flat_true_indices(ft.compress.randk_mask(other_values, 6, seed=11, step=3)) == m  # values are not read
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=torch.tensor(3))) == m
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=torch.tensor(3, device=device))) == m
    assert flat_true_indices(ft.compress.randk_mask(to_device(tree, "cpu"), 6, seed=11, step=3)) == m  # any device
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=4)) != m
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=12, step=3)) != m
    # steps beyond 2**32 use the high word too
    assert flat_true_indices(ft.compress.randk_mask(tree, 6, seed=11, step=3 + 2**32)) != m


def test_randk_same_indices_in_a_separate_process():
    tree = tree_of((40, 25), (17,), (3, 3, 3))
    expected = {step: flat_true_indices(ft.compress.randk_mask(tree, 20, seed=2024, step=step)) for step in (0, 1, 77)}
    code = textwrap.dedent(
        """
        import torch, functopk as ft
        tree = {"p0": torch.zeros(40, 25), "p1": torch.zeros(17), "p2": torch.zeros(3, 3, 3)}
        for step in (0, 1, 77):
            m = ft.compress.randk_mask(tree, 20, seed=2024, step=torch.tensor(step))
            flat = torch.cat([x.reshape(-1) for x in ft.tree.leaves(m)])
            print(step, flat.nonzero().reshape(-1).tolist())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    ).stdout
    got = {int(line.split(" ", 1)[0]): eval(line.split(" ", 1)[1]) for line in out.strip().splitlines()}
    assert got == expected
    assert expected[0] != expected[1] != expected[77]


@pytest.mark.parametrize("n,k", [(1, 1), (10, 1), (10, 10), (1000, 37), (4097, 4096)])
def test_randk_selects_exactly_k(device, n, k):
    tx = ft.randk(k, seed=5)
    out, _ = tx.update({"w": torch.randn(n, device=device)}, tx.init({"w": torch.zeros(n, device=device)}))
    assert int((out["w"] != 0).sum()) == k


def test_randk_transform_equals_mask_and_counts_steps(device):
    params = to_device(tree_of((6, 5), (4,)), device)
    tx = ft.randk(density=0.25, seed=9)
    state = tx.init(params)
    assert state.count.device == real_device(device)
    k = ft.sparse.k_from_density(0.25, 34)
    for step in range(4):
        grads = to_device(tree_of((6, 5), (4,), seed=step + 1), device)
        before = clone_tree(grads)
        out, new_state = tx.update(grads, state, params)
        assert_tree_bitwise_equal(grads, before)  # pure
        mask = ft.compress.randk_mask(grads, k, seed=9, step=step)
        assert_tree_bitwise_equal(out, ft.tree.map(lambda g, m: torch.where(m, g, 0.0), grads, mask))
        assert int(state.count) == step and int(new_state.count) == step + 1
        state = new_state


def test_randk_selection_frequencies_are_uniform():
    """Each coordinate is kept with probability k/n; consecutive steps overlap like independent draws."""
    n, k, steps = 50, 5, 2000
    tree = {"w": torch.zeros(n)}
    counts = torch.zeros(n)
    overlap = 0
    prev = None
    for t in range(steps):
        m = ft.compress.randk_mask(tree, k, seed=1, step=t)["w"]
        counts += m
        if prev is not None:
            overlap += int((m & prev).sum())
        prev = m
    p = k / n
    mean, sd = steps * p, math.sqrt(steps * p * (1 - p))
    assert float((counts - mean).abs().max()) < 5 * sd, counts
    chi2 = float(((counts - mean) ** 2 / mean).sum())  # ~ chi-square with 49 dof: mean 49, sd ~10
    assert chi2 < 49 + 5 * 10, chi2
    expected_overlap = (steps - 1) * k * k / n
    assert abs(overlap - expected_overlap) < 5 * math.sqrt(expected_overlap), overlap


def test_randk_unbiased_scales_by_n_over_k_and_averages_to_the_input():
    x = {"a": torch.tensor([1.0, -2.0, 3.0, 0.5]), "b": torch.tensor([[4.0, -1.0], [0.25, 2.0]])}
    n, k = 8, 2
    tx = ft.randk(k, seed=3, unbiased=True)
    state = tx.init(x)
    total = ft.tree.zeros_like(x)
    steps = 2000
    for t in range(steps):
        out, state = tx.update(x, state)
        if t < 5:
            mask = ft.compress.randk_mask(x, k, seed=3, step=t)
            assert_tree_bitwise_equal(out, ft.tree.map(lambda v, m: torch.where(m, v * (n / k), 0.0), x, mask))
        total = ft.tree.add(total, out)
    mean = ft.tree.scale(total, 1.0 / steps)
    # each coordinate: mean of (n/k) * Bernoulli(k/n) * x, sd = |x| sqrt((n/k - 1) / steps) ~ 0.039 |x|
    for m, v in zip(ft.tree.leaves(mean), ft.tree.leaves(x)):
        assert torch.all((m - v).abs() <= 0.2 * v.abs()), (m, v)


def test_randk_errors():
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.randk()
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.randk(3, density=0.1)
    with pytest.raises(TypeError, match="k must be an int"):
        ft.randk(2.0)
    with pytest.raises(ValueError, match="density must be in"):
        ft.randk(density=1.5)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        ft.randk(1, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        ft.randk(1, seed="a")
    with pytest.raises(TypeError, match="unbiased must be a bool"):
        ft.randk(1, unbiased=1)
    with pytest.raises(ValueError, match="k=5 exceeds"):
        ft.randk(5).init({"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="k=5 exceeds"):
        ft.compress.randk_mask({"w": torch.zeros(4)}, 5, seed=0, step=0)
    with pytest.raises(TypeError, match="step must be an int or a 0-d integer tensor"):
        ft.compress.randk_mask({"w": torch.zeros(4)}, 1, seed=0, step=torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating-point"):
        ft.compress.randk_mask({"w": torch.zeros(4, dtype=torch.int64)}, 1, seed=0, step=0)
    tx = ft.randk(1)
    with pytest.raises(TypeError, match="RandKState"):
        tx.update({"w": torch.zeros(4)}, ft.EmptyState())


@pytest.mark.compile
@pytest.mark.parametrize(
    "make",
    [lambda: ft.randk(density=0.1, seed=4), lambda: ft.randk(5, seed=4, unbiased=True)],
    ids=["randk", "randk-unbiased"],
)
def test_compiles_fullgraph_without_recompiling(make, fresh_dynamo):
    check_compiled(make(), tree_of((6, 5), (4,), (3, 3)))


@pytest.mark.compile
@pytest.mark.slow
def test_randk_keys_under_inductor_equal_eager(fresh_dynamo):
    """Inductor generates its own integer code for the hash: it must give the same keys."""
    keys = torch.compile(lambda step: randk_keys(5000, 2**40 + 17, step), fullgraph=True, backend="inductor")
    for step in (0, 1, 2**33 + 5):
        t = torch.tensor(step)
        assert torch.equal(keys(t), randk_keys(5000, 2**40 + 17, t))


def test_randk_ignores_params_at_update_but_checks_updates():
    params = {"w": torch.zeros(3, 4)}
    tx = ft.randk(2)
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.int64"):
        tx.update({"w": torch.ones(3, 4, dtype=torch.int64)}, state, params)
    # randk does not read params, so it does not check them (as topk and every map of the updates alone)
    out, _ = tx.update({"w": torch.ones(1, 4)}, state, params)
    assert int((out["w"] != 0).sum()) == 2
