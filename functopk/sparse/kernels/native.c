/* functopk's compiled candidate scan, loaded with ctypes by functopk/sparse/kernels/native.py (which
   documents the method). Plain C99 with no headers beyond the C library's and the x86 intrinsics; built with
   -Wall -Wextra and clean under them. */
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
