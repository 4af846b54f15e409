"""A transformation's state, cut into ``torch.optim``-style per-parameter entries and put back together.

``torch.optim`` keeps one dict per parameter (``opt.state[p] = {"step": ...,
"exp_avg": ...}``); functopk keeps one state for a tree of parameters. The
adapter of :mod:`functopk.adapter.groups` stores the torch form (so that
``state_dict``, ``torch.distributed.checkpoint`` and users reading
``opt.state[p]`` see what they expect) and rebuilds the functopk form for each
step. The parameter tree used here is a dict ``{0: p0, 1: p1, ...}`` (or any
tree the caller gives, ``TorchOptimizer``'s by parameter name): a state subtree
of exactly that structure holds one entry per parameter (a *part*); every other
leaf is *shared* by the parameters the state was built for (a step count,
NAdam's ``mu_product``).

* :func:`entry_names`: the per-parameter key of every part and shared leaf,
  named by the state's field (``mu``), renamed to torch's key (``exp_avg``)
  where a rename is given, and by its full path where a field name repeats;
* :func:`split`: state -> one dict per parameter (shared leaves appear in each
  dict as the *same* object, which is how the adapter knows which parameters
  can be updated together);
* :func:`join`: the dicts -> state, given a template of the structure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from functopk.base import OptState

__all__ = ["EntryLayout", "as_tree", "join", "layout_of", "split"]


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
        part: A part's structure: the parameter tree's.
        order: The position (in the list of parameters) of each leaf of a part, in the tree's order.
    """

    n: int
    spec: optree.PyTreeSpec
    names: tuple[str, ...]
    is_part: tuple[bool, ...]
    part: optree.PyTreeSpec
    order: tuple[int, ...]


def _field_path(accessor: optree.PyTreeAccessor) -> list[str]:
    """The accessor as names: NamedTuple fields by name, other entries by key or index."""
    out = []
    for entry in accessor:
        out.append(str(getattr(entry, "field", None) or getattr(entry, "entry", "?")))
    return out


def layout_of(
    state: OptState, ptree: int | Any, rename: Mapping[str, str] | None = None, prefix: str = ""
) -> EntryLayout:
    """The :class:`EntryLayout` of ``state``, a state built for the parameters at the leaves of ``ptree``, a tree
    whose leaves are their positions in the list of parameters (an int ``n``: ``as_tree(range(n))``).

    A part's (or shared leaf's) name is its last NamedTuple field name, passed
    through ``rename``; when two items would get the same name, each takes its
    full path (``"1.count"``) instead. ``prefix`` is put before every name.
    """
    positions, part = optree.tree_flatten(as_tree(range(ptree)) if isinstance(ptree, int) else ptree)  # type: ignore[arg-type]

    def is_part(node: Any) -> bool:  # a subtree with exactly the parameter tree's structure
        return not isinstance(node, torch.Tensor) and optree.tree_structure(node) == part

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
    return EntryLayout(part.num_leaves, spec, tuple(names), parts, part, tuple(positions))


def split(state: OptState, layout: EntryLayout) -> list[dict[str, Any]]:
    """``state`` (of the given layout) as one dict per parameter: its parts' entries and the shared leaves."""
    items = layout.spec.flatten_up_to(state)
    out: list[dict[str, Any]] = [{} for _ in range(layout.n)]
    for name, item, part in zip(layout.names, items, layout.is_part):
        values = layout.part.flatten_up_to(item) if part else [item] * layout.n
        for i, value in zip(layout.order, values):
            out[i][name] = value
    return out


def join(entries: Sequence[Mapping[str, Any]], layout: EntryLayout) -> OptState:
    """The state whose :func:`split` is ``entries`` (shared leaves are taken from the first entry).

    Raises:
        KeyError: an entry lacks a name of the layout (the caller turns it into a clear error).
    """
    items = []
    for name, part in zip(layout.names, layout.is_part):
        items.append(layout.part.unflatten([entries[i][name] for i in layout.order]) if part else entries[0][name])
    return layout.spec.unflatten(items)
