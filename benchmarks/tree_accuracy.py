"""Accuracy of gTop-k's tree exchange against the all-gather re-selection and the exact dense top-k.

Single process: the brute-force references of ``tests/distributed/tree_reference.py``
(which ``tests/distributed/test_tree.py`` checks bit for bit against the gloo
runs at P = 2..8). Prints a markdown table for docs/distributed-measurements.md.

    python benchmarks/tree_accuracy.py [--n 100000] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.distributed.tree_reference import (  # noqa: E402
    allgather_reselect_reference,
    dense_topk_reference,
    local_topk,
    tree_reference,
)


def grads(kind: str, world: int, n: int, step: int) -> list[torch.Tensor]:
    """Per-rank gradients: ``iid`` noise only, or a heavy-tailed ``shared`` signal plus as much noise."""
    shared = torch.distributions.StudentT(3.0).sample((n,)) if kind == "shared" else torch.zeros(n)
    return [shared + torch.randn(n) for _ in range(world)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def one_step(kind: str, world: int, n: int, k: int, seeds: int = 3) -> dict[str, float]:
    """One exchange's figures, averaged over ``seeds`` draws."""
    runs = [_one_step(kind, world, n, k, seed) for seed in range(seeds)]
    return {key: sum(r[key] for r in runs) / seeds for key in runs[0]}


def _one_step(kind: str, world: int, n: int, k: int, seed: int) -> dict[str, float]:
    torch.manual_seed(1000 * seed + world)
    accs = grads(kind, world, n, 0)
    exact = dense_topk_reference(accs, k)
    tree, _, lost = tree_reference(accs, k)
    ag = allgather_reselect_reference(accs, k)
    sent = sum(local_topk(a, k)[0].abs().sum() for a in accs)
    overlap = lambda u: float(((u != 0) & (exact != 0)).sum()) / k  # noqa: E731
    return {"tree_err": _rel(tree, exact), "ag_err": _rel(ag, exact), "tree_vs_ag": _rel(tree, ag),
            "tree_overlap": overlap(tree), "ag_overlap": overlap(ag),
            "lost": float(lost.abs().sum() / sent)}  # fmt: skip


def _allgather_step(accs: list[torch.Tensor], k: int):
    """The all-gather re-selection with its error feedback: ``(mean, residuals)``."""
    mean = allgather_reselect_reference(accs, k)
    residuals = []
    for a in accs:
        _, mask = local_topk(a, k)
        residuals.append(torch.where(mask & (mean != 0), torch.zeros_like(a), a))
    return mean, residuals


def many_steps(kind: str, world: int, n: int, k: int, steps: int) -> dict[str, float]:
    """Relative error of the summed updates over ``steps`` error-feedback steps vs the summed dense means."""
    torch.manual_seed(100 + world)
    res_t = [torch.zeros(n) for _ in range(world)]
    res_a = [torch.zeros(n) for _ in range(world)]
    sum_t, sum_a, dense = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step in range(steps):
        g = grads(kind, world, n, step)
        dense += torch.stack(g).mean(0)
        u, res_t = tree_reference([x + r for x, r in zip(g, res_t)], k)[:2]
        sum_t += u
        u, res_a = _allgather_step([x + r for x, r in zip(g, res_a)], k)
        sum_a += u
    return {"tree_cum": _rel(sum_t, dense), "ag_cum": _rel(sum_a, dense)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| gradients | density | P | rel. error vs dense top-k: all-gather / tree "
          "| top-k overlap: all-gather / tree | tree vs all-gather | lost by the paper's put-back rule "
          f"| summed over {args.steps} steps: all-gather / tree |")  # fmt: skip
    print("| --- | --- | ---: | --- | --- | ---: | ---: | --- |")
    for kind in ("shared", "iid"):
        for density in (0.01, 0.001):
            k = max(1, round(density * args.n))
            for world in (2, 4, 8):
                one = one_step(kind, world, args.n, k)
                cum = many_steps(kind, world, args.n, k, args.steps)
                print(f"| {kind} | {density:.1%} | {world} | {one['ag_err']:.3f} / {one['tree_err']:.3f} "
                      f"| {one['ag_overlap']:.2f} / {one['tree_overlap']:.2f} | {one['tree_vs_ag']:.3f} "
                      f"| {one['lost']:.1%} | {cum['ag_cum']:.3f} / {cum['tree_cum']:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
