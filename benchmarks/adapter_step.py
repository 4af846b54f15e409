"""What the torch.optim adapters cost per step, against the torch.optim class they stand in for.

One ``opt.step()`` on a torchvision model's parameters with fixed random
gradients, for:

* ``torch.optim``: ``torch.optim.AdamW(..., foreach=True)`` (in place), the baseline;
* ``TorchOptimizer.from_torch``: the drop-in with torch's param-group semantics;
* ``TorchOptimizer(tx)``: the one-transformation adapter with ``ft.adamw``;
* ``from_torch + topk``: the drop-in with ``sparsify=ft.topk(k)`` (a global exact top-k first).

The variants are timed round-robin, one step each per round; the table shows
medians and ratios to torch.optim, with the load average before and after.

Usage:
    python benchmarks/adapter_step.py                 # ResNet-50, 15 rounds
    python benchmarks/adapter_step.py --model resnet18 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torchvision

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import functopk as ft  # noqa: E402


def make(kind: str, model: str, k: int) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = list(getattr(torchvision.models, model)().parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if kind == "torch.optim":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "TorchOptimizer.from_torch":
        return ft.TorchOptimizer.from_torch(torch.optim.AdamW, params, lr=1e-3)
    if kind == "TorchOptimizer(tx)":
        return ft.TorchOptimizer(params, ft.adamw(1e-3))
    return ft.TorchOptimizer.from_torch(torch.optim.AdamW, params, ft.topk(k), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="torchvision model name")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after 2 warm-up steps)")
    parser.add_argument("--k", type=int, default=1000, help="k of the sparsified variant")
    args = parser.parse_args()
    kinds = ["torch.optim", "TorchOptimizer.from_torch", "TorchOptimizer(tx)", f"from_torch + topk({args.k})"]
    load_before = os.getloadavg()
    opts = {kind: make(kind, args.model, args.k) for kind in kinds}
    for opt in opts.values():
        opt.step()
        opt.step()
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            start = time.perf_counter()
            opts[kind].step()
            times[kind].append(time.perf_counter() - start)
    base = statistics.median(times["torch.optim"])
    n = sum(p.numel() for p in opts["torch.optim"].param_groups[0]["params"])
    print(f"AdamW step on {args.model} ({n:,} parameters), {torch.get_num_threads()} threads, {args.rounds} "
          f"interleaved rounds, medians; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| variant | step | vs torch.optim |\n| --- | ---: | ---: |")
    for kind in kinds:
        med = statistics.median(times[kind])
        print(f"| {kind} | {med * 1e3:.1f} ms | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
