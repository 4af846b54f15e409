"""Where the time of a pure eager optimizer step goes on CPU, against torch.optim's in-place step.

A pure step (``tx.update`` + ``ft.apply_updates``) returns new tensors: SGD with
momentum writes three fresh trees per step (the momentum, the update, the
parameters), Adam and AdamW four (two moments, the update, the parameters);
torch.optim's foreach step writes into its own buffers (Adam allocates one tree,
its denominator). This script splits the difference into its causes by running
functopk's own kernels (the same ATen calls in the same order, so the same bits,
checked at the end) written by hand in four ways, interleaved round by round:

* ``functopk eager pure``: ``tx.update`` then ``ft.apply_updates``;
* ``kernels, fresh outputs``: the same kernels, each output a new tensor
  (``torch.empty_like``): functopk minus its Python (tree handling, checks);
* ``kernels, reused outputs``: the same kernels writing into buffers allocated
  once, two sets used alternately so that no output overwrites an input: no
  allocation, no page fault, but as many distinct bytes written as the pure step;
* ``kernels, in place``: the same kernels writing over their own inputs (moments
  and parameters; the update into one scratch tree): the memory traffic of an
  in-place step with functopk's kernel count;
* ``torch.optim foreach``, the baseline (``foreach=True``, in place).

Differences: pure - fresh = Python; fresh - reused = allocation (page faults,
allocator); reused - in place = writing new memory instead of memory the kernel
just read (each fresh output is read for ownership, then written back, on top of
the inputs); in place - torch = kernel count and kinds. Page faults per step are
``ru_minflt`` around the step; trees allocated per step: the bytes the
allocator hands out during one more step (torch.profiler), over the tree's.

Usage:
    python benchmarks/pure_floor.py --threads 1 --rounds 20
    python benchmarks/pure_floor.py --model resnet18 --rounds 3     # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from optim import OPTIMIZERS, FunctopkPure, TorchOptim, model_params  # noqa: E402

import functopk as ft  # noqa: E402

Leaves = list[torch.Tensor]
CASES = ("sgd-momentum", "adam", "adamw")


class Kernels:
    """functopk's pure step for one optimizer of :data:`CASES`, as hand-written ATen calls.

    ``mode``: ``"fresh"`` (new outputs), ``"reused"`` (two preallocated sets,
    alternately) or ``"inplace"`` (outputs over their inputs). The numbers are
    those of ``tx.update`` + ``ft.apply_updates`` bit for bit in every mode.
    """

    def __init__(self, case: str, mode: str, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]):
        self.case, self.mode, self.names = case, mode, list(params)
        self.name = "kernels, " + {"fresh": "fresh outputs", "reused": "reused outputs", "inplace": "in place"}[mode]
        self.g = [grads[k] for k in self.names]
        self.p = [params[k].clone() for k in self.names]
        zeros = [torch.zeros_like(x) for x in self.p]
        self.state = [zeros] if case == "sgd-momentum" else [zeros, [torch.zeros_like(x) for x in self.p]]
        self.count = torch.zeros((), dtype=torch.int64)
        roles = len(self.state) + 2  # the state trees, the update, the parameters
        self.pools = [[[torch.empty_like(x) for x in self.p] for _ in range(roles)] for _ in range(2)]
        self.scratch = [torch.empty_like(x) for x in self.p]
        self.parity = 0

    def _out(self, role: int, inputs: Leaves | None) -> Callable[[int], torch.Tensor]:
        """Where output tree ``role`` goes: leaf ``i`` -> its tensor."""
        if self.mode == "fresh":
            return lambda i: torch.empty_like(self.p[i])
        if self.mode == "reused":
            return lambda i: self.pools[self.parity][role][i]
        if inputs is None:
            return lambda i: self.scratch[i]
        return lambda i: inputs[i]

    def step(self) -> None:
        g, p, n = self.g, self.p, range(len(self.p))
        if self.case == "sgd-momentum":  # trace (add with alpha), scale (mul), apply (add)
            (t,) = self.state
            out = self._out(0, t)
            t = [torch.add(g[i], t[i], alpha=0.9, out=out(i)) for i in n]
            out = self._out(1, None)
            u = [torch.mul(t[i], -0.1, out=out(i)) for i in n]
            self.state = [t]
        else:
            u, moments = self._adam(g, p)
            self.state = moments
        out = self._out(len(self.state) + 1, p)
        self.p = [torch.add(p[i], u[i], out=out(i)) for i in n]
        self.parity ^= 1

    def _adam(self, g: Leaves, p: Leaves) -> tuple[Leaves, list[Leaves]]:
        """``adaptive.adam_direction`` with lr and (AdamW) the decoupled decay, as the pure step runs it."""
        mu, nu = self.state
        n = range(len(p))
        out = self._out(0, mu)
        mu = [torch.lerp(mu[i], g[i], 1.0 - 0.9, out=out(i)) for i in n]
        out = self._out(1, nu)
        nu = [torch.mul(nu[i], 0.999, out=out(i)) for i in n]
        for i in n:
            nu[i].addcmul_(g[i], g[i], value=1.0 - 0.999)
        t = (self.count + 1).to(torch.float64)
        bc1, bc2 = 1.0 - torch.pow(0.9, t), 1.0 - torch.pow(0.999, t)
        bc2_sqrt = torch.sqrt(bc2)
        eps, step = (1e-8 * bc2_sqrt).to(torch.float32), (bc2_sqrt / bc1 * -1e-3).to(torch.float32)
        out = self._out(2, None)
        u = [torch.sqrt(nu[i], out=out(i)) for i in n]
        for i in n:
            u[i].add_(eps)
        for i in n:
            torch.div(mu[i], u[i], out=u[i])
        for i in n:
            u[i].mul_(step)
        if self.case == "adamw":
            for i in n:
                u[i].add_(p[i], alpha=-1e-3 * 1e-2)
        self.count = self.count + 1
        return u, [mu, nu]

    def params(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.p))


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def trees_allocated(step: Callable[[], None], numel: int) -> float:
    """Bytes the allocator hands out during one ``step()``, in units of the tree (torch.profiler records)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    total = 0

    def walk(node) -> None:  # noqa: ANN001 (profiler's event node)
        nonlocal total
        if node.typed[0] == _EventType.Allocation and node.typed[1].alloc_size > 0:
            total += node.typed[1].alloc_size
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return total / (4 * numel)


