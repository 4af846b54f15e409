"""benchmarks/host_overhead.py: an optimizer step dispatches as many operators for many leaves as for few.

On an accelerator each dispatched operator is a kernel launch or more (a foreach kernel: a few launches for all
leaves); a count that grew with the leaves would be launches per leaf. The count is taken on the code path
functopk runs on an accelerator (the benchmark's ``accelerator_path``), with CPU tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_overhead  # noqa: E402


@pytest.mark.parametrize("case", host_overhead.CASES)
@pytest.mark.parametrize("variant", host_overhead.VARIANTS[1:], ids=lambda v: v.name)
def test_a_step_dispatches_as_many_operators_for_many_leaves_as_for_few(case, variant):
    opt = host_overhead.OPTIMIZERS[case]
    few, many = host_overhead.ops_per_step(variant, opt, 3).ops, host_overhead.ops_per_step(variant, opt, 40).ops
    assert few == many and sum(few.values()) <= 30, (few, many)
    assert any(name.startswith("_foreach_") for name in few)  # (the count sees the step's kernels)


@pytest.mark.parametrize("variant", host_overhead.VARIANTS[1:3], ids=lambda v: v.name)
def test_sgd_momentums_in_place_steps_allocate_the_update_only(variant):
    """The adapter's and ``update_``'s SGD momentum write the trace into its own tensors (no fresh tree, no
    copy): what a step allocates is the update ``-lr * trace`` alone, one tensor per leaf."""
    count = host_overhead.ops_per_step(variant, host_overhead.OPTIMIZERS["sgd-momentum"], 40)
    assert count.fresh == 40 and "_foreach_copy_" not in count.ops, (count.fresh, count.ops)


def test_the_benchmark_runs_and_reports_every_variant():
    rows = host_overhead.run(["sgd-momentum"], leaves=5, numel=4, rounds=2)
    assert [r["variant"] for r in rows] == [
        "torch.optim foreach", "functopk torch.optim adapter", "functopk eager update_ (donated)",
        "functopk eager pure",
    ]
    assert rows[0]["ratio"] == 1.0 and rows[0]["python_ratio"] == 1.0 and all(r["us"] > 0 for r in rows)
    assert all(0 < r["kernels"] and r["python"] == pytest.approx(r["us"] - r["kernels"]) for r in rows)
    text = host_overhead.report(rows, 5, 4, 2, ("0", "0"))
    assert text.count("| sgd-momentum |") == 4
