"""Optimizer step time on a ResNet-50 parameter tree: functopk against torch.optim and TorchOpt.

For each optimizer (SGD with momentum, Adam, AdamW) it times one optimizer step
(the update plus adding it to the parameters; gradients are given, fixed random
tensors) in these variants:

* ``torch.optim foreach``: ``opt.step()`` with ``foreach=True`` (in place), the baseline;
* ``functopk eager pure``: ``tx.update`` then ``ft.apply_updates`` (new tensors);
* ``functopk eager in-place``: ``tx.update`` then ``ft.apply_updates_`` (into the parameters);
* ``functopk compiled pure``: the pure step under ``torch.compile(fullgraph=True)`` (inductor);
* ``TorchOpt``: its functional optimizer with ``inplace=True`` updates and apply, when installed.

All variants live side by side and are timed round-robin, one step each per
round, so machine load affects them alike; the table shows medians and ratios to
torch.optim. Every variant runs the same steps from the same start, and at the
end their parameters are checked against torch.optim's.

Usage:
    python benchmarks/optim.py                  # ResNet-50, 20 rounds
    python benchmarks/optim.py --quick          # ResNet-18, 3 rounds: a smoke run
    python benchmarks/optim.py --malloc tuned   # keep freed memory in the process (see below)

Memory: a pure step allocates new state tensors (torch.optim overwrites its
own). glibc returns large freed blocks to the system, so on CPU each step's new
tensors arrive as fresh pages, i.e. page faults. ``--malloc tuned`` re-runs the
script with glibc told to keep freed memory (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``), which is what jemalloc or
tcmalloc (the PyTorch CPU tuning guide's advice) do by default.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import functopk as ft  # noqa: E402

try:
    import torchopt
except ImportError:  # optional
    torchopt = None

LR = {"sgd-momentum": 0.1, "adam": 1e-3, "adamw": 1e-3}
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 29),
}


def model_params(name: str) -> dict[str, torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(tree):
    return {k: v.clone() for k, v in tree.items()}


def ft_optimizer(opt: str) -> ft.GradientTransformation:
    if opt == "sgd-momentum":
        return ft.sgd(LR[opt], momentum=0.9)
    if opt == "adam":
        return ft.adam(LR[opt])
    return ft.adamw(LR[opt], weight_decay=1e-2)


class TorchOptim:
    name = "torch.optim foreach"

    def __init__(self, opt: str, params, grads):
        self.tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
        for k, t in self.tensors.items():
            t.grad = grads[k]
        ps = list(self.tensors.values())
        if opt == "sgd-momentum":
            self.opt = torch.optim.SGD(ps, lr=LR[opt], momentum=0.9, foreach=True)
        elif opt == "adam":
            self.opt = torch.optim.Adam(ps, lr=LR[opt], foreach=True)
        else:
            self.opt = torch.optim.AdamW(ps, lr=LR[opt], weight_decay=1e-2, foreach=True)

    def step(self) -> None:
        self.opt.step()

    def params(self):
        return {k: v.detach() for k, v in self.tensors.items()}


class FunctopkPure:
    name = "functopk eager pure"

    def __init__(self, opt: str, params, grads):
        self.tx = ft_optimizer(opt)
        self.p = clone(params)
        self.grads = grads
        self.state = self.tx.init(self.p)

    def step(self) -> None:
        updates, self.state = self.tx.update(self.grads, self.state, self.p)
        self.p = ft.apply_updates(self.p, updates)

    def params(self):
        return self.p


class FunctopkInplace(FunctopkPure):
    name = "functopk eager in-place"

    def step(self) -> None:
        updates, self.state = self.tx.update(self.grads, self.state, self.p)
        ft.apply_updates_(self.p, updates)


class FunctopkCompiled(FunctopkPure):
    name = "functopk compiled pure"

    def __init__(self, opt: str, params, grads):
        super().__init__(opt, params, grads)
        tx = self.tx

        def step(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return ft.apply_updates(params, updates), state

        self.compiled = torch.compile(step, fullgraph=True)

    def step(self) -> None:
        self.p, self.state = self.compiled(self.p, self.grads, self.state)


class TorchOpt:
    name = "TorchOpt"

    def __init__(self, opt: str, params, grads):
        if opt == "sgd-momentum":
            self.tx = torchopt.sgd(LR[opt], momentum=0.9)
        elif opt == "adam":
            self.tx = torchopt.adam(LR[opt])
        else:
            self.tx = torchopt.adamw(LR[opt], weight_decay=1e-2)
        self.p = clone(params)
        self.source = grads
        self.grads = clone(grads)
        self.state = self.tx.init(self.p)

    def prepare(self) -> None:
        # inplace=True turns the gradient tensors into the updates: refill them (untimed).
        for k, v in self.source.items():
            self.grads[k].copy_(v)

    def step(self) -> None:
        # TorchOpt's fastest functional path: updates computed and applied in place.
        updates, self.state = self.tx.update(self.grads, self.state, params=self.p, inplace=True)
        torchopt.apply_updates(self.p, updates, inplace=True)

    def params(self):
        return self.p


def time_variants(variants, rounds: int, sync=lambda: None) -> dict[str, list[float]]:
    times = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            getattr(v, "prepare", lambda: None)()
            gc.collect()
            t0 = time.perf_counter()
            v.step()
            sync()
            times[v.name].append(time.perf_counter() - t0)
    return times


def run(model: str, rounds: int, warmup: int, opts: list[str], compile_: bool, device: str = "cpu") -> list[dict]:
    params = {k: v.to(device) for k, v in model_params(model).items()}
    g = torch.Generator().manual_seed(1)
    grads = {k: (torch.randn(v.shape, generator=g) * 1e-2).to(device) for k, v in params.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    numel = sum(v.numel() for v in params.values())
    malloc = "tuned" if all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()) else "default"
    print(f"# {model}: {len(params)} tensors, {numel / 1e6:.1f}M parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, glibc malloc {malloc}, "
          f"TorchOpt {torchopt.__version__ if torchopt else 'not installed'}",
          flush=True)
    rows = []
    for opt in opts:
        classes: list[Callable] = [TorchOptim, FunctopkPure, FunctopkInplace]
        if compile_:
            classes.append(FunctopkCompiled)
        if torchopt is not None:
            classes.append(TorchOpt)
        variants = [cls(opt, params, grads) for cls in classes]
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(warmup):
                getattr(v, "prepare", lambda: None)()
                v.step()
            if isinstance(v, FunctopkCompiled):
                print(f"  {opt}: compile + {warmup} warm-up steps took {time.perf_counter() - t0:.1f} s", flush=True)
        times = time_variants(variants, rounds, sync)
        ref = variants[0].params()
        base = statistics.median(times[variants[0].name])
        for v in variants:
            worst = max(
                float(((v.params()[k] - ref[k]).abs() / (ref[k].abs() + 1e-3)).max()) for k in ref
            )
            # functopk must match torch.optim to float32 rounding; TorchOpt's Adam orders its float32
            # operations differently, and with the same gradient every step the difference grows by
            # about 1e-5 per step (1.7e-4 after 22 steps), so it only gets a sanity bound
            if worst > (1e-3 if isinstance(v, TorchOpt) else 1e-4):
                raise AssertionError(f"{opt}/{v.name}: parameters differ from torch.optim's by {worst:.2e}")
            med = statistics.median(times[v.name])
            q = statistics.quantiles(times[v.name], n=4)
            rows.append(
                {"optimizer": opt, "variant": v.name, "ms": med * 1e3, "ratio": med / base, "iqr": (q[2] - q[0]) * 1e3}
            )
        del variants
        gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | variant | median ms / step | IQR ms | vs torch.optim foreach |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['optimizer']} | {r['variant']} | {r['ms']:.1f} | {r['iqr']:.1f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, opt in enumerate(opts):
            for r in rows:
                if r["optimizer"] == opt and r["variant"] == name:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(r["ms"])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(opts)), opts)
    ax.set_ylabel("median ms per step (lower is better)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="ResNet-18, 3 rounds: a smoke run")
    parser.add_argument("--model", default=None, help="a torchvision model name (default resnet50)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--optimizers", default="sgd-momentum,adam,adamw")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (parameters, gradients and states live there)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--out", default="out/bench/optim.png", help="where to write the plot")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--malloc", choices=["default", "tuned"], default="default",
                        help="glibc malloc settings for the run (tuned: keep freed memory in the process)")
    args = parser.parse_args()
    if args.malloc == "tuned" and any(os.environ.get(k) != v for k, v in TUNED_MALLOC.items()):
        # glibc reads these when the process starts: run again with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or ("resnet18" if args.quick else "resnet50")
    rounds = args.rounds or (3 if args.quick else 20)
    opts = args.optimizers.split(",")
    rows = run(model, rounds, warmup=2, opts=opts, compile_=not args.no_compile, device=args.device)
    print()
    print(table(rows))
    malloc = "tuned malloc" if all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()) else "default malloc"
    title = f"Optimizer step, {model} ({platform.machine()}, {torch.get_num_threads()} threads, {malloc})"
    plot(rows, args.out, title)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
