"""A/B timing of the library's hot paths at two revisions, alternating processes on one machine.

Usage::

    python benchmarks/ab.py --base a95dd5f            # base revision vs the working tree
    python benchmarks/ab.py --base a95dd5f --runs 6 --threads 2
    python benchmarks/ab.py --base a95dd5f --only "adam,k=255570" --runs 10 --rounds 15

Creates a temporary git worktree of ``--base``, then runs this script as a
child process in the base tree and in this tree by turns (``--runs`` each,
A B A B ...), so that machine load drifts hit both alike. Each child times
``ft.topk_indices`` and ``ft.topk_sparsify`` (exact, eager CPU), one SGD step
of ``ft.sgd(lr, momentum=0.9)`` and one of ``ft.adam(lr)`` (update plus pure
apply) on the parameter tree of torchvision's ResNet-50 with random gradients,
and prints the median over ``--rounds`` calls; the parent prints, per case, the
median over runs of each side and the ratio new / base. Only public names that
exist at both revisions are used. Quote the load average with the numbers.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(rounds: int, only: str | None) -> dict[str, float]:
    import torch
    import torchvision

    import functopk as ft

    model = torchvision.models.resnet50()
    g = torch.Generator().manual_seed(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    n = sum(v.numel() for v in params.values())
    cases = {}
    for k in (1_000, 10_000, 100_000, n // 100):
        cases[f"topk_indices k={k}"] = lambda k=k: ft.topk_indices(grads, k)
        cases[f"topk_sparsify k={k}"] = lambda k=k: ft.topk_sparsify(grads, k)
    for name, tx in (("sgd momentum step", ft.sgd(0.1, momentum=0.9)), ("adam step", ft.adam(1e-3))):
        state = tx.init(params)

        def step(tx=tx, state=state):
            updates, _ = tx.update(grads, state, params)
            return ft.apply_updates(params, updates)

        cases[name] = step
    out = {}
    for name, fn in cases.items():
        if only and not any(part in name for part in only.split(",")):
            continue
        fn()  # warm-up
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=4, help="child processes per side")
    parser.add_argument("--rounds", type=int, default=9, help="timed calls per case in each child")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated substrings: time only the cases matching one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(child(args.rounds, args.only)))
        return
    results: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            for _ in range(args.runs):
                for side, tree in (("base", base), ("new", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--base", args.base,
                           "--rounds", str(args.rounds)] + (["--threads", str(args.threads)] if args.threads else [])
                    cmd += ["--only", args.only] if args.only else []
                    res = json.loads(subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True,
                                                    text=True).stdout.strip().splitlines()[-1])
                    for name, ms in res.items():
                        results[side].setdefault(name, []).append(ms)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    print(f"load average {os.getloadavg()[0]:.2f}; base {args.base}; {args.runs} runs a side, "
          f"median of {args.rounds} calls each; ms")
    print("| case | base | new | new / base |\n| --- | ---: | ---: | ---: |")
    for name in results["base"]:
        b, n = statistics.median(results["base"][name]), statistics.median(results["new"][name])
        print(f"| {name} | {b:.1f} | {n:.1f} | {n / b:.2f}x |")


if __name__ == "__main__":
    main()
