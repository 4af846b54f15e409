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

Building: ``$CC`` (default ``cc``) compiles the source into a shared library
under ``$XDG_CACHE_HOME/functopk`` (default ``~/.cache/functopk``; the
``FUNCTOPK_CACHE_DIR`` environment variable overrides it), named by a hash of
the source and the command, loaded with :mod:`ctypes` (which releases the GIL
during the call). No Python package beyond torch is needed. Where there is no
compiler, the build fails or the platform is Windows, :func:`library` returns
``None`` and the ATen scan runs: the same result, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from functopk.sparse.kernels.base import INT_OF

__all__ = ["build_error", "has_fast", "library", "scan_leaf", "threshold_bits"]

_SOURCE = r"""
#include <stdint.h>
/* (U)(t - a) has its top bit set iff a > t, for a, t below the top bit: plain integer arithmetic.
   IN: top bit set iff t < a <= h. */
#define IN(U, a, t, h) ((U)((U)((t) - (a)) & (U)~(U)((h) - (a))))
#define ABOVE(U, W, a, t, h) (IN(U, a, t, h) >> ((W) - 1))

/* Portable: blocks of 32 tested branch-free (vectorised by the compiler); in a block with a candidate,
   every value is written and the output advances by the test's result. */
#define PORTABLE(NAME, U, W, MASK)                                                                \
static int64_t NAME(const U *x, int64_t n, U t, U h, int64_t base, int64_t *idx, U *val,         \
                    int64_t cap, int64_t *done) {                                                 \
    int64_t c = 0, i = 0;                                                                         \
    for (; i + 32 <= n && cap - c >= 32; i += 32) {                                               \
        U acc = 0;                                                                                \
        for (int j = 0; j < 32; j++) acc |= IN(U, (U)(x[i + j] & MASK), t, h);                    \
        if (acc >> ((W) - 1)) {                                                                   \
            for (int j = 0; j < 32; j++) {                                                        \
                U v = x[i + j];                                                                   \
                idx[c] = base + i + j;                                                            \
                val[c] = v;                                                                       \
                c += ABOVE(U, W, (U)(v & MASK), t, h);                                            \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (; i < n && c < cap; i++) {                                                               \
        U v = x[i];                                                                               \
        if (ABOVE(U, W, (U)(v & MASK), t, h)) { idx[c] = base + i; val[c] = v; c++; }             \
    }                                                                                             \
    *done = i;                                                                                    \
    return c;                                                                                     \
}
PORTABLE(scan16, uint16_t, 16, 0x7fffu)
PORTABLE(scan32, uint32_t, 32, 0x7fffffffu)
PORTABLE(scan64, uint64_t, 64, 0x7fffffffffffffffull)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,popcnt")))
/* One bit per value of x[0:64], set for a candidate: the sign bits of t - a, gathered by movemask. */
AVX2 static inline uint64_t bits32(const uint32_t *x, uint32_t t, uint32_t h) {
    const __m256i vt = _mm256_set1_epi32((int)t), vh = _mm256_set1_epi32((int)h), vm = _mm256_set1_epi32(0x7fffffff);
    uint64_t bits = 0;
    for (int s = 0; s < 8; s++) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 8 * s)), vm);
        __m256i d = _mm256_andnot_si256(_mm256_sub_epi32(vh, a), _mm256_sub_epi32(vt, a));
        bits |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(d)) << (8 * s);
    }
    return bits;
}
AVX2 static inline uint64_t bits64(const uint64_t *x, uint64_t t, uint64_t h) {
    const __m256i vt = _mm256_set1_epi64x((long long)t), vh = _mm256_set1_epi64x((long long)h);
    const __m256i vm = _mm256_set1_epi64x(0x7fffffffffffffffll);
    uint64_t bits = 0;
    for (int s = 0; s < 16; s++) {
        __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 4 * s)), vm);
        __m256i d = _mm256_andnot_si256(_mm256_sub_epi64(vh, a), _mm256_sub_epi64(vt, a));
        bits |= (uint64_t)(uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(d)) << (4 * s);
    }
    return bits;
}
AVX2 static inline uint64_t bits16(const uint16_t *x, uint16_t t, uint16_t h) {
    const __m256i vt = _mm256_set1_epi16((short)t), vh = _mm256_set1_epi16((short)h), vm = _mm256_set1_epi16(0x7fff);
    uint64_t bits = 0;
    for (int s = 0; s < 2; s++) {
        __m256i a0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 32 * s)), vm);
        __m256i a1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 32 * s + 16)), vm);
        __m256i d0 = _mm256_andnot_si256(_mm256_sub_epi16(vh, a0), _mm256_sub_epi16(vt, a0));
        __m256i d1 = _mm256_andnot_si256(_mm256_sub_epi16(vh, a1), _mm256_sub_epi16(vt, a1));
        /* saturating packs keep the signs; it interleaves 128-bit lanes, the permute restores the order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(d0, d1), 0xD8);
        bits |= (uint64_t)(uint32_t)_mm256_movemask_epi8(p) << (32 * s);
    }
    return bits;
}
/* Blocks of 64 values, no branch for blocks of up to 3 candidates (nearly all of them below a few
   percent): the first three set bits are written unconditionally and the output advances by the count. */
#define FAST(NAME, U, BITS)                                                                       \
AVX2 static int64_t NAME(const U *x, int64_t n, U t, U h, int64_t base, int64_t *idx, U *val,    \
                         int64_t cap, int64_t *done) {                                            \
    int64_t c = 0, i = 0;                                                                         \
    for (; i + 64 <= n && cap - c >= 64; i += 64) {                                               \
        uint64_t b0 = BITS(x + i, t, h), b1 = b0 & (b0 - 1), b2 = b1 & (b1 - 1);                  \
        int j0 = b0 ? __builtin_ctzll(b0) : 0, j1 = b1 ? __builtin_ctzll(b1) : 0;                  \
        int j2 = b2 ? __builtin_ctzll(b2) : 0, p = __builtin_popcountll(b0);                      \
        idx[c] = base + i + j0; val[c] = x[i + j0];                                               \
        idx[c + 1] = base + i + j1; val[c + 1] = x[i + j1];                                       \
        idx[c + 2] = base + i + j2; val[c + 2] = x[i + j2];                                       \
        if (__builtin_expect(p > 3, 0)) {                                                         \
            int64_t cc = c + 3;                                                                   \
            for (uint64_t b = b2 & (b2 - 1); b; b &= b - 1, cc++) {                               \
                int j = __builtin_ctzll(b);                                                       \
                idx[cc] = base + i + j; val[cc] = x[i + j];                                       \
            }                                                                                     \
        }                                                                                         \
        c += p;                                                                                   \
    }                                                                                             \
    *done = i;                                                                                    \
    return c;                                                                                     \
}
FAST(fast16, uint16_t, bits16)
FAST(fast32, uint32_t, bits32)
FAST(fast64, uint64_t, bits64)
#define HAS_FAST 1
#else
#define HAS_FAST 0
#endif

/* Candidates of x[0:n]: values whose bits a without the sign bit have t < a <= h, written as (base + i, x[i]).
   Writes at most cap of them; *done is how many values were read (n unless the output filled up).
   fast: use the AVX2 loop where the CPU has it (0: the portable loop only, for tests). */
#define EXPORT(NAME, U, FASTFN, PORTABLEFN)                                                       \
int64_t NAME(const U *x, int64_t n, U t, U h, int64_t base, int64_t *idx, U *val, int64_t cap,   \
             int64_t *done, int fast) {                                                           \
    int64_t c = 0, i = 0, rest = 0;                                                               \
    if (HAS_FAST && fast && fast_ok()) c = FASTFN(x, n, t, h, base, idx, val, cap, &i);           \
    c += PORTABLEFN(x + i, n - i, t, h, base + i, idx + c, val + c, cap - c, &rest);              \
    *done = i + rest;                                                                             \
    return c;                                                                                     \
}
#if HAS_FAST
static int fast_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
}
EXPORT(ft_scan16, uint16_t, fast16, scan16)
EXPORT(ft_scan32, uint32_t, fast32, scan32)
EXPORT(ft_scan64, uint64_t, fast64, scan64)
#else
static int fast_ok(void) { return 0; }
#define NOFAST(x, n, t, h, base, idx, val, cap, done) 0
EXPORT(ft_scan16, uint16_t, NOFAST, scan16)
EXPORT(ft_scan32, uint32_t, NOFAST, scan32)
EXPORT(ft_scan64, uint64_t, NOFAST, scan64)
#endif
int ft_has_fast(void) { return HAS_FAST && fast_ok(); }
"""

_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99"]

build_error: str | None = None
"""Why :func:`library` returned ``None`` (no compiler, a failed build or load), or ``None``."""


def _cache_dir() -> Path:
    if "FUNCTOPK_CACHE_DIR" in os.environ:
        return Path(os.environ["FUNCTOPK_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "functopk"


def _build(compiler: str) -> Path:
    """The shared library for this source and command, compiled unless it is already cached."""
    # the machine type too: a cache directory shared by different machines (a network home) keeps one per type
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, sys.platform, platform.machine()]).encode())
    target = _cache_dir() / f"scan-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "scan.c", Path(tmp) / "scan.so"
        src.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builds (test workers, ranks) each write a whole file
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled scan (built at the first call, then cached on disk), or ``None`` where it cannot be built.

    Example:
        >>> lib = library()
        >>> lib is None or hasattr(lib, "ft_scan32")
        True
    """
    global build_error
    compiler = os.environ.get("CC") or "cc"
    if sys.platform == "win32" or shutil.which(compiler) is None:
        build_error = f"no C compiler ({compiler!r})" if sys.platform != "win32" else "not built on Windows"
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        build_error = f"{type(exc).__name__}: {exc}"
        return None
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
