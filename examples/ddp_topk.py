"""Data-parallel training with DDP and top-k sparse gradient exchange (functopk.distributed.topk_hook).

A small CNN on scikit-learn's handwritten digits (no download), one process per
rank, each training on its own shard of the data:

    torchrun --standalone --nproc-per-node 2 examples/ddp_topk.py [--density 0.01] [--epochs 8] [--dense]

The momentum (0.9) lives in the hook (DGC's momentum correction,
TopKHookState(momentum=...)) and SGD has none; --no-momentum-correction keeps
it in SGD with plain error feedback in the hook, which loses accuracy.

On CPU the ranks talk through gloo; with one GPU per rank, NCCL. Prints the
loss per epoch, the test accuracy, and the bytes each rank handed to the
collectives, against what plain DDP allreduce would have sent.

Fault tolerance: with --checkpoint-dir, every rank saves the model, the
optimizer and its own hook state (residuals differ between ranks) every
--checkpoint-every steps, one file per rank, and a restarted run resumes from
the latest checkpoint that every rank completed, bit for bit:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/ddp_topk.py --checkpoint-dir ckpt

(--standalone: torchrun's default static rendezvous often fails the first
restart. The variable gives each restart its own rendezvous store: with
torchrun's shared one, restarted ranks can read a dead peer's address and fail
to connect or hang, pytorch/pytorch#135712.)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from quickstart import digits, make_model  # the same data and CNN as the single-process example
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from functopk.distributed import TopKHookState, topk_hook

LATEST = "latest"  # the file naming the step of the newest checkpoint that every rank finished writing


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The training and process-group options this example shares with fsdp_topk.py."""
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="process-group timeout: a rank waiting on a peer that hangs fails after this long "
                             "(default 300; torch's own default is 30 minutes)")  # fmt: skip
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic GPU kernels (torch.use_deterministic_algorithms, cuBLAS workspace): "
                             "a run killed and resumed then ends bit-identical to a straight one on CUDA too")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint cadence and the crash for the restart test, shared with fsdp_topk.py."""
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (default 20)")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="testing: the last rank exits abruptly after this step, on the first attempt only "
                             "(TORCHELASTIC_RESTART_COUNT=0), for torchrun --max-restarts to restart the run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each bucket sent per step")
    parser.add_argument("--warmup-iters", type=int, default=10, help="dense iterations before compressing")
    parser.add_argument("--reselect", action="store_true", help="gTop-k: keep the global top k of the sum")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--no-momentum-correction", action="store_true",
                        help="top-k: keep the momentum in the optimizer (plain error feedback) instead of in the "
                             "hook (DGC's momentum correction, TopKHookState(momentum=...), the default)")  # fmt: skip
    parser.add_argument("--dense", action="store_true", help="plain DDP allreduce (no hook), for comparison")
    add_run_arguments(parser)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here (one file per rank) and resume from the latest one")  # fmt: skip
    add_checkpoint_arguments(parser)
    return parser


def checkpoint_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"step{step:08d}-rank{rank}.pt")


def save_checkpoint(directory: str, step: int, rank: int, every: int, payload: dict) -> None:
    """Write this rank's file, then (once every rank has) move the ``latest`` marker to ``step``."""
    path = checkpoint_path(directory, step, rank)
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a crash leaves the old file or the new one, never half of one
    dist.barrier()  # every rank's file for this step is complete
    if rank == 0:
        with open(os.path.join(directory, LATEST + ".tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
    old = checkpoint_path(directory, step - 2 * every, rank)  # the marker names step - every at least by now
    if os.path.exists(old):
        os.remove(old)


def load_checkpoint(directory: str, rank: int) -> dict | None:
    """This rank's part of the newest complete checkpoint, or ``None``."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            step = int(f.read())
    except FileNotFoundError:
        return None
    return torch.load(checkpoint_path(directory, step, rank), weights_only=True)


def resume(
    directory: str | None, model: DDP, opt: torch.optim.Optimizer, state: TopKHookState | None
) -> tuple[int, torch.Tensor | None]:
    """Load this rank's latest checkpoint, if any: the step reached and the epoch's running loss total."""
    if not directory:
        return 0, None
    os.makedirs(directory, exist_ok=True)
    saved = load_checkpoint(directory, dist.get_rank())
    if saved is None:
        return 0, None
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    if state is not None:
        state.load_state_dict(saved["hook"])
    if dist.get_rank() == 0:
        print(f"resumed from the checkpoint of step {saved['step']}", flush=True)
    return saved["step"], saved["epoch_total"].to(next(model.parameters()).device)


def report(model: DDP, state: TopKHookState | None, x_test: torch.Tensor, y_test: torch.Tensor, elapsed: float) -> None:
    """Test accuracy, that every replica holds the same parameters (and their hash), and the bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    # Every replica holds the same parameters: check it.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, flat) for g in gathered)
    if rank == 0:
        digest = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
        print(f"test accuracy {accuracy:.3f}; {elapsed:.1f} s; replicas identical: {identical}; "
              f"parameters sha256 {digest}")  # fmt: skip
        if state is not None:
            t, last = state.total, state.last_step
            # What a ring moves per rank: allreduce 2 (P - 1) / P times the buffer, the all-gather (P - 1) times
            # each rank's k pairs; the saving is n / (P k), so it shrinks as ranks are added.
            ring_dense, ring_sparse = 2 * (world - 1) / world * last.bytes_dense, (world - 1) * last.bytes_sent
            wire = (f"on the wire (ring, {world} ranks) {ring_sparse / 1e3:.1f} kB instead of "
                    f"{ring_dense / 1e3:.1f} kB ({ring_dense / ring_sparse:.0f}x less at P = {world})" if world > 1
                    else "nothing on the wire with a single rank")  # fmt: skip
            print(f"per step after warm-up: {last.bytes_sent / 1e3:.1f} kB handed over per rank instead of "
                  f"{last.bytes_dense / 1e3:.1f} kB; {wire}")
            print(f"in total over {state.iter} iterations ({state.warmup_iters} dense): {t.bytes_sent / 1e6:.3f} MB "
                  f"sent per rank; plain allreduce: {t.bytes_dense / 1e6:.3f} MB "
                  f"({t.bytes_dense / t.bytes_sent:.1f}x more); {state.skipped_iters} iterations with "
                  f"non-finite gradients")  # fmt: skip


def start_ranks(parser: argparse.ArgumentParser, script: str):
    """Parse the arguments, join the process group (nccl on CUDA, gloo on CPU), load this rank's digits.

    Returns ``(args, rank, world, device, loader, (x_train, x_test, y_test))``; shared with fsdp_topk.py.
    """
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error(f"launch with torchrun, e.g. torchrun --standalone --nproc-per-node 2 examples/{script}")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    if args.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: name any op without such a kernel
        torch.backends.cudnn.benchmark = False
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
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
    return args, rank, world, device, loader, (x_train, x_test, y_test)


def checkpoint_saver(args, model: DDP, opt, state: TopKHookState | None):
    """``save(step, total)`` for :func:`train_epochs`: this rank's checkpoint of the model, optimizer and hook."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def save(step: int, total: torch.Tensor) -> None:
        save_checkpoint(args.checkpoint_dir, step, rank, args.checkpoint_every, {
            "step": step, "world": world, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
            "hook": None if state is None else state.state_dict(), "epoch_total": total.clone(),
        })  # fmt: skip

    return save


def bytes_note(state: TopKHookState | None):
    """``note()`` for :func:`train_epochs`: the bytes the hook has sent so far, against dense."""

    def note() -> str:
        if state is None:
            return ""
        t = state.total
        return f"  sent so far {t.bytes_sent / 1e6:7.3f} MB (dense: {t.bytes_dense / 1e6:7.3f} MB)"

    return note


def train_epochs(model, opt, loader, device, args, step: int, resumed_total, save, note=lambda: "") -> float:
    """The training loop, shared with fsdp_topk.py; returns its seconds.

    Starts at ``step`` (0, or a checkpoint's), skipping the batches of the
    current epoch already trained on (the sampler's order depends only on the
    seed and the epoch); calls ``save(step, total)`` every
    ``--checkpoint-every`` steps with ``--checkpoint-dir``; at
    ``--crash-at-step`` the last rank exits abruptly, on torchrun's first
    attempt only; rank 0 prints each epoch's mean loss, then ``note()``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    steps_per_epoch = len(loader)
    start = time.perf_counter()
    for epoch in range(step // steps_per_epoch, args.epochs):
        loader.sampler.set_epoch(epoch)  # the same batches in the same order, resumed or not
        model.train()
        done = step - epoch * steps_per_epoch  # batches of this epoch already trained on before a restart
        total = resumed_total if done and resumed_total is not None else torch.zeros(2, device=device)
        for x, y in itertools.islice(loader, done, None):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            total += torch.stack([loss.detach(), torch.ones((), device=device)])  # sum of losses, batches
            if args.checkpoint_dir and step % args.checkpoint_every == 0:
                save(step, total)
            if step == args.crash_at_step and rank == world - 1 and first_attempt:
                print(f"rank {rank}: crashing after step {step} (--crash-at-step)", flush=True)
                os._exit(13)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  train loss {float(total[0] / total[1]):.4f}{note()}", flush=True)
    return time.perf_counter() - start


def main() -> None:
    args, rank, world, device, loader, (x_train, x_test, y_test) = start_ranks(build_parser(), "ddp_topk.py")
    use_cuda = device.type == "cuda"

    torch.manual_seed(args.seed)
    model = DDP(make_model().to(device), device_ids=[device.index] if use_cuda else None)
    state = None
    if not args.dense:
        # model= gives the residuals parameter names, so that they survive a restart. With momentum correction
        # the hook keeps the velocity (and sends momentum updates), so the optimizer has none.
        in_hook = 0.0 if args.no_momentum_correction else args.momentum
        state = TopKHookState(density=args.density, warmup_iters=args.warmup_iters, reselect=args.reselect,
                              momentum=in_hook, model=model)  # fmt: skip
        model.register_comm_hook(state, topk_hook)
    in_optimizer = args.momentum if state is None or not state.momentum else 0.0
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=in_optimizer)
    n = sum(p.numel() for p in model.parameters())
    if rank == 0:
        mode = "dense allreduce" if args.dense else f"topk_hook, density {args.density:g}"
        if state is not None and state.momentum:
            mode += f", momentum correction {state.momentum:g}"
        print(f"{world} ranks ({'nccl' if use_cuda else 'gloo'}), {mode}; model has {n:,} parameters; "
              f"{len(x_train)} train / {len(x_test)} test images")  # fmt: skip

    step, resumed_total = resume(args.checkpoint_dir, model, opt, state)

    save, note = checkpoint_saver(args, model, opt, state), bytes_note(state)
    elapsed = train_epochs(model, opt, loader, device, args, step, resumed_total, save, note)

    report(model, state, x_test, y_test, elapsed)
    # leave together: a rank tearing gloo down while its peer still talks to it can abort at exit; and
    # release DDP's reducer (which holds the process group and the hook state) before destroying the group
    del model, state, opt, save, note
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
