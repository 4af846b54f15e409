"""Helpers shared by the compressor tests: random trees, and the compile check on one transformation."""

from __future__ import annotations

import torch

from tests.helpers import assert_updates_compile_like_eager


def tree_of(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(*s, generator=g).to(dtype) for i, s in enumerate(shapes)}


def check_compiled(tx, params, steps=3, backend="aot_eager"):
    """``tx.update`` compiled with ``fullgraph=True`` equals eager bit for bit and compiles once; the last state."""
    shapes = [p.shape for p in params.values()]
    (state,) = assert_updates_compile_like_eager(
        [tx], params, lambda i: tree_of(*shapes, seed=100 + i), steps=steps, backend=backend
    )
    return state
