"""Transfer: pretrain a ResNet-18 on digits 0-4, fine-tune it on 5-9 with full, sparse and LoRA fine-tuning.

The data is scikit-learn's handwritten digits (1,797 8x8 images, shipped with
scikit-learn: nothing is downloaded), split once into the two tasks by label
and each task into train/test (70/30, stratified, fixed by ``--seed``). The
model is the demo's ResNet-18 (``examples/train_resnet.py``: 3x3 stride-1
stem, no max-pool, one input channel), pretrained with AdamW on 0-4; its
weights are cached per seed and pretraining length in the system's temporary
directory (``functopk_transfer/``), never in the repository.

Fine-tuning on 5-9 starts every method from the same pretrained weights, sees
the same mini-batches in the same order, and follows the same two rules:

* **The head is new and dense in every method.** The 5-9 labels have no
  pretrained classifier row to adapt, so ``fc`` is re-initialized (same seed
  for all) and trained densely with torch AdamW in every method; the methods
  differ only in how they adapt the body (every other parameter), and ``n``
  and ``k`` count the body only.
* **Batch-norm statistics are frozen** (the model stays in ``eval()`` mode):
  running means and variances are n-sized state outside any optimizer, and
  updating them would be a dense change that LoRA and the sparse methods
  would receive for free.

The methods (``METHODS``, name -> setup function returning the step):

* ``head_only``: the body frozen, only the new head trained (the floor: what
  the pretrained features give without adapting them);
* ``full``: torch AdamW on every parameter;
* ``sparse_{density}_M{M}``: ``ft.sparse_optimizer_from_torch(torch.optim.AdamW,
  body, density=..., refresh_every=M)`` on the body (docs/sparse_finetuning.md's
  recipe), the coordinate set reselected (exact global top-k of ``|g|``) every
  ``M`` steps, the convolutions' weight gradients computed at the set only
  between refreshes; ``_acc``: reselected by ``|g|`` summed since the last
  refresh (``score="accumulated"``, an n-sized sum kept by the optimizer);
* ``lora_r{r}``: peft LoRA on every convolution of the body, at the rank whose
  trainable count is nearest 1% of ``n``; the head through ``modules_to_save``.

It writes ``transfer.json`` (per method: the accuracy curve, final test
accuracy, median step time, trainable coordinates and optimizer-state size),
``transfer.md`` (the table) and ``transfer.png`` (accuracy against step) under
``--out``.

    python benchmarks/transfer.py                  # the documented run -> benchmarks/results/transfer.*
    python benchmarks/transfer.py --quick          # a few steps of everything, seconds; writes to a temp dir

Flags: ``--seed``, ``--pretrain-steps``, ``--steps`` (fine-tuning), ``--batch-size``,
``--eval-every``, ``--threads`` (torch threads, default 1), ``--out``, ``--quick``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn

import functopk as ft

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path(tempfile.gettempdir()) / "functopk_transfer"
# constant learning rates of the body per kind of method (--lr KIND=VALUE overrides; docs/sparse_finetuning.md
# says how they were chosen); the new head uses LR["head"] in every method
LR = {"head": 1e-3, "full": 3e-4, "sparse": 1e-3, "lora": 3e-3}
WEIGHT_DECAY = 0.01

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_tasks(seed: int) -> dict[str, Data]:
    """``{"pretrain": 0-4, "finetune": 5-9}``, each ``(x_train, y_train, x_test, y_test)``, labels 0-4.

    Images are standardised with the pretraining split's training statistics (the
    pretrained model's input normalisation) for both tasks.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    tasks = {}
    for name, low in (("pretrain", 0), ("finetune", 5)):
        idx = torch.nonzero((y >= low) & (y < low + 5)).squeeze(1)
        train, test = train_test_split(idx.numpy(), test_size=0.3, random_state=seed, stratify=y[idx].numpy())
        train, test = torch.as_tensor(train), torch.as_tensor(test)
        tasks[name] = (x[train], y[train] - low, x[test], y[test] - low)
    mean, std = tasks["pretrain"][0].mean(), tasks["pretrain"][0].std()
    return {name: ((a - mean) / std, b, (c - mean) / std, d) for name, (a, b, c, d) in tasks.items()}


def make_resnet(seed: int) -> nn.Module:
    """The demo's small-image ResNet-18, one input channel, 5 classes."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_resnet  # examples/ is not a package

    return train_resnet.make_model(1, 5, seed)


def batches(n: int, size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` mini-batch index sets, reshuffled each pass, the same for every method."""
    gen = torch.Generator().manual_seed(seed)
    order: list[torch.Tensor] = []
    while len(order) * size < steps * size:
        perm = torch.randperm(n, generator=gen)
        order += [perm[i : i + size] for i in range(0, n - size + 1, size)]
    return order[:steps]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train(was_training)
    return acc


