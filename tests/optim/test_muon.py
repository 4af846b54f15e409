"""muon against torch.optim.Muon, step by step, on a tree of 2-D leaves with a non-linear gradient field.

Both sides run free from the same start for 40 steps, each evaluating the
gradient ``sin(3 p) + p**3`` at its own parameters; the parameters are compared
after every step and the momentum buffers at the end. The configurations follow
``optim_inputs_func_muon`` of torch's ``optim_db``.

What tolerance holds, and why: torch's Newton-Schulz iteration runs in bfloat16
whatever the parameters' dtype, so its update is only bfloat16-accurate (about
1e-2 relative against an exact orthogonalisation, see
``test_bfloat16_is_the_precision_of_the_update``). ``muon`` runs the *same*
bfloat16 maths (the same ops in the same order, bit for bit equal to torch's
``_zeropower_via_newtonschulz``), and everything around it in the parameters'
dtype with torch's kernels, so in float64 it agrees with torch to 1e-12 relative
(measured: ~1e-16 relative to the parameters), not merely to bfloat16 precision.
In float32 its error against torch's float64 run is at most 4x torch float32's own.
Only ``ns_coefficients`` given as tensors take another path (``addmm`` takes
numbers only): bit-equal for small matrices, within 2e-2 relative in general.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import functopk as ft
from functopk.optim.muon import TORCH_BUILDERS, TORCH_STATE_NAMES, MuonState, muon, newton_schulz
from tests.optim.common import run_pure
from tests.optim.torch_parity import (
    STEPS,
    assert_float32_like_torch,
    assert_histories,
    field,
    rel_err,
    run_ours,
    torch_runner,
)
from tests.optim.torch_parity import start as start_with

SHAPES = {"tall": (5, 3), "wide": (3, 6), "square": (4, 4), "row": (1, 5)}
COEFFICIENTS = (3.4445, -4.775, 2.0315)


run_torch = torch_runner(torch.optim.Muon)


def start(device, dtype=torch.float64, shapes=SHAPES):
    return start_with(shapes, device, dtype)


CASES = {
    "default": {},
    "lr": {"lr": 0.02},
    "weight_decay": {"lr": 0.02, "weight_decay": 0.2},
    "momentum": {"lr": 0.02, "momentum": 0.8},
    "no_nesterov": {"lr": 0.02, "nesterov": False, "weight_decay": 0.0},
    "ns_steps": {"lr": 0.02, "ns_steps": 6},
    "ns_coefficients": {"lr": 0.02, "ns_coefficients": (3.4, -4.7, 2.0), "eps": 1e-5},
    "match_rms_adamw": {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"},
    "spectral_unclamped": {"lr": 0.02, "adjust_lr_fn": "spectral_unclamped"},
    "original": {"lr": 0.02, "adjust_lr_fn": "original", "momentum": 0.5},
}


def ours_for(kwargs):
    kw = dict(kwargs)
    return muon(kw.pop("lr", 1e-3), **kw)


@pytest.mark.parametrize("kwargs", CASES.values(), ids=CASES.keys())
def test_parity_float64(device, kwargs):
    if kwargs.get("adjust_lr_fn") == "spectral_unclamped":
        try:
            torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
        except ValueError as e:  # torch 2.11 has no spectral_unclamped (functopk needs 2.13; GPU images may lag)
            pytest.skip(f"this torch's Muon: {e}")
    p0 = start(device)
    theirs, opt, tp = run_torch(p0, **kwargs)
    ours, state = run_ours(ours_for(kwargs), p0)
    assert_histories(ours, theirs)
    for k, p in tp.items():  # the state, through TORCH_STATE_NAMES
        for name, key in TORCH_STATE_NAMES["Muon"].items():
            torch.testing.assert_close(getattr(state, name)[k], opt.state[p][key], rtol=1e-12, atol=1e-15)
    assert state.count == STEPS
    assert rel_err(ours[-1], p0) > 1e-3  # the run really moved


@pytest.mark.parametrize("name", ["lr", "no_nesterov", "match_rms_adamw"])
def test_float32_error_like_torch(device, name):
    """In float32, the error against torch's float64 run is at most 4x torch float32's own (plus 1e-6)."""
    kwargs = CASES[name]
    p64 = start(device)
    assert_float32_like_torch(run_torch, ours_for(kwargs), p64, 1e-6, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_newton_schulz_is_torchs(device, dtype):
    """Bit for bit torch's private _zeropower_via_newtonschulz, tall, wide and square, and pure."""
    g = torch.Generator().manual_seed(1)
    for shape in [(7, 3), (3, 7), (5, 5), (1, 4)]:
        x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        before = x.clone()
        ours = newton_schulz(x, COEFFICIENTS, 5, 1e-7)
        assert torch.equal(x, before)  # torch's divides a bfloat16 input in place; this one does not
        theirs = _zeropower_via_newtonschulz(x.clone(), COEFFICIENTS, 5, 1e-7)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_tensor_coefficients_are_bfloat16_close(device):
    """Coefficients given as tensors: no addmm (numbers only); bit-equal on small matrices, close on larger."""
    tensors = tuple(torch.tensor(c, device=device) for c in COEFFICIENTS)
    g = torch.Generator().manual_seed(2)
    for shape in [(5, 3), (40, 24)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
        theirs = _zeropower_via_newtonschulz(x, COEFFICIENTS, 5, 1e-7).float()
        ours = newton_schulz(x, tensors, 5, torch.tensor(1e-7, device=device)).float()
        assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max()


def test_bfloat16_is_the_precision_of_the_update(device):
    """Why float64 parity needs torch's bfloat16 maths: the same iteration in float64 differs at bfloat16 level."""
    x = torch.randn(6, 4, dtype=torch.float64, device=device)
    y = x.T / x.norm()
    for _ in range(5):
        gram = y @ y.T
        y = COEFFICIENTS[0] * y + (COEFFICIENTS[1] * gram + COEFFICIENTS[2] * gram @ gram) @ y
    exact64 = y.T
    ours = newton_schulz(x, COEFFICIENTS, 5, 1e-7).double()
    err = ((ours - exact64).abs().max() / exact64.abs().max()).item()
    assert 1e-4 < err < 0.1, err


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0.02}, {"lr": torch.tensor(0.01), "weight_decay": 0.3}, {"lr": torch.tensor([0.02]), "momentum": 0.7,
     "nesterov": False, "ns_coefficients": (3.3, -4.6, 2.1), "eps": 1e-6, "ns_steps": 4, "adjust_lr_fn": "original"}],
    ids=["float_lr", "tensor_lr", "one_element_lr_all_options"],
)
def test_torch_builder(device, kwargs):
    """The builder, given torch's own complete param group, reproduces torch (a float32 tensor lr included)."""
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    group = dict(torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs).param_groups[0])
    del group["params"]
    p0 = start(device)
    theirs, _, _ = run_torch(p0, **kwargs)
    ours, _ = run_ours(TORCH_BUILDERS["Muon"](group), p0)
    assert_histories(ours, theirs)


