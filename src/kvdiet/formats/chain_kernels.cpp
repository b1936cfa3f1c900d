// Batched products of small operands with at::bmm's bits where its BLAS (MKL's sgemm) sums each output as one FMA
// chain: c[b, i, j] = fma(a[b, i, K-1], w[b, K-1, j], ... fma(a[b, i, 0], w[b, 0, j], +0)), k increasing from a +0
// accumulator. Compiled after rmsnorm_kernels.cpp (its any_nan is in scope) and before hc_kernels.cpp (which uses
// chain_bmm) into the same module; fp8_kernels.cpp holds the bindings. Built at first use by kvdiet.formats.native.
//
// chain_bmm(a, w): a float32 [B, M, K], w float32 [B, K, N] (any strides, B >= 1, 1 <= K <= kChainDepthMax)
//   -> float32 [B, M, N] (contiguous, at::bmm's layout), or std::nullopt for any other input or a NaN output
//   (which NaN a chain keeps is the hardware's, not a rule of torch's). Nothing here says torch's product is such
//   a chain: MKL's order is undocumented, and torch sums products below 400 multiply-adds a matrix in a plain loop
//   of rounded products instead. The order was found by experiment (an FMA chain from +0 in increasing k matched
//   at::bmm on every operand tried at the shapes kvdiet uses, ties, subnormals, cancellation, ±0 and ±inf included;
//   products rounded before their sum, a reversed chain, or a chain from the first product did not), so
//   kvdiet.model.chain_products checks every shape class against at::bmm once per process before it calls this.
//   Why: a prefill's mHC and attention make some 160 such products a chunk; at::bmm's batched-BLAS call takes
//   21-24 µs on [256, 4, 4] x [256, 4, 64] and [256, 4, 8] x [256, 8, 64] (one thread), this loop 13-19 µs.

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChainDepthMax = 64;
constexpr int64_t kChainRows = 4;  // rows of a sharing each load of w

// Lanes of separate outputs, each its own chain: one IEEE fused multiply-add per lane and step, as std::fma
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
constexpr int64_t kChainLanes = 16;
typedef __m512 ChainVec;
#define KVDIET_CHAIN_PS(op) _mm512_##op##_ps
#else
constexpr int64_t kChainLanes = 8;
typedef __m256 ChainVec;
#define KVDIET_CHAIN_PS(op) _mm256_##op##_ps
#endif
inline ChainVec chain_zero() { return KVDIET_CHAIN_PS(setzero)(); }
inline ChainVec chain_load(const float* p) { return KVDIET_CHAIN_PS(loadu)(p); }
inline ChainVec chain_fma(float s, ChainVec w, ChainVec acc) {
  return KVDIET_CHAIN_PS(fmadd)(KVDIET_CHAIN_PS(set1)(s), w, acc);
}
inline void chain_store(float* p, ChainVec v) { KVDIET_CHAIN_PS(storeu)(p, v); }
inline ChainVec chain_fma_vec(ChainVec s, ChainVec w, ChainVec acc) { return KVDIET_CHAIN_PS(fmadd)(s, w, acc); }
#define KVDIET_CHAIN_SET1(x) KVDIET_CHAIN_PS(set1)(x)
#else
constexpr int64_t kChainLanes = 1;
typedef float ChainVec;
inline ChainVec chain_zero() { return 0.0f; }
inline ChainVec chain_load(const float* p) { return *p; }
inline ChainVec chain_fma(float s, ChainVec w, ChainVec acc) { return std::fma(s, w, acc); }
inline void chain_store(float* p, ChainVec v) { *p = v; }
inline ChainVec chain_fma_vec(ChainVec s, ChainVec w, ChainVec acc) { return std::fma(s, w, acc); }
#define KVDIET_CHAIN_SET1(x) (x)
#endif