def pretrain(make_model: Callable[[int], nn.Module], data: Data, steps: int, batch_size: int, seed: int,
             cache: Path | None) -> dict[str, torch.Tensor]:  # fmt: skip
    """AdamW on the pretraining task (train mode); the state dict, read from ``cache`` when there."""
    if cache is not None and cache.exists():
        return torch.load(cache)
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR["head"], weight_decay=WEIGHT_DECAY, foreach=True)
    x, y = data[0], data[1]
    for idx in batches(len(y), batch_size, steps, seed):
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = model.state_dict()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, cache)
    return state


# A method: setup(model, lr) -> (step, info); step(x, y) runs one fine-tuning step. info: trainable and state counts.
Step = Callable[[torch.Tensor, torch.Tensor], Any]
Method = Callable[[nn.Module, float], tuple[Step, dict]]


def body_of(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if not name.startswith("fc.")}


def numel_of(tensors: Any) -> tuple[int, int]:
    """Elements and bytes of the tensors in a tree (an optimizer's state)."""
    leaves = [t for t in optree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in leaves), sum(t.numel() * t.element_size() for t in leaves)


def torch_state_of(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[int, int]:
    """Elements and bytes of a torch optimizer's state for ``params`` (the body's, not the head's)."""
    return numel_of([dict(opt.state[p]) for p in params if p in opt.state])


def full(model: nn.Module, lr: float) -> tuple[Step, dict]:
    opt = adamw(list(body_of(model).values()), lr, list(model.fc.parameters()))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    body = list(body_of(model).values())
    return step, {"trainable": sum(p.numel() for p in body), "state_of": lambda: torch_state_of(opt, body)}


def adamw(body: list[torch.Tensor], lr: float, head: list[torch.Tensor]) -> torch.optim.AdamW:
    """torch AdamW on the body at ``lr`` and on the head at ``LR["head"]``."""
    groups = [{"params": body, "lr": lr}, {"params": head, "lr": LR["head"]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=WEIGHT_DECAY, foreach=True)


def head_only(model: nn.Module, lr: float) -> tuple[Step, dict]:
    """The body frozen (a linear probe of the pretrained features): what adapting the body adds."""
    for p in body_of(model).values():
        p.requires_grad_(False)  # no weight gradients in backward, as for LoRA's frozen base
    opt = adamw([], lr, list(model.fc.parameters()))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    return step, {"trainable": 0, "state_of": lambda: (0, 0)}


def sparse(model: nn.Module, lr: float, density: float, refresh_every: int, score: str = "gradient"
           ) -> tuple[Step, dict]:  # fmt: skip
    """The recipe of docs/sparse_finetuning.md: the body through ``ft.sparse_optimizer_from_torch(AdamW)``, the
    head through torch AdamW (between refreshes the body's weight gradients are computed at the set only)."""
    body = body_of(model)
    head = adamw([], lr, list(model.fc.parameters()))
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, list(body.values()), density=density, score=score,
                                         refresh_every=refresh_every, lr=lr, weight_decay=WEIGHT_DECAY)  # fmt: skip

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        head.step()
        opt.zero_grad()
        head.zero_grad(set_to_none=True)

    def state_of() -> tuple[int, int]:
        state = opt.state_dict()["state"]
        return numel_of([state["count"], state["indices"], state["inner"], state.get("score", [])])

    return step, {"trainable": opt.k, "state_of": state_of}


def conv_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def lora_rank_for(model: nn.Module, target: int) -> int:
    """The LoRA rank whose trainable count on every convolution is nearest ``target`` (at least 1).

    A rank-r LoRA of a ``Conv2d(in, out, kernel)`` is ``Conv2d(in, r, kernel)`` then ``Conv2d(r, out, 1)``:
    ``r * (in * kh * kw + out)`` parameters.
    """
    per_rank = sum(
        m.in_channels * m.kernel_size[0] * m.kernel_size[1] + m.out_channels
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    )
    return max(1, round(target / per_rank))


def lora(model: nn.Module, lr: float, density: float) -> tuple[Step, dict]:
    """peft LoRA on every convolution (rank nearest ``density * n``), the head trained through ``modules_to_save``."""
    import peft

    n = sum(p.numel() for p in body_of(model).values())
    rank = lora_rank_for(model, round(density * n))
    config = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=conv_names(model),
                             modules_to_save=["fc"])  # fmt: skip
    wrapped = peft.get_peft_model(model, config)
    adapters = [p for name, p in wrapped.named_parameters() if p.requires_grad and ".fc." not in name]
    opt = adamw(adapters, lr, [p for name, p in wrapped.named_parameters() if p.requires_grad and ".fc." in name])

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    info = {"trainable": sum(p.numel() for p in adapters), "lora_rank": rank}
    return step, {**info, "state_of": lambda: torch_state_of(opt, adapters)}


