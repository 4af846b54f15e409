"""Whole training steps with and without the global top-k, eager and captured in a CUDA graph.

torchvision's resnet50 (1000 classes), batch 128 of 3x224x224, bfloat16 autocast, channels-last, on
CUDA; one fixed batch already on the device (no data loading). Two pairs, each like for like:

  (a) the usual module loop, eager (zero_grad, forward, backward, opt.step()):
      dense         torch.optim.SGD(lr=0.1, momentum=0.9)  (its foreach step)
      topk          ft.optimizer_from_torch(torch.optim.SGD, ..., lr=0.1, momentum=0.9, sparsify=ft.topk(1000))
  (b) the functional step (torch.func.grad, tx.update, ft.apply_updates), captured in a CUDA graph
      (docs/gpu.md's recipe) and replayed:
      dense graph   tx = ft.sgd(0.1, momentum=0.9)
      topk graph    tx = ft.chain(ft.topk(1000), ft.sgd(0.1, momentum=0.9))

Each variant runs ``--steps`` steps between two CUDA events; the variants take turns for ``--rounds``
rounds; the table gives the median time per step and the top-k variant over its dense twin.
Targets (H200): at most 1.05x for both pairs. With ``--compiled``, two more rows: the functional steps
compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (a few minutes of compiling).

On the CPU (a smoke run: ``--model resnet18 --batch 2 --size 32``) the functional steps run eagerly,
as no CUDA graph exists there, and the times are wall-clock medians.

Usage:
    python benchmarks/whole_step.py --out benchmarks/results/gpu/whole_step.md          # on a GPU
    python benchmarks/whole_step.py --device cpu --model resnet18 --batch 2 --size 32 --rounds 1 --steps 1
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import optree
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import functopk as ft  # noqa: E402
from benchmarks.timing import medians  # noqa: E402

TARGET = 1.05


def make_model(name: str, device: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)().to(device, memory_format=torch.channels_last)


def autocast(device: str, on: bool):
    """bfloat16 autocast (without its weight cache, which must not outlive a CUDA graph capture)."""
    return torch.autocast(device, dtype=torch.bfloat16, enabled=on, cache_enabled=False)


def module_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x, y, amp: bool) -> Callable[[], None]:
    """(a): the usual eager loop's step."""

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(x.device.type, amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return run


def functional_step(model_fn, tx, amp: bool):
    """(b): the pure step of docs/gpu.md."""

    def loss_fn(params, buffers, x, y):
        with autocast(x.device.type, amp):
            logits, buffers = model_fn(params, buffers, x)
        return F.cross_entropy(logits.float(), y), buffers

    def step(params, buffers, opt_state, x, y):
        grads, buffers = torch.func.grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ft.apply_updates(params, updates), buffers, opt_state

    return step


def replayed(step, state: tuple, batch: tuple) -> Callable[[], None]:
    """``step`` captured in a CUDA graph, its results copied back into ``state`` inside the graph: one replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton and cuDNN settle; the step is pure, its results dropped
        for _ in range(3):
            step(*state, *batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new = step(*state, *batch)
        for old, fresh in zip(optree.tree_leaves(state), optree.tree_leaves(new)):
            old.copy_(fresh)
    return graph.replay


def compiled(step, state: tuple, batch: tuple) -> Callable[[], None]:
    """``step`` compiled with ``mode="reduce-overhead"``, each call's results fed to the next."""
    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    carry = [state]

    def run() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        carry[0] = fn(*carry[0], *batch)

    for _ in range(3):  # compile, warm up, record the graph: the timed calls replay it
        run()
    return run


def variants(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    """Every variant's step, each on a model of its own (the same initial weights)."""
    device = args.device
    amp = cuda = device.startswith("cuda")  # bf16 autocast on the GPU only
    sgd = dict(lr=0.1, momentum=0.9)
    dense_model, topk_model = make_model(args.model, device), make_model(args.model, device)
    out = {
        "dense": module_step(dense_model, torch.optim.SGD(dense_model.parameters(), **sgd), x, y, amp),
        "topk": module_step(topk_model, ft.optimizer_from_torch(torch.optim.SGD, topk_model.parameters(),
                                                                sparsify=ft.topk(args.k), **sgd), x, y, amp),
    }
    txs = {"dense": ft.sgd(0.1, momentum=0.9), "topk": ft.chain(ft.topk(args.k), ft.sgd(0.1, momentum=0.9))}
    kinds = ["graph"] + (["compiled"] if args.compiled else [])
    for kind in kinds:
        for name, tx in txs.items():
            model_fn, params, buffers = ft.nn.functionalize(make_model(args.model, device))
            step, state = functional_step(model_fn, tx, amp), (params, buffers, tx.init(params))
            if kind == "compiled":
                out[f"{name} compiled"] = compiled(step, state, (x, y))
            elif cuda:
                out[f"{name} graph"] = replayed(step, state, (x, y))
            else:  # no CUDA graph on the CPU: the same step, eagerly
                carry = [state]
                out[f"{name} graph"] = lambda s=step, c=carry: c.__setitem__(0, s(*c[0], x, y))
    return out


def table(args: argparse.Namespace, med: dict[str, float], load: str) -> str:
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    timing = f"{args.steps} steps between CUDA events" if cuda else "each step timed alone"
    graph = "captured in a CUDA graph" if cuda else "eager (no CUDA graph on the CPU)"
    lines = [
        f"torch {torch.__version__}, device {args.device} ({name}), {args.model}, batch {args.batch} of "
        f"3x{args.size}x{args.size}, {'bf16 autocast, ' if cuda else ''}channels-last, k = {args.k}; "
        f"medians of {args.rounds} interleaved rounds, {timing}; load average before the run {load}",
        "",
        "| pair | dense (ms per step) | top-k (ms per step) | top-k / dense | target |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    pairs = [("(a) module loop, torch.optim.SGD vs optimizer_from_torch, eager", "dense", "topk"),
             (f"(b) functional step, {graph}", "dense graph", "topk graph")]
    if args.compiled:
        pairs.append(("functional step, torch.compile(mode='reduce-overhead')", "dense compiled", "topk compiled"))
    for label, dense, topk in pairs:
        ratio = med[topk] / med[dense]
        verdict = ("met" if ratio <= TARGET else "missed") if cuda else "on a GPU"
        lines.append(f"| {label} | {1e3 * med[dense]:.2f} | {1e3 * med[topk]:.2f} | {ratio:.3f}x | "
                     f"at most {TARGET:.2f}x ({verdict}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="resnet50", help="a torchvision.models name (default resnet50)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=224, help="image side (default 224)")
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed batch (CUDA)")
    parser.add_argument("--compiled", action="store_true", help="also the reduce-overhead compiled steps (CUDA)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    if args.device.startswith("cuda"):
        torch.backends.cudnn.benchmark = True  # the usual setting for a fixed input shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(args.device, memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), generator=g).to(args.device)
    fns = variants(args, x, y)
    text = table(args, medians(fns, args.rounds, args.steps, args.device), load)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
