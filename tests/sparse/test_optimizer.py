"""sparse_optimizer: a coordinate-wise optimizer on k coordinates, against one torch.optim per coordinate in float64."""

from __future__ import annotations

import io

import pytest
import torch

import functopk as ft
from functopk.sparse.optimizer import sparse_optimizer
from tests.helpers import per_coordinate_reference, torch_coordinate

# torch.optim classes and settings (PyTorch's optimizer configurations: momentum, nesterov, amsgrad, centered...)
TORCH_CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    (torch.optim.NAdam, {"lr": 0.05, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.05}),
    (torch.optim.Adamax, {"lr": 0.05}),
    (torch.optim.Adadelta, {"lr": 0.5}),
    (torch.optim.ASGD, {"lr": 0.05, "t0": 2}),
    (torch.optim.Rprop, {"lr": 0.05}),
]
REFRESH = [True, False, False, True, False, True, True, False]  # kept, new and dropped coordinates


def problem(steps: int = len(REFRESH), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(3, 4, generator=gen, dtype=torch.float64),
        "b": torch.randn(5, generator=gen, dtype=torch.float64),
    }
    grads = [
        {name: torch.randn(p.shape, generator=gen, dtype=torch.float64) for name, p in params.items()}
        for _ in range(steps)
    ]
    return params, grads


def flat(tree) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in ft.tree.leaves(tree)])


reference = per_coordinate_reference


def run(opt, params, grads, refresh):
    state = opt.init(params)
    for g, r in zip(grads, refresh):
        updates, state = opt.update(g, state, params, refresh=r)
        params = ft.apply_sparse_updates(params, updates)
    return params, state


