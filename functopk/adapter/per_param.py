"""A transformation's state, cut into ``torch.optim``-style per-parameter entries and put back together.

``torch.optim`` keeps one dict per parameter (``opt.state[p] = {"step": ...,
"exp_avg": ...}``); functopk keeps one state for a tree of parameters. The
adapter of :mod:`functopk.adapter.groups` stores the torch form (so that
``state_dict``, ``torch.distributed.checkpoint`` and users reading
``opt.state[p]`` see what they expect) and rebuilds the functopk form for each
step. The parameter tree used here is a dict ``{0: p0, 1: p1, ...}``: a state
subtree of exactly that structure holds one entry per parameter (a *part*);
every other leaf is *shared* by the parameters the state was built for (a step
count, NAdam's ``mu_product``).

* :func:`entry_names`: the per-parameter key of every part and shared leaf,
  named by the state's field (``mu``), renamed to torch's key (``exp_avg``)
  where a rename is given, and by its full path where a field name repeats;
* :func:`split`: state -> one dict per parameter (shared leaves appear in each
  dict as the *same* object, which is how the adapter knows which parameters
  can be updated together);
* :func:`join`: the dicts -> state, given a template of the structure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from functopk.base import OptState

__all__ = ["EntryLayout", "as_tree", "join", "layout_of", "part_of", "split"]


def as_tree(values: Sequence[Any]) -> dict[int, Any]:
    """The parameter-tree form used for per-parameter states: ``{0: v0, 1: v1, ...}``."""
    return dict(enumerate(values))


class EntryLayout(NamedTuple):
    """Where each per-parameter entry sits in a state built for ``n`` parameters.

    Attributes:
        n: The number of parameters.
        spec: The state's structure down to parts and shared leaves.
        names: The entry name of each flattened item.
        is_part: Whether each flattened item is a part (one entry per parameter).
    """

    n: int
    spec: optree.PyTreeSpec
    names: tuple[str, ...]
    is_part: tuple[bool, ...]


def part_of(ptree: Any) -> Callable[[Any], bool]:
    """Whether a state node is a *part*: a subtree with exactly ``ptree``'s structure (one entry per parameter)."""
    spec = optree.tree_structure(ptree)

    def is_part(node: Any) -> bool:
        return not isinstance(node, torch.Tensor) and optree.tree_structure(node) == spec

    return is_part


def _field_path(accessor: optree.PyTreeAccessor) -> list[str]:
    """The accessor as names: NamedTuple fields by name, other entries by key or index."""
    out = []
    for entry in accessor:
        out.append(str(getattr(entry, "field", None) or getattr(entry, "entry", "?")))
    return out


def layout_of(state: OptState, n: int, rename: Mapping[str, str] | None = None, prefix: str = "") -> EntryLayout:
    """The :class:`EntryLayout` of ``state``, a state built for the parameter tree ``as_tree([p0, ..., p{n-1}])``.

    A part's (or shared leaf's) name is its last NamedTuple field name, passed
    through ``rename``; when two items would get the same name, each takes its
    full path (``"1.count"``) instead. ``prefix`` is put before every name.
    """
    is_part = part_of(as_tree(range(n)))
    accessors, items, spec = optree.tree_flatten_with_accessor(state, is_leaf=is_part)
    parts = tuple(is_part(x) for x in items)
    paths = [_field_path(a) for a in accessors]
    short = []
    for path in paths:
        fields = [p for p in path if not p.isdigit()]
        short.append((rename or {}).get(fields[-1], fields[-1]) if fields else ".".join(path))
    names = []
    for name, path in zip(short, paths):
        names.append(prefix + (name if short.count(name) == 1 else ".".join(path)))
    return EntryLayout(n=n, spec=spec, names=tuple(names), is_part=parts)


def split(state: OptState, layout: EntryLayout) -> list[dict[str, Any]]:
    """``state`` (of the given layout) as one dict per parameter: its parts' entries and the shared leaves."""
    items = layout.spec.flatten_up_to(state)
    out: list[dict[str, Any]] = [{} for _ in range(layout.n)]
    for name, item, part in zip(layout.names, items, layout.is_part):
        for i in range(layout.n):
            out[i][name] = item[i] if part else item
    return out


def join(entries: Sequence[Mapping[str, Any]], layout: EntryLayout) -> OptState:
    """The state whose :func:`split` is ``entries`` (shared leaves are taken from the first entry).

    Raises:
        KeyError: an entry lacks a name of the layout (the caller turns it into a clear error).
    """
    items = []
    for name, part in zip(layout.names, layout.is_part):
        items.append(as_tree([e[name] for e in entries]) if part else entries[0][name])
    return layout.spec.unflatten(items)
