"""``optimizer_from_torch`` against ``torch.optim`` step by step: groups, schedulers, state, resume, AMP.

Every test runs the same float64 model and gradients through a torch.optim
optimizer and through the adapter, doing the same thing to both (group edits,
``None`` gradients, late groups, schedulers, checkpoints), and compares the
parameters after every step (to 1e-12: the maths is the same, the kernels'
order may differ in the last bit).
"""

from __future__ import annotations

import io

import pytest
import torch

import functopk as ft

TOL = 1e-12


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


X = torch.randn(12, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return model(X).sin().square().sum()


def decay_groups(model: torch.nn.Module, **no_decay: object) -> list[dict]:
    """The usual split: weights decay, biases and norm parameters do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, **no_decay}]


def assert_same(m1: torch.nn.Module, m2: torch.nn.Module, where: str = "") -> None:
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        err = (a - b).abs().max().item()
        assert err <= TOL * (1 + a.abs().max().item()), f"{where} {name}: {err}"


def twin(cls, groups_fn=decay_groups, sparsify=None, **kwargs):
    """The same model twice, one with torch's optimizer and one with the adapter."""
    m1, m2 = make_model(), make_model()
    o1 = cls(groups_fn(m1), **kwargs)
    o2 = ft.optimizer_from_torch(cls, groups_fn(m2), sparsify, **kwargs)
    return (m1, o1), (m2, o2)


def step_both(pairs, before=None, after=None, where=""):
    for model, opt in pairs:
        opt.zero_grad()
        loss_of(model).backward()
        if before is not None:
            before(model, opt)
        opt.step()
        if after is not None:
            after(model, opt)
    assert_same(pairs[0][0], pairs[1][0], where)


# --------------------------------------------------------------------------- groups and hyperparameters


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}),
        (torch.optim.NAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ],
)
def test_per_group_hyperparameters_match_torch(cls, kwargs):
    pairs = twin(cls, lambda m: decay_groups(m, lr=kwargs["lr"] / 3), **kwargs)
    for i in range(15):
        step_both(pairs, where=f"step {i}")
    assert pairs[1][1].param_groups[1]["lr"] == kwargs["lr"] / 3  # the real learning rate, as torch holds it


def test_hyperparameter_edits_take_effect_at_the_next_step():
    pairs = twin(torch.optim.Adam, lr=0.01)
    edits = [("lr", 0.003), ("weight_decay", 0.2), ("betas", (0.8, 0.95)), ("eps", 1e-3), ("maximize", True)]
    for i, (key, value) in enumerate(edits):
        step_both(pairs, where=f"before {key}")
        for _, opt in pairs:
            opt.param_groups[i % 2][key] = value
        step_both(pairs, where=f"after {key}")


def test_adagrad_lr_decay_set_later_decays_from_torchs_step_count():
    """Without lr_decay, Adagrad still counts torch's step: an lr_decay set later decays from it."""
    pairs = twin(torch.optim.Adagrad, lr=0.05)
    for i in range(2):
        step_both(pairs, where=f"step {i}")
    for _, opt in pairs:
        opt.param_groups[0]["lr_decay"] = 0.5
    step_both(pairs, where="after lr_decay")


def test_adagrad_initial_accumulator_value_comes_from_the_constructor_as_in_torch():
    """torch.optim.Adagrad starts every sum at the constructor's value; a group's own value is not read."""
    pairs = twin(torch.optim.Adagrad, lambda m: decay_groups(m, initial_accumulator_value=2.0), lr=0.05,
                 initial_accumulator_value=0.1)
    for i in range(2):
        step_both(pairs, where=f"step {i}")
    for (model, opt) in pairs:
        assert opt.param_groups[1]["initial_accumulator_value"] == 2.0
        assert opt.state[model[3].bias]["sum"].min() < 2.0  # started from 0.1, as torch does


def test_none_grads_skip_a_parameter_and_keep_its_step_count():
    def drop_bias(model, opt):
        model[3].bias.grad = None

    pairs = twin(torch.optim.Adam, lr=0.05)
    for i in range(10):
        step_both(pairs, before=drop_bias if i % 3 == 1 else None, where=f"step {i}")
    torch_step = pairs[0][1].state[pairs[0][0][3].bias]["step"]
    ours = pairs[1][1].state[pairs[1][0][3].bias]["step"]
    assert int(ours) == int(torch_step) == 7


