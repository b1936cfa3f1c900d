/* The mHC Sinkhorn normalisation of n hc x hc matrices (hc <= 4) in place, in one call: the same IEEE fp32
 * (or fp64) steps, in the same order, as the pure-torch path in sinkhorn.py, so the results are
 * bit-identical. Built at first use by kvdiet.model.sinkhorn (plain C, no torch headers), called through
 * ctypes.
 *
 * Per matrix c (row-major, c[i*hc + j]):
 *   c += eps;                                       every entry
 *   columns: c[., j] /= (sum_i c[i, j]) + eps;      then (iters - 1) times:
 *   rows:    c[i, .] /= (sum_j c[i, j]) + eps;      columns again.
 * Sums start at 0 and add i = 0, 1, ... one at a time, as torch's CPU sum over a dim of at most 4 values does.
 * No fast-math and no FMA contraction (-ffp-contract=off): each step rounds as torch's kernels round.
 *
 * Matrices go BLOCK at a time, entry-major (a[entry][matrix]), so every step is one loop over BLOCK
 * matrices that the compiler vectorises (a vector add or divide rounds each lane as the scalar one does).
 * The lanes past n in the last block hold 1 and are never written back. */

#include <float.h>
#include <stdint.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "sinkhorn.c needs float arithmetic evaluated in its own precision (FLT_EVAL_METHOD 0)"
#endif

#define BLOCK 16
#define MAX_HC 4

/* One line (a row: step 1; a column: step hc) of BLOCK matrices: sum from 0, + eps, divide. */
#define NORMALISE_LINE(NAME, T)                                                            \
  static inline void NAME(T a[][BLOCK], int64_t first, int64_t step, int64_t hc, T eps) {  \
    T s[BLOCK];                                                                            \
    for (int64_t b = 0; b < BLOCK; ++b) s[b] = 0;                                          \
    for (int64_t t = 0; t < hc; ++t)                                                       \
      for (int64_t b = 0; b < BLOCK; ++b) s[b] = s[b] + a[first + t * step][b];            \
    for (int64_t b = 0; b < BLOCK; ++b) s[b] = s[b] + eps;                                 \
    for (int64_t t = 0; t < hc; ++t)                                                       \
      for (int64_t b = 0; b < BLOCK; ++b) a[first + t * step][b] = a[first + t * step][b] / s[b]; \
  }

#define SINKHORN(NAME, LINE, T)                                                            \
  NORMALISE_LINE(LINE, T)                                                                  \
  int NAME(T *c, int64_t n, int64_t hc, int64_t iters, T eps) {                            \
    if (hc < 1 || hc > MAX_HC) return -1;                                                  \
    const int64_t sq = hc * hc;                                                            \
    T a[MAX_HC * MAX_HC][BLOCK];                                                           \
    for (int64_t m0 = 0; m0 < n; m0 += BLOCK) {                                            \
      const int64_t nb = n - m0 < BLOCK ? n - m0 : BLOCK;                                  \
      for (int64_t k = 0; k < sq; ++k)                                                     \
        for (int64_t b = 0; b < BLOCK; ++b) a[k][b] = b < nb ? c[(m0 + b) * sq + k] + eps : 1; \
      for (int64_t it = 0; it < iters; ++it) {                                             \
        for (int64_t i = 0; it > 0 && i < hc; ++i) LINE(a, i * hc, 1, hc, eps); /* rows */ \
        for (int64_t j = 0; j < hc; ++j) LINE(a, j, hc, hc, eps);           /* columns */  \
      }                                                                                    \
      for (int64_t k = 0; k < sq; ++k)                                                     \
        for (int64_t b = 0; b < nb; ++b) c[(m0 + b) * sq + k] = a[k][b];                   \
    }                                                                                      \
    return 0;                                                                              \
  }

SINKHORN(kvdiet_sinkhorn_f32, line_f32, float)
SINKHORN(kvdiet_sinkhorn_f64, line_f64, double)
