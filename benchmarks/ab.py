"""A/B timing of the library's hot paths at two revisions, alternating processes on one machine.

Usage::

    python benchmarks/ab.py --base a95dd5f            # base revision vs the working tree
    python benchmarks/ab.py --base a95dd5f --runs 6 --threads 2
    python benchmarks/ab.py --base a95dd5f --only "adam,k=255570" --runs 10 --rounds 15
    python benchmarks/ab.py --base a95dd5f --clock cpu     # CPU time: on a machine others load too

Creates a temporary git worktree of ``--base``, then runs this script as a
child process in the base tree and in this tree by turns (``--runs`` each,
A B A B ...), so that machine load drifts hit both alike. Each child times, on
the parameter tree of torchvision's ResNet-50 with random gradients:
``ft.topk_indices`` and ``ft.topk_sparsify`` (exact, eager CPU); one pure step
of ``ft.sgd(lr, momentum=0.9)`` and of ``ft.adam(lr)`` (update plus pure apply)
and the same two in place (``ft.update_``); and one ``step()`` of the optimizer
``ft.optimizer_from_torch`` makes for each of the 13 ``torch.optim`` classes it
covers, without and with ``sparsify=ft.topk(n // 100)`` (Muon on the 2-D views of
the weights); it prints the median over ``--rounds`` calls. The parent prints,
per case, the median over runs of each side and the ratio new / base. Only
public names that exist at both revisions are used. Quote the load average
(printed before and after) with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child(rounds: int, only: str | None, clock: str = "wall") -> dict[str, float]:
    import torch
    import torchvision

    import functopk as ft

    model = torchvision.models.resnet50()
    g = torch.Generator().manual_seed(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    n = sum(v.numel() for v in params.values())
    cases: dict[str, Callable[[], Callable[[], object]]] = {}  # name -> make the timed call (made when timed)
    for k in (1_000, 10_000, 100_000, n // 100):
        cases[f"topk_indices k={k}"] = lambda k=k: lambda: ft.topk_indices(grads, k)
        cases[f"topk_sparsify k={k}"] = lambda k=k: lambda: ft.topk_sparsify(grads, k)
    for name, make in (("sgd momentum step", lambda: ft.sgd(0.1, momentum=0.9)), ("adam step", lambda: ft.adam(1e-3))):
        cases[name] = lambda make=make: pure_step(make(), params, grads)
        cases[f"update_ {name}"] = lambda make=make: in_place_step(make(), params, grads)
    cases.update(adapter_cases(model, n))
    out = {}
    for name, made in cases.items():
        if only and not any(part in name for part in only.split(",")):
            continue
        fn = made()  # (one case's state at a time: the 26 optimizers would not fit in memory together)
        fn()  # warm-up
        times = []
        now = time.perf_counter if clock == "wall" else time.process_time
        for _ in range(rounds):
            t0 = now()
            fn()
            times.append(now() - t0)
        out[name] = statistics.median(times) * 1e3
        del fn
    return out


def pure_step(tx: Any, params: dict[str, Any], grads: dict[str, Any]) -> Callable[[], object]:
    import functopk as ft

    state = tx.init(params)

    def step() -> object:
        updates, _ = tx.update(grads, state, params)
        return ft.apply_updates(params, updates)

    return step


def in_place_step(tx: Any, params: dict[str, Any], grads: dict[str, Any]) -> Callable[[], object]:
    import functopk as ft

    own = {k: v.clone() for k, v in params.items()}
    state = tx.init(own)
    return lambda: ft.update_(tx, grads, state, own)


ADAPTER_CLASSES = {
    "SGD": {"lr": 0.1, "momentum": 0.9}, "Adam": {"lr": 1e-3}, "AdamW": {"lr": 1e-3}, "RMSprop": {"lr": 1e-2},
    "Adagrad": {"lr": 1e-2}, "Adamax": {"lr": 2e-3}, "NAdam": {"lr": 2e-3}, "RAdam": {"lr": 1e-3},
    "Adadelta": {"lr": 1.0}, "Rprop": {"lr": 1e-2}, "ASGD": {"lr": 1e-2}, "Adafactor": {"lr": 1e-2},
    "Muon": {"lr": 0.02},
}  # fmt: skip


def adapter_cases(model: Any, n: int) -> dict[str, Callable[[], Callable[[], object]]]:
    """One ``step()`` of each class's adapter optimizer, without and with a global top-k of ``n // 100``."""
    return {f"adapter {name}{' + topk' if k else ''}": lambda name=name, k=k: adapter_step(model, name, k)
            for name in ADAPTER_CLASSES for k in (0, n // 100)}  # fmt: skip


def adapter_step(model: Any, name: str, k: int) -> Callable[[], object]:
    import torch

    import functopk as ft

    g = torch.Generator().manual_seed(1)
    ps = [p.detach().clone() for p in model.parameters()]
    if name == "Muon":  # (2-D parameters only)
        ps = [p.reshape(p.shape[0], -1).clone() for p in ps if p.dim() >= 2]
    for p in ps:
        p.requires_grad_()
        p.grad = torch.randn(p.shape, generator=g)
    sparsify = ft.topk(k) if k else None
    return ft.optimizer_from_torch(getattr(torch.optim, name), ps, sparsify, **ADAPTER_CLASSES[name]).step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=4, help="child processes per side")
    parser.add_argument("--rounds", type=int, default=9, help="timed calls per case in each child")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated substrings: time only the cases matching one")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or the process's CPU time (all its threads; less moved by other processes "
                        "on a shared machine)")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(child(args.rounds, args.only, args.clock)))
        return
    results: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            for _ in range(args.runs):
                for side, tree in (("base", base), ("new", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--base", args.base,
                           "--rounds", str(args.rounds)] + (["--threads", str(args.threads)] if args.threads else [])
                    cmd += (["--only", args.only] if args.only else []) + ["--clock", args.clock]
                    res = json.loads(subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True,
                                                    text=True).stdout.strip().splitlines()[-1])
                    for name, ms in res.items():
                        results[side].setdefault(name, []).append(ms)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; base {args.base}; "
          f"{args.runs} runs a side, median of {args.rounds} calls each; {args.threads or 'default'} threads; "
          f"{args.clock} clock; ms")
    print("| case | base | new | new / base |\n| --- | ---: | ---: | ---: |")
    for name in results["base"]:
        b, n = statistics.median(results["base"][name]), statistics.median(results["new"][name])
        print(f"| {name} | {b:.1f} | {n:.1f} | {n / b:.2f}x |")


if __name__ == "__main__":
    main()
