"""The host's part of an optimizer step on an accelerator, measured without one.

On a GPU an optimizer step over ResNet-50's 161 leaves is bound by the host:
the kernels of a foreach step take a fraction of a millisecond, the Python
around them and the launches the rest (``benchmarks/results/gpu/profile.md``).
This script measures that host part on the CPU:

* every leaf is tiny (``--numel`` coordinates), so the kernels' own work is
  negligible and what is timed is the Python, the dispatch and the per-leaf
  calls of each step;
* functopk runs the code path it runs on an accelerator: one foreach kernel
  per operation over all leaves (on the CPU it would otherwise run its maths
  batch by batch, :mod:`functopk.tree.chunked`, and write some results with a
  kernel per leaf). :func:`accelerator_path` switches the two places that
  choose by device.

What the CPU does not show: the CUDA caching allocator's host time per fresh
tensor and the launch cost per kernel, which the GPU adds to both sides (the
pure step allocates a new tensor per leaf and output: about 5 us each on the
H200). The CPU's foreach kernels loop over the leaves in C++, where CUDA's
launch a few kernels for all of them: both sides pay that alike.

Variants per optimizer, timed round-robin (one step each per round), medians:
``torch.optim`` foreach (the baseline), functopk's ``torch.optim`` adapter
(``ft.optimizer_from_torch``), ``ft.update_`` and the pure step
(``tx.update`` + ``ft.apply_updates``). The table also gives each one's extra
host time per leaf over the baseline and the aten operators it dispatches per
step at two leaf counts (the same count at both: nothing per leaf). Each
step's operators, recorded with their arguments, are also replayed alone: the
kernels' cost on this CPU (not a GPU's: here a ``mul`` by a number costs
three ``add``s), and the step less that, its Python, which a GPU step pays too.

Usage:
    python benchmarks/host_overhead.py                       # 161 leaves, 300 rounds
    python benchmarks/host_overhead.py --rounds 20 --opts sgd-momentum   # a smoke run
    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from optim import OPTIMIZERS, FunctopkPure, FunctopkTwin, Opt, TorchOptim  # noqa: E402
from timing import interleaved  # noqa: E402

import functopk as ft  # noqa: E402
from functopk.tree import chunked, foreach  # noqa: E402

CASES = ("sgd-momentum", "adam", "adamw")
LEAVES = 161  # ResNet-50's parameter tensors


@contextlib.contextmanager
def accelerator_path() -> Iterator[None]:
    """Inside, functopk runs its accelerator code path on CPU tensors (see the module docstring)."""
    with mock.patch.object(chunked, "applies", lambda params: False), \
            mock.patch.object(foreach, "eager_accelerator", lambda x: True):  # fmt: skip
        yield


class Adapter(FunctopkPure):
    name = "functopk torch.optim adapter"

    def __init__(self, opt: Opt, params, grads):
        self.tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
        for k, t in self.tensors.items():
            t.grad = grads[k]
        self.opt = ft.optimizer_from_torch(getattr(torch.optim, opt.torch_class), self.tensors.values(), **opt.kwargs)

    def step(self) -> None:
        self.opt.step()

    def params(self):
        return {k: v.detach() for k, v in self.tensors.items()}


VARIANTS = (TorchOptim, Adapter, FunctopkTwin, FunctopkPure)


def tree(leaves: int, numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i:03d}": torch.randn(numel, generator=g) for i in range(leaves)}


class _Count(TorchDispatchMode):
    """The operators dispatched (by name) and the tensors they return in new memory (``fresh``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.fresh = 0
        self.calls: list[tuple[Any, tuple, dict]] = []  # each operator with its arguments, to replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += 1
        if not func.__name__.startswith("_record_function") and not func.is_view:
            self.calls.append((func, args, kwargs or {}))  # (a profiler's range, a view: no kernel, no replay)
        out = func(*args, **(kwargs or {}))
        seen = {x.untyped_storage().data_ptr() for x in _tensors((args, kwargs))}
        self.fresh += sum(x.untyped_storage().data_ptr() not in seen and x.numel() > 1 for x in _tensors(out))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def ops_per_step(variant: type, opt: Opt, leaves: int, numel: int = 4) -> _Count:
    """The aten operators one step of ``variant`` dispatches (after a first step), on the accelerator path, and
    the tensors of more than one element they return in new memory (on a GPU: from the caching allocator)."""
    with accelerator_path():
        v = variant(opt, tree(leaves, numel, 0), tree(leaves, numel, 1))
        v.step()
        with _Count() as count:
            v.step()
    return count


def replay(calls: list[tuple[Any, tuple, dict]]) -> Callable[[], None]:
    """The recorded operators called again with their arguments: a step's kernels without the Python around them."""

    def run() -> None:
        with torch.no_grad():  # (as the optimizers step: their parameters require grad)
            for func, args, kwargs in calls:
                func(*args, **kwargs)

    return run


def run(opts: list[str], leaves: int, numel: int, rounds: int) -> list[dict]:
    rows = []
    with accelerator_path():
        for name in opts:
            opt = OPTIMIZERS[name]
            params, grads = tree(leaves, numel, 0), tree(leaves, numel, 1)
            variants = [cls(opt, params, grads) for cls in VARIANTS]
            counts = {v.name: (ops_per_step(type(v), opt, 8), ops_per_step(type(v), opt, leaves, numel))
                      for v in variants}  # fmt: skip
            times = interleaved({v.name: v.step for v in variants}, rounds)
            kernels = interleaved({n: replay(many.calls) for n, (_, many) in counts.items()}, rounds)
            base = times[variants[0].name]  # (TorchOptim: the first of VARIANTS)
            base_python = base - kernels[variants[0].name]
            for v in variants:
                (few, many), t = counts[v.name], times[v.name]
                rows.append(dict(opt=name, variant=v.name, us=t * 1e6, ratio=t / base,
                                 per_leaf=(t - base) * 1e6 / leaves, kernels=kernels[v.name] * 1e6,
                                 python=(t - kernels[v.name]) * 1e6,
                                 python_ratio=(t - kernels[v.name]) / base_python,
                                 ops=(sum(few.ops.values()), sum(many.ops.values())), fresh=many.fresh))
    return rows


def report(rows: list[dict], leaves: int, numel: int, rounds: int, load: tuple[str, str]) -> str:
    command = "python " + shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    lines = [
        f"# Host time of an optimizer step on the accelerator code path ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; load average before "
        f"{load[0]}, after {load[1]}.",
        "",
        f"{leaves} leaves of {numel} coordinates (CPU tensors, functopk on its accelerator path); {rounds} "
        "round-robin rounds after a warm-up step, medians; ratios and extra time per leaf against torch.optim "
        "foreach; aten operators dispatched per step with 8 leaves and with "
        f"{leaves}. Kernels: the step's aten operators replayed alone with their recorded arguments (this "
        "CPU's cost of them, which a GPU's differs from); Python: the step less its kernels, the host work a "
        "GPU step pays as it is.",
        "",
        "| optimizer | variant | us / step | vs torch.optim | extra us / leaf | kernels us | Python us | Python vs "
        f"torch.optim | ops / step (8 / {leaves} leaves) | new tensors / step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['opt']} | {r['variant']} | {r['us']:.0f} | {r['ratio']:.2f}x | {r['per_leaf']:.2f} | "
                     f"{r['kernels']:.0f} | {r['python']:.0f} | {r['python_ratio']:.2f}x | "
                     f"{r['ops'][0]} / {r['ops'][1]} | {r['fresh']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opts", default=",".join(CASES))
    parser.add_argument("--leaves", type=int, default=LEAVES)
    parser.add_argument("--numel", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = run(args.opts.split(","), args.leaves, args.numel, args.rounds)
    after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    text = report(rows, args.leaves, args.numel, args.rounds, (before, after))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
