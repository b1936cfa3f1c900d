// Small products with torch's bits where its BLAS (MKL's sgemm) sums each output as FMA chains: chain_bmm, at::bmm's
// c[b, i, j] = fma(a[b, i, K-1], w[b, K-1, j], ... fma(a[b, i, 0], w[b, 0, j], +0)), k increasing from a +0
// accumulator; chain_mm, at::mm's in MKL's strict reproducible mode, such chains over blocks of k added in order (or,
// MKL's one-row order on an AMD EPYC, four lane sums of rounded products).
// Compiled after rmsnorm_kernels.cpp (its any_nan is in scope) and before hc_kernels.cpp (which uses both) into the
// same module; fp8_kernels.cpp holds the bindings. Built at first use by kvdiet.formats.native.
//
// chain_bmm(a, w, settle_zero, start_negative): a float32 [B, M, K], w float32 [B, K, N] (any strides, B >= 1,
//   1 <= K <= kChainDepthMax) -> float32 [B, M, N] (contiguous, at::bmm's layout), or std::nullopt for any other
//   input or a NaN output (which NaN a chain keeps is the hardware's, not a rule of torch's). settle_zero: each output
//   then has +0 added (c + 0.0f: -0 becomes +0, every other value is kept), the form MKL's Zen code path gives (an AMD
//   EPYC: chains of products that all underflow end at +0 there, where the chain alone gives -0; found by experiment
//   as the rest). start_negative: each chain starts from -0 instead of +0 (its first step is then the first product
//   rounded alone, -0 kept), the form MKL's Zen code path gives for one batch of 1-long chains ([1, 4, 1] x [1, 1,
//   512]: the rounded product).
//   Nothing here says torch's product is such a chain: MKL's order is undocumented, and torch sums products below 400
//   multiply-adds a matrix in a plain loop of rounded products instead. The order was found by experiment (an FMA chain
//   from +0 in increasing k matched at::bmm on every operand tried at the shapes kvdiet uses, ties, subnormals,
//   cancellation, ±0 and ±inf included; products rounded before their sum, a reversed chain, or a chain from the first
//   product did not), so kvdiet.model.chain_products checks every shape class against at::bmm once per process before
//   it calls this.
//   Where both operands hold k contiguously (a's k stride 1, and w's with its n stride not 1: attention's scores
//   q · keysᵀ), the chains run with 16 batches side by side in the vector lanes (AVX-512, at least 16 batches, at
//   most 64 outputs a matrix): each batch's rows of a and of wᵀ transposed into lane vectors, 16 x 16 at a time,
//   the chains summed as above (one fused multiply-add a step), the outputs transposed back; a last partial block
//   reads rows of zeros for its missing batches and stores only its own. Such operands are declined elsewhere
//   (fewer batches, wider matrices, no AVX-512): one output at a time there is slower than at::bmm. MKL sums these
//   as chains too from 3 rows of a up; at 1 and 2 rows (v4.1-micro's 2 heads) it does not, which the check finds.
//   Why: a prefill's mHC and attention make some 160 such products a chunk; at::bmm's batched-BLAS call takes
//   21-24 µs on [256, 4, 4] x [256, 4, 64] and [256, 4, 8] x [256, 8, 64] (one thread), this loop 13-19 µs; on the
//   scores of the 40-layer tiny plan (4 heads x 64 dims), [256, 4, 64] x [256, 64, 8], about 100 µs against 38 µs.
// chain_mm(a, w, block): a float32 [M, K], w float32 [K, N] (any strides, 1 <= M <= kChainMmRows, K >= 1, block
//   >= 1) -> float32 [M, N] (contiguous, at::mm's layout), or std::nullopt for any other input, a build without
//   AVX-512 or a NaN output: out[m, n] = P_0 + P_1 + ... (added in order, P_0 as it is), P_b the FMA chain from +0
//   over the k of block b in increasing k; the blocks are block values of k each (the last the rest), except that
//   a K of more than one and at most two blocks splits in halves, the first ceil(K / 2) long. MKL's sgemm in its
//   strict reproducible mode (which importing kvdiet asks for: kvdiet/threads.py) sums a product of a few rows that
//   way on this build's Intel Xeon with block = 384 (found by experiment, as the chains above: [M, K] · [K, N] at
//   M = 1 .. 16, K = 1 .. 16384 and N = 1 .. 40, zeros' signs included), so kvdiet.model.chain_products.product_block
//   checks a shape class against at::mm once per process before its callers use this. The outputs go 16 to a
//   vector; where w holds k contiguously (w = the transpose of a row-major weight [N, K], as the mHC coefficients'
//   fn_t) 16 of its rows are transposed 16 x 16 at a time into those vectors, so the weight is read in place.
//   Why: at::mm of one row by the mHC coefficients' [1024, 24] takes some 6.5 µs hot in MKL's strict mode (80 such
//   a v4.1-mini decode step, 17 µs each there); the chains take about 2.
//   block = kFourLanes (-4) takes the four-lane form instead (four_lanes): each product rounded, then added to one of
//   four lane sums from +0 (k = 0 and k = 1, 5, 9, ... to lane 0, k = 2, 6, ... to lane 1, and so on up to
//   k = 4q), the lanes summed as (0 + 2) + (1 + 3), then the last (K - 1) mod 4 products added in order: MKL's order
//   for one row by a transposed weight on an AMD EPYC (Zen 4), where its strict mode takes a generic path of 4-float
//   vectors (found by experiment as the chains; kvdiet.model.chain_products.FOUR_LANES). Only where a and w both
//   hold k contiguously, the layout that order was found for (std::nullopt for any other): w's rows read in place,
//   four outputs a vector.

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChainDepthMax = 64;
constexpr int64_t kChainRows = 4;  // rows of a sharing each load of w
constexpr int64_t kBatchOutputs = 64;  // batch-lane products: the most outputs a matrix (M·N)
constexpr int64_t kBatchRows = 64 * kChainDepthMax;  // and the most lane vectors of a task's scratch ((M + N)·K)

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
inline ChainVec chain_start(float zero) { return KVDIET_CHAIN_PS(set1)(zero); }
inline ChainVec chain_load(const float* p) { return KVDIET_CHAIN_PS(loadu)(p); }
inline ChainVec chain_fma(float s, ChainVec w, ChainVec acc) {
  return KVDIET_CHAIN_PS(fmadd)(KVDIET_CHAIN_PS(set1)(s), w, acc);
}
inline void chain_store(float* p, ChainVec v) { KVDIET_CHAIN_PS(storeu)(p, v); }
// v + 0 in each lane: -0 becomes +0 (round to nearest), every other value is kept; the build keeps it (no
// -ffast-math or -fno-signed-zeros)
inline ChainVec chain_settle(ChainVec v) { return KVDIET_CHAIN_PS(add)(v, KVDIET_CHAIN_PS(setzero)()); }
inline ChainVec chain_fma_vec(ChainVec s, ChainVec w, ChainVec acc) { return KVDIET_CHAIN_PS(fmadd)(s, w, acc); }
#define KVDIET_CHAIN_SET1(x) KVDIET_CHAIN_PS(set1)(x)
#else
constexpr int64_t kChainLanes = 1;
typedef float ChainVec;
inline ChainVec chain_start(float zero) { return zero; }
inline ChainVec chain_load(const float* p) { return *p; }
inline ChainVec chain_fma(float s, ChainVec w, ChainVec acc) { return std::fma(s, w, acc); }
inline void chain_store(float* p, ChainVec v) { *p = v; }
inline ChainVec chain_settle(ChainVec v) { return v + 0.0f; }
inline ChainVec chain_fma_vec(ChainVec s, ChainVec w, ChainVec acc) { return std::fma(s, w, acc); }
#define KVDIET_CHAIN_SET1(x) (x)
#endif

