"""Step-by-step parity against optax itself (jax on CPU), for the optimizers that follow optax.

At every step both optimizers get the same parameters and the same gradients
(the reference run's parameters, and a deterministic non-linear gradient field
evaluated there); each runs its update from its *own* state, which is never
synchronised, so an error in a state (a misplaced decay, a bias correction off by
one) accumulates and shows. Feeding both the same inputs makes this a test of the
optimizer, not of the dynamics: Lion's sign turns any last-bit difference in a
free run into a full step once a coordinate's momentum passes through zero.

jax runs in float64 only inside :func:`x64` (``jax.enable_x64`` is a context
manager), so nothing leaks into other tests.
"""

from __future__ import annotations

import jax
import numpy as np
import optree
import pytest
import torch

import functopk as ft

STEPS = 40


def start_params() -> dict[str, np.ndarray]:
    """A small tree: a 2-D, a 1-D, a 0-d and a 3-D leaf (float64 numpy)."""
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)),
        "b": rng.standard_normal(5),
        "s": np.asarray(rng.standard_normal()),
        "k": rng.standard_normal((2, 3, 2)),
    }


def field(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The gradient field ``sin(3 p) + p**3`` (float64 numpy)."""
    return {n: np.sin(3.0 * p) + p**3 for n, p in params.items()}


@pytest.fixture()
def x64():
    """jax in float64 for the test's duration only."""
    with jax.enable_x64(True):
        yield


def to_torch(tree, dtype, device):
    return optree.tree_map(lambda a: torch.from_numpy(np.array(a, dtype=np.float64)).to(device, dtype), tree)


def to_jax(tree, dtype):
    return optree.tree_map(lambda a: jax.numpy.asarray(np.asarray(a, dtype=dtype)), tree)


def to_numpy(tree):
    """float64 numpy copies of a tree of torch tensors or jax arrays."""

    def conv(x):
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().to(torch.float64).numpy()
        return np.asarray(x, dtype=np.float64)

    return optree.tree_map(conv, tree)


def run_pair(tx, otx, *, steps=STEPS, dtype=torch.float64, device="cpu", params=None, jit=True):
    """Run functopk's ``tx`` and optax's ``otx`` side by side on the reference trajectory.

    Returns:
        ``(ours, theirs, state, ostate)``: the lists of each step's updates (float64
        numpy trees) and both final states. optax runs in the matching precision:
        call this inside the ``x64`` fixture for float64.
    """
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    p = start_params() if params is None else params
    state = tx.init(to_torch(p, dtype, device))
    ostate = otx.init(to_jax(p, np_dtype))
    update = jax.jit(otx.update) if jit else otx.update
    ours, theirs = [], []
    for _ in range(steps):
        g = field(p)
        u, state = tx.update(to_torch(g, dtype, device), state, to_torch(p, dtype, device))
        ou, ostate = update(to_jax(g, np_dtype), ostate, to_jax(p, np_dtype))
        ours.append(to_numpy(u))
        theirs.append(to_numpy(ou))
        p = {n: p[n] + theirs[-1][n] for n in p}
    return ours, theirs, state, ostate


def max_rel_error(ours, theirs) -> float:
    """The largest ``|ours - theirs|`` over all steps and leaves, relative to that leaf's largest update."""
    worst = 0.0
    for a, b in zip(ours, theirs):
        for n in b:
            scale = max(np.abs(b[n]).max(), 1e-300)
            worst = max(worst, float(np.abs(a[n] - b[n]).max() / scale))
    return worst


def assert_parity(ours, theirs, rtol=1e-12):
    """Every step's updates agree to ``rtol`` relative to the leaf's largest update."""
    err = max_rel_error(ours, theirs)
    assert err <= rtol, f"max relative error {err:.3g} > {rtol:g}"


def assert_close_np(a, b, rtol=1e-12, where=""):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-300), err_msg=where)


# Decay masks, functopk's and optax's forms: a tree of bools, and a function of the parameters.
MASKS = {
    "tree": ({"w": True, "b": False, "s": False, "k": True},) * 2,
    "function": (
        lambda p: ft.tree.map(lambda x: x.dim() > 1, p),
        lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    ),
}


def assert_float32_like_optax(make, make_optax, steps=20):
    """functopk in float32 is as far from optax-float64 as optax-float32 is (within 4x and a tiny floor)."""
    with jax.enable_x64(True):
        _, ref, _, _ = run_pair(make(), make_optax(), steps=steps)
    with jax.enable_x64(False):
        ours, theirs32, _, _ = run_pair(make(), make_optax(), steps=steps, dtype=torch.float32)
    assert max_rel_error(ours, ref) <= 4 * max_rel_error(theirs32, ref) + 1e-7
