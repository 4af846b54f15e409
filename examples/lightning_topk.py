"""PyTorch Lightning with a top-k sparsified AdamW: one line of ``configure_optimizers`` changes.

    opt = torch.optim.AdamW(self.parameters(), lr=..., weight_decay=...)                       # before
    opt = ft.optimizer_from_torch(torch.optim.AdamW, self.parameters(),                   # after
                                       sparsify=ft.topk(k), lr=..., weight_decay=...)

An MLP with LayerNorm on scikit-learn's digits (no download), trained by
``lightning.Trainer`` with ``OneCycleLR`` stepped every optimizer step,
``gradient_clip_val`` and ``accumulate_grad_batches=2``; ``ModelCheckpoint``
writes a checkpoint after every epoch. Four fits (a few seconds on 2 CPU cores):

1. top-k AdamW, uninterrupted;
2. top-k AdamW resumed with ``Trainer.fit(..., ckpt_path=...)`` from run 1's checkpoint
   half way, into a model with other weights;
3. dense ``torch.optim.AdamW``;
4. dense ``ft.optimizer_from_torch(torch.optim.AdamW, ...)`` (``sparsify=None``).

Checks (the exit status is 1 if one fails): the resumed run ends with run 1's
parameters, AdamW state and scheduler state, bit for bit; the learning rate and
betas every optimizer step used (``OneCycleLR`` cycles both) are torch's; the
per-parameter ``step`` is the trainer's ``global_step``; run 4 equals run 3;
the top-k model learns.

    python examples/lightning_topk.py [--k 500] [--epochs 4] [--lr 0.01]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from quickstart import digits  # scikit-learn's 8x8 digits, split 80/20
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import functopk as ft

BATCH = 64


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))


class DigitsMLP(L.LightningModule):
    """``optimizer``: "topk" (functopk, sparsified), "functopk" (functopk, dense) or "torch"."""

    def __init__(
        self, optimizer: str, k: int | None, density: float | None, lr: float, total_steps: int, init_seed: int = 0
    ) -> None:
        super().__init__()
        self.net = make_mlp(init_seed)
        self.optimizer, self.k, self.density, self.lr, self.total_steps = optimizer, k, density, lr, total_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "torch":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        else:  # the functopk line
            sparsify = ft.topk(self.k, density=self.density) if self.optimizer == "topk" else None
            opt = ft.optimizer_from_torch(
                torch.optim.AdamW, self.parameters(), sparsify=sparsify, lr=self.lr, weight_decay=0.01
            )
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RecordHyperparams(Callback):
    """The learning rate and betas of every optimizer step, read from the optimizer's first param group."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.betas: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        group = optimizer.param_groups[0]
        self.lrs.append(group["lr"])
        self.betas.append(tuple(group["betas"]))


def loader(x: torch.Tensor, y: torch.Tensor, seed: int) -> DataLoader:
    # An epoch-seeded shuffle (Lightning calls sampler.set_epoch), so a resumed run sees the same batches.
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)


def fit(
    module: DigitsMLP,
    data: DataLoader,
    epochs: int,
    ckpt_dir: Path | None = None,
    ckpt_path: str | None = None,
    precision: str = "32-true",
) -> tuple[L.Trainer, RecordHyperparams]:
    record = RecordHyperparams()
    callbacks: list[Callback] = [record]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=1.0, accumulate_grad_batches=2,
        callbacks=callbacks, logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=ckpt_dir, precision=precision,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, record


def torch_one_cycle(lr: float, total_steps: int, steps: int) -> tuple[list[float], list[tuple[float, float]]]:
    """The lr and betas ``torch.optim.AdamW`` holds under ``OneCycleLR`` at each of ``steps`` steps (no Lightning)."""
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(tuple(opt.param_groups[0]["betas"]))
        opt.step()
        sched.step()
    return lrs, betas