// A fixed depth's vector part of kChainRows rows: their a values broadcast once, then each lane block of w's rows
// (contiguous) loaded once for all of them; the k loop unrolled (the same chain, step by step)
template <int64_t kDepth>
void chain_rows_fixed(const float* a, int64_t a_row, int64_t a_col, const float* w, int64_t w_row, float* out,
                      int64_t n, int64_t vec_n) {
  ChainVec av[kChainRows][kDepth];
  for (int64_t r = 0; r < kChainRows; ++r)
    for (int64_t k = 0; k < kDepth; ++k) av[r][k] = KVDIET_CHAIN_SET1(a[r * a_row + k * a_col]);
  for (int64_t j = 0; j < vec_n; j += kChainLanes) {
    ChainVec acc[kChainRows];
    for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_zero();
    for (int64_t k = 0; k < kDepth; ++k) {
      const ChainVec wk = chain_load(w + k * w_row + j);
      for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_fma_vec(av[r][k], wk, acc[r]);
    }
    for (int64_t r = 0; r < kChainRows; ++r) chain_store(out + r * n + j, acc[r]);
  }
}

// out [M, N] of one batch: each output a chain from +0 over k, rows in groups of kChainRows sharing each vector
// of w's row k (contiguous rows of w; a fixed-depth copy of the loop for depths 1-4 and 8), the tail lanes and other
// layouts one output at a time
void chain_matrix(const float* a, int64_t a_row, int64_t a_col, const float* w, int64_t w_row, int64_t w_col,
                  float* out, int64_t m, int64_t depth, int64_t n) {
  const int64_t vec_n = w_col == 1 ? n / kChainLanes * kChainLanes : 0;
  for (int64_t i0 = 0; i0 < m; i0 += kChainRows) {
    const int64_t rows = std::min(kChainRows, m - i0);
    const float* ai = a + i0 * a_row;
    float* oi = out + i0 * n;
    bool fixed = rows == kChainRows && vec_n > 0;
    if (fixed) switch (depth) {
        case 1: chain_rows_fixed<1>(ai, a_row, a_col, w, w_row, oi, n, vec_n); break;
        case 2: chain_rows_fixed<2>(ai, a_row, a_col, w, w_row, oi, n, vec_n); break;
        case 3: chain_rows_fixed<3>(ai, a_row, a_col, w, w_row, oi, n, vec_n); break;
        case 4: chain_rows_fixed<4>(ai, a_row, a_col, w, w_row, oi, n, vec_n); break;
        case 8: chain_rows_fixed<8>(ai, a_row, a_col, w, w_row, oi, n, vec_n); break;
        default: fixed = false;
      }
    for (int64_t j = fixed ? vec_n : 0; j < vec_n; j += kChainLanes) {
      ChainVec acc[kChainRows];
      for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_zero();
      for (int64_t k = 0; k < depth; ++k) {
        const ChainVec wk = chain_load(w + k * w_row + j);
        for (int64_t r = 0; r < rows; ++r) acc[r] = chain_fma(ai[r * a_row + k * a_col], wk, acc[r]);
      }
      for (int64_t r = 0; r < rows; ++r) chain_store(oi + r * n + j, acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = vec_n; j < n; ++j) {
        float acc = 0.0f;
        for (int64_t k = 0; k < depth; ++k) acc = std::fma(ai[r * a_row + k * a_col], w[k * w_row + j * w_col], acc);
        oi[r * n + j] = acc;
      }
  }
}

}  // namespace

#undef KVDIET_CHAIN_SET1
#undef KVDIET_CHAIN_PS

std::optional<at::Tensor> chain_bmm(const at::Tensor& a, const at::Tensor& w) {
  for (const at::Tensor* t : {&a, &w})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->is_neg() || t->is_conj() || t->dim() != 3)
      return {};
  const int64_t batch = a.size(0), m = a.size(1), depth = a.size(2), n = w.size(2);
  if (batch < 1 || depth < 1 || depth > kChainDepthMax || w.size(0) != batch || w.size(1) != depth) return {};
  at::Tensor out = at::empty({batch, m, n}, a.options());
  if (out.numel() == 0) return out;
  const float* ap = a.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t as0 = a.stride(0), as1 = a.stride(1), as2 = a.stride(2);
  const int64_t ws0 = w.stride(0), ws1 = w.stride(1), ws2 = w.stride(2);
  // threads only for work worth waking them: some 2^20 multiply-adds a thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, m * n * depth));
  at::parallel_for(0, batch, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      chain_matrix(ap + b * as0, as1, as2, wp + b * ws0, ws1, ws2, op + b * m * n, m, depth, n);
  });
  if (any_nan(op, out.numel())) return {};
  return out;
}
