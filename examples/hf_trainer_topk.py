"""Hugging Face ``transformers.Trainer`` with a top-k sparsified AdamW, in the two ways Trainer takes an optimizer.

(a) A ready optimizer and scheduler, ``Trainer(..., optimizers=(opt, scheduler))``:

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)                    # before
    opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(),                  # after
                                       sparsify=ft.topk(k), lr=3e-3, weight_decay=0.01)

(b) A class and keyword arguments, ``Trainer(..., optimizer_cls_and_kwargs=(cls, kwargs))``:
Trainer builds its two param groups (weight decay from ``TrainingArguments``,
none for biases and LayerNorm) and calls ``cls(groups, **kwargs)``. Trainer
only calls ``cls`` that way when it is a ``torch.optim.Optimizer`` subclass
(any other callable, a ``functools.partial`` of ``from_torch`` included, is
taken for an optimizer *factory* of the model), so the class comes from
``ft.optimizer_class_from_torch(torch.optim.AdamW, sparsify)``.

A small ``PreTrainedModel`` with its config (an MLP with LayerNorm, random
init, 9,866 parameters) classifies scikit-learn's 8x8 digits; no download, no
network. Runs (under a second each on 2 CPU cores): Trainer's own AdamW (the reference),
(a), (b) saving a checkpoint half way, and that run resumed with
``trainer.train(resume_from_checkpoint=...)`` into a model with other weights.

Checks (the exit status is 1 if one fails): the logged learning rates are the
reference's; in (b) the param groups hold ``TrainingArguments``'
``learning_rate`` (``initial_lr``, and ``lr`` = the scheduler's current value),
its ``weight_decay`` and 0.0 for the no-decay group, exactly like Trainer's
own AdamW; the resumed run ends with the uninterrupted run's parameters and
optimizer state, bit for bit.

    python examples/hf_trainer_topk.py [--k 500] [--steps 24] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    PreTrainedConfig,
    PreTrainedModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402

import functopk as ft  # noqa: E402

IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


class DigitsConfig(PreTrainedConfig):
    model_type = "functopk-digits-mlp"

    def __init__(self, hidden_size: int = 128, num_labels: int = 10, **kwargs: Any) -> None:
        self.hidden_size = hidden_size
        super().__init__(num_labels=num_labels, **kwargs)


class DigitsClassifier(PreTrainedModel):
    """A ``PreTrainedModel``: 64 pixels -> Linear -> LayerNorm -> GELU -> Linear -> 10 logits, with a loss."""

    config_class = DigitsConfig

    def __init__(self, config: DigitsConfig) -> None:
        super().__init__(config)
        self.dense = nn.Linear(64, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.classifier(F.gelu(self.LayerNorm(self.dense(pixel_values))))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def make_model(seed: int) -> DigitsClassifier:
    torch.manual_seed(seed)
    return DigitsClassifier(DigitsConfig())


class Digits(torch.utils.data.Dataset):
    """scikit-learn's 1,797 8x8 digits, as 64 pixel values in [0, 1]."""

    def __init__(self) -> None:
        data = load_digits()
        self.pixels = torch.tensor(data.data, dtype=torch.float32) / 16.0
        self.labels = torch.tensor(data.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


class Snapshot(TrainerCallback):
    """The optimizer's param groups when training begins (after Trainer made them); group and scheduler lrs per step."""

    def __init__(self) -> None:
        self.groups: list[dict[str, Any]] | None = None
        self.scheduler_lr: list[float] | None = None
        self.step_lrs: list[tuple[list[float], list[float]]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:  # fmt: skip
        self.groups = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                       for g in optimizer.param_groups]  # fmt: skip
        self.scheduler_lr = list(lr_scheduler.get_last_lr())

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                    **kwargs: Any) -> None:  # fmt: skip
        self.step_lrs.append(([g["lr"] for g in optimizer.param_groups], list(lr_scheduler.get_last_lr())))


def training_args(out: Path, args: argparse.Namespace, save: bool = False) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=32, learning_rate=args.lr,
        weight_decay=0.01, warmup_steps=args.steps // 4, lr_scheduler_type="linear", max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps" if save else "no", save_steps=args.steps // 2, report_to="none",
        seed=args.seed, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def train(
    out: Path, args: argparse.Namespace, data: Digits, *, save: bool = False, resume: str | None = None,
    init_seed: int | None = None, **trainer_kwargs: Any,
) -> tuple[Trainer, Snapshot]:  # fmt: skip
    model = trainer_kwargs.pop("model", None)
    if model is None:
        model = make_model(args.seed if init_seed is None else init_seed)
    snapshot = Snapshot()
    trainer = Trainer(model=model, args=training_args(out, args, save), train_dataset=data, callbacks=[snapshot],
                      **trainer_kwargs)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the logs are in trainer.state.log_history
    trainer.train(resume_from_checkpoint=resume)
    return trainer, snapshot