def params_of(module: L.LightningModule) -> list[torch.Tensor]:
    return [p.detach() for p in module.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def state_equal(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> bool:
    """The per-parameter states of two optimizers hold the same keys and equal tensors, parameter by parameter."""
    pa = [p for g in opt_a.param_groups for p in g["params"]]
    pb = [p for g in opt_b.param_groups for p in g["params"]]
    for x, y in zip(pa, pb):
        sa, sb = opt_a.state[x], opt_b.state[y]
        if sorted(sa) != sorted(sb) or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return len(pa) == len(pb)


def max_state_diff(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> float:
    """The largest difference between the per-parameter states of two optimizers (inf if their keys differ)."""
    pa = [p for g in opt_a.param_groups for p in g["params"]]
    pb = [p for g in opt_b.param_groups for p in g["params"]]
    worst = 0.0
    for x, y in zip(pa, pb):
        sa, sb = opt_a.state[x], opt_b.state[y]
        if sorted(sa) != sorted(sb):
            return float("inf")
        worst = max([worst] + [(sa[k].double() - sb[k].double()).abs().max().item() for k in sa])
    return worst


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The four fits; what they produced, for the checks (and the tests)."""
    L.seed_everything(args.seed, verbose=False)
    x_train, x_test, y_train, y_test = digits(args.seed)
    data = loader(x_train, y_train, args.seed)
    steps_per_epoch = -(-len(data) // 2)  # accumulate_grad_batches=2; an odd last batch steps at the epoch end
    total = steps_per_epoch * args.epochs
    hp = {"k": None if args.density else args.k, "density": args.density, "lr": args.lr, "total_steps": total}
    out: dict[str, Any] = {"total_steps": total}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        topk = DigitsMLP("topk", **hp)
        trainer, record = fit(topk, data, args.epochs, ckpt_dir=Path(tmp))
        out["seconds_per_fit"] = time.perf_counter() - start
        half = Path(tmp) / f"epoch={args.epochs // 2 - 1}.ckpt"
        resumed = DigitsMLP("topk", **hp, init_seed=args.seed + 1)  # other weights: the checkpoint restores them
        try:
            resumed_trainer, resumed_record = fit(
                resumed, data, args.epochs, ckpt_dir=Path(tmp) / "resumed", ckpt_path=str(half)
            )
            resume_error = None
        except Exception as e:  # reported as failed checks
            resumed_trainer = resumed_record = None
            resume_error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    # float64 (Lightning's precision="64-true"), where the two agree to rounding: the same maths
    _, torch_record = fit(dense_torch := DigitsMLP("torch", **hp), data, args.epochs, precision="64-true")
    dense_ft_trainer, _ = fit(dense_ft := DigitsMLP("functopk", **hp), data, args.epochs, precision="64-true")

    opt = trainer.optimizers[0]
    with torch.no_grad():
        accuracy = (topk.net(x_test).argmax(1) == y_test).float().mean().item()
    ref_lrs, ref_betas = torch_one_cycle(args.lr, total, trainer.global_step)
    diff = max((a - b).abs().max().item() for a, b in zip(params_of(dense_ft), params_of(dense_torch)))
    state_diff = max_state_diff(dense_ft_trainer.optimizers[0], dense_torch.trainer.optimizers[0])
    sparsify = f"topk(density={args.density})" if args.density else f"topk({args.k})"
    checks = {
        "optimizer is functopk's, seen as torch.optim.AdamW (LearningRateMonitor would log lr-AdamW)":
            isinstance(opt, ft.ParamGroupOptimizer) and isinstance(opt, torch.optim.AdamW)
            and type(opt).__name__ == "AdamW",
        f"optimizer steps = {total} (accumulate_grad_batches=2)":
            trainer.global_step == total and len(record.lrs) == total,
        "per-parameter 'step' = trainer.global_step":
            all(int(opt.state[p]["step"]) == trainer.global_step for p in topk.parameters()),
        "lr of every step = torch.optim.AdamW's under OneCycleLR (Lightning run and plain torch)":
            record.lrs == torch_record.lrs == ref_lrs,
        "betas of every step = torch's (OneCycleLR cycles beta1)": record.betas == torch_record.betas == ref_betas,
        f"{sparsify} model learns (test accuracy {accuracy:.3f} > 0.7)": accuracy > 0.7,
        f"dense functopk = torch.optim.AdamW in float64 (parameters: max |diff| {diff:.1e})": diff < 1e-12,
        f"dense functopk's AdamW state = torch's in float64 (max |diff| {state_diff:.1e})": state_diff < 1e-12,
    }  # fmt: skip
    resume = "resume from the half-way checkpoint (Trainer.fit(ckpt_path=...))"
    if resumed_trainer is None:
        checks[f"{resume}: {resume_error}"] = False
    else:
        checks.update({
            f"{resume}: the steps after resuming are the rest": resumed_record.lrs == record.lrs[total // 2 :],
            f"{resume}: parameters = uninterrupted run's, bitwise": equal(params_of(resumed), params_of(topk)),
            f"{resume}: AdamW state = uninterrupted run's, bitwise": state_equal(resumed_trainer.optimizers[0], opt),
            f"{resume}: scheduler state = uninterrupted run's":
                resumed_trainer.lr_scheduler_configs[0].scheduler.state_dict()
                == trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        })  # fmt: skip
    out.update(
        optimizer=opt, scheduler=trainer.lr_scheduler_configs[0].scheduler, record=record, torch_record=torch_record,
        reference_lrs=ref_lrs, reference_betas=ref_betas, accuracy=accuracy, resume_error=resume_error, checks=checks,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=500, help="gradient coordinates kept per step (of 9,866)")
    parser.add_argument("--density", type=float, default=None, help="fraction kept per step, instead of --k")
    parser.add_argument("--epochs", type=int, default=4, help="an even number: the resume starts half way")
    parser.add_argument("--lr", type=float, default=0.01, help="OneCycleLR's max_lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks and the learning rates here")
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.epochs % 2:
        parser.error("--epochs must be even and at least 2")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")  # Lightning 2.6 on torch 2.14
        out = run(args)
    print(f"lightning {L.__version__}, torch {torch.__version__}: {out['total_steps']} optimizer steps per fit, "
          f"{out['seconds_per_fit']:.1f} s for the first")  # fmt: skip
    for name, ok in out["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
    if args.json is not None:
        group = out["optimizer"].param_groups[0]
        args.json.write_text(json.dumps({
            "checks": out["checks"], "resume_error": out["resume_error"], "total_steps": out["total_steps"],
            "max_lr": args.lr, "lrs": out["record"].lrs, "betas": out["record"].betas,
            "final_lr": group["lr"], "final_betas": group["betas"],
        }))  # fmt: skip
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
