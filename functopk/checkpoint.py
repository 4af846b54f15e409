"""Checkpoints: transformation states (any tree of tensors) to and from plain dicts.

A functopk state is a tree of NamedTuples, tuples and dicts whose leaves are
tensors. ``torch.load(..., weights_only=True)`` (the safe default since torch
2.6) refuses to rebuild arbitrary classes such as NamedTuples, so states are
saved as a *plain* dict instead::

    {"format": "functopk.state", "version": 1,
     "structure": "PyTreeSpec((EmptyState(), TraceState(trace={'b': *, 'w': *})))",
     "leaves": {"[1].trace['b']": tensor(...), "[1].trace['w']": tensor(...)},
     "digest": {"algorithm": "sha256", "leaves": {"[1].trace['b']": "5f1c...", "[1].trace['w']": "09ab..."}}}

Only strings, ints, dicts and tensors: ``torch.save`` / ``torch.load(weights_only=True)``
round-trip it. Loading needs a *template*, a state of the expected structure
(usually ``tx.init(params)``): the saved structure, each leaf's shape and dtype
are checked against it, and a mismatch raises :class:`CheckpointError` naming
the leaf. Loading is pure, so a failed load leaves the current state as it was.

Integrity: ``torch.load`` does not notice most changed bytes inside a tensor's
data, so two SHA-256 digests guard a checkpoint, both checked on load:

* the dict carries a digest of every leaf (its path, dtype, shape and bytes; a
  Python leaf's type and value), so a changed leaf raises :class:`CheckpointError`
  naming it, wherever the dict went (``torch.save`` by the user, the state dict
  of a :class:`functopk.TorchOptimizer`);
* a file written by :func:`save_state` is sealed: the digest of all its bytes is
  the zip archive's comment, so that any changed, missing or added byte raises.

Both read every tensor on the host (a device-to-host copy for GPU tensors), at
save and at load, never in an update. Measured on one CPU core for Adam's state
of a ResNet-18 (94 MB): :func:`save_state` 0.6 s (``torch.save`` alone 0.25 s),
:func:`load_state` 0.3 s (``torch.load`` alone 0.14 s), the leaves' digests
0.2 s of each. A dict without ``"digest"`` (written by an older functopk, or
built by hand) still loads, unverified, with a ``UserWarning``; a dict edited
on purpose after :func:`state_to_dict` needs its ``"digest"`` entry dropped.

The same functions work for any tree of tensors, e.g. a whole functional
training state ``{"params": params, "buffers": buffers, "opt_state": opt_state}``.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import warnings
from typing import IO, Any, Union

import optree
import torch

from functopk._checks import check_keys, check_saved, describe, listed
from functopk.files import write_atomically
from functopk.tree.maths import PyTree

__all__ = ["CheckpointError", "load_state", "read_state_dict", "save_state", "state_from_dict", "state_to_dict"]

FORMAT = "functopk.state"
VERSION = 1
DIGEST_ALGORITHM = "sha256"
_KEYS = ("format", "version", "structure", "leaves")
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


def _record(h: Any, text: str) -> None:
    """Feed ``text`` to the hash length-prefixed, so that consecutive fields cannot run into each other."""
    data = text.encode()
    h.update(len(data).to_bytes(8, "little") + data)


def _leaf_digest(path: str, value: Any) -> str:
    """SHA-256 of a leaf: its path, then a tensor's dtype, shape and bytes (in C order), or a number's type and repr.

    Host-side: a tensor is copied to the CPU (and made dense, contiguous, without
    conjugate or negative bits) first. Used at save and load, never in an update.
    """
    h = hashlib.new(DIGEST_ALGORITHM)
    _record(h, path)
    if not isinstance(value, torch.Tensor):
        _record(h, f"{type(value).__name__}:{value!r}")
        return h.hexdigest()
    _record(h, f"tensor:{value.dtype}:{tuple(value.shape)}")
    x = value.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    x = x.resolve_conj().resolve_neg().cpu().contiguous()
    if type(x) is not torch.Tensor:  # a subclass: a DTensor's own shard, else the plain tensor it wraps
        x = x.to_local() if hasattr(x, "to_local") else x.as_subclass(torch.Tensor)
        x = x.cpu().contiguous()
    if x.numel() and not x.data_ptr():  # never read from a tensor without storage (a wrapper subclass)
        raise TypeError(f"cannot digest the leaf {path}: a {type(value).__name__} without its own storage")
    if x.numel():
        # the bytes in place, without numpy (not a dependency); x stays alive while they are read
        h.update((ctypes.c_char * (x.numel() * x.element_size())).from_address(x.data_ptr()))
    return h.hexdigest()


def _check_digest(state_dict: dict[str, Any], paths: list[str]) -> None:
    """``CheckpointError`` unless the dict's digest matches its leaves; a warning when it has none."""
    if "digest" not in state_dict:
        warnings.warn(
            "checkpoint has no digest (written by an older functopk, or built by hand): "
            "its contents are loaded unverified; save it again to add one",
            UserWarning,
            stacklevel=4,  # the caller of state_from_dict or load_state
        )
        return
    digest = state_dict["digest"]
    ok = isinstance(digest, dict) and set(digest) == {"algorithm", "leaves"}
    ok = ok and digest["algorithm"] == DIGEST_ALGORITHM and isinstance(digest["leaves"], dict)
    if not ok or list(digest["leaves"]) != paths:
        raise CheckpointError(
            f"checkpoint digest is malformed (expected {{'algorithm': {DIGEST_ALGORITHM!r}, 'leaves': one digest "
            "per leaf, in the leaves' order}): the checkpoint is corrupted"
        )
    leaves = state_dict["leaves"]
    bad = [p for p in paths if _leaf_digest(p, leaves[p]) != digest["leaves"][p]]
    if bad:
        raise CheckpointError(
            f"checkpoint is corrupted: the contents of {len(bad)} leaves differ from the digest written with "
            f"them: {listed(bad, _MAX_LISTED)} (a dict edited on purpose must have its 'digest' entry removed)"
        )


