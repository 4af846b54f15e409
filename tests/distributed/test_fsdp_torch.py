"""The private PyTorch names of ``functopk.distributed.fsdp_torch`` still exist with the signatures functopk calls.

These fail loudly, naming the moved name, when a PyTorch release changes them.
"""

from __future__ import annotations

import inspect

from functopk.distributed import fsdp_torch


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_reduce_scatter_base_class_signatures():
    rs = fsdp_torch.ReduceScatter
    assert _params(rs.__call__) == ["self", "output_tensor", "input_tensor", "group", "op", "async_op"], \
        "torch's FSDP2 ReduceScatter.__call__ changed its parameters"  # fmt: skip
    allocate = inspect.signature(rs.allocate).parameters
    assert list(allocate) == ["self", "size", "dtype", "device"], "ReduceScatter.allocate changed its parameters"
    assert allocate["dtype"].kind is inspect.Parameter.KEYWORD_ONLY
    assert {"__call__", "allocate"} <= rs.__abstractmethods__


def test_fsdp_module_has_the_setters_functopk_uses():
    for name in ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_force_sum_reduction_for_comms",
                 "set_requires_gradient_sync"):  # fmt: skip
        assert callable(getattr(fsdp_torch.FSDPModule, name, None)), f"FSDPModule.{name} is gone"


def test_local_shape_and_global_offset_signature():
    assert _params(fsdp_torch.compute_local_shape_and_global_offset)[:3] == ["global_shape", "mesh", "placements"]
