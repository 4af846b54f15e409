"""TorchOptimizer: functopk transformations in imperative torch.optim loops."""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.func import grad

import functopk as ft
from functopk.checkpoint import CheckpointError
from tests.helpers import assert_tree_bitwise_equal, batch, clone_tree, small_cnn

K = 30


def imperative_step(model, opt, i):
    x, y = batch(seed=i)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def functional_run(model, tx, steps, *, as_list=False):
    """The functional path on a copy of ``model``; yields (params, buffers, state) after each step."""
    model_fn, params, buffers = ft.nn.functionalize(copy.deepcopy(model))
    names = list(params)  # named_parameters order
    if as_list:
        params = [params[n] for n in names]

    def loss_fn(params, buffers, x, y):
        p = dict(zip(names, params)) if as_list else params
        out, new_buffers = model_fn(p, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    state = tx.init(params)
    for i in range(steps):
        x, y = batch(seed=i)
        grads, buffers = grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, state = tx.update(grads, state, params)
        params = ft.apply_updates(params, updates)
        yield (dict(zip(names, params)) if as_list else params), buffers, state


def lr_factory(make):
    """The functional twin of TorchOptimizer(params, make, lr=...): make's lr injected as a tensor."""
    return lambda lr: ft.inject_hyperparams(lambda learning_rate: make(learning_rate))(learning_rate=lr)


CONFIGS = {
    "sgd_nesterov": dict(tx=lambda: ft.sgd(0.1, momentum=0.9, nesterov=True)),
    "topk_sgd": dict(tx=lambda: ft.chain(ft.topk(K), ft.sgd(0.1, momentum=0.9))),
    "topk_sgd_unnamed": dict(tx=lambda: ft.chain(ft.topk(K), ft.sgd(0.1, momentum=0.9)), named=False),
    "factory_topk_sgd": dict(make=lambda lr: ft.chain(ft.topk(K), ft.sgd(lr, momentum=0.9)), lr=0.1),
    "topk_adam": dict(tx=lambda: ft.chain(ft.topk(K), ft.adam(1e-2))),
    "factory_adam": dict(make=lambda lr: ft.adam(lr), lr=1e-2),
    "topk_error_feedback_sgd": dict(
        tx=lambda: ft.chain(ft.error_feedback(ft.topk(K)), ft.sgd(0.1, momentum=0.9)),
    ),
}


@pytest.mark.parametrize(
    "config", [pytest.param(c, id=name) for name, c in CONFIGS.items()]
)
def test_imperative_equals_functional_bit_for_bit_over_20_steps(config):
    named = config.get("named", True)
    model = small_cnn()
    reference = functional_run(
        model,
        config["tx"]() if "tx" in config else lr_factory(config["make"])(config["lr"]),
        20,
        as_list=not named,
    )
    params = model.named_parameters() if named else model.parameters()
    if "tx" in config:
        opt = ft.TorchOptimizer(params, config["tx"]())
    else:
        opt = ft.TorchOptimizer(params, config["make"], lr=config["lr"])
    for i, (ref_params, ref_buffers, ref_state) in enumerate(reference):  # noqa: B007 (the last one is checked below)
        imperative_step(model, opt, i)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), ref_params[name]), f"step {i}: {name} differs"
        for name, b in model.named_buffers():
            assert torch.equal(b, ref_buffers[name]), f"step {i}: buffer {name} differs"
    assert_tree_bitwise_equal(opt.transform_state, ref_state)


def test_one_line_topk_changes_exactly_k_coordinates_and_leaves_frozen_params_alone():
    model = small_cnn()
    for p in model[0].parameters():  # freeze the first conv
        p.requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    opt = ft.TorchOptimizer(model.parameters(), ft.chain(ft.topk(K), ft.sgd(0.1)))
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        changed = sum(int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before))
        assert changed == K
        for p, g in zip(model.parameters(), grads):  # gradients are only read
            assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen))
    assert ft.tree.leaves(opt.transform_state) == []  # top-k and plain sgd keep no state