def value_digest(path: str, value: Any) -> str:
    """The SHA-256 digest a checkpoint keeps for one value at ``path`` (as for each leaf in :func:`state_to_dict`).

    A tensor's dtype, shape and bytes; any other value's type and ``repr``
    (exact for Python numbers, strings, tuples and lists of them). Read on the
    host: for checkpoints, never in an update. :class:`functopk.TorchOptimizer`
    guards its ``param_groups`` with it.

    Example:
        >>> import torch
        >>> value_digest("lr", 0.1) == value_digest("lr", 0.1), value_digest("lr", 0.1) == value_digest("lr", 0.2)
        (True, False)
        >>> value_digest("lr", torch.tensor(0.1)) == value_digest("lr", 0.1)
        False
    """
    return _leaf_digest(path, value)


_EOCD = b"PK\x05\x06"  # the signature of a zip archive's end record (22 bytes, then the comment)
_SEAL = b"functopk-sha256:"
_SEAL_SIZE = len(_SEAL) + 64  # the comment: the marker and the hex digest


def _hash_prefix(fh: IO[bytes], size: int) -> str:
    """SHA-256 of the first ``size`` bytes of ``fh``, read in 1 MiB chunks (the position is left after them)."""
    h = hashlib.sha256()
    fh.seek(0)
    while size > 0:
        chunk = fh.read(min(size, 1 << 20))
        if not chunk:
            break
        h.update(chunk)
        size -= len(chunk)
    return h.hexdigest()


