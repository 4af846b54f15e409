"""Sampled weight gradients through a stream: every supported layer, tied weights, what falls back, what is never
computed, and the hooks' lifetime."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import functopk as ft
from functopk.sparse import layers
from functopk.sparse.streaming import StreamingTopK
from tests.sparse.helpers import WeightShaped, weights_of


class Tied(nn.Module):
    """A token embedding tied to the output layer, as GPT-2's: one weight, two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6, padding_idx=1)
        self.norm = nn.LayerNorm(6)  # its parameters take the streaming path
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.embed(ids))))


def conv1d(nf: int, nx: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D  # (the integrations extra: not installed at CI's old end)

    return Conv1D(nf, nx)


def ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, 13, shape, generator=torch.Generator().manual_seed(4))


def inputs(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


CASES = {
    "linear": (lambda: nn.Linear(7, 5), lambda: inputs(2, 3, 7)),
    "conv1d": (lambda: conv1d(5, 7), lambda: inputs(2, 3, 7)),
    "embedding": (lambda: nn.Embedding(13, 4, padding_idx=2), lambda: ids(3, 6)),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), lambda: inputs(3, 4, 7, 6)),
    "conv2d_same": (lambda: nn.Conv2d(3, 4, (2, 3), padding="same", dilation=(2, 1)), lambda: inputs(2, 3, 5, 5)),
    "conv2d_unbatched": (lambda: nn.Conv2d(2, 3, 3, dilation=2, bias=False), lambda: inputs(2, 7, 7)),
    "tied": (Tied, lambda: ids(3, 5)),
}


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    return (out * weights).sum()


def flat_grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The dense gradient in the stream's flat order (optree's: a dict's keys sorted)."""
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss_of(model, x), list(params.values()))
    return torch.cat([g.reshape(-1) for g in ft.tree.leaves(dict(zip(params, grads)))])


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.integrations] if c == "conv1d" else []) for c in CASES]
)
def test_each_layer_gives_the_dense_gradient_at_the_set_without_a_dense_weight_gradient(case):
    """float64: equal to the dense gradient within rounding (the same sums in another order; the embedding's are
    the dense backward's order, bit for bit), the weight gets no .grad, and no weight-shaped tensor is made."""
    make, data = CASES[case]
    torch.manual_seed(0)
    model, x = make().double(), data()
    dense = flat_grads(model, x)
    n = dense.numel()
    indices = torch.randperm(n, generator=torch.Generator().manual_seed(7))[: n // 3].sort().values
    with StreamingTopK(dict(model.named_parameters()), k=3) as stream:
        stream.gather(indices)
        with WeightShaped(weights_of(model)) as watch:
            loss_of(model, x).backward()
        assert all(p.grad is None for p in model.parameters())
        got = stream.result()
    assert watch.seen == []
    assert torch.equal(got.indices, indices)
    torch.testing.assert_close(got.values, dense[indices], rtol=1e-12, atol=1e-14)


def test_the_watch_sees_the_dense_gradient_when_selecting_or_not_sampled():
    """The check above can fail: a selecting step, or sampled=False, computes the dense weight gradients."""
    for sampled, gather in [(True, False), (False, True)]:
        model = Tied().double()
        with StreamingTopK(dict(model.named_parameters()), k=3, sampled=sampled) as stream:
            if gather:
                stream.gather(torch.tensor([0, 5]))
            with WeightShaped(weights_of(model)) as watch:
                loss_of(model, ids(3, 5)).backward()
            stream.result()
        assert any("mm" in op for op in watch.seen) and any("embedding_dense_backward" in op for op in watch.seen)


def test_a_weight_used_by_a_layer_and_directly_adds_both_uses():
    """Outside the supported layers the weight still gets its dense gradient (its own hook), added to the claim's."""
    torch.manual_seed(1)
    layer = nn.Linear(4, 4).double()
    x = inputs(3, 4)

    def loss():
        return (layer(x) + torch.nn.functional.linear(x, layer.weight.T.contiguous())).square().sum()

    params = dict(layer.named_parameters())
    dense = torch.cat(
        [g.reshape(-1) for g in ft.tree.leaves(dict(zip(params, torch.autograd.grad(loss(), list(params.values())))))]
    )
    with StreamingTopK(params, k=2) as stream:
        stream.gather(torch.tensor([0, 3, 9, 17]))
        loss().backward()
        got = stream.result()
    torch.testing.assert_close(got.values, dense[[0, 3, 9, 17]], rtol=1e-12, atol=1e-14)


def test_an_in_place_op_on_the_output_and_an_exception_in_forward():
    torch.manual_seed(3)
    layer = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True)).double()
    x, every = inputs(5, 3), torch.arange(16)
    dense = flat_grads(layer, x)
    with StreamingTopK(dict(layer.named_parameters()), k=2) as stream:
        stream.gather(every)
        loss_of(layer, x).backward()  # ReLU(inplace=True) writes into the sampled layer's output
        got = stream.result()
        assert got.values.abs().sum() > 0
        torch.testing.assert_close(got.values, dense, rtol=1e-12, atol=1e-14)
        stream.gather(every)
        with pytest.raises(RuntimeError, match="shape"):
            layer(inputs(2, 5))
        assert isinstance(layer[0].weight, nn.Parameter) and layer[0].weight.requires_grad  # put back


class OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