@pytest.mark.parametrize(
    "cls, kwargs",
    [(torch.optim.Adam, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5})],
)
def test_late_param_group_starts_fresh(cls, kwargs):
    def first_layer_only(model):
        return [{"params": list(model[0].parameters())}]

    pairs = twin(cls, first_layer_only, **kwargs)
    for i in range(4):
        step_both(pairs, where=f"step {i}")
    for model, opt in pairs:
        opt.add_param_group({"params": [p for m in list(model)[1:] for p in m.parameters()], "lr": 0.02})
    for i in range(6):
        step_both(pairs, where=f"after add {i}")


def test_closure_is_evaluated_with_gradients_and_its_loss_returned():
    pairs = twin(torch.optim.SGD, lr=0.1)
    losses = []
    for model, opt in pairs:

        def closure(model=model, opt=opt):
            opt.zero_grad()
            loss = loss_of(model)
            loss.backward()
            return loss

        losses.append(opt.step(closure))
    assert torch.equal(losses[0], losses[1])
    assert_same(pairs[0][0], pairs[1][0])


def test_state_keys_and_values_are_torchs():
    pairs = twin(torch.optim.Adam, lr=0.05, amsgrad=True)
    for _ in range(3):
        step_both(pairs)
    for (p1, p2) in zip(pairs[0][0].parameters(), pairs[1][0].parameters()):
        s1, s2 = pairs[0][1].state[p1], pairs[1][1].state[p2]
        assert set(s1) == set(s2)
        for key in s1:
            assert torch.allclose(s1[key].double(), s2[key].double(), rtol=1e-12, atol=0), key


# --------------------------------------------------------------------------- schedulers

S = torch.optim.lr_scheduler
SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: S.StepLR(o, 3, 0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [2, 5], 0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, 0.5, total_iters=4),
    "LinearLR": lambda o: S.LinearLR(o, 0.2, 1.0, total_iters=5),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, total_iters=3), S.ExponentialLR(o, 0.9)], [3]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, total_iters=3), S.ExponentialLR(o, 0.9)]),
    "CyclicLR": lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=12),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=1),
}


def test_every_scheduler_class_is_tested():
    classes = {
        name for name, obj in vars(S).items()
        if isinstance(obj, type) and issubclass(obj, (S.LRScheduler, S.ReduceLROnPlateau)) and not name.startswith("_")
    }  # fmt: skip
    assert classes - {"LRScheduler", "_LRScheduler"} <= set(SCHEDULERS)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_schedulers_match_torch(name, cls):
    kwargs = {"lr": 0.05, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.05}
    pairs = twin(cls, **kwargs)
    scheds = [SCHEDULERS[name](opt) for _, opt in pairs]
    for i in range(12):
        step_both(pairs, where=f"{name} step {i}")
        for sched in scheds:
            if name == "ReduceLROnPlateau":
                sched.step(1.0)  # a plateau: the lr drops
            else:
                sched.step()
        g1, g2 = pairs[0][1].param_groups, pairs[1][1].param_groups
        for a, b in zip(g1, g2):
            assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


# --------------------------------------------------------------------------- checkpoints


