"""benchmarks/pure_floor.py's hand-written kernels are functopk's pure step, bit for bit, in every output mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import pure_floor  # noqa: E402


@pytest.mark.parametrize("case", pure_floor.CASES)
def test_kernels_match_the_pure_step(case):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    pure = pure_floor.FunctopkPure(pure_floor.OPTIMIZERS[case], params, grads)
    kernels = [pure_floor.Kernels(case, mode, params, grads) for mode in ("fresh", "reused", "inplace")]
    for _ in range(3):
        for v in [pure, *kernels]:
            v.step()
    assert not torch.equal(pure.params()["w"], params["w"])  # the steps moved the parameters
    for v in kernels:
        for k in params:
            assert torch.equal(v.params()[k], pure.params()[k]), (v.name, k)
