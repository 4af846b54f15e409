"""Quickstart: train a small CNN on scikit-learn's digits, applying only the top-k gradient coordinates.

Runs in well under a minute on a 2-core CPU, with no download:

    python examples/quickstart.py [--k 500] [--epochs 5] [--compile]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.func import grad_and_value

import functopk as ft


def digits(seed: int):
    """The 1,797 8x8 handwritten digits shipped with scikit-learn, split 80/20."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10),
    )  # fmt: skip


def train(tx: ft.GradientTransformation, args, x_train, y_train, x_test, y_test) -> tuple[float, float]:
    torch.manual_seed(args.seed)
    model_fn, params, buffers = ft.nn.functionalize(make_model())
    opt_state = tx.init(params)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = model_fn(params, buffers, x, train=True)
        return F.cross_entropy(logits, y), new_buffers

    def step(params, buffers, opt_state, x, y):
        grads, (loss, buffers) = grad_and_value(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ft.apply_updates(params, updates), buffers, opt_state, loss

    if args.compile:
        step = torch.compile(step, fullgraph=True)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.epochs):
        perm = torch.randperm(len(x_train), generator=g)
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            idx = perm[i : i + args.batch_size]
            params, buffers, opt_state, _ = step(params, buffers, opt_state, x_train[idx], y_train[idx])
    elapsed = time.perf_counter() - start
    logits, _ = model_fn(params, buffers, x_test, train=False)
    accuracy = (logits.argmax(1) == y_test).float().mean().item()
    return accuracy, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=500, help="gradient coordinates applied per step")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="compile the training step (fullgraph)")
    args = parser.parse_args()
    if args.k < 1:
        parser.error("--k must be >= 1")
    if args.epochs < 1:
        parser.error("--epochs must be >= 1")

    x_train, x_test, y_train, y_test = digits(args.seed)
    n = sum(p.numel() for p in make_model().parameters())
    if args.k > n:
        parser.error(f"--k must be at most the model's {n} parameters")
    runs = {
        "dense sgd (momentum 0.9)": ft.sgd(args.lr, momentum=0.9),
        f"top-{args.k} + sgd (momentum 0.9)": ft.chain(ft.topk(args.k), ft.sgd(args.lr, momentum=0.9)),
    }
    print(f"digits: {len(x_train)} train / {len(x_test)} test images; model has {n:,} parameters")
    print(f"{'optimizer':<34} {'test acc':>8} {'time':>7} {'density':>8}")
    for name, tx in runs.items():
        acc, secs = train(tx, args, x_train, y_train, x_test, y_test)
        density = 1.0 if name.startswith("dense") else args.k / n
        print(f"{name:<34} {acc:>8.3f} {secs:>6.1f}s {density:>8.4f}")


if __name__ == "__main__":
    main()
