"""benchmarks/transfer.py's pieces on a tiny convolutional model for two steps (the experiment itself is not run)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import transfer  # noqa: E402


class Tiny(nn.Module):
    """A conv, a batch norm and a 5-way ``fc`` head: the shape of model the methods expect."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Tiny()


@pytest.fixture(scope="module")
def tasks():
    return transfer.load_tasks(0)


def test_tasks_split_the_digits_by_label(tasks):
    (x, y, x_test, y_test), (fx, fy, fx_test, fy_test) = tasks["pretrain"], tasks["finetune"]
    assert x.shape[1:] == (1, 8, 8) and all(set(t.tolist()) == set(range(5)) for t in (y, y_test, fy, fy_test))
    assert len(x) + len(x_test) + len(fx) + len(fx_test) == 1797 and len(x_test) == math.ceil(
        0.3 * (len(x) + len(x_test))
    )
    assert not set(map(bytes, x.numpy())) & set(map(bytes, x_test.numpy()))  # no test image in training


def test_sparse_method_changes_at_most_k_body_coordinates_per_step(tasks):
    model = tiny(0)
    model.load_state_dict(transfer.pretrain(tiny, tasks["pretrain"], 2, 16, 0, cache=None))
    model.eval()
    body = transfer.body_of(model)
    n = sum(p.numel() for p in body.values())
    step, info = transfer.sparse(model, 1e-2, density=0.1, refresh_every=2)
    k = round(0.1 * n)
    assert info["trainable"] == k
    x, y = tasks["finetune"][:2]
    for idx in transfer.batches(len(y), 16, 2, 0):
        before = torch.cat([p.detach().flatten() for p in body.values()])
        head = model.fc.weight.detach().clone()
        step(x[idx], y[idx])
        changed = (torch.cat([p.detach().flatten() for p in body.values()]) != before).sum().item()
        assert 0 < changed <= k
        assert not torch.equal(model.fc.weight, head)  # the new head trains densely in every method
    # O(k), not AdamW's 2n: indices, two moments and a step count per coordinate, and one step counter
    assert info["state_of"]()[0] == 4 * k + 1
    acc = transfer.accuracy(model, *tasks["finetune"][2:])
    assert 0.0 <= acc <= 1.0


@pytest.mark.integrations
def test_lora_rank_formula_matches_peft_and_the_curve_is_recorded(tasks, monkeypatch):
    model = tiny(0)
    rank = transfer.lora_rank_for(model, 36)
    assert rank == 3  # a rank-r LoRA of Conv2d(1, 4, 3x3): r * (1 * 9 + 4) = 13 r, nearest 36 at r = 3
    _, info = transfer.lora(tiny(0), 1e-2, density=1.0)  # body n = 36 (conv) + 8 (bn) = 44: nearest at r = 3
    assert info["lora_rank"] == 3 and info["trainable"] == 3 * 13
    monkeypatch.setitem(transfer.METHODS, "tiny_lora", ("lora", lambda m, lr: transfer.lora(m, lr, density=1.0)))
    result = transfer.finetune("tiny_lora", tiny, tiny(0).state_dict(), tasks["finetune"], steps=3, batch_size=16,
                               eval_every=2, seed=0)  # fmt: skip
    assert [s for s, _ in result["curve"]] == [0, 2, 3]
    assert all(0.0 <= a <= 1.0 for _, a in result["curve"]) and len(result["step_s"]) == 3
    # AdamW's two moments and step counter of the two adapter tensors, not the head's
    assert result["state_elems"] == 2 * 3 * 13 + 2