def test_tensor_hyperparameters(device):
    """lr, weight_decay, momentum and eps as 0-d float64 tensors: exact parity."""

    def t(x):
        return torch.tensor(x, dtype=torch.float64, device=device)

    kwargs = {"lr": 0.03, "weight_decay": 0.15, "momentum": 0.9, "eps": 1e-6}
    tx = muon(t(0.03), weight_decay=t(0.15), momentum=t(0.9), eps=t(1e-6))
    p0 = start(device)
    theirs, _, _ = run_torch(p0, **kwargs)
    ours, _ = run_ours(tx, p0)
    assert_histories(ours, theirs)


def test_inject_hyperparams(device):
    """Under inject_hyperparams (ns_steps static: it is a loop count) float32 runs equal the plain ones closely."""
    kwargs = {"weight_decay": 0.1, "momentum": 0.9}
    p0 = start(device, torch.float32)
    plain, _ = run_ours(muon(0.02, ns_steps=5, **kwargs), p0, steps=10)
    tx = ft.inject_hyperparams(muon, static_args=("ns_steps",))(learning_rate=0.02, ns_steps=5, **kwargs)
    injected, state = run_ours(tx, p0, steps=10)
    assert rel_err(injected[-1], plain[-1]) < 1e-3
    assert set(state.hyperparams) == {"learning_rate", "weight_decay", "momentum"}


def test_schedule(device):
    p0 = start(device)
    theirs, _, _ = run_torch(p0, lr=0.05, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s))
    ours, _ = run_ours(muon(lambda count: 0.05 * 0.9 ** count.double()), p0)
    assert_histories(ours, theirs)


