"""FSDP2 training steps with the exact global top-k (``fsdp_topk``) against dense FSDP2, unthrottled loopback.

    python benchmarks/fsdp_exact.py                     # ResNet-50, 2 ranks, 5 rounds (about 6 min on 2 cores)
    python benchmarks/fsdp_exact.py --model resnet18 --rounds 2 --steps 2   # a smoke run (1 min)

Starts ``--ranks`` processes with ``torchrun --standalone`` (gloo over TCP on
127.0.0.1, ``OMP_NUM_THREADS=1``, ``OMP_WAIT_POLICY=PASSIVE``). Each rank
builds torchvision's model (10 classes, batches of 8 random 3x32x32 images per
rank), ``fully_shard`` on every residual block and the root, with
``set_force_sum_reduction_for_comms(True)`` (gloo has no PREMUL_SUM), and
trains full steps (forward, backward with FSDP's all-gathers and
reduce-scatter, optimizer step) with each variant:

* ``dense``: ``torch.optim.SGD(momentum=0.9)`` on the sharded parameters;
* ``adapter``: the same SGD computed by functopk (``ft.optimizer_from_torch``,
  no ``sparsify``): the adapter's own cost;
* ``topk``: the adapter with ``sparsify=fsdp_topk(density=--density)``: each
  rank's local top-k, the all-gather of ``k`` pairs per rank, the global
  selection.

Each variant keeps its own model; every one is warmed up first. Then
``--rounds`` rounds visit every variant (order rotated per round) for one
untimed and ``--steps`` timed steps. A step's time is the slower rank's (an
all-reduce of the max, outside the timed region); the table gives medians of
the step, of its forward and backward and of ``opt.step`` alone, and the ratio to ``dense``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("dense", "adapter", "topk")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", choices=["resnet18", "resnet50"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01, help="fsdp_topk's fraction of all coordinates")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2)
    return parser


def make(model_name: str, variant: str, density: float):
    import torch
    import torchvision

    import functopk as ft
    from functopk.distributed import fsdp_topk
    from functopk.distributed.fsdp_torch import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(num_classes=10)
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            fully_shard(block)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    if variant == "dense":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        sparsify = fsdp_topk(density=density) if variant == "topk" else None
        opt = ft.optimizer_from_torch(torch.optim.SGD, model.parameters(), lr=0.01, momentum=0.9, sparsify=sparsify)
    return model, opt


def step(model, opt, x, y) -> tuple[float, float]:
    """One training step: ``(step seconds, opt.step seconds)``."""
    import torch.nn.functional as F

    t0 = time.perf_counter()
    F.cross_entropy(model(x), y).backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    runs = {v: make(args.model, v, args.density) for v in VARIANTS}
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for _ in range(args.warmup):
            step(*runs[v], x, y)
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            step(*runs[v], x, y)
            for _ in range(args.steps):
                t = torch.tensor(step(*runs[v], x, y), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's time
                times[v].append((float(t[0]), float(t[1])))
    if rank == 0:
        n = sum(p.numel() for p in runs["dense"][0].parameters())
        print(f"{args.model}, {n:,} parameters, {dist.get_world_size()} ranks (gloo, loopback), density "
              f"{args.density:g} (k = {int(n * args.density):,}); {args.rounds} rounds x {args.steps} steps")
        print("| variant | step median (s) | forward + backward (s) | opt.step (s) | step / dense |\n"
              "| --- | --- | --- | --- | --- |")
        base = statistics.median(s for s, _ in times["dense"])
        for v in VARIANTS:
            s, o = statistics.median(s for s, _ in times[v]), statistics.median(o for _, o in times[v])
            fb = statistics.median(s - o for s, o in times[v])
            print(f"| {v} | {s:.3f} | {fb:.3f} | {o:.3f} | {s / base:.3f} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = build_parser().parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           __file__, *sys.argv[1:]]  # fmt: skip
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
