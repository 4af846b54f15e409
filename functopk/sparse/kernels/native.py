"""The compiled candidate scan: one C loop per leaf finds ``|x| > t`` (and NaN) at about memory speed.

The ATen scan (:class:`~functopk.sparse.kernels.scan.Scanner`) needs a
``hardshrink`` pass and a ``nonzero`` over the result, and ATen's CPU ``nonzero``
is not vectorised: around 1% of the coordinates it is half of the selection's
time. This module compiles, at first use, a few lines of C that do both in one
read of each leaf and write the candidates' flat indices and values directly.

How it compares, exactly: for ``t >= 0`` of the leaf's dtype (already rounded
down into it, :func:`~functopk.sparse.kernels.base.round_down`), ``|x| > t`` or
``x`` NaN holds iff the bit pattern of ``x`` without its sign bit, read as an
unsigned integer, is greater than ``t``'s: non-negative floats are ordered like
their bit patterns, NaN patterns lie above ``+inf``'s, and ``-0.0`` becomes
``+0.0``. So the loop never looks at a float: it works for every dtype of a
width (16, 32 or 64 bits) and gives the ATen scan's candidates bit for bit. An
optional upper bound ``|x| <= h`` (bits again) serves the exact selection
among the candidates (:func:`~functopk.sparse.kernels.exact.top_k_of_candidates`).

Two loops, the same output. Where the CPU has AVX2 (checked at run time), each
block of 64 values becomes a 64-bit mask of its candidates (subtract, sign bits,
``movemask``); the first three set bits are written unconditionally and the
output advances by the mask's population count, so the blocks without a
candidate and those with up to three (nearly all of them below a few percent)
cost no branch at all: 1-1.2x a read pass up to 1%. Elsewhere, the portable
loop tests blocks of 32 with a branch-free reduction the compiler vectorises
and, in a block with a candidate, writes every value and advances by the test.

Building: the C source is ``native.c`` beside this module (package data), compiled
with ``$CC`` (default ``cc``; arguments allowed, as in ``CC='gcc -O2'``) and
``-O3 -shared -fPIC -std=c99 -Wall -Wextra`` into a private, verified cache
(:mod:`~functopk.sparse.kernels.libcache`: ``~/.cache/functopk`` by default,
``FUNCTOPK_CACHE_DIR`` overrides), built once per machine and loaded with
:mod:`ctypes` (which releases the GIL during the call). No Python package beyond
torch is needed. ``FUNCTOPK_NATIVE=0`` turns the compiled scan off (as
``KernelConfig(native=False)`` does for one config), read at the first use in a
process. Where there is no compiler, the build fails or the platform is Windows,
:func:`library` returns ``None``, warns once (a ``UserWarning`` with the reason)
and the ATen scan runs: the same result, slower. Where the cache folder cannot be
trusted, the library is built in a private temporary folder for this process,
with a warning saying how to fix the folder.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import warnings
from pathlib import Path

import torch

from functopk.sparse.kernels import libcache
from functopk.sparse.kernels.base import INT_OF

__all__ = ["build_error", "enabled", "has_fast", "library", "scan_leaf", "threshold_bits"]

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-Wall", "-Wextra")
ENV = "FUNCTOPK_NATIVE"
_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")

build_error: str | None = None
"""Why :func:`library` returned ``None`` (turned off, no compiler, a failed build or load), or ``None``."""


def enabled() -> bool:
    """Whether the ``FUNCTOPK_NATIVE`` environment variable allows the compiled scan (unset: yes).

    Raises ``ValueError`` for a value other than ``0``/``false``/``no``/``off``
    or ``1``/``true``/``yes``/``on`` (any case).

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"FUNCTOPK_NATIVE": "0"}):
        ...     enabled()
        False
    """
    value = os.environ.get(ENV, "")
    if value.strip().lower() in _OFF:
        return False
    if value.strip().lower() in _ON:
        return True
    raise ValueError(f"{ENV}={value!r}: expected 0 (the ATen scan) or 1 (the compiled scan where it can be "
                     "built, the default)")


def _load() -> ctypes.CDLL:
    """Build or find the library (``libcache.BuildError`` if it cannot be), warning if it was built privately."""
    if sys.platform == "win32":
        raise libcache.BuildError("it is not built on Windows")
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        raise libcache.BuildError(f"its source is missing from the installed package ({exc})") from None
    lib, note = libcache.load(source, "scan", [*libcache.compiler_command(), *FLAGS])
    if note is not None:
        warnings.warn(f"functopk: {note}. Until then, each process compiles the top-k scan again, in a private "
                      "temporary folder.", UserWarning, stacklevel=3)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled scan (built at the first call, then cached on disk), or ``None`` where it cannot be built.

    Example:
        >>> lib = library()
        >>> lib is None or hasattr(lib, "ft_scan32")
        True
    """
    global build_error
    if not enabled():
        build_error = f"turned off by {ENV}={os.environ[ENV]!r}"
        return None
    try:
        lib = _load()
    except libcache.BuildError as exc:
        build_error = str(exc)
        warnings.warn(f"functopk: the compiled top-k scan is unavailable ({exc}); the ATen scan runs instead: the "
                      f"same results, slower. Set {ENV}=0 to choose the ATen scan without this warning.",
                      UserWarning, stacklevel=2)
        return None
    build_error = None
    for width in (16, 32, 64):
        fn = getattr(lib, f"ft_scan{width}")
        u = {16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}[width]
        p = ctypes.c_void_p
        fn.argtypes = [p, ctypes.c_int64, u, u, ctypes.c_int64, p, p, ctypes.c_int64, p, ctypes.c_int]
        fn.restype = ctypes.c_int64
    lib.ft_has_fast.restype = ctypes.c_int
    return lib


