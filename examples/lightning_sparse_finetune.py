"""PyTorch Lightning with ``ft.sparse_optimizer_from_torch``: ``k`` coordinates trained, accumulation and clipping.

    def configure_optimizers(self):
        return ft.sparse_optimizer_from_torch(torch.optim.AdamW, self.parameters(), density=0.02,
                                              refresh_every=3, grad_accumulation=True, lr=...)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        optimizer.clip_grad_norm_(gradient_clip_val)  # Lightning's own clips freed gradients: nothing

An MLP with LayerNorm on scikit-learn's digits (no download), trained by
``lightning.Trainer`` with ``accumulate_grad_batches=2`` (so the optimizer
takes ``grad_accumulation=True``) and ``gradient_clip_val`` (so the module
points Lightning's clipping at the optimizer's ``clip_grad_norm_``, which
clips the ``k`` values the step uses: the gradients themselves are freed
during backward, and torch's ``clip_grad_norm_`` on the parameters would do
nothing). Between refreshes the ``Linear`` layers compute their weight
gradient at the coordinate set only. Three runs (seconds on 2 CPU cores):

1. Lightning, uninterrupted, a checkpoint after every epoch;
2. Lightning resumed with ``Trainer.fit(..., ckpt_path=...)`` from run 1's
   half-way checkpoint, into a model with other weights;
3. a plain loop making the calls Lightning should make: ``zero_grad``, the
   first micro-batch's backward under ``opt.paused()``, the losses halved as
   Lightning halves them, ``clip_grad_norm_``, ``step``.

Checks (the exit status is 1 if one fails): run 1 equals run 3 bit for bit,
clip norms included (some above the clip value, so clipping acted); run 2
ends with run 1's parameters and sparse state bit for bit; the model learns.

    python examples/lightning_sparse_finetune.py [--density 0.02] [--epochs 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from checks import quiet_lightning, report  # examples/checks.py: the report the tests read
from lightning.pytorch.callbacks import ModelCheckpoint
from quickstart import digits  # scikit-learn's 8x8 digits, split 80/20
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import functopk as ft

BATCH, ACCUMULATE, CLIP = 64, 2, 0.5


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))


def make_optimizer(params: Any, args: argparse.Namespace) -> Any:
    return ft.sparse_optimizer_from_torch(torch.optim.AdamW, params, density=args.density, refresh_every=3,
                                          grad_accumulation=True, lr=args.lr, weight_decay=0.01)  # fmt: skip


class DigitsMLP(L.LightningModule):
    def __init__(self, args: argparse.Namespace, init_seed: int = 0) -> None:
        super().__init__()
        self.net, self.args, self.norms = make_mlp(init_seed), args, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.parameters(), self.args)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        if gradient_clip_val:  # the k values the step uses; Lightning's default sees no gradient
            self.norms.append(float(optimizer.clip_grad_norm_(gradient_clip_val)))


def loader(x: torch.Tensor, y: torch.Tensor, seed: int) -> DataLoader:
    # An epoch-seeded shuffle (Lightning calls sampler.set_epoch), so a resumed run sees the same batches.
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)


def fit(module: DigitsMLP, data: DataLoader, epochs: int, ckpt_dir: Path, ckpt_path: str | None = None) -> None:
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=CLIP, accumulate_grad_batches=ACCUMULATE,
        callbacks=[checkpoint], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=ckpt_dir,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    trainer.optimizers[0].remove()  # the parameters are free again


def plain_loop(args: argparse.Namespace, data: DataLoader) -> tuple[nn.Module, list[float]]:
    """Run 3: the calls Lightning makes, written out."""
    net = make_mlp(0)
    opt = make_optimizer(net.parameters(), args)
    norms = []
    for epoch in range(args.epochs):
        data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        batches = list(data)
        for first, last in zip(batches[0::2], batches[1::2]):
            opt.zero_grad()
            with opt.paused():
                (F.cross_entropy(net(first[0]), first[1]) / ACCUMULATE).backward()
            (F.cross_entropy(net(last[0]), last[1]) / ACCUMULATE).backward()
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
    opt.remove()
    return net, norms


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    x_train, x_test, y_train, y_test = digits(args.seed)
    data = loader(x_train, y_train, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        straight = DigitsMLP(args)
        fit(straight, data, args.epochs, Path(tmp) / "run")
        resumed = DigitsMLP(args, init_seed=1)
        half = Path(tmp) / "run" / f"epoch={args.epochs // 2 - 1}.ckpt"
        fit(resumed, data, args.epochs, Path(tmp) / "resumed", ckpt_path=str(half))
        saved = torch.load(Path(tmp) / "run" / f"epoch={args.epochs - 1}.ckpt", weights_only=False)
        again = torch.load(Path(tmp) / "resumed" / f"epoch={args.epochs - 1}.ckpt", weights_only=False)
    net, norms = plain_loop(args, data)
    with torch.no_grad():
        accuracy = float((straight.net(x_test).argmax(1) == y_test).float().mean())
    state, state_again = saved["optimizer_states"][0]["state"], again["optimizer_states"][0]["state"]
    same_state = all(torch.equal(state[key], state_again[key]) for key in ("count", "indices")) and all(
        torch.equal(state["inner"][name], state_again["inner"][name]) for name in state["inner"]
    )
    checks = {
        f"run 1 = the plain loop's calls, bit for bit ({len(norms)} steps)": same(straight.net, net),
        f"the clip norms are the plain loop's, some above {CLIP} (max {max(norms):.2f})":
            straight.norms == norms and max(norms) > CLIP,
        "run 2 (resumed half way, other initial weights): parameters and sparse state bit for bit":
            same(straight.net, resumed.net) and same_state,
        f"the model learns (test accuracy {accuracy:.3f})": accuracy > 0.6,
    }  # fmt: skip
    return {"checks": checks, "norms": norms, "accuracy": accuracy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.02, help="fraction of the 9,866 coordinates trained")
    parser.add_argument("--epochs", type=int, default=4, help="an even number: the resume starts half way")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks here")
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.epochs % 2:
        parser.error("--epochs must be even and at least 2")
    with quiet_lightning():
        out = run(args)
    return report(out, args.json, f"lightning {L.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    sys.exit(main())
