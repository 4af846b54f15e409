"""What the torch.optim adapters cost per step, against the torch.optim class they stand in for.

One ``opt.step()`` on a torchvision model's parameters with fixed random
gradients, for each ``--optimizer`` (AdamW; SGD with momentum 0.9; ...):

* ``torch.optim``: ``torch.optim.X(..., foreach=True)`` (in place), the baseline;
* ``optimizer_from_torch``: the drop-in with torch's param-group semantics;
* ``TorchOptimizer(tx)``: the one-transformation adapter with ``ft.from_torch(X, ...)``;
* ``from_torch + topk``: the drop-in with ``sparsify=ft.topk(k)`` (a global exact top-k first);
* ``from_torch + topk(density=d)``: the same with ``ft.topk(density=d)`` (``--density``);
* with ``--generic``, the same two through ``ft.chain(ft.topk(...))``, which builds a new dense tree
  every step (the kept gradient buffer serves a constant ``ft.topk`` only);
* ``topk_indices alone``: ``ft.topk_indices`` of the same gradients, the selection the sparsified rows
  run (their target: torch.optim's step plus this), for ``k`` and for the density's ``k``;
* ``torch.optim on top-k grads``: torch's own foreach step on gradients already top-k'd (fixed), the
  cost of its step on mostly-zero gradients (a floor: with the selection, what a hand-written loop costs).

The variants are timed round-robin, one step each per round; the table shows
medians, ratios to torch.optim, and for the sparsified rows the ratio to torch's
step plus ``topk_indices`` (``vs target``) and to torch's step on top-k'd
gradients plus ``topk_indices`` (``vs floor``), with the load average before and after. ``--variants`` chooses the rows
(``torch``, ``from_torch``, ``tx``, ``topk``, ``density``, ``indices``, ``floor``;
torch.optim is always timed), and a last table has one row per class and
thread count. ``torch.optim.Muon`` takes only matrices: it runs on the model's
2-d parameters (ResNet's ``fc.weight``); Muon has no ``foreach`` flag.

``--whole`` times a whole training step instead (zero_grad, forward, cross-entropy,
backward, step) on ``--model`` (default resnet18) with a batch of 16 random
32x32 images: torch.optim; ``from_torch + topk(k)``; and torch.optim after
``ft.topk_indices`` of the gradients (the floor, gradients left dense).

Usage:
    python benchmarks/adapter_step.py                 # ResNet-50, 15 rounds
    python benchmarks/adapter_step.py --model resnet18 --rounds 5 --threads 1
    python benchmarks/adapter_step.py --optimizer SGD Adam RMSprop Adagrad
    python benchmarks/adapter_step.py --whole --optimizer SGD AdamW
    python benchmarks/adapter_step.py --optimizer all --variants torch from_torch --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torchvision

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import functopk as ft  # noqa: E402

KWARGS = {"SGD": {"lr": 1e-3, "momentum": 0.9}}  # the others: lr=1e-3 and torch's defaults
ALL = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD",
       "Adafactor", "Muon"]  # fmt: skip
NO_FOREACH = ("Muon",)
# --variants name -> the prefix of the rows it selects
VARIANTS = {"torch": "torch.optim", "from_torch": "optimizer_from_torch", "tx": "TorchOptimizer(tx)",
            "topk": "from_torch + topk(", "density": "from_torch + topk(density", "indices": "topk_indices alone",
            "floor": "torch.optim on top-k grads"}  # fmt: skip


class _Selection:
    """``ft.topk_indices`` of the gradients, with an optimizer's ``step`` to time it the same way."""

    def __init__(self, params: list[torch.Tensor], k: int) -> None:
        self.params, self.k = params, k
        self.param_groups = [{"params": params}]

    def step(self) -> None:
        ft.topk_indices([p.grad for p in self.params], self.k)


def _topk_grads(params: list[torch.Tensor], k: int) -> None:
    """Replace the gradients by their global top-k (dense, zeros elsewhere)."""
    for p, g in zip(params, ft.topk_sparsify([p.grad for p in params], k)):
        p.grad = g


