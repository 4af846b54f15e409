"""Free-running parity with a torch.optim class: both sides start from the same tree and step 40 times,
each evaluating the gradient field ``sin(3 p) + p**3`` at its own parameters (shared by the optimizer tests)."""

from __future__ import annotations

import functools

import torch

import functopk as ft

STEPS = 40


def field(p):
    return torch.sin(3 * p) + p**3


def start(shapes, device, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for k, s in shapes.items()
    }


def run_torch(cls, p0, steps=STEPS, scheduler=None, **kwargs):
    """``cls`` (a torch.optim class) from ``p0``: the parameters after each step, the optimizer, its parameters."""
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in p0.items()}
    opt = cls(list(tp.values()), **kwargs)
    sched = scheduler(opt) if scheduler else None
    history = []
    for _ in range(steps):
        for p in tp.values():
            p.grad = field(p.detach())
        opt.step()
        if sched:
            sched.step()
        history.append({k: p.detach().clone() for k, p in tp.items()})
    return history, opt, tp


def torch_runner(cls):
    """``run_torch`` bound to one class."""
    return functools.partial(run_torch, cls)


def run_ours(tx, p0, steps=STEPS):
    params = {k: v.clone() for k, v in p0.items()}
    state = tx.init(params)
    history = []
    for _ in range(steps):
        updates, state = tx.update({k: field(v) for k, v in params.items()}, state, params)
        params = ft.apply_updates(params, updates)
        history.append(params)
    return history, state


def rel_err(ours, theirs):
    """The largest |difference| of any leaf relative to that leaf's largest |value| (torch's)."""
    return max(((ours[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item() for k, v in theirs.items())


def assert_histories(ours, theirs, rtol=1e-12):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err = rel_err(a, b)
        assert err <= rtol, f"step {i}: relative error {err:.3g} > {rtol}"


def assert_float32_like_torch(run_torch, tx32, p64, floor, **kwargs):
    """In float32, our error against torch's float64 run is at most 4x torch float32's own (plus ``floor``)."""
    p32 = {k: v.float() for k, v in p64.items()}
    exact, _, _ = run_torch(p64, **kwargs)
    torch32, _, _ = run_torch(p32, **kwargs)
    ours32, _ = run_ours(tx32, p32)
    for i, (e, t, o) in enumerate(zip(exact, torch32, ours32)):
        torch_err = rel_err({k: v.double() for k, v in t.items()}, e)
        our_err = rel_err({k: v.double() for k, v in o.items()}, e)
        assert our_err <= 4 * torch_err + floor, f"step {i}: {our_err:.3g} vs torch float32's {torch_err:.3g}"
