"""Checkpoints: transformation states (any tree of tensors) to and from plain dicts.

A functopk state is a tree of NamedTuples, tuples and dicts whose leaves are
tensors. ``torch.load(..., weights_only=True)`` (the safe default since torch
2.6) refuses to rebuild arbitrary classes such as NamedTuples, so states are
saved as a *plain* dict instead::

    {"format": "functopk.state", "version": 1,
     "structure": "PyTreeSpec((EmptyState(), TraceState(trace={'b': *, 'w': *})))",
     "leaves": {"[1].trace['b']": tensor(...), "[1].trace['w']": tensor(...)}}

Only strings, ints, dicts and tensors: ``torch.save`` / ``torch.load(weights_only=True)``
round-trip it. Loading needs a *template*, a state of the expected structure
(usually ``tx.init(params)``): the saved structure, each leaf's shape and dtype
are checked against it, and a mismatch raises :class:`CheckpointError` naming
the leaf. Loading is pure, so a failed load leaves the current state as it was.

The same functions work for any tree of tensors, e.g. a whole functional
training state ``{"params": params, "buffers": buffers, "opt_state": opt_state}``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from typing import IO, Any, Union

import optree
import torch

from functopk._checks import describe, listed
from functopk.tree.maths import PyTree

__all__ = ["CheckpointError", "load_state", "read_state_dict", "save_state", "state_from_dict", "state_to_dict"]

FORMAT = "functopk.state"
VERSION = 1
_SCALARS = (bool, int, float)
_MAX_LISTED = 5

FileLike = Union[str, "os.PathLike[str]", IO[bytes]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unreadable, or not matching the expected state.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> saved = ft.state_to_dict(tx.init({"w": torch.zeros(2)}))
        >>> try:
        ...     ft.state_from_dict(saved, tx.init({"w": torch.zeros(3)}))
        ... except ft.CheckpointError as err:
        ...     print(type(err).__name__, isinstance(err, ValueError))
        CheckpointError True
    """


def _leaf_paths(treedef: optree.PyTreeSpec) -> list[str]:
    return [a.codify("").lstrip(".") or "<root>" for a in treedef.accessors()]


def state_to_dict(state: PyTree) -> dict[str, Any]:
    """A plain dict describing ``state``, for ``torch.save``.

    The tensors in the result are the state's own tensors, detached (no copy);
    functopk never changes a state in place, so this is safe. Leaves may be
    tensors or Python ``bool``/``int``/``float``; ``None`` nodes are kept in the
    structure.

    Args:
        state: A tree of tensors, e.g. ``tx.init(params)`` or a later state.

    Returns:
        ``{"format", "version", "structure", "leaves"}`` with ``leaves`` an ordered
        dict from readable leaf paths (``"[1].trace['w']"``) to values.

    Raises:
        TypeError: a leaf is neither a tensor nor a Python number.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> sd = ft.state_to_dict(tx.init({"w": torch.zeros(2)}))
        >>> print(sd["structure"])  # doctest: +ELLIPSIS
        PyTreeSpec((TraceState(trace={'w': *}...), EmptyState()))
        >>> sd["leaves"]["[0].trace['w']"]
        tensor([0., 0.])
    """
    leaves, treedef = optree.tree_flatten(state)
    paths = _leaf_paths(treedef)
    out: dict[str, Any] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            out[path] = leaf.detach()
        elif isinstance(leaf, _SCALARS):
            out[path] = leaf
        else:
            raise TypeError(
                f"state leaf at {path} is {describe(leaf)}; a checkpoint can hold tensors and "
                "Python bool/int/float leaves only"
            )
    if len(out) != len(leaves):  # two leaves with one readable path: cannot happen for optree trees
        raise ValueError(f"state has leaves with identical paths: {paths}")
    return {"format": FORMAT, "version": VERSION, "structure": str(treedef), "leaves": out}


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _structure_mismatch(saved: list[str], paths: list[str], saved_structure: Any, treedef: optree.PyTreeSpec) -> str:
    """Where the saved leaves first differ from the template's (not both structures in full)."""
    first = next((i for i, (a, b) in enumerate(zip(saved, paths)) if a != b), min(len(saved), len(paths)))
    if first < max(len(saved), len(paths)):
        where = f"leaf {first} is {saved[first] if first < len(saved) else 'absent'} in the checkpoint"
        detail = [f"{where} but {paths[first] if first < len(paths) else 'absent'} in the current state"]
    else:
        detail = [f"the leaf paths agree but the node types differ: saved {_short(str(saved_structure))}, "
                  f"expected {_short(str(treedef))}"]
    missing = [p for p in paths if p not in set(saved)]
    unexpected = [p for p in saved if p not in set(paths)]
    if missing:
        detail.append(f"missing leaves: {listed(missing, _MAX_LISTED)}")
    if unexpected:
        detail.append(f"unexpected leaves: {listed(unexpected, _MAX_LISTED)}")
    return "checkpoint structure does not match the current state: " + "; ".join(detail)