def _saved(opt: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("sparsify", [None, ft.error_feedback(ft.topk(density=0.2))])
def test_resume_from_state_dict_is_bitwise(sparsify):
    def run(steps, model, opt):
        for _ in range(steps):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()

    straight = make_model()
    opt = ft.optimizer_from_torch(torch.optim.AdamW, decay_groups(straight), sparsify, lr=0.01)
    run(10, straight, opt)

    first = make_model()
    opt1 = ft.optimizer_from_torch(torch.optim.AdamW, decay_groups(first), sparsify, lr=0.01)
    run(6, first, opt1)
    resumed = make_model()
    resumed.load_state_dict(first.state_dict())
    opt2 = ft.optimizer_from_torch(torch.optim.AdamW, decay_groups(resumed), sparsify, lr=0.01)
    opt2.load_state_dict(_saved(opt1))
    run(4, resumed, opt2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    # the counts are shared again after the load: each group steps as one tree
    steps = [opt2.state[p]["step"] for p in opt2.param_groups[0]["params"]]
    assert all(s is steps[0] for s in steps)


def test_torch_checkpoint_loads_into_the_adapter_and_continues_like_torch():
    pairs = twin(torch.optim.Adam, lr=0.05)
    for _ in range(3):
        step_both(pairs)
    pairs[1][1].load_state_dict(_saved(pairs[0][1]))  # torch's own state dict (float32 "step")
    for i in range(3):
        step_both(pairs, where=f"after load {i}")


def test_distributed_checkpoint_state_dict_api_works():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_model()
    opt = ft.optimizer_from_torch(torch.optim.Adam, model.parameters(), ft.topk(5), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()
    osd = get_optimizer_state_dict(model, opt)
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}  # keyed by parameter name
    other = make_model()
    other.load_state_dict(model.state_dict())
    opt2 = ft.optimizer_from_torch(torch.optim.Adam, other.parameters(), ft.topk(5), lr=0.05)
    set_optimizer_state_dict(other, opt2, osd)
    for m, o in ((model, opt), (other, opt2)):
        o.zero_grad()
        loss_of(m).backward()
        o.step()
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_checks_before_changing_anything():
    model = make_model()
    opt = ft.optimizer_from_torch(torch.optim.Adam, decay_groups(model), lr=0.05)
    loss_of(model).backward()
    opt.step()
    before = {p: dict(s) for p, s in opt.state.items()}
    saved = opt.state_dict()
    bad = {**saved, "param_groups": saved["param_groups"][:1]}
    with pytest.raises(ValueError, match="param groups of sizes"):
        opt.load_state_dict(bad)
    bad = {**saved, "state": {**saved["state"], 99: {}}}
    with pytest.raises(ValueError, match="parameter 99"):
        opt.load_state_dict(bad)
    assert {p: dict(s) for p, s in opt.state.items()} == before


# --------------------------------------------------------------------------- AMP and sparsification


def test_grad_scaler_skips_the_same_steps_as_torch():
    pairs = twin(torch.optim.Adam, lr=0.05)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in pairs]
    for i in range(6):
        for (model, opt), scaler in zip(pairs, scalers):
            opt.zero_grad()
            scaler.scale(loss_of(model)).backward()
            if i == 2:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        assert_same(pairs[0][0], pairs[1][0], f"step {i}")
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**8


def test_sparsify_with_k_equal_to_n_is_the_plain_optimizer_bit_for_bit():
    n = sum(p.numel() for p in make_model().parameters())
    plain = twin(torch.optim.Adam, lr=0.05)[1]
    full = twin(torch.optim.Adam, sparsify=ft.topk(n), lr=0.05)[1]
    for _ in range(5):
        for model, opt in (plain, full):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
    for a, b in zip(plain[0].parameters(), full[0].parameters()):
        assert torch.equal(a, b)


def test_sparsify_selects_the_global_top_k_across_groups():
    model = make_model()
    opt = ft.optimizer_from_torch(torch.optim.SGD, decay_groups(model), ft.topk(7), lr=1.0)
    loss_of(model).backward()
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    grads = torch.cat([p.grad.reshape(-1) for g in opt.param_groups for p in g["params"]])
    opt.step()
    moved = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, (p for g in opt.param_groups
                                                                          for p in g["params"]))])  # fmt: skip
    expected = torch.zeros_like(grads)
    top = grads.abs().topk(7).indices
    expected[top] = grads[top]
    assert torch.equal(moved, expected)
    assert len({id(g) for g in opt.param_groups if any((p.grad is not None) for p in g["params"])}) == 2


# --------------------------------------------------------------------------- errors


def test_bad_group_hyperparameters_fail_at_add_param_group_and_leave_the_groups():
    model = make_model()
    opt = ft.optimizer_from_torch(torch.optim.Adam, list(model[0].parameters()), lr=0.05)
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):  # torch's constructor's message
        opt.add_param_group({"params": list(model[3].parameters()), "lr": -1.0})
    assert len(opt.param_groups) == 1