METHODS: dict[str, tuple[str, Method]] = {
    "head_only": ("head", head_only),
    "full": ("full", full),
    "sparse_0.1%_M1": ("sparse", functools.partial(sparse, density=0.001, refresh_every=1)),
    "sparse_0.1%_M20": ("sparse", functools.partial(sparse, density=0.001, refresh_every=20)),
    "sparse_1%_M1": ("sparse", functools.partial(sparse, density=0.01, refresh_every=1)),
    "sparse_1%_M20": ("sparse", functools.partial(sparse, density=0.01, refresh_every=20)),
    "sparse_0.1%_M20_acc": ("sparse", functools.partial(sparse, density=0.001, refresh_every=20, score="accumulated")),
    "sparse_1%_M20_acc": ("sparse", functools.partial(sparse, density=0.01, refresh_every=20, score="accumulated")),
    "lora_1%": ("lora", functools.partial(lora, density=0.01)),
}


def finetune(name: str, make_model: Callable[[int], nn.Module], pretrained: dict, data: Data, steps: int,
             batch_size: int, eval_every: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """One method from the pretrained weights with a new head: its curve, step times and sizes."""
    model = make_model(seed)
    model.load_state_dict(pretrained)
    torch.manual_seed(seed + 1)  # the same new head for every method
    model.fc.reset_parameters()
    model.eval()  # batch-norm statistics frozen (module docstring)
    body = list(body_of(model).values())  # the same tensors after peft wraps their modules
    before = torch.cat([p.detach().flatten() for p in body])
    kind, setup = METHODS[name]
    step, info = setup(model, LR[kind])
    x, y, x_test, y_test = data
    curve = [(0, accuracy(model, x_test, y_test))]
    times = []
    for t, idx in enumerate(batches(len(y), batch_size, steps, seed), start=1):
        start = time.perf_counter()
        step(x[idx], y[idx])
        times.append(time.perf_counter() - start)
        if t % eval_every == 0 or t == steps:
            curve.append((t, accuracy(model, x_test, y_test)))
    state_elems, state_bytes = info.pop("state_of")()
    changed = int((torch.cat([p.detach().flatten() for p in body]) != before).sum())
    return {"method": name, "lr": LR[kind], "curve": curve, "final_acc": curve[-1][1],
            "last3_acc": statistics.mean(a for _, a in curve[-3:]), "step_s": times,
            "step_s_median": statistics.median(times), **info, "state_elems": state_elems, "state_bytes": state_bytes,
            "body_changed": changed}  # fmt: skip


def summary(runs: list[dict]) -> dict[str, Any]:
    """One method over seeds: accuracies (mean, min, max), the mean curve, median step time, sizes."""
    finals = [r["final_acc"] for r in runs]
    curves = [[a for _, a in r["curve"]] for r in runs]
    return {"method": runs[0]["method"], "lr": runs[0]["lr"], "trainable": runs[0]["trainable"],
            "lora_rank": runs[0].get("lora_rank"), "state_bytes": runs[0]["state_bytes"],
            "body_changed": statistics.mean(r["body_changed"] for r in runs), "final_acc_mean": statistics.mean(finals),
            "final_acc_min": min(finals), "final_acc_max": max(finals),
            "last3_acc_mean": statistics.mean(r["last3_acc"] for r in runs),
            "steps": [t for t, _ in runs[0]["curve"]], "curve_mean": [statistics.mean(c) for c in zip(*curves)],
            "curve_min": [min(c) for c in zip(*curves)], "curve_max": [max(c) for c in zip(*curves)],
            "step_s_median": statistics.median(t for r in runs for t in r["step_s"])}  # fmt: skip


def markdown(report: dict) -> str:
    c = report["config"]
    pre = ", ".join(f"{a:.3f}" for a in report["pretrain_acc"])
    lines = [
        f"ResNet-18 pretrained on digits 0-4 ({c['pretrain_steps']} AdamW steps; test accuracy {pre}), fine-tuned "
        f"on 5-9 for {c['steps']} steps of {c['batch_size']} images, seeds {', '.join(map(str, c['seeds']))} (split, "
        f"pretraining, new head, batch order), {c['threads']} torch thread(s), CPU. Body n = {c['n']:,} parameters; "
        f"the new {c['head']:,}-parameter head is trained densely (lr {LR['head']:g}) in every method and not "
        f"counted below. Accuracy on the 5-9 test split ({report['test_images']} images): mean over seeds [min, max].",
        "",
        "| method | lr | trainable (body) | optimizer state (body) | body coordinates changed | final accuracy | "
        "mean of last 3 evaluations | step time (median) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["summary"]:
        name = r["method"] + (f" (r={r['lora_rank']})" if r["lora_rank"] else "")
        lines.append(
            f"| {name} | {r['lr']:g} | {r['trainable']:,} ({r['trainable'] / c['n']:.2%}) | "
            f"{r['state_bytes'] / 1024:,.0f} KiB | {r['body_changed']:,.0f} | {r['final_acc_mean']:.3f} "
            f"[{r['final_acc_min']:.3f}, {r['final_acc_max']:.3f}] | {r['last3_acc_mean']:.3f} | "
            f"{1000 * r['step_s_median']:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in report["summary"]:
        for ax in axes:
            (line,) = ax.plot(r["steps"], r["curve_mean"], label=r["method"], marker=".")
            ax.fill_between(r["steps"], r["curve_min"], r["curve_max"], color=line.get_color(), alpha=0.08)
    axes[0].set(xlabel="fine-tuning step", ylabel="test accuracy on digits 5-9 (mean over seeds)", ylim=(0, 1.01),
                title="Transfer 0-4 -> 5-9, ResNet-18 (new dense head in every method)")  # fmt: skip
    last = report["summary"][0]["steps"][-1]
    axes[1].set(xlabel="fine-tuning step", xlim=(last / 2, last * 1.02), ylim=(0.85, 1.0), title="second half, zoomed")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Pretrain (or read the cache), then fine-tune every method of ``args.methods`` with ``seed``."""
    tasks = load_tasks(seed)
    cache = CACHE / f"resnet18_digits04_seed{seed}_steps{args.pretrain_steps}_bs{args.batch_size}.pt"
    pretrained = pretrain(make_resnet, tasks["pretrain"], args.pretrain_steps, args.batch_size, seed, cache)
    model = make_resnet(seed)
    model.load_state_dict(pretrained)
    run: dict[str, Any] = {"seed": seed, "pretrain_acc": accuracy(model, *tasks["pretrain"][2:]), "methods": {},
                           "test_images": len(tasks["finetune"][3])}  # fmt: skip
    run["n"], run["head"] = (sum(p.numel() for p in ps) for ps in (body_of(model).values(), model.fc.parameters()))
    for name in args.methods:
        result = finetune(name, make_resnet, pretrained, tasks["finetune"], args.steps, args.batch_size,
                          args.eval_every, seed)  # fmt: skip
        run["methods"][name] = result
        print(f"seed {seed} {name}: accuracy {result['final_acc']:.3f}", flush=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", nargs="+", default=[], metavar="KIND=VALUE", help=f"override LR ({LR})")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", type=Path, help="default: benchmarks/results (a temporary directory with --quick)")
    parser.add_argument("--quick", action="store_true", help="a few steps of every method, in seconds")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.pretrain_steps, args.steps, args.batch_size, args.eval_every = [0], 3, 4, 16, 2
        args.out = args.out or Path(tempfile.mkdtemp(prefix="transfer_quick_"))
    out = args.out or RESULTS
    LR.update({kind: float(value) for kind, value in (item.split("=") for item in args.lr)})
    torch.set_num_threads(args.threads)
    runs = [run_seed(seed, args) for seed in args.seeds]
    config = {**{k: v for k, v in vars(args).items() if k not in ("out", "methods", "lr")}, "n": runs[0]["n"],
              "head": runs[0]["head"], "lr": LR}  # fmt: skip
    summaries = [summary([r["methods"][name] for r in runs]) for name in args.methods]
    report = {"config": config, "pretrain_acc": [r["pretrain_acc"] for r in runs],
              "test_images": runs[0]["test_images"], "summary": summaries, "runs": runs}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "transfer.md").write_text(markdown(report))
    plot(report, out / "transfer.png")
    print(markdown(report))
    print(f"wrote {out}/transfer.{{json,md,png}}")


if __name__ == "__main__":
    main()
