/* The mHC Sinkhorn normalisation of n hc x hc matrices in place, in one call: the same IEEE fp32 (or fp64)
 * steps, in the same order, as the pure-torch path in sinkhorn.py, so the results are bit-identical.
 * Built at first use by kvdiet.model.sinkhorn (plain C, no torch headers) and called through ctypes.
 *
 * Per matrix c (row-major, c[i*hc + j]):
 *   c += eps;                                       every entry
 *   columns: c[., j] /= (sum_i c[i, j]) + eps;      then (iters - 1) times:
 *   rows:    c[i, .] /= (sum_j c[i, j]) + eps;      columns again.
 * Sums start at 0 and add i = 0, 1, ... one at a time, as torch's CPU sum over a dim of at most 4 values does.
 * No fast-math and no FMA contraction (-ffp-contract=off): each step rounds as torch's kernels round. */

#include <float.h>
#include <stdint.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "sinkhorn.c needs float arithmetic evaluated in its own precision (FLT_EVAL_METHOD 0)"
#endif

#define SINKHORN(NAME, T)                                                     \
  void NAME(T *c, int64_t n, int64_t hc, int64_t iters, T eps) {              \
    const int64_t sq = hc * hc;                                               \
    for (int64_t m = 0; m < n; ++m, c += sq) {                                \
      for (int64_t k = 0; k < sq; ++k) c[k] = c[k] + eps;                     \
      for (int64_t it = 0; it < iters; ++it) {                                \
        if (it > 0) {                                                         \
          for (int64_t i = 0; i < hc; ++i) {                                  \
            T *row = c + i * hc;                                              \
            T s = 0;                                                          \
            for (int64_t j = 0; j < hc; ++j) s = s + row[j];                  \
            s = s + eps;                                                      \
            for (int64_t j = 0; j < hc; ++j) row[j] = row[j] / s;             \
          }                                                                   \
        }                                                                     \
        for (int64_t j = 0; j < hc; ++j) {                                    \
          T s = 0;                                                            \
          for (int64_t i = 0; i < hc; ++i) s = s + c[i * hc + j];             \
          s = s + eps;                                                        \
          for (int64_t i = 0; i < hc; ++i) c[i * hc + j] = c[i * hc + j] / s; \
        }                                                                     \
      }                                                                       \
    }                                                                         \
  }

SINKHORN(kvdiet_sinkhorn_f32, float)
SINKHORN(kvdiet_sinkhorn_f64, double)
