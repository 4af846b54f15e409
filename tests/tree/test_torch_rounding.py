"""functopk.tree.torch_rounding against the expressions torch.optim evaluates, with Python floats as torch has them."""

from __future__ import annotations

import random

import pytest
import torch

from functopk.tree import torch_rounding as tr


def _pairs(n: int = 2000):
    rng = random.Random(0)
    return [(rng.uniform(1e-5, 1.0), rng.uniform(1e-3, 2.0)) for _ in range(n)]


def test_a_tensor_lr_combines_with_torchs_python_floats_in_its_dtype_bit_for_bit():
    for lr, x in _pairs():
        t = torch.tensor(lr)  # float32, as torch.tensor(0.01) is
        wide = torch.tensor(x, dtype=torch.float64)  # functopk's stand-in for torch's Python float x
        assert torch.equal(tr.lr_divided(t, wide), t / x) and tr.lr_divided(t, wide).dtype == torch.float32
        assert torch.equal(tr.lr_times(t, wide), t * x)
    assert tr.lr_divided(0.5, torch.tensor(4.0, dtype=torch.float64)).item() == 0.125  # a number: float64 maths


def test_decoupled_decay_is_torchs_factor_minus_one_exactly():
    for lr, wd in _pairs(500):
        t = torch.tensor(lr)
        factor = 1 - t * wd  # torch: param.mul_(1 - lr * weight_decay), a float32 tensor here
        coef = tr.decoupled_decay(t, wd)
        assert coef.dtype == torch.float64 and (coef + 1.0).item() == factor.item()
        assert tr.decoupled_decay(lr, wd) == -lr * wd
    both = tr.decoupled_decay(0.01, torch.tensor(0.1))  # a tensor weight decay rounds the factor too
    assert (both + 1.0).item() == (1 - 0.01 * torch.tensor(0.1)).item()


class _Sub(torch.Tensor):
    pass


def test_torch_foreach_picks_as_torch_does():
    cpu = [torch.zeros(2), torch.nn.Parameter(torch.zeros(3))]
    assert tr.torch_foreach(None, cpu) is False  # torch's CPU default: the for-loop
    assert tr.torch_foreach(True, cpu) and tr.torch_foreach("yes", cpu) and not tr.torch_foreach(False, cpu)
    assert not tr.torch_foreach(None, [])
    meta = [torch.zeros(2, device="meta")]
    assert tr.torch_foreach(None, meta) is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_foreach_is_the_default_for_plain_cuda_tensors():
    leaves = [torch.zeros(2, device="cuda")]
    assert tr.torch_foreach(None, leaves) is True
    assert tr.torch_foreach(None, [torch.zeros(2, device="cuda").as_subclass(_Sub)]) is False  # not torch's types


def test_lr_in_float64_names_the_implementation_that_reads_a_tensor_lr_on_the_host():
    leaves = [torch.zeros(2)]
    t = torch.tensor(0.1)
    assert tr.lr_in_float64(0.1, None, leaves, rounded_by_foreach=False)
    assert not tr.lr_in_float64(t, None, leaves, rounded_by_foreach=False)  # the for-loop rounds: CPU default
    assert tr.lr_in_float64(t, None, leaves, rounded_by_foreach=True)
    assert not tr.lr_in_float64(t, True, leaves, rounded_by_foreach=True)


def test_torch_scalar_dtype_follows_the_default_dtype():
    assert tr.torch_scalar_dtype(torch.device("cpu")) == torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert tr.torch_scalar_dtype(torch.device("cpu")) == torch.float64
        assert tr.torch_scalar_dtype(torch.device("mps")) == torch.float32
    finally:
        torch.set_default_dtype(default)
