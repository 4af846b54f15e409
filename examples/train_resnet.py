"""Train a ResNet-18 applying only the top-k gradient coordinates of the whole model each step.

torchvision's ``resnet18`` with a small-image stem (3x3 stride-1 first
convolution, no max-pool) is trained with ``torch.func`` and functopk on
scikit-learn's handwritten digits (1,797 8x8 images, shipped inside
scikit-learn: nothing is downloaded), or on CIFAR-10 when it is already on
disk. Every method starts from the same weights, sees the same mini-batches in
the same order and uses the same learning-rate schedule; only the update rule
differs:

* ``dense``: momentum SGD, ``ft.sgd(lr, momentum=m)``;
* ``topk``: ``ft.chain(ft.topk(k), ft.sgd(lr, momentum=m))``: every step applies
  the k largest gradient coordinates of the whole model and drops the rest;
* ``topk+ef``: ``ft.chain(ft.error_feedback(ft.topk(k)), ft.sgd(lr, momentum=m))``:
  what was not applied is remembered and added to the next gradient;
* ``dgc``: ``ft.dgc(lr, momentum=m, density=ft.dgc_density_warmup(...))``: Deep
  Gradient Compression (momentum correction, momentum factor masking and an
  exponential density warm-up over the first ``--warmup-epochs``).

It prints a table (test accuracy, training loss, wall time, density, and the
bytes one data-parallel rank would send per step against a dense all-reduce)
and writes the loss and accuracy curves and the share of each step's squared
norm that top-k sent (``ft.compress.compression_stats``) as a PNG, plus the
table as markdown and JSON (with the per-step statistics), under ``--out``.

    python examples/train_resnet.py                          # the demo: about 1.5 minutes on 2 quiet cores
    python examples/train_resnet.py --k 1000 --epochs 8      # k instead of a density
    python examples/train_resnet.py --dataset cifar10 --data-dir ~/data --device cuda --compile

``benchmarks/convergence.py`` runs the same code with the documented
experiment's settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.func import grad_and_value

import functopk as ft

METHODS = ("dense", "topk", "topk+ef", "dgc")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEX_BYTES = 4  # int32 flat indices (a ResNet-18 has fewer than 2**31 coordinates)


# --------------------------------------------------------------------------- options


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show (``None``, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n")[0], formatter_class=_Help)
    sel = parser.add_mutually_exclusive_group()
    sel.add_argument("--k", type=_positive_int, default=None, help="coordinates applied per step (global top-k)")
    sel.add_argument("--density", type=_fraction, default=None,
                     help="fraction of coordinates applied per step (0.001 when --k is not given either)")
    parser.add_argument("--methods", type=_methods, default=",".join(METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--epochs", type=_positive_int, default=4, help="passes over the training images")
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="images per step")
    parser.add_argument("--lr", type=_positive_float, default=0.05, help="peak learning rate (cosine decay to 0)")
    parser.add_argument("--momentum", type=_fraction_or_zero, default=0.9, help="momentum of every method's SGD")
    parser.add_argument("--warmup-epochs", type=_non_negative_float, default=1.0,
                        help="DGC: length of the exponential density warm-up (4 stages)")
    parser.add_argument("--dataset", choices=("digits", "cifar10"), default="digits",
                        help="scikit-learn's handwritten digits (shipped), or CIFAR-10 from --data-dir")
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "data"),
                        help="where CIFAR-10 already is (torchvision's cifar-10-batches-py layout); never downloaded")
    parser.add_argument("--train-size", type=_positive_int, default=None,
                        help="use only the first N training images (smoke runs)")
    parser.add_argument("--steps-per-epoch", type=_positive_int, default=None, help="cap the steps of an epoch")
    parser.add_argument("--device", type=_device, default=torch.device("cpu"), help="cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--compile", action="store_true",
                        help="compile the whole training step with torch.compile(fullgraph=True)")
    parser.add_argument("--threads", type=_non_negative_int, default=0,
                        help="torch intra-op threads; 0 keeps torch's choice")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="initial weights and batch order")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "train_resnet"),
                        help="directory for curves.png, results.md and results.json")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return parser


def _number(cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``cast(text)`` if it is finite and ``ok``, else an error saying ``expected``."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: v > 0, "a finite number > 0")
_non_negative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
_fraction = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_fraction_or_zero = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(METHODS)}, got {text!r}")
    return tuple(dict.fromkeys(methods))


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("MPS is not available on this machine")
    return device


# --------------------------------------------------------------------------- data and model


def load_data(
    name: str, data_dir: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``, standardised with the training split's statistics.

    Digits: a stratified 75/25 split fixed by ``seed``. CIFAR-10: the official
    split, read from ``data_dir`` (``FileNotFoundError`` when it is not there).
    """
    if name == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
        train_idx, test_idx = train_test_split(
            range(len(y)), test_size=0.25, random_state=seed, stratify=digits.target
        )
        x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    elif name == "cifar10":
        try:
            train = torchvision.datasets.CIFAR10(data_dir, train=True, download=False)
            test = torchvision.datasets.CIFAR10(data_dir, train=False, download=False)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise FileNotFoundError(
                f"CIFAR-10 is not in {os.path.abspath(data_dir)!r} ({err}). This script never downloads; fetch it "
                "once with torchvision.datasets.CIFAR10(root, download=True) and pass --data-dir root"
            ) from None

        def to_tensors(ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float() / 255.0
            return x, torch.tensor(ds.targets, dtype=torch.int64)

        (x_train, y_train), (x_test, y_test) = to_tensors(train), to_tensors(test)
    else:
        raise ValueError(f"dataset must be 'digits' or 'cifar10', got {name!r}")
    dims = (0, 2, 3)
    mean, std = x_train.mean(dims, keepdim=True), x_train.std(dims, keepdim=True)
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def make_model(in_channels: int, num_classes: int, seed: int) -> nn.Module:
    """torchvision's ResNet-18 with the small-image stem (3x3 stride-1 conv, no max-pool)."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


# --------------------------------------------------------------------------- the methods


def make_tx(method: str, lr: ft.base.ScalarOrSchedule, momentum: float, k: int, density_warmup: ft.base.Schedule
            ) -> ft.GradientTransformation:  # fmt: skip
    """The update rule of ``method``; ``k`` coordinates per step for the sparse ones."""
    if method == "dense":
        return ft.sgd(lr, momentum=momentum)
    stats = ft.compress.compression_stats  # records what each compressor kept; the updates are unchanged
    if method == "topk":
        return ft.chain(stats(ft.topk(k)), ft.sgd(lr, momentum=momentum))
    if method == "topk+ef":
        return ft.chain(ft.error_feedback(stats(ft.topk(k))), ft.sgd(lr, momentum=momentum))
    if method == "dgc":  # ft.dgc(lr, momentum=momentum, density=density_warmup), spelt out to measure its top-k
        return ft.chain(ft.momentum_correction(stats(ft.topk(density=density_warmup)), momentum=momentum),
                        ft.scale_by_learning_rate(lr))
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def wire_bytes(coords: int, numel: int, dense: bool) -> int:
    """Bytes one data-parallel rank hands to the network per step: fp32 values (+ int32 indices)."""
    return 4 * numel if dense else coords * (4 + INDEX_BYTES)


# --------------------------------------------------------------------------- training


def train(method: str, args: argparse.Namespace, data: tuple, progress: bool) -> dict[str, Any]:
    """Train one method from the shared initial weights; returns its history."""
    device = args.device
    x_train, y_train, x_test, y_test = (t.to(device) for t in data)
    model = make_model(x_train.shape[1], 10, args.seed).to(device)
    model_fn, params, buffers = ft.nn.functionalize(model)
    numel = sum(p.numel() for p in params.values())
    n = len(y_train)
    steps_per_epoch = steps_per_epoch_of(n, args)
    total_steps = steps_per_epoch * args.epochs
    k = args.k if args.k is not None else ft.sparse.k_from_density(args.density, numel)
    k = min(k, numel)
    warmup = dgc_warmup(k / numel, steps_per_epoch, args)
    lr = ft.cosine_decay_schedule(args.lr, total_steps)
    tx = make_tx(method, lr, args.momentum, k, warmup)

    def loss_fn(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits, new_b = model_fn(p, b, x, train=True)
        return F.cross_entropy(logits, y), new_b

    grad_fn = grad_and_value(loss_fn, has_aux=True)

    def step(params: dict, buffers: dict, state: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        grads, (loss, buffers) = grad_fn(params, buffers, x, y)
        updates, state = tx.update(grads, state, params)
        return ft.apply_updates(params, updates), buffers, state, loss.detach()

    if args.compile:
        step = torch.compile(step, fullgraph=True)

    def evaluate(params: dict, buffers: dict) -> float:
        correct = 0
        with torch.no_grad():
            for i in range(0, len(y_test), 1000):
                logits, _ = model_fn(params, buffers, x_test[i : i + 1000], train=False)
                correct += (logits.argmax(1) == y_test[i : i + 1000]).sum()
        return float(correct) / len(y_test) * 100.0

    state = tx.init(params)
    hist: dict[str, Any] = {"method": method, "epoch": [0], "test_acc": [evaluate(params, buffers)],
                            "epoch_loss": [math.nan], "step_loss": []}  # fmt: skip
    hist["energy_sent"] = []  # per step: the share of the compressor's input squared norm that it sent
    sent_stats: list[torch.Tensor] = []
    coords_sent = 0
    generator = torch.Generator().manual_seed(args.seed)
    bar = _progress(total_steps, f"{method:8s}", progress)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=generator).to(device)
        losses = []
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            t0 = time.perf_counter()
            params, buffers, state, loss = step(params, buffers, state, x_train[idx], y_train[idx])
            if epoch == 0 and i == 0:  # with --compile: the compilation
                hist["first_step_s"] = time.perf_counter() - t0
            losses.append(loss)
            sent_stats.extend(s.energy for s in compression_stats_in(state))
            t = epoch * steps_per_epoch + i
            coords_sent += numel if method == "dense" else _sent_at(method, t, k, warmup, numel)
            bar.update(1)
        epoch_losses = torch.stack(losses).tolist()  # one host sync per epoch
        hist["step_loss"].extend(epoch_losses)
        if sent_stats:
            hist["energy_sent"].extend(torch.stack(sent_stats).tolist())
            sent_stats = []
        hist["epoch"].append(epoch + 1)
        hist["epoch_loss"].append(sum(epoch_losses) / len(epoch_losses))
        hist["test_acc"].append(evaluate(params, buffers))
        bar.set_postfix(loss=f"{hist['epoch_loss'][-1]:.3f}", test_acc=f"{hist['test_acc'][-1]:.1f}%")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    hist["wall_s"] = time.perf_counter() - start
    bar.close()
    hist.update(numel=numel, k=k, steps=total_steps, density=coords_sent / (numel * total_steps),
                bytes_per_step=wire_bytes(coords_sent / total_steps, numel, method == "dense"),
                dense_bytes_per_step=wire_bytes(numel, numel, True))  # fmt: skip
    return hist


def steps_per_epoch_of(n: int, args: argparse.Namespace) -> int:
    """Full batches per epoch (one shape: no recompiles), capped by ``--steps-per-epoch``."""
    steps = max(1, n // args.batch_size)
    return min(steps, args.steps_per_epoch) if args.steps_per_epoch else steps


def dgc_warmup(density: float, steps_per_epoch: int, args: argparse.Namespace) -> ft.base.Schedule:
    """DGC's warm-up: 4 stages, each a quarter of ``--warmup-epochs``, density falling exponentially to ``density``."""
    stage_steps = max(1, round(args.warmup_epochs * steps_per_epoch / 4))
    return ft.dgc_density_warmup(density, stage_steps, 4 if args.warmup_epochs > 0 else 0)


def warmup_warning(k: int, numel: int, n: int, args: argparse.Namespace) -> str | None:
    """A warning when DGC's density warm-up outlasts the run (DGC then never sends as few as ``k``)."""
    if "dgc" not in args.methods or args.warmup_epochs <= 0:
        return None
    steps_per_epoch = steps_per_epoch_of(n, args)
    total = steps_per_epoch * args.epochs
    schedule = dgc_warmup(k / numel, steps_per_epoch, args)
    last = ft.sparse.k_from_density(float(schedule(torch.tensor(total - 1))), numel)
    if last <= k:
        return None
    return (f"warning: DGC's density warm-up ({args.warmup_epochs:g} {plural(args.warmup_epochs, 'epoch')}) "
            f"outlasts the {total}-step run: its last step still sends {last:,} coordinates, "
            f"{last / k:.0f}x k; lower --warmup-epochs or raise --epochs to compare it at k")


def plural(count: float, word: str) -> str:
    """``word`` or ``word + "s"`` for ``count``."""
    return word if count == 1 else word + "s"


def compression_stats_in(state: Any) -> list[ft.compress.CompressionStats]:
    """The statistics of every ``compression_stats`` wrapper inside an optimizer state."""
    nodes = optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ft.compress.CompressionStatsState))
    return [x.stats for x in nodes if isinstance(x, ft.compress.CompressionStatsState)]


