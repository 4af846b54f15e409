"""Data-parallel training with DDP and top-k sparse gradient exchange (functopk.distributed.topk_hook).

A small CNN on scikit-learn's handwritten digits (no download), one process per
rank, each training on its own shard of the data:

    torchrun --nproc-per-node 2 examples/ddp_topk.py [--density 0.01] [--epochs 8] [--dense]

On CPU the ranks talk through gloo; with one GPU per rank, NCCL. Prints the
loss per epoch, the test accuracy, and the bytes each rank handed to the
collectives, against what plain DDP allreduce would have sent.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from quickstart import digits, make_model  # the same data and CNN as the single-process example
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from functopk.distributed import TopKHookState, topk_hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each bucket sent per step")
    parser.add_argument("--warmup-iters", type=int, default=10, help="dense iterations before compressing")
    parser.add_argument("--reselect", action="store_true", help="gTop-k: keep the global top k of the sum")
    parser.add_argument("--dense", action="store_true", help="plain DDP allreduce (no hook), for comparison")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 examples/ddp_topk.py")
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    x_train, x_test, y_train, y_test = digits(args.seed)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)
    model = DDP(make_model().to(device), device_ids=[device.index] if use_cuda else None)
    state = None
    if not args.dense:
        state = TopKHookState(density=args.density, warmup_iters=args.warmup_iters, reselect=args.reselect)
        model.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        mode = "dense allreduce" if args.dense else f"topk_hook, density {args.density:g}"
        print(f"{world} ranks ({'nccl' if use_cuda else 'gloo'}), {mode}; model has {n:,} parameters; "
              f"{len(x_train)} train / {len(x_test)} test images")  # fmt: skip

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)  # sum of losses, number of batches
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            line = f"epoch {epoch + 1:2d}  train loss {float(total[0] / total[1]):.4f}"
            if state is not None:
                t = state.total
                line += f"  sent so far {t.bytes_sent / 1e6:7.3f} MB (dense: {t.bytes_dense / 1e6:7.3f} MB)"
            print(line, flush=True)
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    # Every replica holds the same parameters: check it.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, flat) for g in gathered)
    if rank == 0:
        print(f"test accuracy {accuracy:.3f}; {elapsed:.1f} s; replicas identical: {identical}")
        if state is not None:
            t, last = state.total, state.last_step
            print(f"per step after warm-up: {last.bytes_sent / 1e3:.1f} kB sent per rank instead of "
                  f"{last.bytes_dense / 1e3:.1f} kB ({last.bytes_dense / last.bytes_sent:.0f}x less), "
                  f"{last.bytes_gathered / 1e3:.1f} kB received")
            print(f"in total over {state.iter} iterations ({state.warmup_iters} dense): {t.bytes_sent / 1e6:.3f} MB "
                  f"sent per rank; plain allreduce: {t.bytes_dense / 1e6:.3f} MB "
                  f"({t.bytes_dense / t.bytes_sent:.1f}x more)")  # fmt: skip
    # leave together: a rank tearing gloo down while its peer still talks to it can abort at exit; and
    # release DDP's reducer (which holds the process group and the hook state) before destroying the group
    del model, state, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