def logged_lrs(trainer: Trainer) -> list[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def logged_losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def hyper(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param-group hyperparameters without the implementation flags (torch picks them per class and device)."""
    return [{k: v for k, v in g.items() if k not in IMPLEMENTATION_FLAGS} for g in groups]


def optimizer_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa
    )


def unwrap(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(opt, "optimizer", opt)


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = Digits()
    sparsify = ft.topk(density=args.density) if args.density else ft.topk(args.k)
    checks: dict[str, bool] = {}
    out: dict[str, Any] = {"checks": checks}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        reference, ref_snap = train(tmp_dir / "reference", args, data)
        ref_lrs = logged_lrs(reference)

        # (a) optimizers=(opt, scheduler)
        model = make_model(args.seed)
        opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(), sparsify=sparsify, lr=args.lr,
                                           weight_decay=0.01)  # fmt: skip
        sched = get_linear_schedule_with_warmup(opt, args.steps // 4, args.steps)
        ta, _ = train(tmp_dir / "a", args, data, model=model, optimizers=(opt, sched))
        losses = logged_losses(ta)
        checks.update({
            "(a) Trainer steps functopk's optimizer (inside Accelerate's wrapper)": unwrap(ta.optimizer) is opt,
            f"(a) {args.steps} steps; every parameter's 'step' = global_step":
                ta.state.global_step == args.steps
                and all(int(opt.state[p]["step"]) == args.steps for p in model.parameters()),
            "(a) logged learning rates = Trainer's own AdamW run's": logged_lrs(ta) == ref_lrs,
            f"(a) loss falls ({losses[0]:.3f} -> {min(losses[-4:]):.3f})": min(losses[-4:]) < losses[0],
        })  # fmt: skip
        out["a"] = {"trainer": ta, "optimizer": opt, "reference_lrs": ref_lrs, "lrs": logged_lrs(ta)}

        # (b) optimizer_cls_and_kwargs: Trainer's kwargs for its own AdamW (lr, betas, eps from TrainingArguments)
        _, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args(tmp_dir, args))
        cls = ft.optimizer_class_from_torch(torch.optim.AdamW, sparsify)
        tb, snap = train(tmp_dir / "b", args, data, save=True, optimizer_cls_and_kwargs=(cls, dict(kwargs)))
        groups = snap.groups or []
        checks.update({
            "(b) from_torch_class: Trainer made it from its two param groups":
                type(unwrap(tb.optimizer)) is cls and len(groups) == 2,
            f"(b) initial_lr = TrainingArguments.learning_rate ({args.lr}) in each group":
                [g["initial_lr"] for g in groups] == [args.lr, args.lr],
            f"(b) lr = the scheduler's current lr in each group, at creation ({snap.scheduler_lr}) and every step":
                [g["lr"] for g in groups] == snap.scheduler_lr and len(snap.step_lrs) == args.steps
                and all(ours == sched for ours, sched in snap.step_lrs),
            "(b) weight_decay = TrainingArguments.weight_decay (0.01), and 0.0 in the no-decay group":
                [g["weight_decay"] for g in groups] == [0.01, 0.0],
            "(b) param groups = Trainer's own AdamW's (all hyperparameters, group sizes)":
                hyper(groups) == hyper(ref_snap.groups or []),
            "(b) logged learning rates = Trainer's own AdamW run's": logged_lrs(tb) == ref_lrs,
        })  # fmt: skip

        # resume (b) half way, into a model with other weights
        ckpt = tmp_dir / "b" / f"checkpoint-{args.steps // 2}"
        try:
            tr, _ = train(tmp_dir / "resumed", args, data, resume=str(ckpt), init_seed=args.seed + 1,
                          optimizer_cls_and_kwargs=(cls, dict(kwargs)))  # fmt: skip
            resume_error = None
        except Exception as e:
            tr, resume_error = None, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        name = "(b) resumed from the half-way checkpoint (train(resume_from_checkpoint=...))"
        if tr is None:
            checks[f"{name}: {resume_error}"] = False
        else:
            checks.update({
                f"{name}: parameters = uninterrupted run's, bitwise": all(
                    torch.equal(p, q) for p, q in zip(tr.model.parameters(), tb.model.parameters())
                ),
                f"{name}: optimizer state = uninterrupted run's, bitwise":
                    optimizer_state_equal(unwrap(tr.optimizer), unwrap(tb.optimizer)),
                f"{name}: logged learning rates (restored history, then the rest) = the reference's":
                    logged_lrs(tr) == ref_lrs,
            })  # fmt: skip
        out["resume_error"] = resume_error
        out["b"] = {"trainer": tb, "groups": groups, "scheduler_lr": snap.scheduler_lr}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=500, help="gradient coordinates kept per step (of 9,866)")
    parser.add_argument("--density", type=float, default=None, help="fraction kept per step, instead of --k")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps (batches of 32); a multiple of 4")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the checks and the learning rates here")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.steps % 4:
        parser.error("--steps must be a positive multiple of 4")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = run(args)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, ok in out["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "checks": out["checks"], "resume_error": out["resume_error"],
            "steps": args.steps, "lr": args.lr, "a_lrs": out["a"]["lrs"], "reference_lrs": out["a"]["reference_lrs"],
            "b_groups": out["b"]["groups"], "b_scheduler_lr": out["b"]["scheduler_lr"],
        }, default=list))  # fmt: skip
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
