"""``ft.optimizer_from_torch`` in PyTorch Lightning, transformers' Trainer and Accelerate (examples/*_topk.py),
and ``ft.sparse_optimizer_from_torch`` in transformers' Trainer (examples/gpt2_sparse_finetune.py), in Lightning
(examples/lightning_sparse_finetune.py) and in the fine-tuning recipe (examples/sparse_finetune_resnet.py).

Each example runs once, in its own process (the frameworks keep global state:
Accelerate's ``AcceleratorState``, Lightning's seeding, logging levels), and
writes its checks and the learning rates it saw to a JSON file; the tests read
it and compare the learning rates with ``torch.optim.AdamW`` under the same
scheduler, computed here without any framework.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functopk as ft

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integrations

def run_example(script: str, tmp_path_factory: pytest.TempPathFactory, *args: str) -> dict:
    out = tmp_path_factory.mktemp(script.split(".")[0]) / "result.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args, "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.exists(), f"{script} wrote no result (exit status {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    result["returncode"], result["stdout"] = proc.returncode, proc.stdout
    return result


def failed(result: dict) -> list[str]:
    return [name for name, ok in result["checks"].items() if not ok]


def scheduled_lrs(make_scheduler, steps: int, lr: float) -> tuple[list[float], torch.optim.Optimizer]:
    """The lr ``torch.optim.AdamW`` holds before each of ``steps`` steps under ``make_scheduler(opt)``, and it."""
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, weight_decay=0.01)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs, opt


# -- PyTorch Lightning ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_result(tmp_path_factory):
    return run_example("lightning_topk.py", tmp_path_factory)


@pytest.mark.slow
def test_lightning_example_checks_pass(lightning_result):
    """OneCycleLR per step, gradient clipping, accumulate_grad_batches=2, ckpt_path resume (bitwise), dense parity."""
    assert failed(lightning_result) == [], lightning_result["stdout"]
    assert lightning_result["returncode"] == 0
    assert any("resume" in name for name in lightning_result["checks"])


@pytest.mark.slow
def test_lightning_lr_is_the_real_lr_under_one_cycle(lightning_result):
    """param_groups[0]["lr"] (and betas) at every step and at the end = torch.optim.AdamW's under OneCycleLR."""
    total, max_lr = lightning_result["total_steps"], lightning_result["max_lr"]
    lrs, opt = scheduled_lrs(
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=max_lr, total_steps=total), total, max_lr
    )
    assert lightning_result["lrs"] == lrs
    assert lightning_result["final_lr"] == opt.param_groups[0]["lr"]
    assert tuple(lightning_result["final_betas"]) == opt.param_groups[0]["betas"]
    assert max(lrs) > 0.99 * max_lr and lrs[0] < max_lr / 20 and lrs[-1] < max_lr / 1000  # it really cycled


# -- transformers.Trainer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_result(tmp_path_factory):
    return run_example("hf_trainer_topk.py", tmp_path_factory)


@pytest.mark.slow
def test_hf_trainer_example_checks_pass(hf_result):
    """optimizers=(opt, scheduler); optimizer_cls_and_kwargs with a class; resume_from_checkpoint (bitwise)."""
    assert failed(hf_result) == [], hf_result["stdout"]
    assert hf_result["returncode"] == 0
    assert any("resumed" in name for name in hf_result["checks"])


@pytest.mark.slow
def test_hf_trainer_param_groups_hold_training_arguments(hf_result):
    """Trainer's two groups: TrainingArguments' learning_rate (lr = the scheduler's), its weight_decay, then 0.0."""
    groups = hf_result["b_groups"]
    assert [g["initial_lr"] for g in groups] == [hf_result["lr"]] * 2
    assert [g["lr"] for g in groups] == hf_result["b_scheduler_lr"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.999)] * 2  # TrainingArguments' adam_beta1/2


@pytest.mark.slow
def test_hf_trainer_logged_lr_is_the_real_lr(hf_result):
    """The logged learning_rate is the lr each step used: linear warm-up from 0, then decay, as torch's AdamW."""
    steps, lr = hf_result["steps"], hf_result["lr"]
    warmup = steps // 4

    def linear(step: int) -> float:  # transformers.get_linear_schedule_with_warmup's factor
        return step / max(1, warmup) if step < warmup else max(0.0, (steps - step) / max(1, steps - warmup))

    lrs, _ = scheduled_lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, linear), steps, lr)
    assert hf_result["a_lrs"] == hf_result["reference_lrs"] == lrs
    assert lrs[0] == 0.0 and lrs[warmup] == lr


# -- Accelerate ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate_result(tmp_path_factory):
    return run_example("accelerate_topk.py", tmp_path_factory)


@pytest.mark.slow
def test_accelerate_example_checks_pass(accelerate_result):
    """prepare(model, opt, loader, scheduler), accumulate, clip_grad_norm_, save_state/load_state (bitwise)."""
    assert failed(accelerate_result) == [], accelerate_result["stdout"]
    assert accelerate_result["returncode"] == 0


