"""The hook's per-bucket selection, ``selection="exact"`` vs ``"threshold"``, on 25 MB buckets (no process group).

Replays what :func:`functopk.distributed.topk_hook` does to one bucket each
step (``acc = grad + residual``; select the top ``k`` of ``acc``; the rest is
the new residual) with synthetic gradients: 10 "layers" whose scales span two
orders of magnitude, heavy-tailed (Student t, 3 degrees of freedom), redrawn
every step, the whole gradient drifting by ``--drift`` per step. Both
selections run on the same ``acc`` every step, in alternating order, and must
return the same coordinates (checked). One thread; medians over the measured
steps (after ``--warmup`` steps).

    python benchmarks/hook_selection.py --densities 0.01 0.001 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functopk
from functopk.distributed.exchange import _local_topk  # noqa: E402
from functopk.distributed.threshold import threshold_select  # noqa: E402


def gradients(n: int, steps: int, drift: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 0, 10)[torch.randperm(10, generator=gen)]
    layer = torch.repeat_interleave(scales, torch.full((10,), n // 10))
    layer = torch.cat([layer, layer.new_full((n - layer.numel(),), 1.0)])
    t = torch.distributions.StudentT(3.0)
    for step in range(steps):
        torch.manual_seed(seed * 1000 + step)
        yield t.sample((n,)) * layer * (1.0 + drift) ** step


def run(n: int, density: float, steps: int, warmup: int, drift: float, slack: float) -> dict:
    k = max(1, int(n * density))
    residual = torch.zeros(n)
    threshold = None
    exact_s, thr_s, fallbacks, cand_ratio = [], [], 0, []
    for step, g in enumerate(gradients(n, warmup + steps, drift, 0)):
        acc = g + residual
        order = ("exact", "threshold") if step % 2 else ("threshold", "exact")
        for which in order:
            t0 = time.perf_counter()
            if which == "exact":
                idx, vals = _local_topk(acc, k)
                dt_e = time.perf_counter() - t0
            else:
                old = threshold
                idx2, vals2, threshold, fb = threshold_select(acc, k, threshold, slack=slack)
                dt_t = time.perf_counter() - t0
        assert torch.equal(idx, idx2) and torch.equal(vals, vals2), "threshold mode selected other coordinates"
        if step >= warmup:
            exact_s.append(dt_e)
            thr_s.append(dt_t)
            fallbacks += fb
            if old is not None:
                cand_ratio.append(int((acc.abs() > old).sum()) / k)
        residual = acc.index_fill_(0, idx, 0)
    return {
        "density": density, "k": k, "exact_ms": 1e3 * statistics.median(exact_s),
        "threshold_ms": 1e3 * statistics.median(thr_s), "fallbacks": fallbacks, "steps": steps,
        "candidates_per_k": statistics.median(cand_ratio) if cand_ratio else float("nan"),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=25.0, help="bucket size in MB of float32 (DDP's default: 25)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--drift", type=float, default=0.01, help="relative change of the gradient scale per step")
    p.add_argument("--slack", type=float, default=0.97)
    args = p.parse_args()
    torch.set_num_threads(1)
    n = int(args.mb * 2**20) // 4
    print(f"bucket {args.mb} MB ({n} float32), 1 thread, {args.steps} steps after {args.warmup}, "
          f"drift {args.drift}/step, slack {args.slack}, torch {torch.__version__}")  # fmt: skip
    print("| density | k | exact ms | threshold ms | speed-up | fallbacks | candidates / k |")
    print("|---|---|---|---|---|---|---|")
    for d in args.densities:
        r = run(n, d, args.steps, args.warmup, args.drift, args.slack)
        print(f"| {d:g} | {r['k']} | {r['exact_ms']:.1f} | {r['threshold_ms']:.1f} | "
              f"{r['exact_ms'] / r['threshold_ms']:.2f}x | {r['fallbacks']}/{r['steps']} | "
              f"{r['candidates_per_k']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
