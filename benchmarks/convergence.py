"""Convergence of sparsified training: dense SGD vs top-k with and without error feedback vs DGC.

torchvision's ResNet-18 (11.2M parameters) with a small-image stem (3x3 conv,
stride 1, one input channel, no max-pool) trained on scikit-learn's handwritten
digits (1,797 8x8 grayscale images, shipped with scikit-learn: no download).
Every method starts from the same initial weights, sees the same mini-batches
in the same order and gets the same number of epochs and the same learning
rate schedule; only the optimizer differs:

* ``dense``: ``ft.sgd(lr, momentum)``;
* ``topk``: ``chain(ft.topk(density=d), ft.sgd(lr, momentum))``: the
  coordinates not sent are dropped;
* ``topk+ef``: ``chain(ft.error_feedback(ft.topk(density=d)), ft.sgd(lr, momentum))``;
* ``dgc``: ``ft.dgc(lr, momentum, density)`` (momentum correction, momentum
  factor masking) with DGC's exponential density warm-up over the first
  ``--warmup-epochs`` (scaled to this short run).

Training steps are eager ``torch.func.grad`` over ``ft.nn.functionalize``
(BatchNorm statistics go in and come out). Prints a markdown table (final test
accuracy, best test accuracy, final train loss, wall time) and writes a PNG of
the curves.

    python benchmarks/convergence.py            # the documented run (about 8 minutes on 2 cores)
    python benchmarks/convergence.py --quick    # smoke run, well under a minute
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.func import grad_and_value

import functopk as ft

METHODS = ("dense", "topk", "topk+ef", "dgc")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PNG = os.path.join(ROOT, "docs", "img", "convergence.png")


def load_data(seed: int, test_fraction: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (N, 1, 8, 8) float tensors, standardised with the training split's statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=test_fraction, random_state=seed, stratify=y.numpy()
    )
    x_train, x_test = x[idx_train], x[idx_test]
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y[idx_train], (x_test - mean) / std, y[idx_test]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def make_tx(method: str, lr: Any, momentum: float, density: float) -> ft.GradientTransformation:
    if method == "dense":
        return ft.sgd(lr, momentum=momentum)
    if method == "topk":
        return ft.chain(ft.topk(density=density), ft.sgd(lr, momentum=momentum))
    if method == "topk+ef":
        return ft.chain(ft.error_feedback(ft.topk(density=density)), ft.sgd(lr, momentum=momentum))
    if method == "dgc":
        return ft.dgc(lr, momentum=momentum, density=density)
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def evaluate(model_fn: Callable, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        logits, _ = model_fn(params, buffers, x, train=False)
    return (logits.argmax(1) == y).float().mean().item() * 100.0


def train(method: str, args: argparse.Namespace, data: tuple) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    model_fn, params, buffers = ft.nn.functionalize(make_model(args.seed))
    n = len(y_train)
    steps_per_epoch = n // args.batch_size  # drop the last partial batch: every step has the same shape
    total_steps = steps_per_epoch * args.epochs
    lr = ft.cosine_decay_schedule(args.lr, total_steps)
    # DGC's density warm-up, evaluated on the host at each step; the transformation is rebuilt when the
    # density changes (its state carries over unchanged), as the reference calls warmup_compress_ratio(epoch).
    # ft.dgc(density=ft.dgc_density_warmup(...)) does the same inside the state where ft.topk takes a schedule.
    warmup_steps = max(1, round(args.warmup_epochs * steps_per_epoch / max(args.warmup_stages, 1)))
    density_at = ft.dgc_density_warmup(args.density, warmup_steps, args.warmup_stages)

    def loss_fn(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits, new_b = model_fn(p, b, x, train=True)
        return F.cross_entropy(logits, y), new_b

    grad_fn = grad_and_value(loss_fn, has_aux=True)
    density = float(density_at(0)) if method == "dgc" else args.density
    tx = make_tx(method, lr, args.momentum, density)
    state = tx.init(params)
    history = {"epoch": [0], "train_loss": [math.nan]}
    history["test_acc"] = [evaluate(model_fn, params, buffers, x_test, y_test)]
    step = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        losses = []
        for i in range(steps_per_epoch):
            if method == "dgc":
                d = float(density_at(step))
                if d != density:
                    density, tx = d, make_tx(method, lr, args.momentum, d)
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            grads, (loss, buffers) = grad_fn(params, buffers, x_train[idx], y_train[idx])
            updates, state = tx.update(grads, state, params)
            params = ft.apply_updates(params, updates)
            step += 1
            losses.append(loss.item())
        history["epoch"].append(epoch + 1)
        history["test_acc"].append(evaluate(model_fn, params, buffers, x_test, y_test))
        history["train_loss"].append(sum(losses) / len(losses))
        if args.verbose:
            print(f"  {method:8s} epoch {epoch + 1:2d}  loss {history['train_loss'][-1]:.4f}  "
                  f"test acc {history['test_acc'][-1]:.2f}%  ({time.perf_counter() - start:.0f} s wall, "
                  f"{time.process_time() - cpu_start:.0f} s CPU)", flush=True)
    history["wall_s"] = time.perf_counter() - start
    history["cpu_s"] = time.process_time() - cpu_start
    history["steps"] = step
    return history


def plot(results: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for method, h in results.items():
        ax1.plot(h["epoch"], h["test_acc"], marker="o", label=method)
        ax2.plot(h["epoch"][1:], h["train_loss"][1:], marker="o", label=method)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("test accuracy (%)")
    ax1.set_ylim(0, 100)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("mean training loss of the epoch")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--warmup-epochs", type=float, default=1.0, help="length of DGC's density warm-up")
    parser.add_argument("--warmup-stages", type=int, default=4, help="density stages in DGC's warm-up")
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--png", default=DEFAULT_PNG, help="where to write the curves")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 epoch on a tenth of the data")
    parser.add_argument("--verbose", action="store_true", help="print every epoch")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            parser.error(f"unknown method {m!r}; expected some of {METHODS}")

    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_data(args.seed, args.test_fraction)
    if args.quick:
        args.epochs = 1
        data = tuple(t[: len(t) // 10] for t in data)
        if args.png == DEFAULT_PNG:
            args.png = os.path.join(tempfile.gettempdir(), "functopk_convergence_quick.png")

    torch.manual_seed(args.seed)
    total_start = time.perf_counter()
    results = {}
    for method in methods:
        results[method] = train(method, args, data)

    n_params = sum(p.numel() for p in make_model(args.seed).parameters())
    k = ft.k_from_density(args.density, n_params)
    print(f"\nResNet-18 (small-image stem, {n_params:,} parameters) on sklearn digits: "
          f"{len(data[1])} train / {len(data[3])} test images, {args.epochs} epochs, batch {args.batch_size}, "
          f"SGD momentum {args.momentum}, lr {args.lr} cosine-decayed to 0, density {args.density} "
          f"(k = {k:,}), seed {args.seed}")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads\n")
    print("| method | final test acc (%) | best test acc (%) | final train loss | wall time (s) | CPU time (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for method, h in results.items():
        print(f"| {method} | {h['test_acc'][-1]:.2f} | {max(h['test_acc']):.2f} | {h['train_loss'][-1]:.4f} | "
              f"{h['wall_s']:.0f} | {h['cpu_s']:.0f} |")
    print("\ntest accuracy per epoch:")
    for method, h in results.items():
        print(f"  {method:8s} " + " ".join(f"{a:5.1f}" for a in h["test_acc"]))
    title = (f"ResNet-18 on sklearn digits, batch {args.batch_size}, lr {args.lr} (cosine), "
             f"momentum {args.momentum}, density {args.density}")
    plot(results, args.png, title)
    print(f"\nwrote {os.path.abspath(args.png)}")
    print(f"total wall time {time.perf_counter() - total_start:.0f} s")


if __name__ == "__main__":
    main()
