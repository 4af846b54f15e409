"""Compiled top-k against eager and against a compiled dense step: the two tables of docs/benchmarks.md.

Table 1, a whole training step (``grad`` + ``tx.update`` + ``apply_updates``)
on torchvision's resnet18 (10 classes), batch 16 of 3x32x32, CPU:

  dense     tx = sgd(0.1, momentum=0.9)
  topk1000  tx = chain(topk(1000), sgd(0.1, momentum=0.9))
  topk1%    tx = chain(topk(density=0.01), sgd(0.1, momentum=0.9))

each eager and compiled (``torch.compile(step, fullgraph=True)``, inductor).
Compile time is the wall time of the first compiled call (tracing, inductor
and the first run), with inductor's on-disk caches disabled (a cold compile,
as on a fresh machine; ``--warm-cache`` keeps them: a later run of the same
step then compiles in a few seconds). Then all variants run in interleaved rounds; medians.

Table 2, the selection alone (``ft.topk_sparsify(g, k)``) on the resnet50
parameter shapes (25.6M standard normal coordinates), k = 1000 and 1% of n, at
each thread count: eager (the eager exact kernel), compiled (the same kernel as
the ``functopk::topk_dense`` custom operator) and compiled ``method="torch"``
(the static kernel, which is what compiled "exact" ran before the operators).

Usage:
    python benchmarks/compiled_step.py                     # both tables (about 10 minutes on 2 cores)
    python benchmarks/compiled_step.py --quick             # fewer rounds, table 2 at 2 threads only
    python benchmarks/compiled_step.py --tables 2 --threads 1 2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch.func import grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import functopk as ft  # noqa: E402
from benchmarks.timing import device_sync, first_call, interleaved  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_step(model_fn, tx):
    def loss_fn(params, buffers, x, y):
        logits, buffers = model_fn(params, buffers, x, train=True)
        return F.cross_entropy(logits, y), buffers

    def step(params, buffers, opt_state, x, y):
        grads, buffers = grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ft.apply_updates(params, updates), buffers, opt_state

    return step


def step_table(rounds: int, device: str = "cpu") -> list[dict]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    model_fn, params, buffers = ft.nn.functionalize(model)
    x = torch.randn(16, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    n = sum(p.numel() for p in params.values())
    sync = device_sync(device)
    variants = {
        "dense": ft.sgd(0.1, momentum=0.9),
        "topk1000": ft.chain(ft.topk(1000), ft.sgd(0.1, momentum=0.9)),
        "topk1%": ft.chain(ft.topk(density=0.01), ft.sgd(0.1, momentum=0.9)),
    }
    fns, compile_s = {}, {}
    for name, tx in variants.items():
        state = tx.init(params)
        eager = make_step(model_fn, tx)
        compiled = torch.compile(eager, fullgraph=True)
        fns[f"{name} eager"] = lambda f=eager, s=state: f(params, buffers, s, x, y)
        fns[f"{name} compiled"] = lambda f=compiled, s=state: f(params, buffers, s, x, y)
        compile_s[name] = first_call(fns[f"{name} compiled"], sync)
        print(f"  {name}: first compiled call {compile_s[name]:.1f} s", flush=True)
    med = interleaved(fns, rounds, sync)
    rows = []
    for name in variants:
        e, c = med[f"{name} eager"], med[f"{name} compiled"]
        rows.append(
            dict(variant=name, n=n, eager_ms=1e3 * e, compiled_ms=1e3 * c, compile_s=compile_s[name],
                 vs_eager=c / e, vs_dense=c / med["dense compiled"])
        )
    return rows


def resnet50_tree(device: str = "cpu") -> list[torch.Tensor]:
    import torchvision

    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [p.shape for p in torchvision.models.resnet50().parameters()]
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def selection_table(rounds: int, threads: list[int], device: str = "cpu") -> list[dict]:
    tree = resnet50_tree(device)
    n = sum(x.numel() for x in tree)
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for label, k in (("1000", 1000), ("1% n", n // 100)):
            torch._dynamo.reset()
            compiled = torch.compile(lambda g, k=k: ft.topk_sparsify(g, k), fullgraph=True)
            static = torch.compile(lambda g, k=k: ft.topk_sparsify(g, k, method="torch"), fullgraph=True)
            same = all(torch.equal(a, b) for a, b in zip(compiled(tree), ft.topk_sparsify(tree, k)))
            med = interleaved(
                {"eager": lambda k=k: ft.topk_sparsify(tree, k), "compiled": lambda: compiled(tree),
                 "static": lambda: static(tree)},
                rounds,
                device_sync(device),
            )
            rows.append(dict(threads=t, k=label, eager_ms=1e3 * med["eager"], compiled_ms=1e3 * med["compiled"],
                             static_ms=1e3 * med["static"], ratio=med["compiled"] / med["eager"], identical=same))
            print(f"  {t} thread(s), k={label}: {rows[-1]}", flush=True)
    return rows


def markdown_steps(rows: list[dict]) -> str:
    lines = [
        "| step (resnet18, batch 16, 3x32x32) | eager (ms) | compiled (ms) | compiled / eager | "
        "compiled / compiled dense | first compiled call (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['eager_ms']:.0f} | {r['compiled_ms']:.0f} | {r['vs_eager']:.2f}x | "
            f"{r['vs_dense']:.2f}x | {r['compile_s']:.0f} |"
        )
    return "\n".join(lines)


def markdown_selection(rows: list[dict]) -> str:
    lines = [
        "| threads | k | eager exact (ms) | compiled exact, operator (ms) | compiled / eager | "
        "compiled static kernel (ms) | bit-identical to eager |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['threads']} | {r['k']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['ratio']:.2f}x | "
            f"{r['static_ms']:.0f} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def header(device: str) -> str:
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, device {device}, "
        f"load average before the run {load}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds; table 2 at 2 threads only")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts of table 2")
    parser.add_argument("--step-threads", type=int, default=2, help="threads of table 1")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk caches (default: cold)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled_step.md")
    args = parser.parse_args()
    if not args.warm_cache:
        torch._inductor.config.force_disable_caches = True
    rounds, threads = (3, [2]) if args.quick else (args.rounds, args.threads)
    parts = [f"# Compiled top-k ({time.strftime('%Y-%m-%d')})", "", header(args.device), ""]
    if 1 in args.tables:
        torch.set_num_threads(args.step_threads)
        print("table 1: whole steps", flush=True)
        steps = step_table(rounds, args.device)
        cache = "warm" if args.warm_cache else "cold (inductor caches disabled)"
        title = f"Whole steps, {args.step_threads} threads, {rounds} interleaved rounds, medians; compile {cache}:"
        parts += [title, "", markdown_steps(steps), ""]
    if 2 in args.tables:
        print("table 2: selection alone", flush=True)
        sel = selection_table(rounds, threads, args.device)
        title = f"Selection alone, resnet50 tree, {rounds} interleaved rounds, medians:"
        parts += [title, "", markdown_selection(sel), ""]
    text = "\n".join(parts)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
