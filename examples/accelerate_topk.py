"""Hugging Face Accelerate with a top-k sparsified AdamW: one line of the training script changes.

    opt = torch.optim.AdamW(model.parameters(), lr=..., weight_decay=...)                      # before
    opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(),                  # after
                                       sparsify=ft.topk(k), lr=..., weight_decay=...)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

An MLP with LayerNorm on scikit-learn's digits (no download), on the CPU,
with ``gradient_accumulation_steps=2`` (``accelerator.accumulate``),
``accelerator.clip_grad_norm_`` and a warm-up + cosine schedule
(``SequentialLR(LinearLR, CosineAnnealingLR)``). Three runs (a second or so
each on 2 CPU cores): uninterrupted; the first half, ``accelerator.save_state``,
then ``accelerator.load_state`` into a fresh model, optimizer and scheduler and
the second half; and dense ``torch.optim.AdamW`` for the learning rates.

Checks (the exit status is 1 if one fails): Accelerate wraps functopk's
optimizer and steps it once per two batches; the learning rate of every step
is ``torch.optim.AdamW``'s under the same schedule; the run resumed from
``save_state``/``load_state`` ends with the uninterrupted run's parameters,
optimizer state and scheduler state, bit for bit; the model learns.

    python examples/accelerate_topk.py [--k 500] [--epochs 4] [--lr 0.01]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from quickstart import digits  # scikit-learn's 8x8 digits, split 80/20
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import functopk as ft

BATCH = 64
ACCUMULATE = 2


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))


def make_optimizer(kind: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sparsify = ft.topk(density=args.density) if args.density else ft.topk(args.k)
    return ft.optimizer_from_torch(  # the functopk line
        torch.optim.AdamW, model.parameters(), sparsify=sparsify, lr=args.lr, weight_decay=0.01
    )


def make_scheduler(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = max(1, total // 5)
    return torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, total - warmup)],
        milestones=[warmup],
    )  # fmt: skip


class Run:
    """A model, optimizer, scheduler and loader prepared by one Accelerator; ``epochs(n)`` trains."""

    def __init__(self, kind: str, args: argparse.Namespace, data: TensorDataset, total: int, init_seed: int) -> None:
        self.accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
        self.model = make_mlp(init_seed)
        self.opt = make_optimizer(kind, self.model, args)
        self.raw_opt = self.opt
        loader = DataLoader(data, batch_size=BATCH, shuffle=False, drop_last=True)
        self.model, self.opt, self.loader, self.sched = self.accelerator.prepare(
            self.model, self.opt, loader, make_scheduler(self.opt, total)
        )
        self.lrs: list[float] = []

    def epochs(self, n: int) -> None:
        acc = self.accelerator
        for _ in range(n):
            for x, y in self.loader:
                with acc.accumulate(self.model):
                    acc.backward(F.cross_entropy(self.model(x), y))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(self.model.parameters(), 1.0)
                        self.lrs.append(self.opt.param_groups[0]["lr"])
                    self.opt.step()
                    self.sched.step()
                    self.opt.zero_grad()


def torch_lrs(args: argparse.Namespace, total: int) -> list[float]:
    """The lr ``torch.optim.AdamW`` holds at each step under the same schedule, without Accelerate."""
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=args.lr, weight_decay=0.01)
    sched = make_scheduler(opt, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits(args.seed)
    perm = torch.randperm(len(x_train))
    data = TensorDataset(x_train[perm], y_train[perm])
    total = len(data) // BATCH // ACCUMULATE * args.epochs
    full = Run("topk", args, data, total, args.seed)
    full.epochs(args.epochs)
    dense = Run("torch", args, data, total, args.seed)
    dense.epochs(args.epochs)
    with torch.no_grad():
        accuracy = (full.model(x_test).argmax(1) == y_test).float().mean().item()
    sparsify = f"topk(density={args.density})" if args.density else f"topk({args.k})"
    checks = {
        "accelerator.prepare wraps functopk's optimizer (AcceleratedOptimizer)":
            type(full.opt).__name__ == "AcceleratedOptimizer" and full.opt.optimizer is full.raw_opt,
        f"{total} optimizer steps (gradient_accumulation_steps=2); every parameter's 'step' = {total}":
            len(full.lrs) == total and all(int(s["step"]) == total for s in full.raw_opt.state.values()),
        "lr of every step = torch.optim.AdamW's under the same schedule (Accelerate run and plain torch)":
            full.lrs == dense.lrs == torch_lrs(args, total),
        f"{sparsify} model learns (test accuracy {accuracy:.3f} > 0.7)": accuracy > 0.7,
    }  # fmt: skip
    name = "save_state half way, load_state into a fresh model, optimizer, scheduler"
    resume_error = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            first = Run("topk", args, data, total, args.seed)
            first.epochs(args.epochs // 2)
            first.accelerator.save_state(tmp)
            second = Run("topk", args, data, total, args.seed + 1)  # other weights: load_state restores them
            second.accelerator.load_state(tmp)
            second.epochs(args.epochs - args.epochs // 2)
        except Exception as e:
            resume_error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    if resume_error is not None:
        checks[f"{name}: {resume_error}"] = False
    else:
        checks.update({
            f"{name}: parameters = uninterrupted run's, bitwise":
                all(torch.equal(p, q) for p, q in zip(second.model.parameters(), full.model.parameters())),
            f"{name}: optimizer state = uninterrupted run's, bitwise": state_equal(second.raw_opt, full.raw_opt),
            f"{name}: scheduler state = uninterrupted run's":
                second.sched.scheduler.state_dict() == full.sched.scheduler.state_dict(),
            f"{name}: the lrs after resuming = the rest": second.lrs == full.lrs[len(first.lrs) :],
        })  # fmt: skip
    return {"checks": checks, "run": full, "reference_lrs": torch_lrs(args, total), "resume_error": resume_error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=500, help="gradient coordinates kept per step (of 9,866)")
    parser.add_argument("--density", type=float, default=None, help="fraction kept per step, instead of --k")
    parser.add_argument("--epochs", type=int, default=4, help="the resume starts after half of them")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks and the learning rates here")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    out = run(args)
    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}")
    for name, ok in out["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "checks": out["checks"], "resume_error": out["resume_error"], "lrs": out["run"].lrs,
            "final_lr": out["run"].opt.param_groups[0]["lr"], "lr": args.lr,
        }))  # fmt: skip
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