def test_changing_gradient_sets_match_torch_optim_sgd():
    """Params without .grad are skipped and keep their momentum, as in torch.optim; new params join."""
    model = small_cnn()
    extra = torch.nn.Parameter(torch.randn(3))
    ref_model, ref_extra = copy.deepcopy(model), extra.detach().clone().requires_grad_()
    opt = ft.TorchOptimizer(model.named_parameters(), ft.sgd(0.1, momentum=0.9))
    ref = torch.optim.SGD(ref_model.named_parameters(), lr=0.1, momentum=0.9)
    for i in range(8):
        if i == 5:
            opt.add_param_group({"params": [("extra", extra)]})
            ref.add_param_group({"params": [("extra", ref_extra)]})
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, ref)):
            x, y = batch(seed=i)
            o.zero_grad()
            loss = F.cross_entropy(m(x), y) + (e.square().sum() if i >= 5 else 0.0)
            loss.backward()
            if i in (2, 3, 6):  # the last layer gets no gradient on these steps
                m[7].weight.grad = None
        if i in (2, 3, 6):
            buf = opt.transform_state[0].trace["7.weight"].clone()
            w = model[7].weight.detach().clone()
        opt.step()
        ref.step()
        if i in (2, 3, 6):
            assert torch.equal(opt.transform_state[0].trace["7.weight"], buf)
            assert torch.equal(model[7].weight.detach(), w)
        for p, q in zip([*model.parameters(), extra], [*ref_model.parameters(), ref_extra]):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert "extra" in opt.transform_state[0].trace


