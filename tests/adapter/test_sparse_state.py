"""sparse_optimizer_from_torch: torch.optim on k coordinates, against the functional form and torch.optim."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import functopk as ft
from functopk.sparse.optimizer import sparse_optimizer
from tests.helpers import bits, per_coordinate_reference, torch_coordinate

CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
]
STEPS = 6


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def data(steps: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(5, 2, generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def train(opt, net, batches):
    for x, y in batches:
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()


def functional(cls, kwargs, k, refresh_every, batches, score="gradient"):
    """The functional form on the same model, with dense gradients."""
    net = model()
    params = list(net.parameters())
    opt = sparse_optimizer(ft.from_torch(cls, **kwargs), k=k, score=score)
    state = opt.init(params)
    for step, (x, y) in enumerate(batches):
        grads = torch.autograd.grad(loss_of(net, x, y), params)
        updates, state = opt.update(list(grads), state, params, refresh=step % refresh_every == 0)
        ft.apply_sparse_updates_(params, updates)
    return flat(net)


@pytest.mark.parametrize("sampled", [False, True], ids=["dense", "sampled"])
@pytest.mark.parametrize("refresh_every", [1, 3])
@pytest.mark.parametrize("cls, kwargs", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_equals_the_functional_sparse_optimizer_step_by_step(cls, kwargs, refresh_every, sampled):
    """Bit for bit with dense weight gradients; within rounding when the Linear layers' weight gradients are
    computed at the set only between refreshes (the same sums in another order)."""
    net = model()
    opt = ft.sparse_optimizer_from_torch(
        cls, net.parameters(), k=5, refresh_every=refresh_every, sampled=sampled, **kwargs
    )
    assert isinstance(opt, cls) and type(opt).__name__ == cls.__name__
    train(opt, net, data())
    expected = functional(cls, kwargs, 5, refresh_every, data())
    if sampled:
        torch.testing.assert_close(flat(net), expected, rtol=1e-12, atol=1e-14)
    else:
        assert torch.equal(bits(flat(net)), bits(expected))
    assert int(opt.state_dict()["state"]["count"]) == STEPS


@pytest.mark.parametrize("refresh_every", [1, 3])
def test_accumulated_score_equals_the_functional_form(refresh_every):
    net = model()
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    opt = ft.sparse_optimizer_from_torch(
        torch.optim.AdamW, net.parameters(), k=5, refresh_every=refresh_every, score="accumulated", **kwargs
    )
    train(opt, net, data())
    expected = functional(torch.optim.AdamW, kwargs, 5, refresh_every, data(), score="accumulated")
    assert torch.equal(bits(flat(net)), bits(expected))
    assert len(opt.state_dict()["state"]["score"]) == len(list(net.parameters()))


def reference(cls, groups, grads, k, refresh_every):
    """One torch optimizer per coordinate with its group's hyperparameters, made when it joins the set."""
    params = [p for ps, _ in groups for p in ps]
    owner = [i for i, (ps, _) in enumerate(groups) for p in ps for _ in range(p.numel())]
    refresh = [step % refresh_every == 0 for step in range(len(grads))]
    return per_coordinate_reference(
        lambda c, value: torch_coordinate(cls, groups[owner[c]][1])(c, value), params, grads, k, refresh
    )


