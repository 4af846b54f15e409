"""Gradient hooks whose lifetime is their owner's: :class:`GradientHooks`.

:class:`~functopk.sparse.StreamingTopK` folds each gradient into its selection
from a post-accumulate-grad hook on the parameter, and frees it. Hooks live on
the parameters, so a careless lifetime breaks whatever trains the model next:
a forgotten stream would go on freeing ``.grad`` under a dense optimizer made
later on the same model. Three rules prevent that:

* **the hooks hold their owner weakly**: an owner that is deleted (or
  collected) stops them at once (a hook whose owner is gone leaves ``.grad``
  alone) and removes them from the parameters (a ``weakref.finalize``);
* **one owner per parameter**: hooking a parameter that a live owner has
  hooked raises ``ValueError`` naming it, before anything is registered (two
  owners would each fold the gradient, and the second would find it freed);
* :meth:`GradientHooks.remove` removes them at once, and frees the parameters
  for another owner.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradientHooks", "hook_weakly", "owner_of"]

# parameter -> its owner (weakly): the one-owner rule; an entry whose owner is gone is free
_OWNERS: Any = WeakIdKeyDictionary()

OnGradient = Callable[[Any, int, torch.Tensor], None]


def owner_of(tensor: torch.Tensor) -> Any:
    """The live owner whose :class:`GradientHooks` are on ``tensor``, or ``None``.

    Example:
        >>> import torch, functopk as ft
        >>> w = torch.ones(2, requires_grad=True)
        >>> stream = ft.sparse.StreamingTopK([w], k=1)
        >>> owner_of(w) is stream
        True
        >>> del stream
        >>> owner_of(w) is None
        True
    """
    ref = _OWNERS.get(tensor)
    return None if ref is None else ref()


class _Hook:
    """One parameter's hook: calls ``on_gradient(owner, index, param)`` while the owner lives."""

    __slots__ = ("index", "on_gradient", "owner")

    def __init__(self, owner: weakref.ref[Any], on_gradient: OnGradient, index: int) -> None:
        self.owner, self.on_gradient, self.index = owner, on_gradient, index

    def __call__(self, param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:  # gone (collected, not yet finalized): leave .grad as autograd wrote it
            self.on_gradient(owner, self.index, param)


def hook_weakly(owner: Any, on_gradient: OnGradient, tensor: torch.Tensor, index: int) -> Any:
    """One post-accumulate-grad hook on ``tensor`` calling ``on_gradient(owner, index, tensor)`` while ``owner`` lives.

    For an owner's own autograd leaves (a sampled layer's coordinate leaf): no
    one-owner check, and the hook goes with the tensor. Returns its handle.

    Example:
        >>> import torch
        >>> class Printer:
        ...     def show(self, i, leaf):
        ...         print(i, leaf.grad)
        >>> printer, leaf = Printer(), torch.zeros(2, requires_grad=True)
        >>> _ = hook_weakly(printer, Printer.show, leaf, 7)
        >>> (3 * leaf).sum().backward()
        7 tensor([3., 3.])
    """
    return tensor.register_post_accumulate_grad_hook(_Hook(weakref.ref(owner), on_gradient, index))


def _check_leaves(leaves: list[torch.Tensor], paths: list[str]) -> None:
    """Each tensor once (one hook each), each a leaf of the autograd graph (hooks can only go there)."""
    first: dict[int, int] = {}
    for i, x in enumerate(leaves):
        j = first.setdefault(id(x), i)
        if j != i:
            raise ValueError(
                f"params lists one tensor twice, at {paths[j]} and {paths[i]}; a top-k would count its "
                "gradient twice: list each parameter once"
            )
        if x.requires_grad and not x.is_leaf:
            raise ValueError(
                f"params leaf at {paths[i]} is not a leaf of the autograd graph (it was computed from "
                "other tensors), so autograd accumulates no .grad into it; pass the parameters themselves"
            )


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


class GradientHooks:
    """Post-accumulate-grad hooks on ``leaves`` calling ``on_gradient(owner, i, leaves[i])``; owned weakly.

    Registered on every leaf that requires grad, after checking that no live
    owner has hooked one of them already. They stop and are removed when
    ``owner`` dies, or at :meth:`remove`. ``on_gradient`` is a plain function
    (``type(owner).method``), so the hooks keep no reference to the owner.

    Args:
        owner: The object the hooks work for (it keeps this object).
        on_gradient: Called as ``on_gradient(owner, i, leaves[i])`` once autograd has accumulated ``leaves[i].grad``.
        leaves: The tensors to hook (autograd leaves).
        paths: A readable path for each leaf, for the one-owner error.

    Raises:
        ValueError: A tensor listed twice, one that requires grad but is not a leaf of the autograd graph, or one
            hooked by another live owner (naming its path); nothing is registered.

    Example:
        >>> import torch
        >>> class Printer:
        ...     def show(self, i, param):
        ...         print(i, param.grad)
        >>> w = torch.ones(2, requires_grad=True)
        >>> printer = Printer()
        >>> hooks = GradientHooks(printer, Printer.show, [w], ["w"])
        >>> (2 * w).sum().backward()
        0 tensor([2., 2.])
        >>> del printer                       # the owner is gone: so are its hooks
        >>> (2 * w).sum().backward()
        >>> hooks.active
        False
    """

    def __init__(self, owner: Any, on_gradient: OnGradient, leaves: list[torch.Tensor], paths: list[str]) -> None:
        _check_leaves(leaves, paths)
        hooked = [(i, x) for i, x in enumerate(leaves) if x.requires_grad]
        for i, x in hooked:
            other = owner_of(x)
            if other is not None:
                raise ValueError(
                    f"params leaf at {paths[i]} already has the gradient hooks of a live {type(other).__name__} "
                    "(another stream, or a sparse optimizer's): both would fold its gradient, and the second would "
                    "find it freed. One stream per parameter: remove the other first (its remove(), the end of its "
                    "`with` block, or `del` it)"
                )
        ref = weakref.ref(owner)
        handles = [x.register_post_accumulate_grad_hook(_Hook(ref, on_gradient, i)) for i, x in hooked]
        for _, x in hooked:
            _OWNERS[x] = ref
        self._owner, self._hooked = ref, [x for _, x in hooked]
        self._release = weakref.finalize(owner, _remove_all, handles)  # when the owner dies, or at remove()

    @property
    def active(self) -> bool:
        """Whether the hooks are still on the parameters (neither removed nor orphaned)."""
        return self._release.alive

    def remove(self) -> None:
        """Remove the hooks from the parameters now and free them for another owner (again: nothing)."""
        self._release()
        for x in self._hooked:
            if _OWNERS.get(x) is self._owner:
                del _OWNERS[x]
        self._hooked = []