// A fixed depth's vector part of kChainRows rows: their a values broadcast once, then each lane block of w's rows
// (contiguous) loaded once for all of them; the k loop unrolled (the same chain, step by step)
template <int64_t kDepth>
void chain_rows_fixed(const float* a, int64_t a_row, int64_t a_col, const float* w, int64_t w_row, float* out,
                      int64_t n, int64_t vec_n, float zero, bool settle_zero) {
  ChainVec av[kChainRows][kDepth];
  for (int64_t r = 0; r < kChainRows; ++r)
    for (int64_t k = 0; k < kDepth; ++k) av[r][k] = KVDIET_CHAIN_SET1(a[r * a_row + k * a_col]);
  for (int64_t j = 0; j < vec_n; j += kChainLanes) {
    ChainVec acc[kChainRows];
    for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_start(zero);
    for (int64_t k = 0; k < kDepth; ++k) {
      const ChainVec wk = chain_load(w + k * w_row + j);
      for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_fma_vec(av[r][k], wk, acc[r]);
    }
    for (int64_t r = 0; r < kChainRows; ++r) chain_store(out + r * n + j, settle_zero ? chain_settle(acc[r]) : acc[r]);
  }
}

// out [M, N] of one batch: each output a chain from `zero` (+0, or -0) over k, rows in groups of kChainRows sharing
// each vector of w's row k (contiguous rows of w; a fixed-depth copy of the loop for depths 1-4 and 8), the tail
// lanes and other layouts one output at a time; settle_zero: +0 then added to each output before it is stored
void chain_matrix(const float* a, int64_t a_row, int64_t a_col, const float* w, int64_t w_row, int64_t w_col,
                  float* out, int64_t m, int64_t depth, int64_t n, float zero, bool settle_zero) {
  const int64_t vec_n = w_col == 1 ? n / kChainLanes * kChainLanes : 0;
  for (int64_t i0 = 0; i0 < m; i0 += kChainRows) {
    const int64_t rows = std::min(kChainRows, m - i0);
    const float* ai = a + i0 * a_row;
    float* oi = out + i0 * n;
    bool fixed = rows == kChainRows && vec_n > 0;
    if (fixed) switch (depth) {
        case 1: chain_rows_fixed<1>(ai, a_row, a_col, w, w_row, oi, n, vec_n, zero, settle_zero); break;
        case 2: chain_rows_fixed<2>(ai, a_row, a_col, w, w_row, oi, n, vec_n, zero, settle_zero); break;
        case 3: chain_rows_fixed<3>(ai, a_row, a_col, w, w_row, oi, n, vec_n, zero, settle_zero); break;
        case 4: chain_rows_fixed<4>(ai, a_row, a_col, w, w_row, oi, n, vec_n, zero, settle_zero); break;
        case 8: chain_rows_fixed<8>(ai, a_row, a_col, w, w_row, oi, n, vec_n, zero, settle_zero); break;
        default: fixed = false;
      }
    for (int64_t j = fixed ? vec_n : 0; j < vec_n; j += kChainLanes) {
      ChainVec acc[kChainRows];
      for (int64_t r = 0; r < kChainRows; ++r) acc[r] = chain_start(zero);
      for (int64_t k = 0; k < depth; ++k) {
        const ChainVec wk = chain_load(w + k * w_row + j);
        for (int64_t r = 0; r < rows; ++r) acc[r] = chain_fma(ai[r * a_row + k * a_col], wk, acc[r]);
      }
      for (int64_t r = 0; r < rows; ++r) chain_store(oi + r * n + j, settle_zero ? chain_settle(acc[r]) : acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = vec_n; j < n; ++j) {
        float acc = zero;
        for (int64_t k = 0; k < depth; ++k) acc = std::fma(ai[r * a_row + k * a_col], w[k * w_row + j * w_col], acc);
        oi[r * n + j] = settle_zero ? acc + 0.0f : acc;
      }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kBatchLanes = 16;  // batches side by side in one vector (batch-lane products)

// Rows rows[0..16) of `depth` floats (each contiguous) as depth vectors whose lane l holds rows[l][k]: 16 x 16
// transposes of 16-float chunks (transpose16, index_kernels.cpp), a last partial chunk read through a mask.
inline void lanes_of_rows(const float* const* rows, int64_t depth, __m512* out) {
  for (int64_t k0 = 0; k0 < depth; k0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, depth - k0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
    u32x16 r[16];
    for (int l = 0; l < 16; ++l) r[l] = reinterpret_cast<u32x16>(_mm512_maskz_loadu_ps(mask, rows[l] + k0));
    transpose16(r);
    for (int64_t c = 0; c < cnt; ++c) out[k0 + c] = reinterpret_cast<__m512>(r[c]);
  }
}

// Outputs i0 .. i0+MI x j0 .. j0+NJ of 16 batches: each lane its batch's chain from `zero` over k, one fused
// multiply-add a step (the rows of a and the columns of w as lane vectors, at[i][k] and wt[j][k]), into tile
// [i·n + j][16].
template <int MI, int NJ>
void batch_lane_block(const __m512* at, const __m512* wt, int64_t depth, int64_t i0, int64_t j0, int64_t n,
                      float zero, __m512* tile) {
  __m512 acc[MI][NJ];
  for (int i = 0; i < MI; ++i)
    for (int j = 0; j < NJ; ++j) acc[i][j] = _mm512_set1_ps(zero);
  for (int64_t k = 0; k < depth; ++k) {
    __m512 wk[NJ];
    for (int j = 0; j < NJ; ++j) wk[j] = wt[(j0 + j) * depth + k];
    for (int i = 0; i < MI; ++i) {
      const __m512 ak = at[(i0 + i) * depth + k];
      for (int j = 0; j < NJ; ++j) acc[i][j] = _mm512_fmadd_ps(ak, wk[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MI; ++i)
    for (int j = 0; j < NJ; ++j) tile[(i0 + i) * n + j0 + j] = acc[i][j];
}

template <int MI>
void batch_lane_row(const __m512* at, const __m512* wt, int64_t depth, int64_t i0, int64_t n, float zero,
                    __m512* tile) {
  int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) batch_lane_block<MI, 4>(at, wt, depth, i0, j0, n, zero, tile);
  switch (n - j0) {
    case 3: batch_lane_block<MI, 3>(at, wt, depth, i0, j0, n, zero, tile); break;
    case 2: batch_lane_block<MI, 2>(at, wt, depth, i0, j0, n, zero, tile); break;
    case 1: batch_lane_block<MI, 1>(at, wt, depth, i0, j0, n, zero, tile); break;
    default: break;
  }
}

// Batches b0 .. b0+16 (those below `batch`; the rest read a row of zeros and are not stored) of a product whose
// operands both hold k contiguously (a [B, M, K] with a's k stride 1, w [B, K, N] with w's k stride 1: w = kᵀ of
// keys [B, N, K]): the same chains as chain_matrix, with the batches in the vector lanes instead of the outputs.
// at / wt: scratch of M·K and N·K vectors, tile of M·N. settle_zero: +0 added to each output before it is stored.
void chain_batch_lanes(const float* a, int64_t as0, int64_t as1, const float* w, int64_t ws0, int64_t ws2,
                       float* out, int64_t b0, int64_t batch, int64_t m, int64_t depth, int64_t n, __m512* at,
                       __m512* wt, __m512* tile, float zero, bool settle_zero) {
  alignas(64) static const float kZeros[kChainDepthMax] = {};
  const int64_t live = std::min(kBatchLanes, batch - b0);
  const float* rows[16];
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t l = 0; l < 16; ++l) rows[l] = l < live ? a + (b0 + l) * as0 + i * as1 : kZeros;
    lanes_of_rows(rows, depth, at + i * depth);
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t l = 0; l < 16; ++l) rows[l] = l < live ? w + (b0 + l) * ws0 + j * ws2 : kZeros;
    lanes_of_rows(rows, depth, wt + j * depth);
  }
  int64_t i0 = 0;
  for (; i0 + 4 <= m; i0 += 4) batch_lane_row<4>(at, wt, depth, i0, n, zero, tile);
  switch (m - i0) {
    case 3: batch_lane_row<3>(at, wt, depth, i0, n, zero, tile); break;
    case 2: batch_lane_row<2>(at, wt, depth, i0, n, zero, tile); break;
    case 1: batch_lane_row<1>(at, wt, depth, i0, n, zero, tile); break;
    default: break;
  }
  // tile [output][lane] back to out [batch][output]: 16 outputs at a time transposed
  const int64_t outputs = m * n;
  for (int64_t o0 = 0; o0 < outputs; o0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, outputs - o0);
    u32x16 r[16];
    for (int64_t c = 0; c < 16; ++c)
      r[c] = c < cnt ? reinterpret_cast<u32x16>(settle_zero ? chain_settle(tile[o0 + c]) : tile[o0 + c]) : u32x16{};
    transpose16(r);
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int64_t l = 0; l < live; ++l)
      _mm512_mask_storeu_ps(out + (b0 + l) * outputs + o0, mask, reinterpret_cast<__m512>(r[l]));
  }
}