FALLBACKS = {
    "reflect padding": lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
    "scale_grad_by_freq": lambda: nn.Embedding(13, 4, scale_grad_by_freq=True),
    "own forward": lambda: OwnForward(7, 5),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_unsupported_layers_keep_their_dense_gradient_and_the_same_result(case):
    torch.manual_seed(2)
    model = FALLBACKS[case]().double()
    x = inputs(2, 2, 6, 6) if "padding" in case else ids(2, 5) if "freq" in case else inputs(3, 7)
    dense = flat_grads(model, x)
    with StreamingTopK(dict(model.named_parameters()), k=2) as stream:
        stream.gather(torch.tensor([1, 4, 8]))
        with WeightShaped([model.weight]) as watch:
            loss_of(model, x).backward()
        got = stream.result()
    assert watch.seen != []  # the dense weight gradient, gathered by the weight's own hook
    assert torch.equal(got.values, dense[[1, 4, 8]])


def test_grad_mode_off_and_score_accumulated_use_the_dense_path():
    layer = nn.Linear(3, 2).double()
    stream = StreamingTopK([layer.weight, layer.bias], k=2, score="accumulated")  # its sums need every |g|
    stream.gather(torch.tensor([0]))
    assert stream.sampling_claim(layer.weight) is None
    stream.remove()
    stream = StreamingTopK([layer.weight, layer.bias], k=2)
    stream.gather(torch.tensor([0]))
    with torch.no_grad():
        layer(inputs(1, 3))
    assert stream.sampling_claim(layer.weight) is not None and stream.sampling_claim(torch.zeros(1)) is None
    stream.remove()


@pytest.mark.compile
def test_compiled_code_reads_nothing_of_the_global_hooks(fresh_dynamo):
    """Installed, they stay out of a compiled forward: no guard on their state, so a layer type first seen
    eagerly afterwards does not recompile it (their registry of types once did, through a guard on its size)."""
    release = layers.enable()
    try:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4))
        x = torch.randn(2, 3)
        compiled = torch.compile(lambda x: model(x), fullgraph=True)  # (a module would warn of the global hooks)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(x)
            nn.Sequential(nn.Conv1d(2, 2, 1), nn.GELU())(torch.randn(1, 2, 3))  # new types: the registry grows
            torch.testing.assert_close(compiled(x), model(x))  # (inductor may round LayerNorm otherwise)
    finally:
        release()


def test_the_global_hooks_live_while_a_sampling_stream_does():
    gc.collect()
    layer, before = nn.Linear(3, 2), layers.users()
    first = StreamingTopK([layer.weight], k=1)
    second = StreamingTopK([layer.bias], k=1)
    unsampled = StreamingTopK([nn.Linear(2, 2).weight], k=1, sampled=False)  # holds nothing
    assert layers.users() == before + 2
    first.remove()
    first.remove()
    assert layers.users() == before + 1
    del second
    gc.collect()
    assert layers.users() == before  # a deleted stream releases them too
    unsampled.remove()


def test_a_backward_after_its_set_ended_raises_and_a_zero_grad_between_forward_and_backward_does_not():
    """Lightning calls zero_grad() between the forward and the backward: the forward's claim stays valid."""
    layer = nn.Linear(3, 2).double()
    stream = StreamingTopK(dict(layer.named_parameters()), k=2)
    stream.gather(torch.tensor([0, 4]))
    loss = layer(inputs(2, 3)).sum()
    stream.discard()
    loss.backward()
    assert stream.result().values.abs().sum() > 0
    stream.gather(torch.tensor([0, 4]))
    loss = layer(inputs(2, 3)).sum()
    stream.result()  # the step ends before the backward
    with pytest.raises(RuntimeError, match="after that set ended"):
        loss.backward()
    stream.remove()


def test_accumulation_paused_or_grad_accumulation_adds_the_micro_batches():
    """paused() and grad_accumulation=True give the same bits, equal to the summed dense gradient within rounding;
    without either, a second backward raises."""
    torch.manual_seed(3)
    model = Tied().double()
    batches = [ids(2, 5), ids(3, 4)]
    params = dict(model.named_parameters())
    total = sum(flat_grads(model, b) for b in batches)
    indices = torch.arange(0, total.numel(), 7)
    results = []
    for how in ("paused", "grad_accumulation"):
        with StreamingTopK(params, k=3, grad_accumulation=how == "grad_accumulation") as stream:
            stream.gather(indices)
            with stream.paused() if how == "paused" else torch.enable_grad():
                loss_of(model, batches[0]).backward()
            loss_of(model, batches[1]).backward()
            results.append(stream.result().values)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], total[indices], rtol=1e-12, atol=1e-14)
    with StreamingTopK(params, k=3) as stream:
        stream.gather(indices)
        loss_of(model, batches[0]).backward()
        with pytest.raises(RuntimeError, match="grad_accumulation=True"):
            loss_of(model, batches[1]).backward()


def test_grad_accumulation_in_a_selecting_step_selects_from_the_sum():
    torch.manual_seed(4)
    model = Tied().double()
    batches = [ids(2, 5), ids(3, 4)]
    params = dict(model.named_parameters())
    expected = ft.topk_indices([sum(flat_grads(model, b) for b in batches)], 6)
    with StreamingTopK(params, k=6, grad_accumulation=True) as stream:
        for batch in batches:
            loss_of(model, batch).backward()
        assert stream.started and all(p.grad is not None for p in params.values())  # kept until result()
        got = stream.result()
    assert torch.equal(got.indices, expected.indices)
    torch.testing.assert_close(got.values, expected.values, rtol=1e-12, atol=1e-14)
