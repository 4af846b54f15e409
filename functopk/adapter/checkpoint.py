"""Checkpoints of :class:`~functopk.adapter.ParamGroupOptimizer`: ``torch.optim``'s layout, in both directions.

Saving (:func:`unshared`): in memory, the parameters that step together share
one step count (one tensor object, :mod:`functopk.adapter.groups`). A state
dict gives every parameter its own copy, as ``torch.optim`` does: ``torch.save``
keeps sharing, and a ``torch.optim`` optimizer loading a shared count would add
1 to it once per parameter. Every other tensor is a copy too, since the next
step writes into the optimizer's state.

Loading checks the whole state dict before anything changes, and reads it as
``torch.optim`` does, failing at load what ``torch.optim`` would fail on at its
next step:

* :func:`filled_group`: a param group from an older torch lacks keys added
  since (``maximize``, ``foreach``, ...): the class's own ``__setstate__`` fills
  them, as in ``torch.optim``; a group that still lacks one of the class's keys
  is a checkpoint of another class;
* :func:`loaded_entry`: each key of a parameter's entry is one the
  transformation keeps, or one ``torch.optim`` writes for the class
  (kept as given where the transformation has no such entry); any other key (a typo)
  raises. Numbers (an older torch's ``step``) become tensors, tensors must
  have the expected shape. ``torch.optim.SGD`` keeps no step count: a loaded
  ``momentum_buffer`` means the parameter has stepped (torch's rule), so
  functopk's count of it starts at 1;
* :func:`share_equal_scalars_`: after loading, equal counts become one tensor again;
* :func:`loaded_sparse_state`, :func:`loaded_scores`: the state of a
  :func:`~functopk.sparse_optimizer_from_torch` optimizer (its ``k`` coordinates'
  indices and named state vectors, and a stream's sums of ``|g|``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from functopk._checks import check_keys, check_saved, describe, listed
from functopk.adapter import per_param
from functopk.sparse.opt_state import SparseOptState

__all__ = [
    "Expected", "check_group_sizes", "expected_entries", "filled_group", "loaded_entry", "loaded_scores",
    "loaded_sparse_state", "share_equal_scalars_", "unshared",
]  # fmt: skip


def unshared(state: Mapping[Any, Mapping[str, Any]]) -> dict[Any, dict[str, Any]]:
    """``state`` (a state dict's ``"state"``) with a copy of each tensor: shared with no other entry, nor the optimizer.

    (The optimizer's next step writes into its own state tensors: :mod:`functopk.inplace`.)
    """
    return {
        key: {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in entries.items()}
        if isinstance(entries, Mapping)
        else entries  # put there by a state-dict hook (torch keeps it as given)
        for key, entries in state.items()
    }


def check_group_sizes(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """A checkpoint's param groups must list as many parameters, group by group, as the optimizer's.

    Raises:
        ValueError: they differ in number or size.
    """
    sizes, own = [len(s["params"]) for s in saved], [len(g["params"]) for g in groups]
    if sizes != own:
        raise ValueError(f"loaded state dict has param groups of sizes {sizes}, this optimizer has {own}")


def filled_group(
    optimizer_class: type[torch.optim.Optimizer], index: int, saved: Any, keys: Iterable[str]
) -> dict[str, Any]:
    """A saved param group with the keys ``optimizer_class.__setstate__`` fills for older checkpoints.

    Args:
        optimizer_class: The ``torch.optim`` class whose checkpoint this should be.
        index: The group's position (for messages).
        saved: The saved group.
        keys: The optimizer's hyperparameter keys (its ``defaults``): those the class keeps in its
            param groups must be in the group once filled.

    Raises:
        TypeError: ``saved`` is not a dict with a list of ``"params"``.
        ValueError: it lacks a key of ``keys`` that the class keeps and torch does not fill either.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
        raise TypeError(
            f"state_dict['param_groups'][{index}] must be a dict with a list 'params', got {describe(saved)}"
        )
    # torch's own rule, run by torch: its __setstate__ on a throw-away optimizer of the class
    make: Any = optimizer_class  # (every torch.optim class has defaults for all but params)
    throwaway = make([torch.zeros(2, 2, requires_grad=True)])
    kept = set(throwaway.param_groups[0])  # (not defaults: torch's load_state_dict adds 'differentiable' there)
    throwaway.__setstate__({"state": {}, "param_groups": [{**saved, "params": []}]})
    group = {**throwaway.param_groups[0], "params": saved["params"]}
    missing = [repr(k) for k in keys if k in kept and k not in group]
    if missing:
        raise ValueError(
            f"param group {index} lacks {listed(missing)}, which torch.optim.{optimizer_class.__name__} keeps; is "
            "this a checkpoint of another optimizer class?"
        )
    return group


class Expected(NamedTuple):
    """What one parameter's state entry may hold.

    Attributes:
        like: Each key the transformations keep -> a value of the right shape and dtype.
        torch_keys: Keys ``torch.optim`` writes for the class (accepted even where not kept).
        buffers: The optimizer's per-parameter keys (not ``sparsify``'s, not shared counts).
        counts: The optimizer's step counts that torch does not save (SGD's): 1 when a buffer is loaded.
    """

    like: Mapping[str, Any]
    torch_keys: Collection[str]
    buffers: Collection[str]
    counts: Collection[str]


def expected_entries(
    templates: Iterable[tuple[list[torch.Tensor], list[dict[str, Any]], per_param.EntryLayout, bool]],
    torch_keys: Iterable[str],
) -> dict[torch.Tensor, Expected]:
    """Each parameter's :class:`Expected` entry.

    Args:
        templates: Per transformation: its parameters, their fresh entries (on any
            device), its layout, and whether it is the optimizer's own (not ``sparsify``).
        torch_keys: The per-parameter keys ``torch.optim`` writes for the class.
    """
    keys = frozenset(torch_keys)
    like: dict[torch.Tensor, dict[str, Any]] = {}
    buffers: dict[torch.Tensor, list[str]] = {}
    counts: dict[torch.Tensor, list[str]] = {}
    for params, entries, layout, main in templates:
        shared = {n for n, is_part in zip(layout.names, layout.is_part) if not is_part}
        for p, e in zip(params, entries):
            like.setdefault(p, {}).update(e)
            if main:
                buffers[p] = [n for n in e if n not in shared]
                counts[p] = [
                    n
                    for n in shared
                    if n not in keys and isinstance(e[n], torch.Tensor) and not e[n].is_floating_point()
                ]
    return {p: Expected(like[p], keys, buffers.get(p, []), counts.get(p, [])) for p in like}


def loaded_entry(key: Any, entries: Any, param: torch.Tensor, expected: Expected, owner: str) -> dict[str, Any]:
    """A saved entry of ``state_dict['state'][key]`` as it will be kept for ``param``.

    Raises:
        TypeError: the entry is not a dict, or a value is neither a tensor nor a number where a tensor is kept.
        ValueError: a key is not one ``owner`` keeps, a tensor has another shape than expected, or a step
            count is not a whole number ``>= 0`` (torch would carry 2.7 steps on; functopk's counts are integers).
    """
    where = f"state_dict['state'][{key!r}]"
    if not isinstance(entries, dict):
        raise TypeError(f"{where} must be a dict, got {describe(entries)}")
    unknown = [repr(n) for n in entries if n not in expected.like and n not in expected.torch_keys]
    if unknown:
        raise ValueError(
            f"{where} has key {listed(unknown)}, which {owner} does not keep for parameter {key!r}; expected "
            f"keys: {listed(sorted(map(repr, expected.like)), limit=12)}"
        )
    out = {}
    for name, value in entries.items():
        like = expected.like.get(name)
        if not isinstance(like, torch.Tensor):  # a torch key the transformation does not keep: as given
            out[name] = value.to(param.device) if isinstance(value, torch.Tensor) else value
            continue
        if not like.is_floating_point() and like.dim() == 0:
            _check_count(f"{where}[{name!r}]", value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and like.dim() == 0:
            out[name] = torch.tensor(value, device=param.device).to(like.dtype)  # an older torch's step
        else:  # (its dtype becomes the kept one, as torch.optim's load casts)
            check_saved(value, like, f"{where}[{name!r}] (parameter {key!r}, as {owner} keeps it)", exact=False)
            out[name] = value.to(device=param.device, dtype=like.dtype)
    if any(n in entries for n in expected.buffers):
        for name in expected.counts:
            if name not in out:  # torch.optim's rule: a buffer exists, so this is not the first step
                out[name] = torch.ones((), dtype=expected.like[name].dtype, device=param.device)
    return out


def _check_count(where: str, value: Any) -> None:
    """``ValueError`` unless a saved step count (torch writes a float, functopk an integer) is a whole number
    ``>= 0``: the count functopk keeps is an integer, and 2.7 steps would silently become 2."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # (the type and shape checks below name it)
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{where} is {value!r}: a step count must be a whole number >= 0 (functopk counts steps as "
                         "integers)")  # fmt: skip


def share_equal_scalars_(
    state: Mapping[torch.Tensor, dict[str, Any]], parts: Iterable[tuple[list[torch.Tensor], per_param.EntryLayout]]
) -> None:
    """Let parameters whose shared leaves are equal share one object again (one cohort), in place.

    A load gives every parameter its own copy of its step count; equal counts
    (compared once, here, on the host) become one tensor again, so that a group
    keeps stepping as one tree. ``parts``: the parameters of each transformation, with its layout.
    """
    for params, layout in parts:
        shared = {n for n, is_part in zip(layout.names, layout.is_part) if not is_part}
        pool: dict[Any, Any] = {}
        for p in params:
            entries = state.get(p, {})
            for name, value in entries.items():
                if name in shared and isinstance(value, torch.Tensor) and value.dim() == 0:
                    key = (name, value.dtype, value.device, value.tolist())
                    entries[name] = pool.setdefault(key, value)


def loaded_sparse_state(saved: Any, like: SparseOptState, keys: list[str], n: int, owner: str) -> SparseOptState:
    """A sparse optimizer's saved ``"state"``, checked against ``like`` (its state for the loaded param groups).

    Raises:
        TypeError: a value is not a tensor.
        ValueError: other keys or names than ``like``'s, another shape or dtype (another ``k``), indices not
            ascending in ``[0, n)``, or a negative count.
    """
    check_keys(saved, keys, name=f"state_dict['state'] must have the keys {keys}; it", type_error=ValueError)
    what = f"state_dict['state']['inner'] must hold {sorted(like.inner)} (the state of {owner}); it"
    check_keys(saved["inner"], like.inner, name=what, type_error=ValueError)
    pairs = {"count": (saved["count"], like.count), "indices": (saved["indices"], like.indices)}
    pairs.update({f"inner.{name}": (saved["inner"][name], like.inner[name]) for name in like.inner})
    for name, (value, want) in pairs.items():  # (another shape: another k)
        check_saved(value, want, f"state_dict['state'] {name}", why=f" (this optimizer's k={like.indices.numel()})")
    device = like.indices.device
    idx = saved["indices"].to(device)
    if idx.numel() and not (bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < n):
        raise ValueError(f"state_dict['state'] indices must be ascending flat indices in [0, {n})")
    if int(saved["count"]) < 0:
        raise ValueError(f"state_dict['state'] count must be >= 0, got {int(saved['count'])}")
    inner = {name: value.to(device) for name, value in saved["inner"].items()}
    return SparseOptState(saved["count"].to(device), idx, inner, None)


def loaded_scores(saved: Any, live: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Saved sums of ``|g|``, checked against a stream's ``live`` ones (``None``: it keeps none, nothing loaded).

    Raises:
        ValueError: not one tensor per parameter, of its shape and dtype.
    """
    if live is None:
        return []
    if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
        got = f"{len(saved)} entries" if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise ValueError(
            f"state_dict['state'] score must be a list of {len(live)} tensors (one per parameter), got {got}"
        )
    for i, (x, want) in enumerate(zip(saved, live)):
        check_saved(x, want, f"state_dict['state'] score[{i}] (parameter {i}'s)", type_error=ValueError)
    return list(saved)