constexpr int64_t kChainMmRows = 16;  // chain_mm's most rows of a (a decode step's)
constexpr int64_t kFourLanes = -4;    // chain_mm's block for the four-lane form (four_lanes)

// Outputs n0 .. n0 + 16 (those below n) of rows m0 .. m0 + R of a · w over k = k0 .. k1 - 1: each one FMA chain from
// +0 in increasing k, the 16 outputs in the lanes, into out (row stride n). w's rows k for those outputs come as
// 16 vectors a chunk of 16 k: loaded where w holds n contiguously, transposed from 16 of its columns where it
// holds k contiguously, gathered otherwise.
template <int R>
void chain_mm_lanes(const float* a, int64_t as0, int64_t as1, const float* w, int64_t ws0, int64_t ws1, float* out,
                    int64_t n, int64_t k0, int64_t k1, int64_t m0, int64_t n0) {
  const int64_t live = std::min<int64_t>(16, n - n0);
  const __mmask16 lanes = static_cast<__mmask16>((1u << live) - 1u);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c0 = k0; c0 < k1; c0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, k1 - c0);
    u32x16 wk[16];
    if (ws1 == 1) {
      for (int64_t c = 0; c < cnt; ++c)
        wk[c] = reinterpret_cast<u32x16>(_mm512_maskz_loadu_ps(lanes, w + (c0 + c) * ws0 + n0));
    } else if (ws0 == 1) {
      const __mmask16 ks = static_cast<__mmask16>((1u << cnt) - 1u);
      for (int64_t j = 0; j < 16; ++j)
        wk[j] = j < live ? reinterpret_cast<u32x16>(_mm512_maskz_loadu_ps(ks, w + (n0 + j) * ws1 + c0)) : u32x16{};
      transpose16(wk);
    } else {
      for (int64_t c = 0; c < cnt; ++c) {
        alignas(64) float v[16] = {};
        for (int64_t j = 0; j < live; ++j) v[j] = w[(c0 + c) * ws0 + (n0 + j) * ws1];
        wk[c] = reinterpret_cast<u32x16>(_mm512_load_ps(v));
      }
    }
    for (int64_t c = 0; c < cnt; ++c) {
      const __m512 wv = reinterpret_cast<__m512>(wk[c]);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[(m0 + r) * as0 + (c0 + c) * as1]), wv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * n + n0, lanes, acc[r]);
}