GROUP_CASES = [
    (torch.optim.AdamW, [{"lr": 0.05, "weight_decay": 0.2}, {"lr": 0.01, "weight_decay": 0.0}]),
    # the groups' states differ in structure (weight decay is one more piece of the chain)
    (
        torch.optim.SGD,
        [{"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}, {"lr": 0.1, "momentum": 0.5, "weight_decay": 0.3}],
    ),
]


@pytest.mark.parametrize("cls, hyper", GROUP_CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_param_groups_each_with_its_own_hyperparameters(cls, hyper):
    gen = torch.Generator().manual_seed(2)
    w, b = (torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in [(3, 4), (5,)])
    steps = 7
    coefficients = [torch.randn(17, generator=gen, dtype=torch.float64) for _ in range(steps)]
    start = [w.detach().clone(), b.detach().clone()]
    opt = ft.sparse_optimizer_from_torch(
        cls, [{"params": [w], **hyper[0]}, {"params": [b], **hyper[1]}], k=6, refresh_every=3
    )
    for c in coefficients:  # loss linear in the parameters: the gradient at each step is c
        (torch.cat([w.reshape(-1), b]) * c).sum().backward()
        opt.step()
    expected = reference(cls, [([start[0]], hyper[0]), ([start[1]], hyper[1])], coefficients, 6, 3)
    torch.testing.assert_close(torch.cat([w.detach().reshape(-1), b.detach()]), expected, rtol=1e-12, atol=1e-12)


def test_a_hyperparameter_that_changes_the_state_takes_effect_at_the_next_step():
    net = model()
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, net.parameters(), k=4, lr=0.1)
    train(opt, net, data(1))
    assert opt.state_dict()["state"]["inner"] == {}  # plain SGD keeps nothing
    opt.param_groups[0]["momentum"] = 0.9
    train(opt, net, data(2)[1:])
    assert sorted(opt.state_dict()["state"]["inner"]) == ["count", "momentum_buffer"]


def test_a_step_lr_scheduler_changes_the_learning_rate_at_the_next_step():
    net, batches = model(), data()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, net.parameters(), k=5, refresh_every=2, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches:
        loss_of(net, x, y).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**STEPS
    # the functional form with a 0-d tensor learning rate changed in place between steps
    ref = model()
    params = list(ref.parameters())
    lr = torch.tensor(0.1, dtype=torch.float64)
    tx = sparse_optimizer(ft.from_torch(torch.optim.AdamW, lr=lr), k=5)
    state = tx.init(params)
    for step, (x, y) in enumerate(batches):
        grads = torch.autograd.grad(loss_of(ref, x, y), params)
        updates, state = tx.update(list(grads), state, params, refresh=step % 2 == 0)
        ft.apply_sparse_updates_(params, updates)
        lr.fill_(0.1 * 0.5 ** (step + 1))
    torch.testing.assert_close(flat(net), flat(ref), rtol=1e-12, atol=1e-12)
    unscheduled = model()
    train(
        ft.sparse_optimizer_from_torch(torch.optim.AdamW, unscheduled.parameters(), k=5, lr=0.1), unscheduled, batches
    )
    assert not torch.allclose(flat(unscheduled), flat(net))


@pytest.mark.parametrize("score", ["gradient", "accumulated"])
def test_state_dict_round_trip_and_bitwise_resume(score):
    batches = data(10)
    straight = model()
    train(
        ft.sparse_optimizer_from_torch(torch.optim.AdamW, straight.parameters(), k=5, refresh_every=3, score=score),
        straight,
        batches,
    )

    first = model()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, first.parameters(), k=5, refresh_every=3, score=score)
    train(opt, first, batches[:5])  # the next step (5) gathers at the set chosen at step 3
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert sorted(saved["opt"]["state"]) == ["count", "indices", "inner"] + (
        ["score"] if score == "accumulated" else []
    )
    assert sorted(saved["opt"]["state"]["inner"]) == ["exp_avg", "exp_avg_sq", "step"]

    resumed = model(seed=5)  # other weights, other state: everything comes from the checkpoint
    resumed.load_state_dict(saved["model"])
    again = ft.sparse_optimizer_from_torch(torch.optim.AdamW, resumed.parameters(), k=5, refresh_every=3, score=score)
    again.load_state_dict(saved["opt"])
    for key in ("count", "indices"):
        assert torch.equal(again.state_dict()["state"][key], opt.state_dict()["state"][key])
    if score == "accumulated":  # the sums of |g| since the refresh at step 3, in the new stream
        sums, loaded = opt.state_dict()["state"]["score"], again.state_dict()["state"]["score"]
        assert all(x.abs().sum() > 0 and torch.equal(x, y) for x, y in zip(sums, loaded))
    train(again, resumed, batches[5:])
    assert torch.equal(bits(flat(resumed)), bits(flat(straight)))


def test_load_state_dict_checks_everything_before_changing_anything():
    net = model()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, net.parameters(), k=5, refresh_every=2, lr=0.01)
    train(opt, net, data(1))
    good = opt.state_dict()
    before = {key: value.clone() for key, value in good["state"]["inner"].items()}

    def changed(**state):
        return {**good, "state": {**good["state"], **state}}

    other_k = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model().parameters(), k=4).state_dict()
    sgd = ft.sparse_optimizer_from_torch(torch.optim.SGD, model().parameters(), k=5, lr=0.1, momentum=0.9)
    bad = [
        (other_k, ValueError, "k=5"),
        (sgd.state_dict(), ValueError, "param group 0 lacks"),
        (changed(inner={**good["state"]["inner"], "exp_avg": torch.zeros(5)}), ValueError, "inner.exp_avg is"),
        (changed(inner={"exp_avg": torch.zeros(5)}), ValueError, "must hold"),
        (changed(indices=good["state"]["indices"].flip(0)), ValueError, "ascending"),
        (changed(count="3"), TypeError, "count must be a tensor"),
        ({**good, "param_groups": good["param_groups"] * 2}, ValueError, "sizes"),
        ({**good, "param_groups": [{**good["param_groups"][0], "lr": -1.0}]}, ValueError, "param group 0"),
        ([], TypeError, "must be a dict"),
        (changed(score=[torch.zeros(1)]), ValueError, "must have the keys"),
    ]
    for state_dict, error, match in bad:
        with pytest.raises(error, match=match):
            opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.01 and int(opt.state_dict()["state"]["count"]) == 1
    for key, value in opt.state_dict()["state"]["inner"].items():
        assert torch.equal(value, before[key])
    accumulating = ft.sparse_optimizer_from_torch(torch.optim.AdamW, model().parameters(), k=5, score="accumulated")
    saved = accumulating.state_dict()
    sums = saved["state"]["score"]
    for bad_score in [sums[:-1], [torch.zeros(1), *sums[1:]], "sums"]:
        with pytest.raises(ValueError, match="score"):
            accumulating.load_state_dict({**saved, "state": {**saved["state"], "score": bad_score}})


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.Adafactor, ps, k=2), ValueError, "not coordinate-wise"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.LBFGS, ps, k=2), ValueError, "no functopk form"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SparseAdam, ps, k=2), ValueError, "no functopk form"),
        (lambda ps: ft.sparse_optimizer_from_torch(ft.adamw, ps, k=2), TypeError, "optimizer_class"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, lr=-1.0), ValueError, "learning rate"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, bad=1), TypeError, "bad"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, refresh_every=0), ValueError, "refresh"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, refresh_every=1.5), TypeError, "refresh"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, score="sum"), ValueError, "score"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=99), ValueError, "k"),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps, k=2, density=0.5), ValueError, "exactly one"),
        (
            lambda ps: ft.sparse_optimizer_from_torch(torch.optim.Adam, ps, k=2, capturable=True),
            NotImplementedError,
            "capturable",
        ),
        (lambda ps: ft.sparse_optimizer_from_torch(torch.optim.SGD, ps + ps, k=2), ValueError, "twice"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call(list(torch.nn.Linear(3, 2).parameters()))


def test_add_param_group_after_construction_is_refused():
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, torch.nn.Linear(3, 2).parameters(), k=2, lr=0.1)
    with pytest.raises(NotImplementedError, match="add_param_group after construction"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert len(opt.param_groups) == 1


def test_gradients_are_freed_and_the_state_is_16_bytes_per_coordinate_for_adamw():
    net = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    k = 10
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, net.parameters(), k=k, refresh_every=2)
    for _ in range(3):  # a refresh, a gather, a refresh
        net(torch.randn(4, 30)).square().sum().backward()
        assert all(p.grad is None for p in net.parameters())
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()["state"]
    tensors = [state["count"], state["indices"], *state["inner"].values()]
    assert sum(t.numel() * t.element_size() for t in tensors) == 16 * k + 8  # + the 8-byte step count