def _sent_at(method: str, t: int, k: int, warmup: ft.base.Schedule, numel: int) -> int:
    """Coordinates a sparse method sends at step ``t`` (DGC: its warm-up density's k)."""
    if method == "dgc":
        return int(ft.sparse.k_from_density(float(warmup(t)), numel))
    return k


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
    return _NoBar()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- report


def table(results: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    rows = [
        "| method | final test acc (%) | best test acc (%) | final train loss | density | bytes/step (per rank) "
        "| vs dense | wall time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for h in results:
        rows.append(
            f"| {h['method']} | {h['test_acc'][-1]:.2f} | {max(h['test_acc']):.2f} | {h['epoch_loss'][-1]:.4f} "
            f"| {100 * h['density']:.3g}% | {_human(h['bytes_per_step'])} | "
            f"{h['bytes_per_step'] / h['dense_bytes_per_step']:.2%} | {h['wall_s']:.0f} |"
        )
    return "\n".join(rows)


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def plot(results: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Training loss per step (smoothed), test accuracy per epoch, and what each top-k step sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for h in results:
        color = f"C{METHODS.index(h['method'])}"  # one colour per method in every panel
        if h.get("energy_sent"):
            energy = torch.tensor(h["energy_sent"])
            steps_per_epoch = len(energy) / max(1, h["epoch"][-1])
            ax3.plot([(i + 1) / steps_per_epoch for i in range(len(energy))], energy.tolist(), label=h["method"],
                     color=color)
        losses = torch.tensor(h["step_loss"])
        width = max(1, len(losses) // 20)
        smooth = torch.nn.functional.avg_pool1d(losses[None, None], width, stride=1)[0, 0] if width > 1 else losses
        steps_per_epoch = len(losses) / max(1, h["epoch"][-1])
        ax1.plot([(i + width) / steps_per_epoch for i in range(len(smooth))], smooth.tolist(), label=h["method"],
                 color=color)
        ax2.plot(h["epoch"], h["test_acc"], marker="o", label=h["method"], color=color)
    ax1.set(xlabel="epoch", ylabel="training loss (running mean)", yscale="log")
    ax2.set(xlabel="epoch", ylabel="test accuracy (%)", ylim=(0, 100))
    ax3.set(xlabel="epoch", ylabel="share of |top-k input|^2 sent per step", yscale="log")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None, *, defaults: dict[str, Any] | None = None,
         description: str | None = None, png_name: str = "curves.png") -> list[dict[str, Any]]:  # fmt: skip
    """Parse ``argv``, train every method, print and write the results; returns the histories."""
    parser = build_parser(description)
    if defaults:
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    if args.k is None and args.density is None:
        args.density = 0.001
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data = load_data(args.dataset, args.data_dir, args.seed)
    except FileNotFoundError as err:
        parser.error(str(err))
    if args.train_size is not None:
        data = (data[0][: args.train_size], data[1][: args.train_size], data[2], data[3])
    if len(data[1]) < args.batch_size:
        parser.error(f"--batch-size {args.batch_size} exceeds the {len(data[1])} training images")

    numel = sum(p.numel() for p in make_model(data[0].shape[1], 10, args.seed).parameters())
    k = args.k if args.k is not None else ft.sparse.k_from_density(args.density, numel)
    if k > numel:
        parser.error(f"--k {k} exceeds the model's {numel:,} coordinates")
    header = (
        f"ResNet-18 (small-image stem, {numel:,} parameters) on {args.dataset}: {len(data[1])} train / "
        f"{len(data[3])} test images; {args.epochs} {plural(args.epochs, 'epoch')}, batch {args.batch_size}, "
        f"momentum SGD {args.momentum}, lr {args.lr} cosine to 0; k = {k:,} ({k / numel:.3%}) per step; "
        f"seed {args.seed}"
    )
    print(header)
    print(f"torch {torch.__version__}, device {args.device}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads{', compiled' if args.compile else ''}", flush=True)

    warning = warmup_warning(k, numel, len(data[1]), args)
    if warning:
        print(warning, flush=True)
    results = [train(m, args, data, progress=not args.no_progress) for m in args.methods]
    if args.compile:
        print("compile time (first step, compilation included): "
              + ", ".join(f"{h['method']} {h['first_step_s']:.1f} s" for h in results), flush=True)

    os.makedirs(args.out, exist_ok=True)
    md = table(results)
    print("\n" + md + "\n")
    print("test accuracy per epoch:")
    for h in results:
        print(f"  {h['method']:8s} " + " ".join(f"{a:5.1f}" for a in h["test_acc"]))
    png = os.path.join(args.out, png_name)
    plot(results, png, header)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(header + "\n\n" + md + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        options = {key: (str(v) if isinstance(v, torch.device) else v) for key, v in vars(args).items()}
        json.dump({"options": options, "torch": torch.__version__, "results": results}, f, indent=1)
    print(f"\nwrote {os.path.abspath(png)}")
    print(f"wrote {os.path.abspath(os.path.join(args.out, 'results.md'))} and results.json")
    return results


if __name__ == "__main__":
    main()