// Outputs n0 .. n0 + 4G - 1 of one row of a · w in the four-lane form (chain_mm's kFourLanes), a and w both holding
// k contiguously (a transposed weight's view, as the mHC coefficients' fn_t; w's rows read in place): each product
// rounded, then added to its lane's sum (k = 0 to lane 0, k = 1 .. 4q to lane (k - 1) mod 4, each lane from +0 in
// increasing k), the lanes summed as (0 + 2) + (1 + 3), then the last (depth - 1) mod 4 products added in order.
// Each four outputs keep their lane sums in one vector (output i in its 128-bit lane i); each 16 values of k are four
// vectors of products (one an output), their 128-bit lanes transposed so that vector b holds every output's products
// 4b .. 4b + 3 of the 16, added in b order, so each lane sum takes its products in increasing k. G groups of four
// outputs go side by side, so their chains of adds overlap.
template <int G>
void four_lanes(const float* a, const float* w, int64_t ws1, float* out, int64_t n, int64_t depth, int64_t n0) {
  const int64_t tail = 1 + (depth - 1) / 4 * 4;
  const float* rows[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) rows[g][i] = w + std::min<int64_t>(n0 + 4 * g + i, n - 1) * ws1;  // past n: repeats
  __m512 sum[G];
  const __m512 x0 = _mm512_set1_ps(a[0]);
  for (int g = 0; g < G; ++g) {  // k = 0 to lane 0 of each output
    const __m512 first = _mm512_set_ps(0, 0, 0, rows[g][3][0], 0, 0, 0, rows[g][2][0], 0, 0, 0, rows[g][1][0], 0, 0,
                                       0, rows[g][0][0]);
    // lane 0 of each output only (an infinite a[0] times the zeros beside it would be NaN)
    sum[g] = _mm512_add_ps(_mm512_setzero_ps(), _mm512_maskz_mul_ps(0x1111, x0, first));
  }
  for (int64_t k = 1; k < tail; k += 16) {
    const int64_t blocks = std::min<int64_t>(16, tail - k) / 4;  // whole blocks of 4 (the last chunk may hold fewer)
    const __mmask16 take = static_cast<__mmask16>((1u << (4 * blocks)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(take, a + k);
    __m512 t[G][4];
    for (int g = 0; g < G; ++g) {
      __m512 p[4];
      for (int i = 0; i < 4; ++i) p[i] = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(take, rows[g][i] + k));
      // 128-bit lanes transposed: t[g][b] lane i = p[i]'s lane b
      const __m512 lo01 = _mm512_shuffle_f32x4(p[0], p[1], 0x44), hi01 = _mm512_shuffle_f32x4(p[0], p[1], 0xEE);
      const __m512 lo23 = _mm512_shuffle_f32x4(p[2], p[3], 0x44), hi23 = _mm512_shuffle_f32x4(p[2], p[3], 0xEE);
      t[g][0] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
      t[g][1] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
      t[g][2] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
      t[g][3] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
    }
    for (int64_t b = 0; b < blocks; ++b)
      for (int g = 0; g < G; ++g) sum[g] = _mm512_add_ps(sum[g], t[g][b]);
  }
  for (int g = 0; g < G; ++g) {
    // (0 + 2) + (1 + 3) within each 128-bit lane
    const __m512 pairs = _mm512_add_ps(sum[g], _mm512_permute_ps(sum[g], 0x4E));
    const __m512 folded = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, folded);
    for (int64_t i = 0; i < 4 && n0 + 4 * g + i < n; ++i) {
      float total = lanes[4 * i];
      for (int64_t k = tail; k < depth; ++k) total = total + a[k] * rows[g][i][k];
      out[n0 + 4 * g + i] = total;
    }
  }
}