def _seal_(fh: IO[bytes]) -> None:
    """Give the zip ``torch.save`` just wrote to ``fh`` a comment holding the SHA-256 of all bytes before it."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(size - 22)
    if fh.read(22)[:4] != _EOCD:
        raise RuntimeError("torch.save wrote a file without a zip end record at its end: cannot seal it")
    fh.seek(size - 2)  # the end record's comment length, 0 as torch writes it
    fh.write(_SEAL_SIZE.to_bytes(2, "little"))
    digest = _hash_prefix(fh, size)
    fh.write(_SEAL + digest.encode())


def _check_seal(fh: IO[bytes], name: str) -> bool:
    """Whether ``fh`` is sealed by :func:`_seal_`; ``CheckpointError`` if its seal or its bytes are damaged."""
    size = fh.seek(0, os.SEEK_END)
    start = max(0, size - 22 - _SEAL_SIZE)
    fh.seek(start)
    tail = fh.read()
    at = tail.rfind(_EOCD)
    if at < 0:  # no end record: not a zip archive, torch.load says what is wrong
        return False
    comment_size = int.from_bytes(tail[at + 20 : at + 22], "little")
    if comment_size == 0 and start + at == size - 22:  # as torch.save writes it: not sealed
        return False
    comment = tail[at + 22 :]
    if comment_size != _SEAL_SIZE or len(comment) != _SEAL_SIZE or not comment.startswith(_SEAL):
        raise CheckpointError(
            f"cannot read a checkpoint from {name!r}: the file is truncated or corrupted (its zip end record "
            "does not match the digest written after it)"
        )
    if _hash_prefix(fh, size - _SEAL_SIZE) != comment[len(_SEAL) :].decode("ascii", errors="replace"):
        raise CheckpointError(
            f"cannot read a checkpoint from {name!r}: the file is corrupted (its bytes differ from the SHA-256 "
            "digest saved with them)"
        )
    return True


def state_to_dict(state: PyTree) -> dict[str, Any]:
    """A plain dict describing ``state``, for ``torch.save``.

    The tensors in the result are the state's own tensors, detached (no copy);
    functopk never changes a state in place, so this is safe. Leaves may be
    tensors or Python ``bool``/``int``/``float``; ``None`` nodes are kept in the
    structure.

    The result also holds a SHA-256 digest of every leaf, which
    :func:`state_from_dict` checks: computing it reads every tensor on the host
    (see the module's docstring for its cost).

    Args:
        state: A tree of tensors, e.g. ``tx.init(params)`` or a later state.

    Returns:
        ``{"format", "version", "structure", "leaves", "digest"}`` with ``leaves`` an
        ordered dict from readable leaf paths (``"[1].trace['w']"``) to values, and
        ``digest`` ``{"algorithm": "sha256", "leaves": {path: hex digest}}``.

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
    digest = {"algorithm": DIGEST_ALGORITHM, "leaves": {p: _leaf_digest(p, v) for p, v in out.items()}}
    return {"format": FORMAT, "version": VERSION, "structure": str(treedef), "leaves": out, "digest": digest}


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _structure_mismatch(saved: list[str], paths: list[str], saved_structure: Any, treedef: optree.PyTreeSpec) -> str:
    """Where the saved leaves first differ from the template's (not both structures in full)."""
    first = next((i for i, (a, b) in enumerate(zip(saved, paths)) if a != b), min(len(saved), len(paths)))
    head = "checkpoint structure does not match the current state: "
    if first < len(paths) and sorted(saved) == sorted(paths):  # every leaf is there, in another order
        where = f"its leaf {first} is {saved[first]}, the current state's is {paths[first]}"
        if saved_structure == str(treedef):
            return (head + f"the checkpoint has the same leaves in another order ({where}): its 'leaves' dict was "
                    "reordered after state_to_dict made it; put them back in the order state_to_dict lists them")
        return (head + f"the checkpoint has the same leaves in another order ({where}), because its containers "
                f"order their entries otherwise: saved {_short(str(saved_structure))}, expected {_short(str(treedef))}")
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
    return head + "; ".join(detail)


def state_from_dict(template: PyTree, state_dict: dict[str, Any]) -> PyTree:
    """The state saved in ``state_dict``, checked against ``template``.

    ``template`` gives the expected structure (NamedTuple types, dict keys),
    and each leaf's shape and dtype; ``tx.init(params)`` is the usual template.
    Loaded tensors are moved to the device of the corresponding template leaf
    (they may share memory with ``state_dict``'s tensors). Pure: neither
    argument is changed, so on error the caller's current state is untouched.
    The leaves are checked against the dict's digest (see :func:`state_to_dict`);
    a dict without one (written by an older functopk) loads unverified, with a
    ``UserWarning``.

    Args:
        template: A state of the expected structure.
        state_dict: A dict made by :func:`state_to_dict` (possibly after
            ``torch.save`` / ``torch.load``).

    Returns:
        A new state with ``template``'s structure and the saved values.

    Raises:
        CheckpointError: ``state_dict`` is not a functopk state dict, or its
            structure, a leaf's shape, dtype or type differs from ``template``'s,
            or a leaf differs from its digest (a corrupted checkpoint); the
            message names the leaf.

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
    return _from_dict(template, state_dict, verify=True)


def _from_dict(template: PyTree, state_dict: dict[str, Any], *, verify: bool) -> PyTree:
    """:func:`state_from_dict`; ``verify=False`` skips the leaves' digests (a sealed file's bytes were checked)."""
    what = f"state_dict is not a functopk state dict (keys format={FORMAT!r}, version, structure, leaves, digest): it"
    check_keys(state_dict, _KEYS, ("digest",), name=what, error=CheckpointError, type_error=CheckpointError)
    if state_dict["format"] != FORMAT:
        raise CheckpointError(f"{what} has format {state_dict['format']!r}")
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
        check_saved(got, want, f"checkpoint leaf {path}", error=CheckpointError, type_error=CheckpointError)
        new_leaves.append(got.to(want.device) if isinstance(got, torch.Tensor) else got)
    if verify:
        _check_digest(state_dict, paths)
    return optree.tree_unflatten(treedef, new_leaves)


def save_state(f: FileLike, state: PyTree) -> None:
    """``torch.save(state_to_dict(state), f)``; a path is written atomically.

    A path is written to a temporary file in the same directory, then renamed,
    so a crash mid-write never leaves a truncated checkpoint under ``f``
    (:func:`functopk.files.write_atomically`). As with ``torch.save``, an
    existing file keeps its mode (a new one gets ``0666`` less the umask), and
    a symbolic link such as ``latest.pt -> step-100.pt`` stays a link: its
    target is replaced, in the target's folder; a device or a pipe is written
    in place.

    The file is sealed: a SHA-256 of all its bytes is written in the zip
    archive's comment (``torch.load`` reads the file as usual), and
    :func:`load_state` and :func:`read_state_dict` check it, so that a change
    to any byte raises :class:`CheckpointError`. The digests (the leaves' and
    the file's) cost about 0.35 s per 100 MB of state; see the module's
    docstring.

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
        buffer = io.BytesIO()  # sealing reads the bytes back, which f may not allow
        torch.save(sd, buffer)
        _seal_(buffer)
        f.write(buffer.getbuffer())
        return

    def write(fh: IO[bytes]) -> None:
        torch.save(sd, fh)
        _seal_(fh)

    write_atomically(f, write)


def read_state_dict(f: FileLike) -> dict[str, Any]:
    """``torch.load(f, map_location="cpu", weights_only=True)``, with unreadable files as :class:`CheckpointError`.

    Use it to read any checkpoint written with ``torch.save`` (e.g. a
    :class:`functopk.TorchOptimizer` state dict). A file sealed by
    :func:`save_state` is checked against its digest first, and any damage
    raises :class:`CheckpointError`. A missing file still raises ``FileNotFoundError``.

    Example:
        >>> import io, torch, functopk as ft
        >>> from functopk.checkpoint import read_state_dict
        >>> read_state_dict(io.BytesIO(b"PK\x03\x04 cut short"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        functopk.checkpoint.CheckpointError: cannot read a checkpoint from 'BytesIO': the file is truncated, ...
    """
    return _read(f)[0]


def _read(f: FileLike) -> tuple[dict[str, Any], bool]:
    """:func:`read_state_dict`, and whether the file was sealed (its digest then matched)."""
    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else type(f).__name__
    source: Any = f
    try:
        if isinstance(f, (str, os.PathLike)):
            with open(f, "rb") as fh:
                sealed = _check_seal(fh, name)
        else:  # read once, from where f is, for both the seal and torch.load
            source = io.BytesIO(f.read())
            sealed = _check_seal(source, name)
            source.seek(0)
        return torch.load(source, map_location="cpu", weights_only=True), sealed
    except (FileNotFoundError, CheckpointError):
        raise
    except Exception as e:  # anything torch.load's unpickler meets in a damaged file (KeyError, ...)
        raise CheckpointError(
            f"cannot read a checkpoint from {name!r}: the file is truncated, corrupted or not written by "
            f"torch.save ({type(e).__name__}: {_short(str(e), 200)})"
        ) from e


def load_state(f: FileLike, template: PyTree) -> PyTree:
    """Read a state written by :func:`save_state`, checked against ``template``.

    Checks the file's seal (see :func:`save_state`), reads it with
    ``torch.load(weights_only=True)`` onto the CPU, then moves each tensor to the
    device of its template leaf. A file without a seal (written by ``torch.save``
    or an older functopk) is checked with the digests of its leaves, if it has them.

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
    state_dict, sealed = _read(f)
    return _from_dict(template, state_dict, verify=not sealed)