def test_a_replaced_parameter_gets_fresh_state():
    """State follows parameter objects: a new tensor in a param group starts from init, not from another's state."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = ft.TorchOptimizer([a, b], ft.sgd(1.0, momentum=0.5))
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    new_b = torch.nn.Parameter(torch.zeros(2))
    opt.param_groups[0]["params"][1] = new_b  # e.g. a re-created layer
    a.grad, new_b.grad = torch.ones(3), torch.full((2,), 2.0)
    opt.step()
    momentum_a, momentum_b = opt.transform_state[0].trace
    assert torch.equal(momentum_a, torch.full((3,), 1.5))  # 1 + 0.5 * 1: kept
    assert torch.equal(momentum_b, torch.full((2,), 2.0))  # fresh: 2 + 0.5 * 0
    assert torch.equal(new_b.detach(), torch.full((2,), -2.0))


class FlatState(NamedTuple):
    total: torch.Tensor


def flat_sum_tx():
    """A transformation whose state is sized by the whole parameter set (not per parameter)."""

    def init(params):
        return FlatState(torch.zeros(sum(p.numel() for p in ft.tree.leaves(params))))

    def update(updates, state, params=None):
        flat = torch.cat([u.reshape(-1) for u in ft.tree.leaves(updates)])
        return ft.tree.scale(updates, -0.1), FlatState(state.total + flat)

    return ft.GradientTransformation(init, update)


def test_state_sized_by_the_parameter_set_cannot_be_recut():
    model = torch.nn.Linear(3, 2)
    opt = ft.TorchOptimizer(model.parameters(), flat_sum_tx())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = clone_tree(opt.transform_state)
    params = [p.detach().clone() for p in model.parameters()]
    model.bias.grad = None
    with pytest.raises(ValueError, match="cannot be carried over"):
        opt.step()
    assert_tree_bitwise_equal(opt.transform_state, state)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def scaled_run(skip_at=None, inf_at=None, steps=5):
    torch.manual_seed(0)
    model = small_cnn()
    opt = ft.TorchOptimizer(model.parameters(), lambda lr: ft.chain(ft.topk(K), ft.sgd(lr, momentum=0.9)), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i in range(steps):
        if i == skip_at:
            continue
        x, y = batch(seed=i)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if i == inf_at:
            model[3].weight.grad[0, 0, 0, 0] = float("inf")
            state, params = clone_tree(opt.transform_state), [p.detach().clone() for p in model.parameters()]
            scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == inf_at:  # skipped: nothing changed, the scale backed off
            assert_tree_bitwise_equal(opt.transform_state, state)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            assert scaler.get_scale() == scale / 2
    return model, opt


def test_grad_scaler_skips_inf_steps_without_touching_state():
    model, opt = scaled_run(inf_at=2)
    ref_model, ref_opt = scaled_run(skip_at=2)  # the same run with that batch left out
    # power-of-two loss scales are exact, so the runs agree bit for bit
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert_tree_bitwise_equal(opt.transform_state, ref_opt.transform_state)
    assert int(opt.transform_state.count) == 4


def test_closure_and_steps_without_gradients():
    model = small_cnn()
    ref_model = copy.deepcopy(model)
    opt = ft.TorchOptimizer(model.parameters(), ft.chain(ft.topk(K), ft.sgd(0.1)))
    ref = ft.TorchOptimizer(ref_model.parameters(), ft.chain(ft.topk(K), ft.sgd(0.1)))
    x, y = batch()

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    ref_loss = imperative_step(ref_model, ref, 0)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    opt.zero_grad()
    state = opt.transform_state
    assert opt.step() is None  # no gradients at all: nothing happens
    assert opt.transform_state is state


def train(model, opt, sched, steps):
    for i in steps:
        imperative_step(model, opt, i)
        sched.step()


def make_opt(model, k=K):
    opt = ft.TorchOptimizer(
        model.named_parameters(), lambda lr: ft.chain(ft.topk(k), ft.sgd(lr, momentum=0.9, nesterov=True)), lr=0.1
    )
    return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)


def test_resume_from_checkpoint_gives_the_uninterrupted_trajectory(tmp_path):
    model = small_cnn()
    opt, sched = make_opt(model)
    train(model, opt, sched, range(0, 10))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    train(model, opt, sched, range(10, 20))

    torch.manual_seed(123)
    resumed = small_cnn()  # other initial values: everything must come from the checkpoint
    ropt, rsched = make_opt(resumed)
    ckpt = torch.load(path, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    rsched.load_state_dict(ckpt["sched"])
    assert int(ropt.transform_state.count) == 10
    train(resumed, ropt, rsched, range(10, 20))
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    assert_tree_bitwise_equal(ropt.transform_state, opt.transform_state)
    assert ropt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_state_dict_layout_and_empty_state():
    model = small_cnn()
    opt, _ = make_opt(model)
    assert opt.state_dict()["state"] == {}
    fresh, _ = make_opt(small_cnn())
    fresh.load_state_dict(opt.state_dict())
    assert fresh.transform_state is None
    imperative_step(model, opt, 0)
    sd = opt.state_dict()
    entry = sd["state"]["functopk"]
    assert entry["params_with_state"] == list(range(10))
    assert entry["transform"]["format"] == "functopk.state"
    assert sd["param_groups"][0]["param_names"][0] == "0.weight"
    # the state lives in torch.optim's per-parameter dict, as every adapter keeps it: transform_state is it joined
    trace = opt.transform_state.inner_state[1][0].trace
    for name, p in model.named_parameters():
        assert opt.state[p]["trace"] is trace[name]


def checkpoint_bytes(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return buffer.getvalue()


def assert_load_fails_cleanly(opt, state_dict, error, match):
    state, groups = clone_tree(opt.transform_state), copy.deepcopy(opt.param_groups)
    with pytest.raises(error, match=match):
        opt.load_state_dict(state_dict)
    assert_tree_bitwise_equal(opt.transform_state, state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in groups
    ]


def load_bytes(data):
    return torch.load(io.BytesIO(data), weights_only=True)


def test_bad_checkpoints_raise_clearly_and_change_nothing(tmp_path):
    model = small_cnn()
    opt, sched = make_opt(model)
    train(model, opt, sched, range(3))
    target_model = small_cnn()
    target, target_sched = make_opt(target_model)
    train(target_model, target, target_sched, range(2))

    # another transformation: structure
    other_model = small_cnn()
    other = ft.TorchOptimizer(other_model.named_parameters(), ft.chain(ft.topk(K), ft.sgd(0.1)))
    imperative_step(other_model, other, 0)
    assert_load_fails_cleanly(target, load_bytes(checkpoint_bytes(other)), CheckpointError, "structure does not match")

    # another head width: shape
    wide = small_cnn(num_classes=5)
    wide_opt, _ = make_opt(wide)
    x, y = batch()
    F.cross_entropy(wide(x), y).backward()
    wide_opt.step()
    assert_load_fails_cleanly(target, load_bytes(checkpoint_bytes(wide_opt)), CheckpointError,
                              r"inner_state\[1\]\[0\]\.trace\['7.bias'\] is a tensor of shape \(5,\)")

    # float64 model: dtype
    double = small_cnn().double()
    double_opt, _ = make_opt(double)
    F.cross_entropy(double(x.double()), y).backward()
    double_opt.step()
    assert_load_fails_cleanly(target, load_bytes(checkpoint_bytes(double_opt)), CheckpointError, "torch.float64")

    # other parameter groups
    grouped = small_cnn()
    grouped_opt = ft.TorchOptimizer([{"params": grouped[:7].parameters()}, {"params": grouped[7].parameters()}],
                                    ft.sgd(0.1))
    assert_load_fails_cleanly(target, grouped_opt.state_dict(), ValueError, "param groups of sizes")

    # malformed entries
    sd = load_bytes(checkpoint_bytes(opt))
    bad = {**sd, "state": {"functopk": {**sd["state"]["functopk"], "params_with_state": [0, 99]}}}
    assert_load_fails_cleanly(target, bad, CheckpointError, "params_with_state")
    bad = {**sd, "state": {**sd["state"], 3: {"momentum_buffer": torch.zeros(3)}}}
    assert_load_fails_cleanly(target, bad, CheckpointError, "does not know")

    # a truncated file
    path = tmp_path / "opt.pt"
    path.write_bytes(checkpoint_bytes(opt)[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        ft.checkpoint.read_state_dict(path)

    # and after all that, the good checkpoint still loads
    target.load_state_dict(sd)
    assert_tree_bitwise_equal(target.transform_state, opt.transform_state)


def test_bad_param_groups_in_a_checkpoint_raise_before_anything_changes():
    model = small_cnn()
    opt, sched = make_opt(model)
    train(model, opt, sched, range(2))
    sd = load_bytes(checkpoint_bytes(opt))
    group = sd["param_groups"][0]
    no_lr = {k: v for k, v in group.items() if k != "lr"}
    assert_load_fails_cleanly(opt, {**sd, "param_groups": [no_lr]}, ValueError, "param group 0 lacks 'lr'")
    assert_load_fails_cleanly(opt, {**sd, "param_groups": [{**group, "lr": -1.0}]}, ValueError, "lr.* must be >= 0")
    twice = {**group, "param_names": ["a"] * len(group["params"])}
    assert_load_fails_cleanly(opt, {**sd, "state": {}, "param_groups": [twice]}, ValueError, "'a' appears twice")
    no_params = {k: v for k, v in group.items() if k != "params"}
    assert_load_fails_cleanly(opt, {**sd, "param_groups": [no_params]}, CheckpointError, "list 'params'")
    train(model, opt, sched, range(2, 3))  # and it still steps


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_step_equals_eager_and_does_not_recompile(fresh_dynamo):
    """torch.compile(opt.step) runs the step eagerly (dynamo skips it: the engine writes in place), so it equals
    the eager step bit for bit and never recompiles."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)) for _ in "ab"]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        ft.TorchOptimizer(m.parameters(), lambda lr: ft.chain(ft.topk(7), ft.sgd(lr, momentum=0.9)),
                          lr=torch.tensor(0.1))
        for m in models
    ]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    compiled = torch.compile(opts[0].step, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.randn(8, 6, generator=g)
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().mean().backward()
        if i == 0:
            opts[0].step()  # the first step creates the state (compiling it would cost a second compile)
        else:
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                compiled()
        opts[1].step()
        for s in scheds:
            s.step()
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(p, q)
        assert_tree_bitwise_equal(opts[0].transform_state, opts[1].transform_state)
    # the state holds the lr of the last step, not an alias of the group's tensor that the scheduler changed since
    assert torch.equal(opts[0].transform_state.hyperparams["learning_rate"], torch.tensor(0.1 * 0.5**3))
    assert torch.equal(opts[0].param_groups[0]["lr"], torch.tensor(0.1 * 0.5**4))


def test_constructor_and_group_errors():
    model = small_cnn()
    with pytest.raises(TypeError, match="tx must be a functopk.GradientTransformation or a factory"):
        ft.TorchOptimizer(model.parameters(), 0.1)
    with pytest.raises(TypeError, match="lr is required"):
        ft.TorchOptimizer(model.parameters(), lambda lr: ft.sgd(lr))
    with pytest.raises(TypeError, match="factory returned float"):
        ft.TorchOptimizer(model.parameters(), lambda lr: lr, lr=0.1)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        ft.TorchOptimizer(model.parameters(), lambda lr: ft.sgd(lr), lr=-1.0)
    with pytest.raises(TypeError, match="lr must be a real number"):
        ft.TorchOptimizer(model.parameters(), lambda lr: ft.sgd(lr), lr="big")
    # a ready transformation has its own learning rate: lr= would silently multiply it (0.1 x 0.1)
    for lr in (0.1, 1.0, torch.tensor(0.1)):
        with pytest.raises(TypeError, match="lr= goes with a factory"):
            ft.TorchOptimizer(model.parameters(), ft.sgd(0.1), lr=lr)
    with pytest.raises(ValueError, match="empty parameter list"):
        ft.TorchOptimizer([], ft.sgd(0.1))
    opt = ft.TorchOptimizer([("a", torch.nn.Parameter(torch.zeros(2)))], ft.sgd(0.1))
    with pytest.raises(ValueError, match="'a' appears twice"):
        opt.add_param_group({"params": [("a", torch.nn.Parameter(torch.zeros(1)))]})
    with pytest.raises(TypeError, match="lr must be"):
        opt.add_param_group({"params": [("b", torch.nn.Parameter(torch.zeros(1)))], "lr": None})
    assert len(opt.param_groups) == 1
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse_opt = ft.TorchOptimizer(emb.parameters(), ft.sgd(0.1))
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients"):
        sparse_opt.step()


def test_interop_doc_examples_run():
    """Every python block of docs/interop.md runs, in order, in one namespace.

    The first block is the ResNet-18 one-liner: it asserts that exactly 1000 coordinates change.
    """
    pytest.importorskip("torchvision")
    text = (Path(__file__).parents[1] / "docs" / "interop.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/interop.md", "exec"), namespace)