// Every output of a [m, ·] · w [·, n] in the four-lane form (four_lanes), into out [m, n] (a's and w's k strides 1)
void four_lanes_run(const float* a, int64_t as0, const float* w, int64_t ws1, float* out, int64_t m, int64_t n,
                    int64_t depth) {
  for (int64_t r = 0; r < m; ++r) {
    int64_t n0 = 0;
    for (; n0 + 8 < n; n0 += 12) four_lanes<3>(a + r * as0, w, ws1, out + r * n, n, depth, n0);
    for (; n0 < n; n0 += 4) four_lanes<1>(a + r * as0, w, ws1, out + r * n, n, depth, n0);
  }
}

// Every output of a [m, ·] · w [·, n] over k = k0 .. k1 - 1, each one chain (chain_mm_lanes), into out [m, n]
void chain_mm_run(const float* a, int64_t as0, int64_t as1, const float* w, int64_t ws0, int64_t ws1, float* out,
                  int64_t m, int64_t n, int64_t k0, int64_t k1) {
  for (int64_t n0 = 0; n0 < n; n0 += 16) {
    int64_t m0 = 0;
    for (; m0 + 4 <= m; m0 += 4) chain_mm_lanes<4>(a, as0, as1, w, ws0, ws1, out, n, k0, k1, m0, n0);
    switch (m - m0) {
      case 3: chain_mm_lanes<3>(a, as0, as1, w, ws0, ws1, out, n, k0, k1, m0, n0); break;
      case 2: chain_mm_lanes<2>(a, as0, as1, w, ws0, ws1, out, n, k0, k1, m0, n0); break;
      case 1: chain_mm_lanes<1>(a, as0, as1, w, ws0, ws1, out, n, k0, k1, m0, n0); break;
      default: break;
    }
  }
}
#endif

}  // namespace

