"""Sharded data-parallel training with FSDP2 and the exact global top-k of the gradient (fsdp_topk).

The quickstart's CNN on scikit-learn's handwritten digits (no download), one
process per rank, each training on its own shard of the data, the parameters
sharded with ``torch.distributed.fsdp.fully_shard``:

    torchrun --standalone --nproc-per-node 2 examples/fsdp_topk.py [--k 500] [--epochs 8] [--dense]

After FSDP's reduce-scatter every rank holds its shard of the averaged
gradient; fsdp_topk selects the k coordinates of largest magnitude over the
whole unsharded model (k pairs per rank all-gathered), exactly as
functopk.topk_indices on the full gradient would, and the torch.optim adapter
(ft.optimizer_from_torch) applies SGD with momentum to that. --dense trains
without it, for comparison.

On CPU the ranks talk through gloo; with one GPU per rank, NCCL. Gloo has no
PREMUL_SUM, so every FSDP module reduces with a plain sum
(set_force_sum_reduction_for_comms) and divides afterwards.

Fault tolerance: with --checkpoint-dir, the sharded model and optimizer are
saved with torch.distributed.checkpoint every --checkpoint-every steps (each
rank writes its shards), and a restarted run resumes from the latest
checkpoint that every rank completed, bit for bit:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/fsdp_topk.py --checkpoint-dir ckpt

(The variable gives each restart its own rendezvous store; see examples/ddp_topk.py.)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# the same options, start, data and sampler as the DDP example
from ddp_topk import add_checkpoint_arguments, add_run_arguments, start_ranks, train_epochs
from quickstart import make_model  # the same CNN as the single-process example
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

import functopk as ft
from functopk.distributed import fsdp_topk

LATEST = "latest"  # the file naming the step of the newest checkpoint that every rank finished writing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=500, help="coordinates of the whole model updated per step")
    parser.add_argument("--dense", action="store_true", help="plain FSDP2 (no top-k), for comparison")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    add_run_arguments(parser)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save DCP checkpoints here and resume from the latest one")  # fmt: skip
    add_checkpoint_arguments(parser)
    return parser


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 on each convolution and the classifier, then the root (which takes the batch norms)."""
    for layer in model:
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo refuses PREMUL_SUM
    return model


def save_checkpoint(directory: str, step: int, every: int, model, opt, total: torch.Tensor) -> None:
    """Every rank writes its shards of step ``step``; then rank 0 moves the ``latest`` marker to it."""
    model_sd, optim_sd = get_state_dict(model, opt)
    extra = {"step": torch.tensor(step), f"total{dist.get_rank()}": total.clone()}  # the totals differ by rank
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": extra}, checkpoint_id=checkpoint_path(directory, step))
    dist.barrier()  # every rank's shards of this step are written
    if dist.get_rank() == 0:
        with open(os.path.join(directory, LATEST + ".tmp"), "w") as f:
            f.write(str(step))
        os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
        shutil.rmtree(checkpoint_path(directory, step - 2 * every), ignore_errors=True)  # the marker is past it


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step{step:08d}")


def resume(directory: str | None, model, opt, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """Load the latest complete checkpoint into ``model`` and ``opt``, if any: the step and the epoch's totals."""
    if not directory:
        return 0, None
    os.makedirs(directory, exist_ok=True)
    try:
        with open(os.path.join(directory, LATEST)) as f:
            step = int(f.read())
    except FileNotFoundError:
        return 0, None
    model_sd, optim_sd = get_state_dict(model, opt)  # the sharded layout to load into
    mine = f"total{dist.get_rank()}"
    state = {"model": model_sd, "optim": optim_sd, "extra": {"step": torch.tensor(0), mine: torch.zeros(2)}}
    dcp.load(state, checkpoint_id=checkpoint_path(directory, step))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if dist.get_rank() == 0:
        print(f"resumed from the checkpoint of step {step}", flush=True)
    return int(state["extra"]["step"]), state["extra"][mine].to(device)


def report(model, x_test: torch.Tensor, y_test: torch.Tensor, elapsed: float) -> None:
    """Test accuracy and a hash of the unsharded parameters (every rank takes part in gathering them)."""
    device = next(model.parameters()).device
    with torch.no_grad():  # before the forward: FSDP2 leaves the root's parameters unsharded after it
        flat = torch.cat([p.full_tensor().reshape(-1).cpu() for p in model.parameters()])
        model.eval()
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    if dist.get_rank() == 0:
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(f"test accuracy {accuracy:.3f}; {elapsed:.1f} s; parameters sha256 {digest}", flush=True)


def main() -> None:
    args, rank, world, device, loader, (x_train, x_test, y_test) = start_ranks(build_parser(), "fsdp_topk.py")
    use_cuda = device.type == "cuda"

    torch.manual_seed(args.seed)
    model = shard(make_model().to(device))
    sparsify = None if args.dense else fsdp_topk(args.k)
    opt = ft.optimizer_from_torch(torch.optim.SGD, model.parameters(), lr=args.lr, momentum=args.momentum,
                                  sparsify=sparsify)  # fmt: skip
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        mode = "dense FSDP2" if args.dense else f"fsdp_topk, k = {args.k} of {n:,} coordinates"
        print(f"{world} ranks ({'nccl' if use_cuda else 'gloo'}), {mode}; {len(x_train)} train / "
              f"{len(x_test)} test images")  # fmt: skip

    step, resumed_total = resume(args.checkpoint_dir, model, opt, device)

    def save(step: int, total: torch.Tensor) -> None:
        save_checkpoint(args.checkpoint_dir, step, args.checkpoint_every, model, opt, total)

    elapsed = train_epochs(model, opt, loader, device, args, step, resumed_total, save)
    report(model, x_test, y_test, elapsed)
    dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
