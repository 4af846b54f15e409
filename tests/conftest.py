"""Shared test helpers."""

from __future__ import annotations

import os

import optree
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("FUNCTOPK_HYPOTHESIS_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
settings.load_profile("default")

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (so NaN == NaN and -0.0 != 0.0)."""
    return x.contiguous().view(_INT_VIEW[x.dtype]) if x.dtype in _INT_VIEW else x


def assert_tree_bitwise_equal(a, b) -> None:
    """Same structure, shapes, dtypes, devices and bit patterns."""
    la, da = optree.tree_flatten(a)
    lb, db = optree.tree_flatten(b)
    assert da == db, f"structures differ: {da} vs {db}"
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        assert torch.equal(bits(x), bits(y)), f"values differ:\n{x}\n{y}"


def assert_tree_close(a, b, rtol: float = 1e-6, atol: float = 0.0) -> None:
    la, da = optree.tree_flatten(a)
    lb, db = optree.tree_flatten(b)
    assert da == db, f"structures differ: {da} vs {db}"
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def clone_tree(tree):
    return optree.tree_map(lambda x: x.clone(), tree)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture()
def fresh_dynamo():
    """A clean torch._dynamo cache before and after the test (recompile checks count from zero)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
