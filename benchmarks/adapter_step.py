"""What the torch.optim adapters cost per step, against the torch.optim class they stand in for.

One ``opt.step()`` on a torchvision model's parameters with fixed random
gradients, for each ``--optimizer`` (AdamW; SGD with momentum 0.9; ...):

* ``torch.optim``: ``torch.optim.X(..., foreach=True)`` (in place), the baseline;
* ``TorchOptimizer.from_torch``: the drop-in with torch's param-group semantics;
* ``TorchOptimizer(tx)``: the one-transformation adapter with ``ft.from_torch(X, ...)``;
* ``from_torch + topk``: the drop-in with ``sparsify=ft.topk(k)`` (a global exact top-k first);
* ``topk_indices alone``: ``ft.topk_indices`` of the same gradients, the selection the previous row
  runs (its target: torch.optim's step plus this).

The variants are timed round-robin, one step each per round; the table shows
medians and ratios to torch.optim, with the load average before and after, and
a last table has one row per class (``--variants`` chooses the rows of the
per-class tables: ``torch``, ``from_torch``, ``tx``, ``topk``, ``indices``).
``torch.optim.Muon`` takes only matrices: it runs on the model's 2-d
parameters (ResNet's ``fc.weight``); Muon has no ``foreach`` flag.

Usage:
    python benchmarks/adapter_step.py                 # ResNet-50, 15 rounds
    python benchmarks/adapter_step.py --model resnet18 --rounds 5
    python benchmarks/adapter_step.py --optimizer SGD Adam RMSprop Adagrad
    python benchmarks/adapter_step.py --optimizer all --variants torch from_torch --threads 1 2
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

KWARGS = {"SGD": {"lr": 1e-3, "momentum": 0.9}}  # the others: lr=1e-3 and torch's defaults
ALL = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD",
       "Adafactor", "Muon"]  # fmt: skip
NO_FOREACH = ("Muon",)
VARIANTS = {"torch": "torch.optim", "from_torch": "TorchOptimizer.from_torch", "tx": "TorchOptimizer(tx)",
            "topk": "from_torch + topk", "indices": "topk_indices alone"}  # fmt: skip


class _Selection:
    """``ft.topk_indices`` of the gradients, with an optimizer's ``step`` to time it the same way."""

    def __init__(self, params: list[torch.Tensor], k: int) -> None:
        self.params, self.k = params, k
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        ft.topk_indices([p.grad for p in self.params], self.k)


def make(kind: str, model: str, k: int, name: str) -> torch.optim.Optimizer | _Selection:
    torch.manual_seed(0)
    params = list(getattr(torchvision.models, model)().parameters())
    if name == "Muon":
        params = [p for p in params if p.dim() == 2]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    cls, kwargs = getattr(torch.optim, name), KWARGS.get(name, {"lr": 1e-3})
    if kind == "torch.optim":
        return cls(params, **kwargs) if name in NO_FOREACH else cls(params, foreach=True, **kwargs)
    if kind == "TorchOptimizer.from_torch":
        return ft.TorchOptimizer.from_torch(cls, params, **kwargs)
    if kind == "TorchOptimizer(tx)":
        return ft.TorchOptimizer(params, ft.from_torch(cls, **kwargs))
    if kind == "topk_indices alone":
        return _Selection(params, k)
    return ft.TorchOptimizer.from_torch(cls, params, ft.topk(min(k, sum(p.numel() for p in params))), **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="torchvision model name")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after 2 warm-up steps)")
    parser.add_argument("--k", type=int, default=1000, help="k of the sparsified variant")
    parser.add_argument("--optimizer", nargs="+", default=["AdamW"], help="torch.optim class names, or all")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="what to time (torch.optim is always timed)")  # fmt: skip
    parser.add_argument("--threads", nargs="+", type=int, default=[0], help="torch threads (0: torch's default)")
    args = parser.parse_args()
    names = ALL if args.optimizer == ["all"] else args.optimizer
    summary = []
    for threads in args.threads:
        if threads:
            torch.set_num_threads(threads)
        for name in names:
            summary.append((name, torch.get_num_threads(), *run(name, args)))
    print("| class | threads | torch.optim | from_torch | ratio | load |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, threads, base, ours, load in summary:
        print(f"| {name} | {threads} | {base * 1e3:.1f} ms | {ours * 1e3:.1f} ms | {ours / base:.2f}x | {load} |")


def run(name: str, args: argparse.Namespace) -> tuple[float, float, str]:
    """Time ``name``'s variants; ``(torch.optim's median, from_torch's median or NaN, load averages)``."""
    chosen = ["torch", *(v for v in args.variants if v != "torch")]
    kinds = [VARIANTS[v] + (f"({args.k})" if v == "topk" else "") for v in chosen]
    load_before = os.getloadavg()
    opts = {kind: make(kind, args.model, args.k, name) for kind in kinds}
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
    n = sum(p.numel() for p in opts["torch.optim"].param_groups[0]["params"])  # type: ignore[union-attr]
    print(f"{name} {KWARGS.get(name, {'lr': 1e-3})} step on {args.model} ({n:,} parameters), "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds, medians; "
          f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| variant | step | vs torch.optim |\n| --- | ---: | ---: |")
    for kind in kinds:
        med = statistics.median(times[kind])
        print(f"| {kind} | {med * 1e3:.1f} ms | {med / base:.2f}x |")
    print()
    ours = statistics.median(times[VARIANTS["from_torch"]]) if VARIANTS["from_torch"] in times else float("nan")
    return base, ours, f"{load_before[0]:.1f}-{os.getloadavg()[0]:.1f}"


if __name__ == "__main__":
    main()
