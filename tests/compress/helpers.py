"""Helpers shared by the compressor tests: random trees and the compile-versus-eager check."""

from __future__ import annotations

import torch
import torch._dynamo

from tests.helpers import assert_tree_bitwise_equal


def tree_of(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(*s, generator=g).to(dtype) for i, s in enumerate(shapes)}


def check_compiled(tx, params, steps=3, backend="aot_eager"):
    """``tx.update`` compiled with ``fullgraph=True`` equals eager bit for bit and compiles once; the last state."""
    state_e = state_c = tx.init(params)
    update_c = torch.compile(tx.update, fullgraph=True, backend=backend)
    for i in range(steps):
        grads = tree_of(*[p.shape for p in params.values()], seed=100 + i)
        u_e, state_e = tx.update(grads, state_e, params)
        if i == 0:
            u_c, state_c = update_c(grads, state_c, params)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                u_c, state_c = update_c(grads, state_c, params)
        assert_tree_bitwise_equal(u_c, u_e)
        assert_tree_bitwise_equal(state_c, state_e)
    return state_c