def threshold_bits(t: float, leaf_dtype: torch.dtype) -> int:
    """The bit pattern of ``t`` (``t >= 0``, a value of ``leaf_dtype``) as a non-negative int.

    Example:
        >>> threshold_bits(1.0, torch.float32) == 0x3F800000
        True
    """
    return int(torch.tensor(t, dtype=leaf_dtype).view(INT_OF[leaf_dtype]).item())


def has_fast(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` runs its AVX2 loop on this CPU (otherwise the portable loop; both give the same output).

    Example:
        >>> lib = library()
        >>> lib is None or has_fast(lib) in (True, False)
        True
    """
    return bool(lib.ft_has_fast())


def scan_leaf(
    lib: ctypes.CDLL,
    leaf: torch.Tensor,
    t_bits: int,
    base: int,
    out: tuple[torch.Tensor, torch.Tensor],
    used: int = 0,
    room: int | None = None,
    *,
    upper_bits: int | None = None,
    fast: bool = True,
) -> tuple[int, int]:
    """Write the candidates of ``leaf`` (contiguous, 1-d, CPU) into ``out`` from position ``used``, in flat order.

    A candidate's bits without the sign bit are above ``t_bits`` and at most
    ``upper_bits`` (default: no upper bound), both bit patterns of
    non-negative values of the leaf's dtype (:func:`threshold_bits`).

    ``out`` is ``(indices, values)``: int64 flat indices (``base`` being the
    leaf's first) and values in the leaf's dtype, bit for bit. At most ``room``
    (default: all of ``out`` past ``used``) are written; the scan stops there.
    Returns ``(written, read)``: the number of candidates written and of the
    leaf's values read (``leaf.numel()`` unless it stopped). ``fast=False`` runs
    the portable loop even where the AVX2 one could run (the same output).

    Example:
        >>> lib = library()
        >>> out = torch.empty(4, dtype=torch.int64), torch.empty(4)
        >>> leaf = torch.tensor([0.5, -3.0, float("nan"), 1.0])
        >>> lib is None or scan_leaf(lib, leaf, threshold_bits(1.0, torch.float32), 10, out) == (2, 4)
        True
        >>> lib is None or out[0][:2].tolist() == [11, 12]
        True
    """
    idx, vals = out
    room = idx.numel() - used if room is None else room
    width = 8 * leaf.element_size()
    upper_bits = (1 << (width - 1)) - 1 if upper_bits is None else upper_bits
    done = ctypes.c_int64(0)
    fn = getattr(lib, f"ft_scan{width}")
    written = fn(leaf.data_ptr(), leaf.numel(), t_bits, upper_bits, base, idx.data_ptr() + 8 * used,
                 vals.data_ptr() + vals.element_size() * used, room, ctypes.byref(done), int(fast))
    return int(written), done.value
