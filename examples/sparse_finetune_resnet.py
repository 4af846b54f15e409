"""Sparse fine-tuning of a pretrained ResNet-18: a new head trained densely, 1% of the body, batch norm frozen.

The recipe of docs/sparse_finetuning.md on its experiment, small: torchvision's
ResNet-18 (the demo's small-image stem, one input channel) is pretrained with
AdamW on scikit-learn's handwritten digits 0-4 (nothing is downloaded), then
fine-tuned on 5-9:

    head = model.fc (re-initialized)                     # new classes: a new head, trained densely
    model.eval()                                         # batch-norm statistics frozen
    dense = torch.optim.AdamW(head.parameters(), lr=1e-3)
    sparse = ft.sparse_optimizer_from_torch(torch.optim.AdamW, body, density=0.01, refresh_every=20, lr=1e-3)

Between refreshes the body's convolutions compute their weight gradient at the
coordinate set only. The same fine-tuning with the body frozen (the head
alone) is the baseline.

Checks (the exit status is 1 if one fails): each step's ``backward`` leaves the
body's gradients freed; the body changes in at most ``k`` coordinates per
coordinate set (steps 0, 20, 40, ...); the batch-norm statistics do not move;
the head trains; the sparse fine-tuning ends more accurate on 5-9 than the
head alone.

    python examples/sparse_finetune_resnet.py [--density 0.01] [--steps 40] [--pretrain-steps 100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from checks import report  # examples/checks.py: the report the tests read
from sklearn.datasets import load_digits
from torch import nn
from train_resnet import make_model  # the demo's ResNet-18 (examples/ is on the path when run as a script)

import functopk as ft


def tasks() -> dict[str, tuple[torch.Tensor, ...]]:
    """Digits 0-4 (pretraining) and 5-9 (fine-tuning, labels 0-4), each split 70/30 into train and test."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, low in (("pretrain", 0), ("finetune", 5)):
        idx = torch.nonzero((y >= low) & (y < low + 5)).squeeze(1)
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        cut = int(0.7 * idx.numel())
        out[name] = (x[idx[:cut]], y[idx[:cut]] - low, x[idx[cut:]], y[idx[cut:]] - low)
    return out


def batches(n: int, steps: int, size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n, (size,), generator=gen) for _ in range(steps)]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def pretrained(data: tuple[torch.Tensor, ...], steps: int) -> nn.Module:
    model = make_model(1, 5, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for idx in batches(len(data[1]), steps, 32, seed=0):
        F.cross_entropy(model(data[0][idx]), data[1][idx]).backward()
        opt.step()
        opt.zero_grad()
    return model


def finetune(base: nn.Module, data: tuple[torch.Tensor, ...], args: argparse.Namespace, frozen: bool) -> dict:
    """The recipe (``frozen``: the body frozen, the head alone); what each step did."""
    model = make_model(1, 5, seed=0)
    model.load_state_dict(base.state_dict())
    torch.manual_seed(1)
    model.fc.reset_parameters()  # the new task's head
    model.eval()  # batch-norm statistics frozen
    body = [p for name, p in model.named_parameters() if not name.startswith("fc.")]
    stats = [b.clone() for b in model.buffers()]
    dense = torch.optim.AdamW(model.fc.parameters(), lr=1e-3, weight_decay=0.01)
    if frozen:
        for p in body:
            p.requires_grad_(False)
    else:
        sparse = ft.sparse_optimizer_from_torch(
            torch.optim.AdamW, body, density=args.density, refresh_every=args.refresh_every, lr=1e-3, weight_decay=0.01
        )
    start, head = [p.detach().clone() for p in body], model.fc.weight.detach().clone()
    freed = []
    for idx in batches(len(data[1]), args.steps, 32, seed=1):
        F.cross_entropy(model(data[0][idx]), data[1][idx]).backward()
        freed.append(all(p.grad is None for p in body))
        dense.step()
        dense.zero_grad()
        if not frozen:
            sparse.step()
            sparse.zero_grad()
    changed = sum(int((p != s).sum()) for p, s in zip(body, start))
    kept = all(torch.equal(a, b) for a, b in zip(model.buffers(), stats))
    return {"accuracy": accuracy(model, *data[2:]), "changed": changed, "freed": all(freed), "stats_kept": kept,
            "k": 0 if frozen else sparse.k, "head_trained": not torch.equal(model.fc.weight, head)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    data = tasks()
    base = pretrained(data["pretrain"], args.pretrain_steps)
    sparse = finetune(base, data["finetune"], args, frozen=False)
    head_only = finetune(base, data["finetune"], args, frozen=True)
    sets = (args.steps - 1) // args.refresh_every + 1
    checks = {
        "every backward left the body's gradients freed": sparse["freed"],
        f"the body changed in at most {sets} sets of k={sparse['k']} ({sparse['changed']} coordinates)":
            0 < sparse["changed"] <= sets * sparse["k"],
        "batch-norm statistics unchanged": sparse["stats_kept"] and head_only["stats_kept"],
        "the new head trained": sparse["head_trained"],
        f"sparse fine-tuning beats the head alone ({sparse['accuracy']:.3f} > {head_only['accuracy']:.3f})":
            sparse["accuracy"] > head_only["accuracy"],
    }  # fmt: skip
    return {"checks": checks, "sparse": sparse, "head_only": head_only}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of the body's coordinates trained")
    parser.add_argument("--refresh-every", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40, help="fine-tuning steps of 32 images")
    parser.add_argument("--pretrain-steps", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks here")
    args = parser.parse_args(argv)
    return report(run(args), args.json, f"torch {torch.__version__}")


if __name__ == "__main__":
    sys.exit(main())
