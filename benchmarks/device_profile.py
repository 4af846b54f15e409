"""Where a GPU step's time goes: kernel launches and the busiest host-side ops, by torch.profiler.

For the resnet50 parameter tree on one device (fixed random gradients), each case is run
once to warm up, then ``--steps`` times under ``torch.profiler``:

  torch.topk (concatenated)     the floor of the selection
  cat+topk+scatter              the usual dense top-k
  ft.topk_indices / topk_sparsify (k = 1000 and 1% of n; the default backend, Triton on CUDA), and
  ft.topk_indices with KernelConfig(backend="aten")
  torch.optim SGD / Adam foreach, and functopk's pure step, apply_updates_ and ft.update_
  one foreach multiply into a new tensor per leaf against the same in place: what a fresh tensor costs

It prints, per case: wall milliseconds per call (device synchronised), device kernels
launched per call, device busy milliseconds per call, and the host ops with the most self
time. Few device-busy milliseconds against many wall milliseconds means the step is
launch-bound (one kernel per leaf instead of foreach kernels).

Usage:
    python benchmarks/device_profile.py --device cuda --out benchmarks/results/gpu/profile.md
    python benchmarks/device_profile.py --device cpu --small --steps 1     # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import functopk as ft  # noqa: E402
from benchmarks.device_topk import ATEN, trees, usual_dense_topk  # noqa: E402
from benchmarks.timing import device_sync  # noqa: E402


def optimizer_cases(leaves: list[torch.Tensor]) -> dict:
    """torch.optim's foreach steps and functopk's three eager ways, for SGD momentum and Adam."""
    params = {f"p{i}": x.clone() for i, x in enumerate(leaves)}
    grads = {k: torch.randn_like(v) * 1e-3 for k, v in params.items()}
    cases = {}
    for name, tx, torch_opt in (
        ("sgd", ft.sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
        ("adam", ft.adam(1e-3), lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True)),
    ):
        tp = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(tp, grads.values()):
            p.grad = g.clone()
        opt = torch_opt(tp)
        cases[f"{name}: torch.optim foreach"] = opt.step
        box = {"p": {k: v.clone() for k, v in params.items()}}
        box["s"] = tx.init(box["p"])

        def pure(tx=tx, box=box):
            updates, box["s"] = tx.update(grads, box["s"], box["p"])
            box["p"] = ft.apply_updates(box["p"], updates)

        def inplace(tx=tx, box=box):
            updates, box["s"] = tx.update(grads, box["s"], box["p"])
            ft.apply_updates_(box["p"], updates)

        cases[f"{name}: functopk pure"] = pure
        cases[f"{name}: functopk apply_updates_"] = inplace
        cases[f"{name}: functopk update_"] = lambda tx=tx, box=box: ft.update_(tx, grads, box["s"], box["p"])
    return cases


def allocation_cases(leaves: list[torch.Tensor]) -> dict:
    """What a fresh tensor costs: one foreach multiply by 1 over the tree into new tensors, and the same in place
    (equal device work; the difference over the leaf count is the host's price of a tensor from the allocator)."""
    xs = [x.clone() for x in leaves]
    return {
        f"allocation probe: _foreach_mul, {len(xs)} new tensors": lambda: torch._foreach_mul(xs, 1.0),
        "allocation probe: _foreach_mul_, in place": lambda: torch._foreach_mul_(xs, 1.0),
    }


def profile_one(fn, steps: int, sync, device: str, top: int) -> tuple[float, int, float, list[str]]:
    """Wall ms per call, device kernels per call, device-busy ms per call, and the top host ops."""
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    wall = (time.perf_counter() - t) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(getattr(e, "device_time_total", 0.0) for e in kernels) / 1e3 / steps  # microseconds to ms
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40)
    return wall, round(len(kernels) / steps), busy, table.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a tree 100x smaller (smoke run)")
    parser.add_argument("--top", type=int, default=8, help="host ops listed per case")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args()
    sync = device_sync(args.device)
    leaves = trees(args.device, args.small)["resnet50"]
    n = sum(x.numel() for x in leaves)
    flat_mags = torch.cat([x.reshape(-1) for x in leaves]).abs()
    cases = {}
    for label, k in (("k=1000", 1000), ("k=1%", n // 100)):
        cases[f"torch.topk (concatenated), {label}"] = lambda k=k: torch.topk(flat_mags, k, sorted=False)
        cases[f"cat+topk+scatter, {label}"] = lambda k=k: usual_dense_topk(leaves, k)
        cases[f"ft.topk_indices, {label}"] = lambda k=k: ft.topk_indices(leaves, k)
        cases[f"ft.topk_indices (aten), {label}"] = lambda k=k: ft.topk_indices(leaves, k, config=ATEN)
        cases[f"ft.topk_sparsify, {label}"] = lambda k=k: ft.topk_sparsify(leaves, k)
    cases.update(optimizer_cases(leaves))
    cases.update(allocation_cases(leaves))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    summary = [f"torch {torch.__version__}, {args.device} ({name}), resnet50 tree: {len(leaves)} leaves, "
               f"{n / 1e6:.1f}M coordinates; {args.steps} profiled calls per case", "",
               "| case | wall ms / call | kernels / call | device-busy ms / call |", "| --- | ---: | ---: | ---: |"]
    details = []
    for case, fn in cases.items():
        wall, kernels, busy, table = profile_one(fn, args.steps, sync, args.device, args.top)
        summary.append(f"| {case} | {wall:.2f} | {kernels} | {busy:.2f} |")
        print(summary[-1], flush=True)
        details += ["", f"### {case}", "", "```", *table, "```"]
    text = "\n".join(summary + details) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