std::optional<at::Tensor> chain_mm(const at::Tensor& a, const at::Tensor& w, int64_t block) {
#if defined(__AVX512F__)
  for (const at::Tensor* t : {&a, &w})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->is_neg() || t->is_conj() || t->dim() != 2)
      return {};
  const int64_t m = a.size(0), depth = a.size(1), n = w.size(1);
  if (m < 1 || m > kChainMmRows || depth < 1 || w.size(0) != depth || (block < 1 && block != kFourLanes)) return {};
  at::Tensor out = at::empty({m, n}, a.options());
  if (n == 0) return out;
  const float* ap = a.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t as0 = a.stride(0), as1 = a.stride(1), ws0 = w.stride(0), ws1 = w.stride(1);
  if (block == kFourLanes) {
    if (as1 != 1 || ws0 != 1) return {};  // the form is MKL's for operands holding k contiguously
    four_lanes_run(ap, as0, wp, ws1, op, m, n, depth);
    if (any_nan(op, out.numel())) return {};
    return out;
  }
  // the blocks' first k: a K of one to two blocks splits in halves (the first the longer), else blocks of `block`
  std::vector<int64_t> starts{0};
  if (depth > block && depth <= 2 * block) {
    starts.push_back((depth + 1) / 2);
  } else {
    for (int64_t k = block; k < depth; k += block) starts.push_back(k);
  }
  starts.push_back(depth);
  const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
  if (blocks == 1) {
    chain_mm_run(ap, as0, as1, wp, ws0, ws1, op, m, n, 0, depth);
  } else {
    // each block's chains into parts [block, m, n], then added in order (on the calling thread: the blocks split
    // over two threads measured no faster in a decode step)
    std::vector<float> parts(blocks * m * n);
    for (int64_t b = 0; b < blocks; ++b)
      chain_mm_run(ap, as0, as1, wp, ws0, ws1, parts.data() + b * m * n, m, n, starts[b], starts[b + 1]);
    for (int64_t i = 0; i < m * n; ++i) {
      float sum = parts[i];
      for (int64_t b = 1; b < blocks; ++b) sum = sum + parts[b * m * n + i];
      op[i] = sum;
    }
  }
  if (any_nan(op, out.numel())) return {};
  return out;
