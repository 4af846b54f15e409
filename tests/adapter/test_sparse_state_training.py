"""sparse_optimizer_from_torch in training loops: sampled weight gradients between refreshes, gradient accumulation,
clipping, and the class door (what trainers need)."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import bits
from tests.sparse.helpers import WeightShaped, tiny_gpt2, weights_of

pytestmark = pytest.mark.integrations  # (GPT-2: transformers)


def batches(count: int, size: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 29, (size, 12), generator=gen) for _ in range(count)]


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(sampled: bool, steps: int = 8, refresh_every: int = 3) -> torch.Tensor:
    model = tiny_gpt2()
    with ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=300, refresh_every=refresh_every,
                                        sampled=sampled, lr=0.01, weight_decay=0.1) as opt:  # fmt: skip
        for ids in batches(steps):
            opt.zero_grad()
            loss_of(model, ids).backward()
            opt.step()
    return flat(model)


def test_a_run_with_sampled_weight_gradients_equals_the_dense_backward_run_within_rounding():
    """GPT-2 (Conv1D, a tied embedding), float64, refresh every 3 steps: the same run within rounding."""
    dense, sampled = train(sampled=False), train(sampled=True)
    assert not torch.equal(dense, flat(tiny_gpt2()))
    torch.testing.assert_close(sampled, dense, rtol=1e-10, atol=1e-12)


def test_no_dense_weight_gradient_between_refreshes_and_the_dense_one_at_a_refresh():
    model = tiny_gpt2()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=300, refresh_every=3, lr=0.01)
    seen = []
    for ids in batches(4, size=5):  # 60 tokens: no activation is shaped like a weight
        with WeightShaped(weights_of(model)) as watch:
            loss_of(model, ids).backward()
            opt.step()
            opt.zero_grad()
        seen.append(watch.seen)
    assert [bool(s) for s in seen] == [True, False, False, True]  # steps 0 and 3 refresh
    assert any("mm" in op for op in seen[0]) and any("embedding_dense_backward" in op for op in seen[0])
    opt.remove()


def run_accumulating(how: str, micro: list[torch.Tensor], clip: float | None = None) -> tuple[torch.Tensor, list]:
    model = tiny_gpt2()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=300, refresh_every=3, lr=0.01,
                                         grad_accumulation=how == "grad_accumulation")  # fmt: skip
    norms = []
    for first, last in zip(micro[0::2], micro[1::2]):
        with opt.paused() if how == "paused" else torch.enable_grad():
            loss_of(model, first).backward()
        loss_of(model, last).backward()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    opt.remove()
    return flat(model), norms


def test_grad_accumulation_equals_paused_bit_for_bit_and_the_summed_loss_within_rounding():
    micro = batches(12, size=2)
    by_flag, _ = run_accumulating("grad_accumulation", micro)
    by_pause, _ = run_accumulating("paused", micro)
    assert torch.equal(bits(by_flag), bits(by_pause))
    model = tiny_gpt2()
    with ft.sparse_optimizer_from_torch(torch.optim.AdamW, model.parameters(), k=300, refresh_every=3,
                                        lr=0.01) as opt:  # fmt: skip
        for first, last in zip(micro[0::2], micro[1::2]):
            (loss_of(model, first) + loss_of(model, last)).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(by_flag, flat(model), rtol=1e-10, atol=1e-12)


def test_clip_grad_norm_clips_the_k_values_as_torch_clips_a_tensor():
    """The norm returned is the k values' (a 0-d tensor); the step uses them scaled as torch.nn.utils would: the
    functional form with torch.nn.utils.clip_grad_norm_ on the stream's values gives the same bits."""
    micro = batches(8, size=2)
    clipped, norms = run_accumulating("grad_accumulation", micro, clip=0.05)
    model = tiny_gpt2()
    params = list(model.parameters())
    opt = ft.sparse.sparse_optimizer(ft.from_torch(torch.optim.AdamW, lr=0.01), k=300)
    state = opt.init(params)
    with ft.sparse.StreamingTopK(params, k=300) as stream:
        for step, (first, last, norm) in enumerate(zip(micro[0::2], micro[1::2], norms)):
            if step % 3:
                stream.gather(state.indices)
            with stream.paused():
                loss_of(model, first).backward()
            loss_of(model, last).backward()
            grads = stream.result()
            values = torch.zeros_like(grads.values, requires_grad=True)
            values.grad = grads.values.clone()
            expected = torch.nn.utils.clip_grad_norm_([values], 0.05)
            assert norm.dim() == 0 and torch.equal(norm, expected) and norm > 0.05
            with torch.no_grad():
                updates, state = opt.update(grads._replace(values=values.grad), state, params, refresh=step % 3 == 0)
                ft.apply_sparse_updates_(params, updates)
    assert torch.equal(bits(clipped), bits(flat(model)))


def test_clip_grad_norm_edge_cases():
    w = torch.zeros(3, requires_grad=True)
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, [w], k=2, lr=1.0)
    assert float(opt.clip_grad_norm_(1.0)) == 0.0  # no backward: nothing to clip
    (w * torch.tensor([3.0, 0.0, 4.0])).sum().backward()
    assert float(opt.clip_grad_norm_(10.0)) == pytest.approx(5.0)  # below max_norm: unchanged
    opt.step()
    assert torch.allclose(w, torch.tensor([-3.0, 0.0, -4.0]))
    (w * torch.tensor([3.0, 0.0, 4.0])).sum().backward()
    opt.clip_grad_norm_(1.0)
    (w * torch.tensor([3.0, 0.0, 4.0])).sum().backward()
    with pytest.raises(RuntimeError, match="after clip_grad_norm_"):
        opt.step()
    opt.zero_grad()
    (w * torch.tensor([3.0, 0.0, 4.0])).sum().backward()
    opt.clip_grad_norm_(1.0)
    opt.zero_grad()  # drops the clipped gradient too
    opt.step()
    assert torch.allclose(w, torch.tensor([-3.0, 0.0, -4.0]))
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(-1.0)


def test_the_class_door_takes_param_groups_and_the_same_keywords():
    cls = ft.sparse_optimizer_class_from_torch(torch.optim.AdamW)
    assert cls is ft.sparse_optimizer_class_from_torch(torch.optim.AdamW)
    assert (
        cls.__name__ == "AdamW"
        and issubclass(cls, torch.optim.AdamW)
        and issubclass(cls, ft.adapter.SparseStateOptimizer)
    )
    model = tiny_gpt2()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = cls(groups, k=50, refresh_every=2, grad_accumulation=True, lr=0.01)  # what Trainer's optimizer_cls does
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.k == 50
    loss_of(model, batches(1)[0]).backward()
    loss_of(model, batches(1)[0]).backward()  # accumulated
    opt.step()
    opt.remove()
    with pytest.raises(ValueError, match="no functopk form"):
        ft.sparse_optimizer_class_from_torch(torch.optim.LBFGS)
