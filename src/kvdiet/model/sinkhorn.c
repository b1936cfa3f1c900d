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
 * The lanes past n in the last block hold 1 and are never written back. A last block of fewer than SMALL
 * fp32 matrices (a decode step's one) goes one matrix at a time instead, all its entries in one 16-lane
 * vector (lane 4i + j: entry (i, j)): a line's sums for every lane at once, each lane adding its line's
 * entries in the same order from 0, then one divide; the same IEEE steps on every entry (a 16-matrix block
 * costs as many divides whatever its fill: some 6 µs for one matrix, 20 iterations). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

/* One fp32 matrix at a time (see the top): lane 4i + j holds entry (i, j) of c (hc x hc row-major), the lanes
 * of i or j >= hc hold 1 and are never read by a real lane's sum nor written back. ROW_PICK[t] gives lane
 * (i, j) entry (i, t), COL_PICK[t] entry (t, j): a row's (a column's) t-th addend. */
#define SMALL 4
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
static const i32x16 ROW_PICK[MAX_HC] = {{0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12},
                                        {1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13},
                                        {2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14},
                                        {3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15}};
static const i32x16 COL_PICK[MAX_HC] = {{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3},
                                        {4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7},
                                        {8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11},
                                        {12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15, 12, 13, 14, 15}};

static inline f32x16 pick(f32x16 v, i32x16 lanes) {
#if defined(__GNUC__) && !defined(__clang__)
  return __builtin_shuffle(v, lanes);
#else
  f32x16 r;
  for (int l = 0; l < 16; ++l) r[l] = v[lanes[l] & 15];
  return r;
#endif
}

/* Every line (rows: ROW_PICK, columns: COL_PICK) of one matrix: sum from 0 over t < hc, + eps, divide. */
static inline f32x16 normalise_lines(f32x16 a, const i32x16 *picks, int64_t hc, float eps) {
  f32x16 s = {0};
  for (int64_t t = 0; t < hc; ++t) s = s + pick(a, picks[t]);
  s = s + eps;
  return a / s;
}

static void sinkhorn_small_f32(float *c, int64_t n, int64_t hc, int64_t iters, float eps) {
  const int64_t sq = hc * hc;
  for (int64_t m = 0; m < n; ++m) {
    float *mat = c + m * sq;
    f32x16 a;
    for (int l = 0; l < 16; ++l) a[l] = 1;
    for (int64_t i = 0; i < hc; ++i)
      for (int64_t j = 0; j < hc; ++j) a[i * 4 + j] = mat[i * hc + j] + eps;
    for (int64_t it = 0; it < iters; ++it) {
      if (it > 0) a = normalise_lines(a, ROW_PICK, hc, eps);
      a = normalise_lines(a, COL_PICK, hc, eps);
    }
    for (int64_t i = 0; i < hc; ++i)
      for (int64_t j = 0; j < hc; ++j) mat[i * hc + j] = a[i * 4 + j];
  }
}

/* SMALL_PATH(c, nb, hc, iters, eps): a last block of nb < SMALL matrices one at a time (1), else 0. */
#define SMALL_F32(c, nb, hc, iters, eps) (nb < SMALL ? (sinkhorn_small_f32(c, nb, hc, iters, eps), 1) : 0)
#define SMALL_NONE(c, nb, hc, iters, eps) 0

#define SINKHORN(NAME, LINE, T, SMALL_PATH)                                                \
  NORMALISE_LINE(LINE, T)                                                                  \
  int NAME(T *c, int64_t n, int64_t hc, int64_t iters, T eps) {                            \
    if (hc < 1 || hc > MAX_HC) return -1;                                                  \
    const int64_t sq = hc * hc;                                                            \
    T a[MAX_HC * MAX_HC][BLOCK];                                                           \
    for (int64_t m0 = 0; m0 < n; m0 += BLOCK) {                                            \
      const int64_t nb = n - m0 < BLOCK ? n - m0 : BLOCK;                                  \
      if (SMALL_PATH(c + m0 * sq, nb, hc, iters, eps)) continue;                           \
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

SINKHORN(kvdiet_sinkhorn_f32, line_f32, float, SMALL_F32)
SINKHORN(kvdiet_sinkhorn_f64, line_f64, double, SMALL_NONE)

/* The comb matrices from their logits: softmax over each row, then the normalisation above, in one call. The
 * softmax repeats torch's CPU kernel for rows shorter than a vector (2.x SoftMaxKernel, _vec_softmax_lastdim):
 * m = the row's maximum (left to right; NaN if any is NaN); e = exp(x - m) by the vector exp torch calls
 * (`vexp`: Sleef_expf16_u10 with AVX512 kernels, `lanes` 16; Sleef_expf8_u10 with AVX2, `lanes` 8; its
 * address handed in from torch's own library), a lane per entry, so neighbours never change a result;
 * s = ((e0 + e1) + e2) + ...; r = 1 / s; out = e * r.
 * logits: n matrices, hc x hc row-major each, matrix m at logits + m * stride; comb: n x hc x hc, contiguous.
 * Returns -1 (nothing written) off x86-64 or for hc or lanes it does not take. */
#if defined(__x86_64__)
typedef __m512 (*vexp16_t)(__m512);
typedef __m256 (*vexp8_t)(__m256);
__attribute__((target("avx512f"))) static void vexp16(void *f, float *buf) {
  _mm512_storeu_ps(buf, ((vexp16_t)f)(_mm512_loadu_ps(buf)));
}
__attribute__((target("avx2"))) static void vexp8(void *f, float *buf) {
  _mm256_storeu_ps(buf, ((vexp8_t)f)(_mm256_loadu_ps(buf)));
}
#endif

/* torch's vec::maximum(a, b) in one lane: _mm_max_ps(a, b) (a > b ? a : b), NaN when either is NaN */
static inline float max_or_nan(float a, float b) {
  if (a != a || b != b) return a != a ? a : b;
  return a > b ? a : b;
}

int kvdiet_softmax_sinkhorn_f32(const float *logits, int64_t stride, float *comb, int64_t n, int64_t hc,
                                int64_t iters, float eps, void *vexp, int64_t lanes) {
#if defined(__x86_64__)
  if (hc < 1 || hc > MAX_HC || vexp == 0 || (lanes != 8 && lanes != 16)) return -1;
  const int64_t rows = n * hc, per_call = lanes / hc;
  float buf[16];
  for (int64_t r0 = 0; r0 < rows; r0 += per_call) {
    const int64_t nr = rows - r0 < per_call ? rows - r0 : per_call;
    for (int64_t q = 0; q < 16; ++q) buf[q] = 0;
    for (int64_t k = 0; k < nr; ++k) {
      const int64_t r = r0 + k;
      const float *row = logits + (r / hc) * stride + (r % hc) * hc;
      float m = row[0];
      for (int64_t j = 1; j < hc; ++j) m = max_or_nan(m, row[j]);
      for (int64_t j = 0; j < hc; ++j) buf[k * hc + j] = row[j] - m;
    }
    if (lanes == 16) vexp16(vexp, buf); else vexp8(vexp, buf);
    for (int64_t k = 0; k < nr; ++k) {
      const float *e = buf + k * hc;
      float s = e[0];
      for (int64_t j = 1; j < hc; ++j) s = s + e[j];
      s = 1 / s;
      float *out = comb + (r0 + k) * hc;
      for (int64_t j = 0; j < hc; ++j) out[j] = e[j] * s;
    }
  }
  return kvdiet_sinkhorn_f32(comb, n, hc, iters, eps);
#else
  (void)logits; (void)stride; (void)comb; (void)n; (void)hc; (void)iters; (void)eps; (void)vexp; (void)lanes;
  return -1;
#endif
}

/* torch's sigmoid of n contiguous fp32 values in place (UnaryOpsKernel's sigmoid through cpu_kernel_vec, one
 * thread): the first n - n % (2 lanes) by the vector path 1 / (vexp(0 - a) + 1), the rest by the scalar one
 * 1 / (1 + expf(-a)) (libm's expf, which torch's scalar loop calls). */
static void sigmoid_like_torch(float *a, int64_t n, void *vexp, int64_t lanes) {
#if defined(__x86_64__)
  const int64_t end = n - n % (2 * lanes);
  int64_t i = 0;
  float buf[16];
  for (; i < end; i += lanes) {
    for (int64_t q = 0; q < lanes; ++q) buf[q] = 0.f - a[i + q];
    if (lanes == 16) vexp16(vexp, buf); else vexp8(vexp, buf);
    for (int64_t q = 0; q < lanes; ++q) a[i + q] = 1.f / (buf[q] + 1.f);
  }
  for (; i < n; ++i) a[i] = 1.f / (1.f + expf(-a[i]));
#else
  (void)a; (void)n; (void)vexp; (void)lanes;
#endif
}

int kvdiet_sigmoid_f32(float *a, int64_t n, void *vexp, int64_t lanes) {
#if defined(__x86_64__)
  if (vexp == 0 || (lanes != 8 && lanes != 16)) return -1;
  sigmoid_like_torch(a, n, vexp, lanes);
  return 0;
#else
  (void)a; (void)n; (void)vexp; (void)lanes;
  return -1;
#endif
}

/* All mHC coefficients of t rows from the torch-computed parts (v41-spec 8.1a), in the formula's op order:
 *   r = 1 / sqrtf(mean_sq + rms_eps);  z = ((mixes * r) * scale) + base   (mixes [t, (2+hc)hc], overwritten)
 *   pre = sigmoid(z[:, :hc]) + hc_eps;  post = s + s with s = sigmoid(z[:, hc:2hc]);  each as one contiguous
 *   [t, hc] run, as torch's sigmoid sees it;  comb = kvdiet_softmax_sinkhorn_f32(z[:, 2hc:]).
 * torch's rsqrt is 1 / sqrt on both of its paths, so a scalar one repeats it. */
int kvdiet_hc_mix_f32(float *mixes, const float *mean_sq, const float *scale, const float *base, int64_t t,
                      int64_t hc, float rms_eps, float hc_eps, int64_t iters, float *pre, float *post,
                      float *comb, void *vexp, int64_t lanes) {
  if (hc < 1 || hc > MAX_HC || vexp == 0 || (lanes != 8 && lanes != 16)) return -1;
  const int64_t n_mix = (2 + hc) * hc;
  for (int64_t row = 0; row < t; ++row) {
    float r = mean_sq[row] + rms_eps;
    r = 1.f / sqrtf(r);
    float *z = mixes + row * n_mix;
    for (int64_t k = 0; k < n_mix; ++k) z[k] = z[k] * r;
    for (int64_t k = 0; k < n_mix; ++k) z[k] = z[k] * scale[k];
    for (int64_t k = 0; k < n_mix; ++k) z[k] = z[k] + base[k];
    for (int64_t j = 0; j < hc; ++j) {
      pre[row * hc + j] = z[j];
      post[row * hc + j] = z[hc + j];
    }
  }
  sigmoid_like_torch(pre, t * hc, vexp, lanes);
  for (int64_t k = 0; k < t * hc; ++k) pre[k] = pre[k] + hc_eps;
  sigmoid_like_torch(post, t * hc, vexp, lanes);
  for (int64_t k = 0; k < t * hc; ++k) post[k] = post[k] + post[k];
  return kvdiet_softmax_sinkhorn_f32(mixes + 2 * hc, n_mix, comb, t, hc, iters, hc_eps, vexp, lanes);
}