def test_a_step_without_backward_changes_nothing():
    net = model()
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, net.parameters(), k=3, lr=0.1, momentum=0.9)
    train(opt, net, data(1))
    before, count = flat(net).clone(), opt.state_dict()["state"]["count"].clone()
    assert opt.step() is None and opt.step(lambda: 1.5) == 1.5  # a closure without backward
    assert torch.equal(flat(net), before) and torch.equal(opt.state_dict()["state"]["count"], count)


def test_parameters_without_a_gradient_are_not_selected_and_the_indices_cover_all():
    net = model()
    unused = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    params = [unused, *net.parameters()]
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, params, k=4, lr=0.1, refresh_every=2)
    ref_net = model()
    ref_params = [torch.ones(4, dtype=torch.float64), *ref_net.parameters()]
    tx = sparse_optimizer(ft.from_torch(torch.optim.SGD, lr=0.1), k=4)
    state = tx.init(ref_params)
    for step, (x, y) in enumerate(data(3)):
        loss_of(net, x, y).backward()
        opt.step()
        grads = [torch.zeros(4, dtype=torch.float64), *torch.autograd.grad(loss_of(ref_net, x, y), ref_params[1:])]
        updates, state = tx.update(grads, state, ref_params, refresh=step % 2 == 0)
        ft.apply_sparse_updates_(ref_params, updates)
    assert torch.equal(unused.detach(), torch.ones(4, dtype=torch.float64))
    assert torch.equal(opt.state_dict()["state"]["indices"], state.indices)
    assert torch.equal(bits(flat(net)), bits(flat(ref_net)))


