"""What differs between the torch releases functopk supports, in one place.

* :data:`MINIMUM_TORCH`: the oldest torch of each feature that needs more than
  the package's floor, and the clear error a feature raises on an older one
  (:func:`too_old_for`, :func:`check_compiling`);
* :func:`same_structure`: tree-structure equality in a form every supported
  ``torch.compile`` traces (dynamo 2.11 fails on ``==`` between the tree
  structures it makes while tracing);
* :func:`replace`: a NamedTuple's ``_replace`` in a form every supported
  ``torch.compile`` traces (dynamo 2.11 compiles ``_replace`` into an empty
  tuple). Code that can run in a compiled step calls it, never ``_replace``;
* :func:`assume_constant_result`: ``torch.compiler.assume_constant_result``
  without importing ``torch._dynamo`` (torch's own imports it, about a second,
  at the decoration: ``import functopk`` must not).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_T = TypeVar("_T", bound=tuple)
_F = TypeVar("_F", bound=Callable[..., Any])

TORCH_FLOOR = "2.9"
"""The oldest torch functopk supports (pyproject.toml's ``torch>=`` and the README say the same)."""

MINIMUM_TORCH = {
    "torch.compile of functopk code": "2.10",
}
"""Each feature that needs a newer torch than :data:`TORCH_FLOOR`, and the torch it needs (docs/design.md)."""


def torch_older_than(version: str) -> bool:
    """Whether the running torch is older than ``version`` (``"2.10"``; local tags such as ``+cu128`` ignored)."""
    return torch.torch_version.TorchVersion(torch.__version__) < version


def too_old_for(feature: str) -> str | None:
    """The error message for ``feature`` (a key of :data:`MINIMUM_TORCH`) on the running torch; ``None`` if new enough.

    >>> message = too_old_for("torch.compile of functopk code")
    >>> message is None or message.startswith("torch.compile of functopk code needs torch >= 2.10; this is torch")
    True
    """
    version = MINIMUM_TORCH[feature]
    if not torch_older_than(version):
        return None
    return f"{feature} needs torch >= {version}; this is torch {torch.__version__}"


COMPILE_TOO_OLD = too_old_for("torch.compile of functopk code")
"""Why functopk cannot be compiled on this torch: dynamo before 2.10 cannot trace optree, which holds every tree."""


FOREACH_TENSOR_SCALARS_TRACE = not torch_older_than("2.11")
"""Whether dynamo traces a foreach kernel given a 0-d tensor as its scalar (``torch._foreach_add(xs, t)``):
2.10 makes it a host read it then loses (``PendingUnbackedSymbolNotFound``); the list form traces everywhere."""

DTENSOR_FOREACH_TENSOR_SCALAR = not torch_older_than("2.14")
"""Whether DTensor propagates a foreach kernel's 0-d tensor scalar over shards (``torch._foreach_add_(shards, t,
alpha=1)``, the ``Tensor`` overload): torch 2.9.1 raises "Sharding propagation failed", 2.11.0 "does not have a
sharding strategy registered", 2.14.1 runs it (2.12 and 2.13 untried: taken as the older). Before, the ``Scalar``
overload runs (a host read of the scalar)."""


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``DTensor``, without importing ``torch.distributed.tensor`` (none exists before it is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def check_compiling() -> None:
    """While ``torch.compile`` traces on a torch older than 2.10, ``RuntimeError`` naming 2.10 (else nothing).

    Traceable: it reads a constant. Eagerly it does nothing, on every torch.
    With ``fullgraph=True`` dynamo reports the error with this message; without,
    dynamo runs the functopk call eagerly (a graph break), as for any code it
    cannot trace.
    """
    if COMPILE_TOO_OLD is not None and torch.compiler.is_compiling():
        raise RuntimeError(COMPILE_TOO_OLD)


def same_structure(a: Any, b: Any) -> bool:
    """Whether the tree structures (``optree.PyTreeSpec``) ``a`` and ``b`` are equal.

    Eagerly, optree's own ``a == b``. While ``torch.compile`` traces, the
    structures are dynamo's Python stand-ins, whose ``==`` older dynamos cannot
    trace; there they are compared node by node instead, on what both kinds of
    structure expose: node types (namedtuple classes included), entries (dict
    keys, in order for ordered dicts; sequence positions), leaf and node
    counts, ``None`` handling and namespace. A node's data beyond its entries
    (a ``defaultdict``'s factory, a ``deque``'s ``maxlen``, a custom node's
    metadata) is compared eagerly only.

    >>> import optree
    >>> same_structure(optree.tree_structure({"a": 1, "b": (2, 3)}), optree.tree_structure({"b": (0, 0), "a": 0}))
    True
    >>> same_structure(optree.tree_structure([1, 2]), optree.tree_structure((1, 2)))
    False
    """
    if not torch.compiler.is_compiling():
        return bool(a == b)
    return same_nodes(a, b)


def same_nodes(a: Any, b: Any) -> bool:
    """:func:`same_structure`'s traced form: equal node by node (see there); also callable eagerly, for its tests."""
    if (
        a.type is not b.type
        or a.num_leaves != b.num_leaves
        or a.num_nodes != b.num_nodes
        or a.none_is_leaf != b.none_is_leaf
        or (a.namespace and b.namespace and a.namespace != b.namespace)
        or a.entries() != b.entries()
    ):
        return False
    return all(same_nodes(x, y) for x, y in zip(a.children(), b.children()))


def replace(state: _T, **fields: Any) -> _T:
    """``state._replace(**fields)``: a copy of the NamedTuple ``state`` with ``fields`` changed.

    >>> from typing import NamedTuple
    >>> class Pair(NamedTuple):
    ...     a: int
    ...     b: int
    >>> replace(Pair(1, 2), b=3)
    Pair(a=1, b=3)
    """
    unknown = set(fields) - set(state._fields)  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(f"{type(state).__name__} has no fields {sorted(unknown)}")
    return type(state)(*[fields.get(name, value) for name, value in zip(state._fields, state)])  # type: ignore


class EagerUnderCompile:
    """``fn``, which a compiled caller runs eagerly (``torch.compiler.disable``) once :meth:`arm` has been called.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (about a second), so it is applied when the first
    object that needs it is built (an optimizer's ``__init__`` calls :meth:`arm`), not at ``import functopk``.

    >>> f = EagerUnderCompile(lambda x: x + 1)
    >>> f.arm()
    >>> f(1)
    2
    """

    def __init__(self, fn: Callable[..., Any], reason: str | None = None) -> None:
        self.fn, self.reason, self.disabled = fn, reason, None

    def arm(self) -> None:
        """Make the disabled form (once)."""
        if self.disabled is None:
            self.disabled = torch.compiler.disable(self.fn, reason=self.reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.disabled or self.fn)(*args, **kwargs)


def assume_constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``: the same mark on ``fn``.

    Dynamo reads the mark when it traces a call of ``fn`` and takes the result as a constant;
    ``tests/test_compat.py`` checks that torch's decorator sets exactly this mark.

    >>> f = assume_constant_result(lambda: 3)
    >>> f()
    3
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