def test_the_step_writes_the_state_in_place_bit_for_bit_with_some_parameters_frozen():
    """TorchOptimizer runs on the in-place engine: its state tensors stay the same objects, their values are
    tx.update's bit for bit, also on a step where a parameter has no gradient (it takes no part)."""
    model = small_cnn()
    tx = ft.adamw(1e-2, weight_decay=0.1)
    opt = ft.TorchOptimizer(model.named_parameters(), tx)
    _, _, ref_state = next(functional_run(model, tx, 1))  # (its copy of the model made now, before the step)
    imperative_step(model, opt, 0)
    assert_tree_bitwise_equal(opt.transform_state, ref_state)
    ptrs = {n: (opt.state[p]["mu"].data_ptr(), opt.state[p]["nu"].data_ptr()) for n, p in model.named_parameters()}
    frozen = model[7].bias
    x, y = batch(seed=1)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    frozen.grad = None
    names = [n for n, p in model.named_parameters() if p is not frozen]
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p is not frozen}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p is not frozen}
    state = ref_state._replace(mu={n: ref_state.mu[n] for n in names}, nu={n: ref_state.nu[n] for n in names})
    updates, new = tx.update(grads, state, params)
    before = frozen.detach().clone()
    opt.step()
    for n, p in model.named_parameters():
        assert opt.state[p]["mu"].data_ptr() == ptrs[n][0] and opt.state[p]["nu"].data_ptr() == ptrs[n][1]
        if p is frozen:
            assert torch.equal(p.detach(), before)
        else:
            assert torch.equal(p.detach(), params[n] + updates[n]) and torch.equal(opt.state[p]["mu"], new.mu[n])