def make(kind: str, model: str, k: int, name: str, density: float) -> torch.optim.Optimizer | _Selection:
    torch.manual_seed(0)
    params = list(getattr(torchvision.models, model)().parameters())
    if name == "Muon":
        params = [p for p in params if p.dim() == 2]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    cls, kwargs = getattr(torch.optim, name), KWARGS.get(name, {"lr": 1e-3})
    if kind == "torch.optim on top-k grads":
        _topk_grads(params, k)
    if kind.startswith("torch.optim"):
        return cls(params, **kwargs) if name in NO_FOREACH else cls(params, foreach=True, **kwargs)
    if kind == "optimizer_from_torch":
        return ft.optimizer_from_torch(cls, params, **kwargs)
    if kind == "TorchOptimizer(tx)":
        return ft.TorchOptimizer(params, ft.from_torch(cls, **kwargs))
    if kind.startswith("topk_indices alone"):
        return _Selection(params, k if "density" not in kind else ft.sparse.k_from_density(density, n))
    sparsify = ft.topk(density=density) if "density" in kind else ft.topk(k)
    if "generic" in kind:  # chain(topk) is not served by the kept gradient buffer: the dense-tree road
        sparsify = ft.chain(sparsify)
    return ft.optimizer_from_torch(cls, params, sparsify, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="torchvision model name (resnet50; --whole: resnet18)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after 2 warm-up steps)")
    parser.add_argument("--k", type=int, default=1000, help="k of the sparsified variant")
    parser.add_argument("--density", type=float, default=0.01, help="density of the other sparsified variant")
    parser.add_argument("--optimizer", nargs="+", default=["AdamW"], help="torch.optim class names, or all")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="rows to time (torch.optim is always timed)")  # fmt: skip
    parser.add_argument("--threads", nargs="+", type=int, default=[0], help="torch threads (0: torch's default)")
    parser.add_argument("--whole", action="store_true", help="time a whole training step (see above)")
    parser.add_argument("--generic", action="store_true", help="add the sparsified rows with chain(topk): no buffer")
    args = parser.parse_args()
    args.model = args.model or ("resnet18" if args.whole else "resnet50")
    names = ALL if args.optimizer == ["all"] else args.optimizer
    summary = []
    for threads in args.threads:
        if threads:
            torch.set_num_threads(threads)
        for name in names:
            if args.whole:
                run_whole(name, args)
            else:
                summary.append((name, torch.get_num_threads(), *run(name, args)))
    if summary:
        print("| class | threads | torch.optim | from_torch | ratio | load |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, threads, base, ours, load in summary:
        print(f"| {name} | {threads} | {base * 1e3:.1f} ms | {ours * 1e3:.1f} ms | {ours / base:.2f}x | {load} |")


def _timed(steps: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each step, timed round-robin after two warm-up calls each."""
    for step in steps.values():
        step()
        step()
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(rounds):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(t) for kind, t in times.items()}


def run(name: str, args: argparse.Namespace) -> tuple[float, float, str]:
    """Time ``name``'s chosen rows; ``(torch.optim's median, from_torch's median or NaN, load averages)``."""
    kinds = ["torch.optim", "optimizer_from_torch", "TorchOptimizer(tx)", f"from_torch + topk({args.k})",
             f"from_torch + topk(density={args.density})", f"topk_indices alone (k={args.k})",
             f"topk_indices alone (density={args.density})", "torch.optim on top-k grads"]  # fmt: skip
    if args.generic:
        kinds[5:5] = [f"from_torch + topk({args.k}), generic", f"from_torch + topk(density={args.density}), generic"]
    prefixes, all_kinds = [VARIANTS[v] for v in args.variants], kinds
    kinds = [kd for kd in all_kinds if kd == "torch.optim" or any(kd.startswith(p) for p in prefixes)]
    if any(kd.startswith("from_torch + topk") for kd in kinds):  # their ratios need the selection and the floor
        kinds += [kd for kd in all_kinds if kd.startswith(("topk_indices", "torch.optim on")) and kd not in kinds]
    load_before = os.getloadavg()
    opts = {kind: make(kind, args.model, args.k, name, args.density) for kind in kinds}
    med = _timed({kind: opt.step for kind, opt in opts.items()}, args.rounds)
    base, floor = med["torch.optim"], med.get("torch.optim on top-k grads", float("nan"))
    n = sum(p.numel() for p in opts["torch.optim"].param_groups[0]["params"])
    print(f"{name} {KWARGS.get(name, {'lr': 1e-3})} step on {args.model} ({n:,} parameters), "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds, medians; "
          f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| variant | step | vs torch.optim | vs target | vs floor |\n| --- | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        extra = "| | |"
        if kind.startswith("from_torch + topk"):
            sel = med[f"topk_indices alone ({'density=' + str(args.density) if 'density' in kind else f'k={args.k}'})"]
            extra = f"| {med[kind] / (base + sel):.2f}x | {med[kind] / (floor + sel):.2f}x |"
        print(f"| {kind} | {med[kind] * 1e3:.1f} ms | {med[kind] / base:.2f}x {extra}")
    print()
    return base, med.get("optimizer_from_torch", float("nan")), f"{load_before[0]:.1f}-{os.getloadavg()[0]:.1f}"


def whole_step(name: str, model_name: str, kind: str, k: int) -> Callable[[], object]:
    """One training step of ``model_name`` on a fixed batch of 16 32x32 images, with ``kind``'s optimizer."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(num_classes=10)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    params = list(model.parameters())
    cls, kwargs = getattr(torch.optim, name), KWARGS.get(name, {"lr": 1e-3})
    if kind.startswith("from_torch"):
        sparsify = ft.chain(ft.topk(k)) if "generic" in kind else ft.topk(k)
        opt: torch.optim.Optimizer = ft.optimizer_from_torch(cls, params, sparsify, **kwargs)
    else:
        opt = cls(params, foreach=True, **kwargs)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if kind.startswith("torch + topk_indices"):
            ft.topk_indices([p.grad for p in params], k)
        opt.step()

    return step


def run_whole(name: str, args: argparse.Namespace) -> None:
    kinds = ["torch.optim", f"from_torch + topk({args.k})", f"torch + topk_indices({args.k})"]
    if args.generic:
        kinds.append(f"from_torch + topk({args.k}), generic")
    load_before = os.getloadavg()
    med = _timed({kind: whole_step(name, args.model, kind, args.k) for kind in kinds}, args.rounds)
    print(f"whole {name} {KWARGS.get(name, {'lr': 1e-3})} training step, {args.model}, batch 16 at 32x32, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds, medians; "
          f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| variant | step | vs torch.optim | vs torch + topk_indices |\n| --- | ---: | ---: | ---: |")
    for kind in kinds:
        print(f"| {kind} | {med[kind] * 1e3:.1f} ms | {med[kind] / med[kinds[0]]:.2f}x "
              f"| {med[kind] / med[kinds[2]]:.2f}x |")
    print()


if __name__ == "__main__":
    main()