@pytest.mark.parametrize("cls, kwargs", TORCH_CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_matches_one_torch_optimizer_per_coordinate(cls, kwargs):
    params, grads = problem()
    got, state = run(sparse_optimizer(ft.from_torch(cls, **kwargs), k=4), params, grads, REFRESH)
    expected = reference(torch_coordinate(cls, kwargs), params, grads, 4, REFRESH)
    torch.testing.assert_close(flat(got), expected, rtol=1e-12, atol=1e-12)
    assert state.indices.numel() == 4 and int(state.count) == len(grads)


def test_accumulated_score_ranks_the_sum_of_magnitudes_since_the_last_refresh():
    params, grads = problem()
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    opt = sparse_optimizer(ft.from_torch(torch.optim.AdamW, **kwargs), k=3, score="accumulated")
    got, state = run(opt, params, grads, REFRESH)
    expected = reference(torch_coordinate(torch.optim.AdamW, kwargs), params, grads, 3, REFRESH, "accumulated")
    torch.testing.assert_close(flat(got), expected, rtol=1e-12, atol=1e-12)
    assert state.score is not None and flat(state.score).abs().sum() > 0  # two steps since the last refresh


def test_lion_matches_the_dense_lion_per_coordinate():
    params, grads = problem()
    tx = ft.lion(0.01, weight_decay=0.1)

    def make(c, value):  # the dense functional lion on a one-coordinate parameter (itself tested against optax)
        holder = {"p": value.clone().reshape(1)}
        state = [tx.init(holder)]

        class Step:
            def step(self):
                u, state[0] = tx.update({"p": p.grad}, state[0], {"p": p.detach().clone()})
                with torch.no_grad():
                    p.add_(u["p"])

        p = torch.nn.Parameter(holder["p"])
        return p, Step()

    got, _ = run(sparse_optimizer(tx, k=5), params, grads, REFRESH)
    torch.testing.assert_close(flat(got), reference(make, params, grads, 5, REFRESH), rtol=1e-12, atol=1e-12)


def test_a_refresh_selects_exactly_what_topk_indices_selects():
    params, grads = problem(1)
    grads[0]["w"][0, :3] = torch.tensor([7.0, -7.0, 7.0], dtype=torch.float64)  # ties go to the lower index
    updates, _ = sparse_optimizer(ft.sgd(1.0), k=2).update(
        grads[0], sparse_optimizer(ft.sgd(1.0), k=2).init(params), params, refresh=True
    )
    assert torch.equal(updates.indices, ft.topk_indices(grads[0], 2).indices)
    assert torch.equal(updates.values, -ft.topk_indices(grads[0], 2).values)


def test_state_is_16_bytes_per_coordinate_for_adamw_in_float32():
    params = {"w": torch.zeros(100)}
    state = sparse_optimizer(ft.adamw(1e-3, weight_decay=0.01), k=10).init(params)
    tensors = [state.indices, *ft.tree.leaves(state.inner)]
    assert sum(t.numel() * t.element_size() for t in tensors) == 16 * 10  # index, step count, mu, nu: 4 bytes each
    assert state.indices.dtype == torch.int32 and state.score is None


def test_the_stream_selection_gives_the_dense_result():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = sparse_optimizer(ft.adam(0.1), k=5)
    dense_state = stream_state = opt.init(params)
    with ft.sparse.StreamingTopK(dict(model.named_parameters()), k=5) as stream:
        for _ in range(3):
            x = torch.randn(3, 4, dtype=torch.float64)
            model(x).square().sum().backward()
            sparse = stream.result()
            grads = ft.tree.map(lambda p: torch.zeros_like(p), params)
            grads = ft.apply_sparse_updates(grads, sparse)  # the dense gradient is zero outside the top 5
            u_dense, dense_state = opt.update(grads, dense_state, params, refresh=True)
            u_stream, stream_state = opt.update(sparse, stream_state, params, refresh=True)
            assert torch.equal(u_dense.indices, u_stream.indices) and torch.equal(u_dense.values, u_stream.values)
            ft.apply_sparse_updates_(dict(model.named_parameters()), u_stream)
            params = {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_stream_gathering_at_the_set_between_refreshes_gives_the_dense_result():
    """Bit for bit with the stream's dense weight gradients (sampled=False; tests/sparse/test_layers.py checks the
    sampled ones against the dense gradient within rounding)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
    live = dict(model.named_parameters())
    opt = sparse_optimizer(ft.adamw(0.1, weight_decay=0.1), k=5)
    params = {name: p.detach().clone() for name, p in live.items()}
    dense_state = stream_state = opt.init(params)
    with ft.sparse.StreamingTopK(live, k=5, sampled=False) as stream:
        for step in range(5):
            refresh = step % 2 == 0
            if not refresh:
                stream.gather(stream_state.indices)
            loss = model(torch.randn(3, 4, dtype=torch.float64)).square().sum()
            grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()), retain_graph=True)))
            loss.backward()  # folded (refresh) or gathered at the set, and freed
            assert all(p.grad is None for p in live.values())
            u_dense, dense_state = opt.update(grads, dense_state, params, refresh=refresh)
            u_stream, stream_state = opt.update(stream.result(), stream_state, params, refresh=refresh)
            assert torch.equal(u_dense.indices, u_stream.indices) and torch.equal(u_dense.values, u_stream.values)
            params = ft.apply_sparse_updates_(live, u_stream)
            params = {name: p.detach().clone() for name, p in live.items()}


def test_a_stream_summing_the_scores_selects_as_the_accumulated_dense_refresh():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).double()
    live = dict(model.named_parameters())
    dense_opt = sparse_optimizer(ft.adam(0.1), k=5, score="accumulated")
    stream_opt = sparse_optimizer(ft.adam(0.1), k=5)
    params = {name: p.detach().clone() for name, p in live.items()}
    dense_state, stream_state = dense_opt.init(params), stream_opt.init(params)
    with ft.sparse.StreamingTopK(live, k=5, score="accumulated") as stream:
        for step in range(7):
            refresh = step % 3 == 0
            if not refresh:
                stream.gather(stream_state.indices)
            loss = model(torch.randn(3, 4, dtype=torch.float64)).square().sum()
            grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()), retain_graph=True)))
            loss.backward()
            u_dense, dense_state = dense_opt.update(grads, dense_state, params, refresh=refresh)
            u_stream, stream_state = stream_opt.update(stream.result(), stream_state, params, refresh=refresh)
            assert torch.equal(u_dense.indices, u_stream.indices) and torch.equal(u_dense.values, u_stream.values)
            ft.apply_sparse_updates_(live, u_stream)
            params = {name: p.detach().clone() for name, p in live.items()}
    with pytest.raises(ValueError, match='StreamingTopK\\(..., score="accumulated"\\)'):
        dense_opt.update(ft.topk_indices(grads, 5), dense_state, params, refresh=True)


def test_state_round_trips_through_a_checkpoint_and_resumes_bitwise():
    params, grads = problem()
    opt = sparse_optimizer(ft.adamw(0.05, weight_decay=0.1), k=4, score="accumulated")
    mid, state = run(opt, params, grads[:4], REFRESH[:4])
    buffer = io.BytesIO()
    ft.save_state(buffer, state)
    buffer.seek(0)
    loaded = ft.load_state(buffer, opt.init(params))
    straight, _ = run_from(opt, mid, state, grads[4:], REFRESH[4:])
    resumed, _ = run_from(opt, mid, loaded, grads[4:], REFRESH[4:])
    assert all(torch.equal(a, b) for a, b in zip(ft.tree.leaves(straight), ft.tree.leaves(resumed)))


def run_from(opt, params, state, grads, refresh):
    for g, r in zip(grads, refresh):
        updates, state = opt.update(g, state, params, refresh=r)
        params = ft.apply_sparse_updates(params, updates)
    return params, state


@pytest.mark.parametrize(
    "inner",
    [
        ft.lamb(1e-3),
        ft.adafactor(1e-3),
        ft.muon(1e-3),
        ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(0.1)),
        ft.chain(ft.topk(2), ft.sgd(0.1)),
        ft.from_torch(torch.optim.Adafactor, lr=1e-2),
    ],
    ids=["lamb", "adafactor", "muon", "clip_by_global_norm", "topk", "torch-adafactor"],
)
def test_optimizers_that_are_not_coordinatewise_are_refused(inner):
    with pytest.raises(ValueError, match="not coordinate-wise"):
        sparse_optimizer(inner, k=2)


def test_a_tensor_learning_rate_changed_in_place_is_the_global_schedule():
    lr = torch.tensor(0.1)
    opt = sparse_optimizer(ft.adamw(lr), k=2)
    params, grads = {"w": torch.zeros(4)}, {"w": torch.tensor([1.0, -2.0, 3.0, 0.5])}
    updates, state = opt.update(grads, opt.init(params), params, refresh=True)
    torch.testing.assert_close(updates.values, torch.tensor([0.1, -0.1]))  # Adam's first step: -lr * sign(g)
    lr.fill_(0.01)
    updates, state = opt.update(grads, state, params, refresh=True)
    torch.testing.assert_close(updates.values, torch.tensor([0.01, -0.01]))


def test_a_schedule_inside_is_refused_and_other_bad_arguments_named():
    with pytest.raises(ValueError, match="schedule"):
        sparse_optimizer(ft.adamw(ft.linear_schedule(1.0, 0.0, 10)), k=2)
    with pytest.raises(TypeError, match="inner must be a functopk GradientTransformation"):
        sparse_optimizer(torch.optim.AdamW, k=2)
    with pytest.raises(ValueError, match="score"):
        sparse_optimizer(ft.sgd(0.1), k=2, score="momentum")
    opt = sparse_optimizer(ft.sgd(0.1), k=2)
    params = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="k"):
        sparse_optimizer(ft.sgd(0.1), k=4).init(params)
    state = opt.init(params)
    with pytest.raises(TypeError, match="refresh must be a bool"):
        opt.update({"w": torch.ones(3)}, state, params, refresh=1)
    with pytest.raises(ValueError, match="grads leaf at \\['w'\\] has shape"):
        opt.update({"w": torch.ones(4)}, state, params, refresh=True)
    with pytest.raises(ValueError, match="other coordinates than state.indices"):
        opt.update(ft.topk_indices({"w": torch.tensor([0.0, 1.0, 2.0])}, 2), state, params, refresh=False)
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update({"w": torch.ones(3)}, state, refresh=True)


@pytest.mark.compile
@pytest.mark.slow
def test_compiles_with_fullgraph_and_matches_eager():
    params, grads = problem(3)
    params = ft.tree.cast(params, torch.float32)
    grads = [ft.tree.cast(g, torch.float32) for g in grads]
    opt = sparse_optimizer(ft.adamw(0.05, weight_decay=0.1), k=4)

    def step(g, state, p, refresh: bool):
        updates, state = opt.update(g, state, p, refresh=refresh)
        return ft.apply_sparse_updates(p, updates), state

    compiled = torch.compile(step, fullgraph=True)
    eager_p, eager_s = params, opt.init(params)
    comp_p, comp_s = params, opt.init(params)
    for g, r in zip(grads, [True, False, True]):
        eager_p, eager_s = step(g, eager_s, eager_p, r)
        comp_p, comp_s = compiled(g, comp_s, comp_p, r)
    for a, b in zip(ft.tree.leaves(eager_p), ft.tree.leaves(comp_p)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(eager_s.indices, comp_s.indices)


def test_inject_hyperparams_is_coordinatewise_and_its_learning_rate_one_for_all_coordinates():
    """inject_hyperparams(ft.adam): the same steps as ft.adam with a 0-d tensor learning rate changed in place,
    through refreshes (coordinates that join use the current learning rate, not the first one)."""
    params, grads = problem()
    lr = torch.tensor(0.1, dtype=torch.float64)
    injected = sparse_optimizer(ft.inject_hyperparams(ft.adam)(learning_rate=lr.clone()), k=4)
    plain = sparse_optimizer(ft.adam(lr), k=4)
    p_inj, p_plain = params, params
    s_inj, s_plain = injected.init(params), plain.init(params)
    for step, (g, refresh) in enumerate(zip(grads, REFRESH)):
        u_inj, s_inj = injected.update(g, s_inj, p_inj, refresh=refresh)
        u_plain, s_plain = plain.update(g, s_plain, p_plain, refresh=refresh)
        assert torch.equal(u_inj.indices, u_plain.indices) and torch.equal(u_inj.values, u_plain.values)
        p_inj, p_plain = ft.apply_sparse_updates(p_inj, u_inj), ft.apply_sparse_updates(p_plain, u_plain)
        new_lr = 0.1 / (step + 2)
        lr.fill_(new_lr)
        hyper = {**s_inj.inner.hyperparams, "learning_rate": torch.tensor(new_lr, dtype=torch.float64)}
        s_inj = s_inj._replace(inner=s_inj.inner._replace(hyperparams=hyper))
    with pytest.raises(ValueError, match="schedule"):
        sparse_optimizer(ft.inject_hyperparams(ft.adam)(learning_rate=ft.linear_schedule(0.1, 0.0, 10)), k=2)
    with pytest.raises(ValueError, match="not coordinate-wise"):
        sparse_optimizer(ft.inject_hyperparams(ft.lamb)(learning_rate=0.1), k=2)
