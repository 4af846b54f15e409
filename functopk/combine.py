"""Combinators: transformations built from other transformations."""

from __future__ import annotations

from typing import Any

from functopk.base import GradientTransformation, OptState, Params, Updates, check_transformation

__all__ = ["chain", "named_chain"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations one after another; the state is the tuple of their states.

    Args:
        *transforms: The transformations, in the order they act on the updates.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.chain(ft.topk(2), ft.sgd(learning_rate=0.1))
        >>> state = tx.init({"w": torch.zeros(4)})
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -3.0, 2.0, 0.5])}, state)
        >>> updates["w"]
        tensor([-0.0000,  0.3000, -0.2000, -0.0000])
    """
    for i, tx in enumerate(transforms):
        check_transformation(tx, f"transforms[{i}]")

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def update(
        updates: Updates, state: tuple[OptState, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"state must be a tuple of {len(transforms)} states (one per chained transformation), "
                f"got {type(state).__name__}" + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_state = []
        for tx, s in zip(transforms, state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, but the state is a dict keyed by the given names.

    Named states are easier to read and to address in checkpoints.

    Args:
        *transforms: ``(name, transformation)`` pairs; names must be distinct strings.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.named_chain(("sparsify", ft.topk(1)), ("sgd", ft.sgd(0.1, momentum=0.9)))
        >>> sorted(tx.init({"w": torch.zeros(3)}))
        ['sgd', 'sparsify']
    """
    names = []
    for i, item in enumerate(transforms):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"transforms[{i}] must be a (name: str, transformation) pair, got {item!r}")
        check_transformation(item[1], f"transforms[{i}][1]")
        names.append(item[0])
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be distinct, got {names}")

    def init(params: Params) -> dict[str, Any]:
        return {name: tx.init(params) for name, tx in transforms}

    def update(
        updates: Updates, state: dict[str, Any], params: Params | None = None
    ) -> tuple[Updates, dict[str, Any]]:
        if not isinstance(state, dict) or set(state) != set(names):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be a dict with keys {sorted(names)}, got {got}")
        new_state = {}
        for name, tx in transforms:
            updates, new_state[name] = tx.update(updates, state[name], params)
        return updates, new_state

    return GradientTransformation(init, update)
