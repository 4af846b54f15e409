"""The digest that guards a :class:`~functopk.TorchOptimizer` state dict's ``param_groups``.

The transformation state carries the digest of its leaves
(:func:`functopk.state_to_dict`); the param groups beside it (every key of
every group: ``lr``, ``params``, names, any key of the user's) and the indices
of the parameters with state get one here, so that a changed byte anywhere in
the checkpoint raises :class:`~functopk.CheckpointError` naming it.
"""

from __future__ import annotations

import warnings
from typing import Any

from functopk._checks import listed
from functopk.checkpoint import DIGEST_ALGORITHM, CheckpointError, value_digest

__all__ = ["check_groups_digest", "groups_digest"]


def groups_digest(groups: list[dict[str, Any]], params_with_state: Any) -> dict[str, Any]:
    """The digest of a state dict's ``param_groups`` (every key of every group) and ``params_with_state``."""
    values = {f"param_groups[{i}][{k!r}]": v for i, g in enumerate(groups) for k, v in g.items()}
    values["params_with_state"] = params_with_state
    return {"algorithm": DIGEST_ALGORITHM, "values": {path: value_digest(path, v) for path, v in values.items()}}


def check_groups_digest(entry: dict[str, Any], groups: list[dict[str, Any]], where: str) -> None:
    """``CheckpointError`` naming what differs from the digest saved with the groups; a warning without one."""
    if "digest" not in entry:
        warnings.warn(
            f"{where} has no digest of the param groups (written by an older functopk, "
            "or built by hand): they are loaded unverified; save it again to add one",
            UserWarning,
            stacklevel=4,  # the caller of load_state_dict
        )
        return
    saved = entry["digest"]
    if not isinstance(saved, dict) or set(saved) != {"algorithm", "values"} or not isinstance(saved["values"], dict):
        raise CheckpointError(f"{where}['digest'] is malformed: the checkpoint is damaged")
    now = groups_digest(groups, entry["params_with_state"])["values"]
    bad = sorted(p for p in set(now) | set(saved["values"]) if now.get(p) != saved["values"].get(p))
    if saved["algorithm"] != DIGEST_ALGORITHM or bad:
        what = f"{listed(bad)} {'differs' if len(bad) == 1 else 'differ'}" if bad else "the digest's algorithm differs"
        raise CheckpointError(
            f"checkpoint is corrupted: {what} from the digest saved with the state (a dict edited on purpose must "
            f"have its {where}['digest'] entry removed)"
        )