def run_case(case: str, params, grads, rounds: int) -> list[dict]:
    opt = OPTIMIZERS[case]
    variants = [TorchOptim(opt, params, grads), FunctopkPure(opt, params, grads)]
    variants += [Kernels(case, mode, params, grads) for mode in ("fresh", "reused", "inplace")]
    for v in variants:  # warm-up
        for _ in range(2):
            v.step()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    flts: dict[str, list[int]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            gc.collect()
            f0, t0 = faults(), time.perf_counter()
            v.step()
            times[v.name].append(time.perf_counter() - t0)
            flts[v.name].append(faults() - f0)
    pure, fresh = variants[1].params(), variants[2].params()
    same = all(torch.equal(pure[k], x.params()[k]) for x in variants[2:] for k in pure)
    if not same or not all(torch.equal(pure[k], fresh[k]) for k in pure):
        raise SystemExit(f"{case}: the hand-written kernels no longer give functopk's bits: update this script")
    base = statistics.median(times[variants[0].name])
    numel = sum(x.numel() for x in params.values())
    return [{"case": case, "variant": v.name, "ms": statistics.median(times[v.name]) * 1e3,
             "ratio": statistics.median(times[v.name]) / base, "faults": statistics.median(flts[v.name]),
             "trees": trees_allocated(v.step, numel)}
            for v in variants]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = model_params(args.model)
    g = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in params.items()}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = [row for case in args.cases.split(",") for row in run_case(case, params, grads, args.rounds)]
    print(f"{args.model}, torch {torch.__version__} (functopk {ft.__version__}), {torch.get_num_threads()} threads, "
          f"{args.rounds} interleaved rounds, medians; load average {load} before, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| optimizer | variant | ms / step | vs torch.optim | page faults / step | trees allocated / step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['variant']} | {r['ms']:.1f} | {r['ratio']:.2f}x | {r['faults']:.0f} "
              f"| {r['trees']:.2f} |")


if __name__ == "__main__":
    main()
