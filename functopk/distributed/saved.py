"""What ``TopKHookState.load_state_dict`` accepts: the whole saved dict, checked before anything changes.

A :meth:`TopKHookState.state_dict` holds the configuration it was saved with
(not loaded: the loading state keeps its own), the iteration count, the
statistics, and the residuals (velocities) and bucket layout by parameter
name. :func:`check_saved` checks every key, type and shape and returns what
the state takes over, so that a bad dict raises before the state is touched.
Keys added after version 1 without a version change (``momentum``,
``exchange``, ``velocities``) may be absent: older checkpoints lack them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from functopk._checks import check_bool, check_choice, check_density, check_int, check_keys, check_number, describe
from functopk.distributed.config import EXCHANGES
from functopk.distributed.names import check_names
from functopk.distributed.resume import check_layout
from functopk.distributed.stats import HookStats

__all__: list[str] = []

FORMAT = "functopk.topk_hook"
VERSION = 2
_REQUIRED = ("format", "version", "density", "warmup_iters", "reselect", "iter", "skipped_iters", "last_step",
             "total", "residuals")  # fmt: skip
_OPTIONAL = ("momentum", "exchange", "velocities")


class Saved(NamedTuple):
    """What :meth:`TopKHookState.load_state_dict` takes over from a checked state dict."""

    iter: int
    skipped_iters: int
    last_step: HookStats
    total: HookStats
    residuals: dict[str, torch.Tensor]
    velocities: dict[str, torch.Tensor]
    layout: tuple[tuple[str, ...], ...] | None


def check_saved(state_dict: Any, shapes: Mapping[str, tuple[int, ...]], momentum: float) -> Saved:
    """The checked content of a saved hook state; ``shapes`` are the model's (``{}`` without ``model=``).

    Raises:
        TypeError: a value of the wrong type (the message names its key).
        ValueError: not a hook state dict, a key missing or unknown, a value
            out of range, names or shapes unlike the model's, or velocities
            while this state has ``momentum=0``.
    """
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        raise ValueError(f"state_dict is not a TopKHookState.state_dict() (format {FORMAT!r}), "
                         f"got {describe(state_dict)}")  # fmt: skip
    version = check_int(state_dict["version"], "state_dict['version']", minimum=1) if "version" in state_dict \
        else VERSION  # (reported missing below)
    if version > VERSION:
        raise ValueError(f"state_dict['version'] is {version}: saved by a newer functopk (this one reads up to "
                         f"{VERSION})")  # fmt: skip
    required = _REQUIRED + (("layout",) if version >= 2 else ())
    check_keys(state_dict, required, _OPTIONAL + ("layout",),
               name=f"TopKHookState.load_state_dict: state_dict (version {version})")  # fmt: skip
    _check_config(state_dict)
    residuals = check_names("residuals", state_dict["residuals"], shapes)
    velocities = check_names("velocities", state_dict.get("velocities", {}), shapes)
    if velocities and not momentum:
        raise ValueError("TopKHookState.load_state_dict: the checkpoint holds momentum-correction velocities "
                         "but this state has momentum=0; build it with the momentum it was saved with "
                         f"({state_dict.get('momentum')})")  # fmt: skip
    return Saved(
        iter=check_int(state_dict["iter"], "state_dict['iter']", minimum=0),
        skipped_iters=check_int(state_dict["skipped_iters"], "state_dict['skipped_iters']", minimum=0),
        last_step=_stats(state_dict["last_step"], "last_step"),
        total=_stats(state_dict["total"], "total"),
        residuals=residuals,
        velocities=velocities,
        layout=check_layout(state_dict.get("layout"), shapes),
    )


def _check_config(state_dict: Mapping[str, Any]) -> None:
    """The saved configuration: not loaded, but a wrong type means the dict is not what it claims to be."""
    check_density(state_dict["density"], "state_dict['density']", allow_tensor=False)
    check_int(state_dict["warmup_iters"], "state_dict['warmup_iters']", minimum=0)
    check_bool(state_dict["reselect"], "state_dict['reselect']")
    if "momentum" in state_dict:
        check_number(state_dict["momentum"], "state_dict['momentum']", minimum=0.0, below=1.0)
    check_choice(state_dict.get("exchange", "allgather"), "state_dict['exchange']", EXCHANGES)


def _stats(saved: Any, key: str) -> HookStats:
    """``state_dict[key]``: a dict of every :class:`HookStats` field to a count."""
    if not isinstance(saved, Mapping):
        raise TypeError(f"state_dict[{key!r}] must be a dict of the HookStats fields, got {describe(saved)}")
    if set(saved) != set(HookStats._fields):
        raise ValueError(f"state_dict[{key!r}] must have exactly the keys {list(HookStats._fields)}, "
                         f"got {sorted(map(str, saved))}")  # fmt: skip
    return HookStats(**{f: check_int(saved[f], f"state_dict[{key!r}][{f!r}]", minimum=0) for f in HookStats._fields})