#else
  return {};
#endif
}

#undef KVDIET_CHAIN_SET1
#undef KVDIET_CHAIN_PS

std::optional<at::Tensor> chain_bmm(const at::Tensor& a, const at::Tensor& w, bool settle_zero = false,
                                     bool start_negative = false) {
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
  const float zero = start_negative ? -0.0f : 0.0f;  // each chain's accumulator before its first product
  const int64_t as0 = a.stride(0), as1 = a.stride(1), as2 = a.stride(2);
  const int64_t ws0 = w.stride(0), ws1 = w.stride(1), ws2 = w.stride(2);
  // threads only for work worth waking them: some 2^20 multiply-adds a thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, m * n * depth));
  // both operands hold k contiguously (q · keysᵀ): 16 batches a vector where that path takes them, else declined
  const bool keys_layout = as2 == 1 && ws1 == 1 && ws2 != 1;
#if defined(__AVX512F__)
  if (keys_layout && batch >= kBatchLanes && m * n <= kBatchOutputs && (m + n) * depth <= kBatchRows) {
    const int64_t blocks = (batch + kBatchLanes - 1) / kBatchLanes;
    at::parallel_for(0, blocks, std::max<int64_t>(1, grain / kBatchLanes), [&](int64_t k0, int64_t k1) {
      std::vector<__m512> scratch((m + n) * depth + m * n);
      for (int64_t blk = k0; blk < k1; ++blk)
        chain_batch_lanes(ap, as0, as1, wp, ws0, ws2, op, blk * kBatchLanes, batch, m, depth, n, scratch.data(),
                          scratch.data() + m * depth, scratch.data() + (m + n) * depth, zero, settle_zero);
    });
    if (any_nan(op, out.numel())) return {};
    return out;
  }
#endif
  if (keys_layout) return {};
  at::parallel_for(0, batch, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      chain_matrix(ap + b * as0, as1, as2, wp + b * ws0, ws1, ws2, op + b * m * n, m, depth, n, zero,
                   settle_zero);
  });
  if (any_nan(op, out.numel())) return {};
  return out;
}
