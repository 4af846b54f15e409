"""Sparse fine-tuning of a tiny GPT-2: train ``k`` coordinates of the whole model, with optimizer state of size ``k``.

The model is ``transformers.GPT2LMHeadModel`` built from a config (2 layers,
width 64, 104,192 parameters, random init: no download, no network); the text
is generated here: token sequences that follow one of a few rules
``x[t+1] = (a * x[t] + b) mod 32``, so a model that reads the context predicts
them. Two ways to train the same ``k`` coordinates:

(1) transformers' ``Trainer`` with ``ft.sparse_optimizer_from_torch``:

    opt = torch.optim.AdamW(groups, lr=1e-2)                                        # dense: n-sized state
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, groups, k=k,            # k coordinates, state of size k
                                         refresh_every=M, grad_accumulation=True, lr=1e-2)
    SparseTrainer(model, args, optimizers=(opt, None))  # Trainer adds its linear schedule

    ``groups`` are Trainer's own two param groups (weight decay, and none for
    biases and LayerNorm weights); each coordinate steps with its group's
    hyperparameters. ``gradient_accumulation_steps=2`` needs
    ``grad_accumulation=True`` (the micro-batches' gradients add up).
    ``max_grad_norm`` clips through ``opt.clip_grad_norm_``: the gradients are
    freed during backward, so the Trainer's own clipping (torch's
    ``clip_grad_norm_`` on the parameters) would see none and log
    ``grad_norm=0``; ``SparseTrainer`` overrides the Trainer's one clipping
    method to clip the ``k`` values the optimizer uses and log their norm.
    The same optimizer from its class: ``optimizer_cls_and_kwargs=(
    ft.sparse_optimizer_class_from_torch(torch.optim.AdamW), {"density": ...})``.

(2) a plain loop with the functional form: ``ft.sparse.sparse_optimizer`` and a
    ``ft.sparse.StreamingTopK`` (select on refresh steps, gather in between).

Between refreshes both compute the weight gradients of GPT-2's layers at the
coordinate set only (``Conv1D``, the tied token embedding and output layer).

Checks (the exit status is 1 if one fails): every ``p.grad`` is ``None`` when
the optimizer steps; each step changes at most ``k`` coordinates; the state is
16 bytes per coordinate (AdamW in float32) plus the 8-byte count; the loss
falls, in both ways; the logged ``grad_norm`` is the clipped norm, above zero,
at every step; ``trainer.train(resume_from_checkpoint=...)`` from the
half-way checkpoint, into a model with other initial weights, ends with the
uninterrupted run's parameters, bit for bit; in float64 with every
coordinate trained (``density=1``), two accumulated micro-batches and clipping
end where the Trainer's own ``torch.optim.AdamW`` run (its accumulation, its
clipping) ends, within rounding, the optimizer made by the Trainer from its
class. (That the adapter and the functional form compute the same thing is
tested in ``tests/adapter/``.)

    python examples/gpt2_sparse_finetune.py [--density 0.01] [--refresh-every 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from checks import report  # noqa: E402  # examples/checks.py: the report the tests read
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import functopk as ft  # noqa: E402

VOCAB, LENGTH = 32, 32
RULES = [(1, 1), (1, 3), (3, 1), (5, 2)]  # x[t+1] = (a * x[t] + b) mod VOCAB


def make_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


class RuleText(torch.utils.data.Dataset):
    """Generated sequences: a random first token, then one of RULES."""

    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        rules = torch.randint(len(RULES), (size,), generator=gen)
        tokens = torch.empty(size, LENGTH, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (size,), generator=gen)
        a = torch.tensor([r[0] for r in RULES])[rules]
        b = torch.tensor([r[1] for r in RULES])[rules]
        for t in range(1, LENGTH):
            tokens[:, t] = (a * tokens[:, t - 1] + b) % VOCAB
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def trainer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainer's own two param groups: weight decay, and none for biases and LayerNorm weights."""
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


class SparseTrainer(Trainer):
    """The Trainer, clipping the ``k`` values the sparse optimizer uses (``clip_grad_norm_``), logging their norm."""

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper
        norm = optimizer.clip_grad_norm_(self.args.max_grad_norm)
        self.norms = [*getattr(self, "norms", []), float(norm)]
        return norm


class Watch(TrainerCallback):
    """Before each optimizer step: are the gradients freed? After it: how many coordinates moved?"""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.freed, self.moved = model, [], []
        self.before: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.freed.append(all(p.grad is None for p in self.model.parameters()))
        self.before = [p.detach().clone() for p in self.model.parameters()]

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.moved.append(sum(int((p != b).sum()) for p, b in zip(self.model.parameters(), self.before)))


def state_bytes(state_dict: dict[str, Any]) -> int:
    s = state_dict["state"]
    return sum(t.numel() * t.element_size() for t in [s["count"], s["indices"], *s["inner"].values()])