def state_from_dict(template: PyTree, state_dict: dict[str, Any]) -> PyTree:
    """The state saved in ``state_dict``, checked against ``template``.

    ``template`` gives the expected structure (NamedTuple types, dict keys),
    and each leaf's shape and dtype; ``tx.init(params)`` is the usual template.
    Loaded tensors are moved to the device of the corresponding template leaf
    (they may share memory with ``state_dict``'s tensors). Pure: neither
    argument is changed, so on error the caller's current state is untouched.

    Args:
        template: A state of the expected structure.
        state_dict: A dict made by :func:`state_to_dict` (possibly after
            ``torch.save`` / ``torch.load``).

    Returns:
        A new state with ``template``'s structure and the saved values.

    Raises:
        CheckpointError: ``state_dict`` is not a functopk state dict, or its
            structure, a leaf's shape, dtype or type differs from ``template``'s;
            the message names the leaf.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> _, state = tx.update({"w": torch.ones(2)}, state)
        >>> restored = ft.state_from_dict(tx.init({"w": torch.zeros(2)}), ft.state_to_dict(state))
        >>> restored[0].trace["w"]
        tensor([1., 1.])
        >>> ft.state_from_dict(tx.init({"w": torch.zeros(3)}), ft.state_to_dict(state))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functopk.checkpoint.CheckpointError: checkpoint leaf [0].trace['w'] is a tensor of shape (2,) ...
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"state_dict must be a dict made by state_to_dict, got {type(state_dict).__name__}")
    missing_keys = [k for k in ("format", "version", "structure", "leaves") if k not in state_dict]
    if missing_keys or state_dict.get("format") != FORMAT:
        raise CheckpointError(
            f"state_dict is not a functopk state dict (expected keys format={FORMAT!r}, version, structure, "
            f"leaves; got keys {sorted(map(str, state_dict))})"
        )
    if state_dict["version"] != VERSION:
        raise CheckpointError(
            f"state_dict has format version {state_dict['version']!r}; this functopk reads version {VERSION}"
        )
    saved = state_dict["leaves"]
    if not isinstance(saved, dict):
        raise CheckpointError(f"state_dict['leaves'] must be a dict, got {type(saved).__name__}")

    leaves, treedef = optree.tree_flatten(template)
    paths = _leaf_paths(treedef)
    if list(saved) != paths or state_dict["structure"] != str(treedef):
        raise CheckpointError(_structure_mismatch(list(saved), paths, state_dict["structure"], treedef))
    new_leaves = []
    for path, want in zip(paths, leaves):
        got = saved[path]
        if isinstance(want, torch.Tensor):
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
            if ok and got.layout != want.layout:
                ok = False
        else:
            ok = type(got) is type(want)
        if not ok:
            raise CheckpointError(f"checkpoint leaf {path} is {describe(got)}, expected {describe(want)}")
        new_leaves.append(got.to(want.device) if isinstance(got, torch.Tensor) else got)
    return optree.tree_unflatten(treedef, new_leaves)


def save_state(f: FileLike, state: PyTree) -> None:
    """``torch.save(state_to_dict(state), f)``; a path is written atomically.

    A path is written to a temporary file in the same directory, then renamed,
    so a crash mid-write never leaves a truncated checkpoint under ``f``.

    Args:
        f: A path or a writable binary file object.
        state: The tree to save.

    Example:
        >>> import os, tempfile, torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "opt_state.pt")
        >>> ft.save_state(path, tx.init({"w": torch.zeros(3)}))
        >>> torch.load(path, weights_only=True)["leaves"]["[0].trace['w']"]
        tensor([0., 0., 0.])
    """
    sd = state_to_dict(state)
    if not isinstance(f, (str, os.PathLike)):
        torch.save(sd, f)
        return
    path = os.fspath(f)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".functopk-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(sd, fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_state_dict(f: FileLike) -> dict[str, Any]:
    """``torch.load(f, map_location="cpu", weights_only=True)``, with unreadable files as :class:`CheckpointError`.

    Use it to read any checkpoint written with ``torch.save`` (e.g. a
    :class:`functopk.TorchOptimizer` state dict). A missing file still raises
    ``FileNotFoundError``.

    Example:
        >>> import io, torch, functopk as ft
        >>> from functopk.checkpoint import read_state_dict
        >>> read_state_dict(io.BytesIO(b"PK\x03\x04 cut short"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functopk.checkpoint.CheckpointError: cannot read a checkpoint from 'BytesIO': the file is truncated, ...
    """
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else type(f).__name__
        raise CheckpointError(
            f"cannot read a checkpoint from {name!r}: the file is truncated, corrupted or not written by "
            f"torch.save ({type(e).__name__}: {_short(str(e), 200)})"
        ) from e


def load_state(f: FileLike, template: PyTree) -> PyTree:
    """Read a state written by :func:`save_state`, checked against ``template``.

    Reads with ``torch.load(weights_only=True)`` onto the CPU, then moves each
    tensor to the device of its template leaf.

    Args:
        f: A path or a readable binary file object.
        template: A state of the expected structure (e.g. ``tx.init(params)``).

    Raises:
        CheckpointError: the file is truncated or not a checkpoint, or its
            contents do not match ``template`` (see :func:`state_from_dict`).
        FileNotFoundError: there is no file at ``f``.

    Example:
        >>> import io, torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> state = tx.init({"w": torch.ones(2)})
        >>> buffer = io.BytesIO()
        >>> ft.save_state(buffer, state)
        >>> _ = buffer.seek(0)
        >>> ft.load_state(buffer, state)[0].trace["w"]
        tensor([0., 0.])
    """
    return state_from_dict(template, read_state_dict(f))