def test_a_round_trip_before_the_first_step_changes_nothing_and_copies_are_refused():
    """Accelerate's AcceleratedOptimizer loads the optimizer's own state dict when it wraps it."""
    net = model()
    opt = ft.sparse_optimizer_from_torch(torch.optim.AdamW, net.parameters(), k=5, refresh_every=3, sampled=False)
    opt.load_state_dict(opt.state_dict())
    train(opt, net, data())
    assert torch.equal(bits(flat(net)), bits(functional(torch.optim.AdamW, {}, 5, 3, data())))
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad], ids=lambda c: c.__name__)
def test_rmsprop_and_adagrad_with_torchs_defaults_step_as_torch_per_coordinate(cls):
    """momentum=0 and lr_decay=0 (torch's defaults) chain a step counter: still coordinate-wise."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    coefficients = [torch.randn(12, generator=gen, dtype=torch.float64) for _ in range(7)]
    start = w.detach().clone()
    opt = ft.sparse_optimizer_from_torch(cls, [w], k=5, refresh_every=3)
    for c in coefficients:
        (w.reshape(-1) * c).sum().backward()
        opt.step()
    expected = reference(cls, [([start], {})], coefficients, 5, 3)
    torch.testing.assert_close(w.detach().reshape(-1), expected, rtol=1e-12, atol=1e-12)
    assert sorted(opt.state_dict()["state"]["inner"]) == (
        ["square_avg", "step"] if cls is torch.optim.RMSprop else ["step", "sum"]
    )


def test_a_group_without_momentum_holds_no_other_groups_buffer_and_starts_its_own_afresh():
    """SGD groups with momentum 0.9 and 0; the second gains momentum later: as torch.optim, to 1e-12."""
    gen = torch.Generator().manual_seed(4)
    w, b = (torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in [(3, 4), (5,)])
    ref_w, ref_b = (torch.nn.Parameter(x.detach().clone()) for x in (w, b))
    hyper = [{"lr": 0.05, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.0}]
    opt = ft.sparse_optimizer_from_torch(
        torch.optim.SGD, [{"params": [w], **hyper[0]}, {"params": [b], **hyper[1]}], k=17
    )  # k = n: every coordinate steps, so torch.optim itself is the reference
    ref = torch.optim.SGD([{"params": [ref_w], **hyper[0]}, {"params": [ref_b], **hyper[1]}], foreach=True)
    for step in range(6):
        if step == 3:
            state = opt.state_dict()["state"]
            on_b = state["indices"] >= 12
            assert not state["inner"]["momentum_buffer"][on_b].any() and not state["inner"]["count"][on_b].any()
            for group in (opt.param_groups[1], ref.param_groups[1]):
                group["momentum"] = 0.9
        c = torch.randn(17, generator=gen, dtype=torch.float64)
        for params, optimizer in (([w, b], opt), ([ref_w, ref_b], ref)):
            optimizer.zero_grad()
            (torch.cat([p.reshape(-1) for p in params]) * c).sum().backward()
            optimizer.step()
        torch.testing.assert_close(
            torch.cat([w.reshape(-1), b]), torch.cat([ref_w.reshape(-1), ref_b]), rtol=1e-12, atol=1e-12
        )


def test_the_first_coordinate_set_starts_from_its_own_groups_state():
    """ASGD's eta starts at its group's lr: coordinates of the initial set (the first k) of a later group too."""
    gen = torch.Generator().manual_seed(5)
    b, w = (torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in [(5,), (3, 4)])
    hyper = [{"lr": 0.05, "t0": 2}, {"lr": 0.01, "t0": 2}]
    coefficients = [torch.randn(17, generator=gen, dtype=torch.float64) for _ in range(4)]
    coefficients[0][5] = 10.0  # w's first coordinate: in the initial set (0..5), and selected at step 0
    start = [b.detach().clone(), w.detach().clone()]
    opt = ft.sparse_optimizer_from_torch(
        torch.optim.ASGD, [{"params": [b], **hyper[0]}, {"params": [w], **hyper[1]}], k=6, refresh_every=2
    )
    for c in coefficients:
        (torch.cat([b, w.reshape(-1)]) * c).sum().backward()
        opt.step()
    expected = reference(torch.optim.ASGD, [([start[0]], hyper[0]), ([start[1]], hyper[1])], coefficients, 6, 2)
    torch.testing.assert_close(torch.cat([b.detach(), w.detach().reshape(-1)]), expected, rtol=1e-12, atol=1e-12)


def test_momentum_turned_off_then_on_restarts_the_buffer_where_torch_continues_its_old_one():
    """A documented difference: the state keeps the names of the groups' current maths only."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    ref_w = torch.nn.Parameter(w.detach().clone())
    opt = ft.sparse_optimizer_from_torch(torch.optim.SGD, [w], k=6, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD([ref_w], lr=0.1, momentum=0.9, foreach=True)
    for momentum in (0.9, 0.9, 0.0, 0.9, 0.9):
        opt.param_groups[0]["momentum"] = ref.param_groups[0]["momentum"] = momentum
        if momentum == 0.0:
            ref.state[ref_w].pop("momentum_buffer")  # what functopk does: the buffer starts again afterwards
            assert sorted(opt.state_dict()["state"]["inner"]) == ["count", "momentum_buffer"]
        c = torch.randn(6, generator=gen, dtype=torch.float64)
        for param, optimizer in ((w, opt), (ref_w, ref)):
            optimizer.zero_grad()
            (param * c).sum().backward()
            optimizer.step()
        if momentum == 0.0:
            assert opt.state_dict()["state"]["inner"] == {}
    torch.testing.assert_close(w.detach(), ref_w.detach(), rtol=1e-12, atol=1e-12)