def test_other_parameters_go_to_another_optimizer(device):
    """partition: muon for the matrices, adamw for the rest, equals torch's Muon + AdamW pair."""
    p0 = {**start(device), "bias": torch.linspace(-1, 1, 3, dtype=torch.float64, device=device),
          "gain": torch.tensor(0.5, dtype=torch.float64, device=device)}
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    opt_m = torch.optim.Muon([p for p in tp.values() if p.dim() == 2], lr=0.02)
    opt_a = torch.optim.AdamW([p for p in tp.values() if p.dim() != 2], lr=0.01, foreach=True)
    labels = {k: "muon" if v.dim() == 2 else "adamw" for k, v in p0.items()}
    tx = ft.partition({"muon": muon(0.02), "adamw": ft.adamw(0.01)}, labels)
    params = {k: v.clone() for k, v in p0.items()}
    state = tx.init(params)
    for i in range(10):
        for p in tp.values():
            p.grad = field(p.detach())
        opt_m.step()
        opt_a.step()
        updates, state = tx.update({k: field(v) for k, v in params.items()}, state, params)
        params = ft.apply_updates(params, updates)
        err = rel_err(params, {k: p.detach() for k, p in tp.items()})
        assert err <= 1e-12, f"step {i}: {err:.3g}"


def test_non_matrix_leaves_are_refused(device):
    tx = muon()
    with pytest.raises(ValueError, match=r"params leaf at \['b'\] has shape \(3,\).*partition"):
        tx.init({"w": torch.zeros(2, 2, device=device), "b": torch.zeros(3, device=device)})
    with pytest.raises(ValueError, match=r"params leaf at \['s'\] has shape \(\)"):
        tx.init({"s": torch.tensor(1.0, device=device)})
    state = tx.init({"w": torch.zeros(2, 2, device=device)})
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\] has shape \(4,\)"):
        tx.update({"w": torch.zeros(4, device=device)}, state, {"w": torch.zeros(4, device=device)})
    with pytest.raises(ValueError, match="only supports 2D"):  # torch refuses them too
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": -1.0}, ValueError, "learning_rate"),
        ({"learning_rate": "x"}, TypeError, "learning_rate"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"momentum": -0.5}, ValueError, "momentum"),
        ({"nesterov": 1}, TypeError, "nesterov"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients"),
        ({"ns_coefficients": 3.0}, TypeError, "ns_coefficients"),
        ({"ns_coefficients": (1.0, "b", 2.0)}, TypeError, r"ns_coefficients\[1\]"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"ns_steps": 100}, ValueError, "ns_steps"),
        ({"ns_steps": 5.0}, TypeError, "ns_steps"),
        ({"ns_steps": torch.tensor(5)}, TypeError, "ns_steps"),
        ({"adjust_lr_fn": "sqrt"}, ValueError, "adjust_lr_fn"),
        ({"adjust_lr_fn": 1}, TypeError, "adjust_lr_fn"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        muon(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_pure(device, dtype):
    params = start(device, dtype)
    grads = {k: field(v) for k, v in params.items()}
    run_pure(muon(0.02, nesterov=False), params=params, grads=grads)


def test_bfloat16_buffer_is_plain_momentum(device):
    """The buffer is the momentum; torch divides a bfloat16 buffer by its norm in place when nesterov=False."""
    p = {"w": torch.randn(4, 3, device=device).bfloat16()}
    g = {"w": torch.randn(4, 3, device=device).bfloat16()}
    tx = muon(0.02, nesterov=False)
    _, state = tx.update(g, tx.init(p), p)
    assert torch.equal(state.momentum_buffer["w"], torch.zeros_like(g["w"]).lerp(g["w"], 1 - 0.95))


def test_state_names_match_torch_keys(device):
    p0 = start(device)
    state = muon().init(p0)
    assert isinstance(state, MuonState) and state.count.dtype == torch.int64
    _, opt, tp = run_torch(p0, steps=1)
    for p in tp.values():
        assert set(TORCH_STATE_NAMES["Muon"].values()) == set(opt.state[p])
    assert set(TORCH_STATE_NAMES["Muon"]) <= set(MuonState._fields)


def test_empty_tree():
    tx = muon()
    updates, state = tx.update({}, tx.init({}), {})
    assert updates == {} and state.count == 1