def with_trainer(
    args: argparse.Namespace,
    data: RuleText,
    out: Path,
    resume: str | None = None,
    init_seed: int | None = None,
    *,
    accumulate: int = 2,
    from_class: bool = False,
    steps: int | None = None,
    dtype: torch.dtype = torch.float32,
    density: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(1): the Trainer with the adapter (saving half way, or resuming from there); the model and what was seen.

    ``accumulate`` micro-batches of ``16 // accumulate`` per step; ``from_class``: the Trainer builds the optimizer
    from ``ft.sparse_optimizer_class_from_torch`` (``optimizer_cls_and_kwargs``) instead of taking it made.
    """
    model = make_model(args.seed if init_seed is None else init_seed).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    sparse = {"density": density or args.density, "refresh_every": args.refresh_every, "grad_accumulation": True,
              "lr": args.lr}  # fmt: skip
    steps = steps or args.steps
    training = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=16 // accumulate,
        gradient_accumulation_steps=accumulate, learning_rate=args.lr, lr_scheduler_type="linear",
        max_grad_norm=args.max_grad_norm, logging_steps=1, save_strategy="steps", save_steps=max(1, steps // 2),
        report_to="none", seed=args.seed, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    watch = Watch(model)
    if from_class:
        made = {"optimizer_cls_and_kwargs": (ft.sparse_optimizer_class_from_torch(torch.optim.AdamW), sparse)}
    else:
        opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, trainer_groups(model, 0.01), **sparse)
        made = {"optimizers": (opt, None)}
    trainer = SparseTrainer(model=model, args=training, train_dataset=data, callbacks=[watch], **made)
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=resume)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    seen = {"k": opt.k, "n": n, "losses": [h["loss"] for h in logged], "freed": watch.freed, "moved": watch.moved,
            "state_bytes": state_bytes(opt.state_dict()), "grad_norms": [h["grad_norm"] for h in logged],
            "clipped": getattr(trainer, "norms", [])}  # fmt: skip
    opt.remove()  # the parameters are free again
    return model, seen


def with_torch_adamw(args: argparse.Namespace, data: RuleText, out: Path, steps: int) -> torch.nn.Module:
    """The Trainer's own path in float64: ``torch.optim.AdamW``, its clipping, 2 accumulated micro-batches."""
    model = make_model(args.seed).double()
    training = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=args.lr, lr_scheduler_type="linear", max_grad_norm=args.max_grad_norm, report_to="none",
        seed=args.seed, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, save_strategy="no",
    )  # fmt: skip
    opt = torch.optim.AdamW(trainer_groups(model, 0.0), lr=args.lr)
    trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=(opt, None))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return model


def with_plain_loop(args: argparse.Namespace, data: RuleText) -> tuple[Any, list[float]]:
    """(2): the functional form and a stream, constant lr; returns the model and the losses."""
    model = make_model(args.seed)
    params = dict(model.named_parameters())
    n = sum(p.numel() for p in params.values())
    k = ft.sparse.k_from_density(args.density, n)
    opt = ft.sparse.sparse_optimizer(ft.from_torch(torch.optim.AdamW, lr=args.lr), k=k)
    state = opt.init(params)
    batches = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    losses = []
    with ft.sparse.StreamingTopK(params, k=k) as stream:
        for step, batch in zip(range(args.steps), batches):
            refresh = step % args.refresh_every == 0
            if not refresh:
                stream.gather(state.indices)  # between refreshes: the gradient at the set only
            loss = model(**batch).loss
            loss.backward()  # each gradient folded (or gathered) and freed
            with torch.no_grad():
                updates, state = opt.update(stream.result(), state, params, refresh=refresh)
                ft.apply_sparse_updates_(params, updates)
            losses.append(float(loss.detach()))
    return model, losses


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = RuleText(16 * args.steps, args.seed)
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, seen = with_trainer(args, data, Path(tmp) / "run")
        k, losses, norms = seen["k"], seen["losses"], seen["grad_norms"]
        checks.update({
            f"(1) Trainer: every p.grad is None at each optimizer step ({args.steps} steps)":
                len(seen["freed"]) == args.steps and all(seen["freed"]),
            f"(1) each step changes at most k={k} of {seen['n']} coordinates (max {max(seen['moved'])})":
                max(seen["moved"]) <= k,
            f"(1) optimizer state = 16 bytes per coordinate + 8 ({seen['state_bytes']} bytes)":
                seen["state_bytes"] == 16 * k + 8,
            f"(1) loss falls ({losses[0]:.3f} -> {min(losses[-4:]):.3f})": min(losses[-4:]) < losses[0] - 0.1,
            f"(1) the logged grad_norm is the clipped k values' norm at every step (first {norms[0]:.3f})":
                len(norms) == args.steps and all(g > 0 for g in norms) and norms == seen["clipped"],
        })  # fmt: skip
        half = str(Path(tmp) / "run" / f"checkpoint-{args.steps // 2}")
        resumed, _ = with_trainer(args, data, Path(tmp) / "resumed", resume=half, init_seed=args.seed + 1)
        checks["(1) resumed from the half-way checkpoint (other initial weights): parameters bit for bit"] = all(
            torch.equal(p, q) for p, q in zip(resumed.parameters(), model.parameters())
        )
        steps = min(args.steps, 8)
        every, _ = with_trainer(args, data, Path(tmp) / "every", from_class=True, steps=steps, dtype=torch.float64,
                                density=1.0)  # fmt: skip
        torch_run = with_torch_adamw(args, data, Path(tmp) / "torch", steps)
        gap = max(float((p - q).abs().max()) for p, q in zip(every.parameters(), torch_run.parameters()))
        name = f"(1) float64, every coordinate, {steps} steps of 2 micro-batches, clipped: the Trainer's own AdamW run"
        checks[f"{name} (max gap {gap:.1e})"] = gap < 1e-9
        _, plain_losses = with_plain_loop(args, data)
        checks[f"(2) plain loop: loss falls ({plain_losses[0]:.3f} -> {min(plain_losses[-4:]):.3f})"] = (
            min(plain_losses[-4:]) < plain_losses[0] - 0.1
        )
    return {"checks": checks, "losses": losses, "plain_losses": plain_losses, "k": k, "n": seen["n"],
            "grad_norms": norms}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of the coordinates trained")
    parser.add_argument("--refresh-every", type=int, default=3, help="steps each coordinate set is kept")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the k values' norm to this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks and the losses here")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = run(args)
    return report(out, args.json, f"transformers {transformers.__version__}, torch {torch.__version__}; "
                                  f"k={out['k']} of n={out['n']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