@pytest.mark.slow
def test_accelerate_lr_is_the_real_lr(accelerate_result):
    lr, lrs = accelerate_result["lr"], accelerate_result["lrs"]
    total = len(lrs)
    warmup = max(1, total // 5)

    def schedule(opt):
        return torch.optim.lr_scheduler.SequentialLR(
            opt,
            [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, warmup),
             torch.optim.lr_scheduler.CosineAnnealingLR(opt, total - warmup)],
            milestones=[warmup],
        )  # fmt: skip

    expected, opt = scheduled_lrs(schedule, total, lr)
    assert lrs == expected
    assert accelerate_result["final_lr"] == opt.param_groups[0]["lr"]


# -- sparse fine-tuning of a GPT-2 config: Trainer with sparse_optimizer_from_torch, and a plain loop -----------


@pytest.mark.slow
def test_gpt2_sparse_finetune_example_checks_pass(tmp_path_factory):
    """Trainer(optimizers=(opt, None)) with gradient_accumulation_steps=2 and max_grad_norm through the optimizer's
    clip_grad_norm_: gradients freed, <= k coordinates per step, 16 bytes per coordinate, the loss falls, the logged
    grad_norm is the clipped norm (not 0), resume_from_checkpoint between two refreshes is bitwise, accumulated
    micro-batches equal whole batches (optimizer_cls_and_kwargs with the class door); the plain loop's loss falls."""
    result = run_example("gpt2_sparse_finetune.py", tmp_path_factory, "--steps", "16")
    assert failed(result) == [], result["stdout"]
    assert result["returncode"] == 0
    assert any("resumed" in name for name in result["checks"]) and len(result["checks"]) == 8
    assert len(result["losses"]) == len(result["plain_losses"]) == 16
    assert len(result["grad_norms"]) == 16 and min(result["grad_norms"]) > 0


@pytest.mark.slow
def test_lightning_sparse_finetune_example_checks_pass(tmp_path_factory):
    """accumulate_grad_batches=2 (grad_accumulation=True) and gradient_clip_val (configure_gradient_clipping calling
    clip_grad_norm_): Lightning's run equals the plain loop's calls bit for bit, and ckpt_path resumes bitwise."""
    result = run_example("lightning_sparse_finetune.py", tmp_path_factory)
    assert failed(result) == [], result["stdout"]
    assert result["returncode"] == 0 and len(result["checks"]) == 4
    assert max(result["norms"]) > 0.5  # some steps were clipped


@pytest.mark.slow
def test_sparse_finetune_resnet_example_checks_pass(tmp_path_factory):
    """The recipe: a new dense head, 1% of a pretrained ResNet-18's body, batch norm frozen; it beats the head alone."""
    result = run_example("sparse_finetune_resnet.py", tmp_path_factory)
    assert failed(result) == [], result["stdout"]
    assert result["returncode"] == 0 and len(result["checks"]) == 5


# -- what the frameworks' resume paths need from ParamGroupOptimizer -----------------------------------


def test_load_state_dict_with_topk_k_larger_than_a_parameter():
    """Lightning's ckpt_path, Trainer's resume_from_checkpoint and Accelerate's load_state all call this."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 10))
    opt = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(), sparsify=ft.topk(500), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    fresh = ft.optimizer_from_torch(torch.optim.AdamW, model.parameters(), sparsify=ft.topk(500), lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    assert all(torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in model.parameters())


def test_add_param_group_smaller_than_k_with_error_feedback_topk():
    """Lightning's BackboneFinetuning (and any unfreezing schedule) adds param groups during training."""
    body, head = torch.nn.Linear(64, 128), torch.nn.Linear(128, 2)  # the head: 258 coordinates < k
    opt = ft.optimizer_from_torch(
        torch.optim.AdamW, body.parameters(), sparsify=ft.error_feedback(ft.topk(500)), lr=0.01
    )
    x = torch.randn(4, 64)
    head(body(x)).sum().backward()
    opt.step()
    opt.add_param_group({"params": head.parameters(), "lr": 1e-3})
    opt.zero_grad()
    head.zero_grad()
    head(body(x)).sum().backward()
    opt.step()
    assert sorted(opt.state[head.weight]) == ["exp_avg", "exp_avg_sq", "sparsify.residual", "step"]


def test_from_torch_class_is_an_optimizer_class_with_torchs_signature():
    """What transformers' Trainer needs from optimizer_cls_and_kwargs: a class, called with the groups."""
    sparsify = ft.topk(3)
    cls = ft.optimizer_class_from_torch(torch.optim.AdamW, sparsify)
    assert isinstance(cls, type) and issubclass(cls, ft.ParamGroupOptimizer)
    assert cls.__name__ == "AdamW" and issubclass(cls, torch.optim.AdamW)  # what loggers show, what isinstance sees
    assert ft.optimizer_class_from_torch(torch.optim.AdamW, sparsify) is cls  # the same class for the same args
    model = torch.nn.Linear(4, 2)
    opt = cls([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.02}], lr=0.01, weight_decay=0.0)
    model(torch.randn(3, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert sum(int((p != b).sum()) for p, b in zip(model.parameters(), before)) == 3  # one top-k over both groups
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    with pytest.raises(ValueError, match="no functopk form"):
        ft.optimizer_class_from_torch(torch.optim.LBFGS)
