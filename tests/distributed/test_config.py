"""The frozen configurations of ``distributed_topk`` and ``topk_hook``, and where the ranks' agreement is checked.

All in this process: no process group is started (the agreement's collective is
replaced by a recorder).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from functopk.distributed import TopKHookState, distributed_topk
from functopk.distributed import transform as transform_module
from functopk.distributed.config import ExchangeConfig, HookConfig
from functopk.sparse import k_from_density


def test_exchange_config_is_checked_and_frozen():
    config = ExchangeConfig(density=0.5, reselect=True, exchange="tree")
    assert (config.k, config.density, config.k_for(10)) == (None, 0.5, k_from_density(0.5, 10))
    assert ExchangeConfig(k=3).k_for(10) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.reselect = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="give exactly one of k or density"):
        ExchangeConfig()
    with pytest.raises(TypeError, match="reselect must be a bool, got int 1"):
        ExchangeConfig(k=1, reselect=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"k=5 exceeds the number of coordinates in the tree \(4\)"):
        ExchangeConfig(k=5).k_for(4)


def test_hook_config_is_checked_and_frozen():
    config = HookConfig(density=1, warmup_iters=0, momentum=0.5)
    assert (config.density, type(config.density), config.momentum) == (1.0, float, 0.5)  # stored converted
    assert config.bucket_k(1000) == 1000 and HookConfig().bucket_k(1000) == k_from_density(0.01, 1000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.momentum = 0.9  # type: ignore[misc]
    with pytest.raises(ValueError, match="HookConfig takes a density, not k"):
        HookConfig(k=3)
    with pytest.raises(ValueError, match=r"momentum must be < 1"):
        HookConfig(momentum=1.0)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        HookConfig(overlap="yes")  # type: ignore[arg-type]


def test_the_hook_state_keeps_its_configuration_frozen():
    state = TopKHookState(density=0.1, warmup_iters=2, selection="threshold", exchange="tree")
    assert state.config == HookConfig(density=0.1, warmup_iters=2, selection="threshold", exchange="tree")
    assert (state.density, state.warmup_iters, state.selection, state.exchange) == (0.1, 2, "threshold", "tree")
    with pytest.raises(AttributeError):
        state.density = 0.5  # type: ignore[misc]  # the ranks compared the old value: no silent change


def test_distributed_topk_agrees_in_init_and_keeps_nothing_mutable(monkeypatch):
    """The one-time agreement check runs in ``init`` (when a process group exists), not hidden in ``update``'s
    closure: the transformation captures only its frozen configuration and the group."""
    checked = []
    monkeypatch.setattr(transform_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(transform_module, "resolve_group", lambda group, what: ("group", 0, 1))
    monkeypatch.setattr(transform_module, "check_agreement", lambda what, fields, *args: checked.append(fields))
    tx = distributed_topk(2, reselect=True)
    state = tx.init({"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float64)})
    assert state.residual.dtype == torch.float64 and len(checked) == 1
    fields = checked[0]
    assert (fields["the number of coordinates"], fields["k"], fields["reselect"]) == (5, 2, True)
    assert (fields["exchange"], fields["the residual dtype"]) == ("allgather", "torch.float64")
    for fn in (tx.init, tx.update):
        captured = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
        captured += list(getattr(fn, "args", ())) + list(getattr(fn, "keywords", {}).values())
        assert not [c for c in captured if isinstance(c, (set, list, dict))], captured
        assert all(dataclasses.is_dataclass(c) or c is None for c in captured), captured
