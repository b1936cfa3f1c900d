// Fused FP4 block codec (fp4_e2m1_e4m3x16 and mxfp4): one pass over each row, bit-identical to the
// pure-torch path in fp4.py / e2m1.py / scales.py. Built at first use by kvdiet.formats.native.
//
// encode: rows x [n, dim] (float32 / bfloat16 / float16, contiguous) -> entries [n, dim/2 + dim/block]
//   per block: amax = max|x| (on the bits), scale by the recipe, q = RNE_e2m1(clamp(x / s, +-6)),
//   two codes per byte (low nibble = even element), then the scale bytes.
//   Returns -1, or the first row holding a non-finite value (nothing is promised about `out` then).
// decode: entries [n, width] (any row stride, unit element stride) -> values [n, dim] float32 / bfloat16.
//   Returns -1, or the first row holding a scale byte outside the recipe's written range.
// Rounding and comparisons are plain IEEE fp32 (no fast-math), as torch's CPU kernels compute them.
// fp8_kernels.cpp follows in the same translation unit and holds the module's bindings.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kE4M3 = 0;   // block 16, E4M3 scale: s = e4m3(clamp(max(amax, 6*2^-9) / 6, 2^-9, 448))
constexpr int kUE8M0 = 1;  // block 32, UE8M0 scale: s = 2^min(ceil(log2(max(amax, 6*2^-126) / 6)), 125)

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) { return float_of(static_cast<uint32_t>(v.x) << 16); }
inline float load(c10::Half v) { return static_cast<float>(v); }

// E4M3 byte -> float32 value, for the scale bytes 0x00..0x7F (higher bytes are never read)
struct E4m3Table {
  float v[128];
  E4m3Table() {
    for (int b = 0; b < 128; ++b) v[b] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(b));
  }
};
const E4m3Table kE4m3;

// RNE fp32 -> E4M3 byte for y in [2^-9, 448], branch-free: c10::detail::fp8e4m3fn_from_fp32_value's arithmetic
inline uint32_t e4m3_byte(float y) {
  uint32_t bits = bits_of(y);
  uint32_t normal = (bits + ((7u - 127u) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  uint32_t subnormal = bits_of(y + 0x1p14f) - (141u << 23);  // y < 2^-6: RNE to a multiple of 2^-9
  return bits < (121u << 23) ? subnormal : normal;
}

// stored scale byte of each block from its amax bits (amax finite)
inline uint32_t scale_byte(int recipe, uint32_t amax_bits) {
  float amax = float_of(amax_bits);
  if (recipe == kE4M3) {
    float y = std::max(amax, 6.0f * 0x1p-9f) / 6.0f;
    return e4m3_byte(std::min(std::max(y, 0x1p-9f), 448.0f));
  }
  float y = std::max(amax, 6.0f * 0x1p-126f) / 6.0f;
  return std::min<uint32_t>((bits_of(y) + 0x7FFFFFu) >> 23, 125 + 127);
}

inline float scale_value(int recipe, uint32_t byte) {
  return recipe == kE4M3 ? kE4m3.v[byte & 127] : float_of(byte << 23);
}

// the first row of [begin, end) (atomically the smallest over threads) recorded in `bad`
inline void note_row(std::atomic<int64_t>& bad, int64_t r) {
  int64_t seen = bad.load();
  while (r < seen && !bad.compare_exchange_weak(seen, r)) {
  }
}

// what a kernel returns: -1 when no row was noted (`bad` still INT64_MAX), else the first noted row
inline int64_t first_noted(const std::atomic<int64_t>& bad) {
  const int64_t first = bad.load();
  return first == INT64_MAX ? -1 : first;
}

template <typename T, int Block>
int64_t encode_rows(const T* x, int64_t n, int64_t dim, uint8_t* out) {
  constexpr int recipe = Block == 16 ? kE4M3 : kUE8M0;
  const int64_t nb = dim / Block, value_bytes = dim / 2, width = value_bytes + nb;
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    std::vector<float> f(dim), s(nb);
    std::vector<uint32_t> amax(nb);
    std::vector<uint8_t> c(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      uint8_t* o = out + r * width;
      for (int64_t i = 0; i < dim; ++i) f[i] = load(xr[i]);
      uint32_t top = 0;
      for (int64_t b = 0; b < nb; ++b) {
        uint32_t m = 0;
        for (int i = 0; i < Block; ++i) m = std::max(m, bits_of(f[b * Block + i]) & 0x7FFFFFFFu);
        amax[b] = m;
        top = std::max(top, m);
      }
      if (top >= 0x7F800000u) {  // +-inf or NaN somewhere in the row
        note_row(bad, r);
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) amax[b] = scale_byte(recipe, amax[b]);
      for (int64_t b = 0; b < nb; ++b) {
        o[value_bytes + b] = static_cast<uint8_t>(amax[b]);
        s[b] = scale_value(recipe, amax[b]);
      }
      for (int64_t b = 0; b < nb; ++b) {
        const float sb = s[b], inv = 1.0f / sb;  // UE8M0: s is a power of two, so x * (1/s) == x / s exactly
        for (int i = 0; i < Block; ++i) {
          float q = recipe == kE4M3 ? f[b * Block + i] / sb : f[b * Block + i] * inv;
          uint32_t sign = bits_of(q) >> 31 << 3;
          float a = std::fabs(q);
          uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                         (a > 5.0f);
          c[b * Block + i] = static_cast<uint8_t>(sign | idx);
        }
      }
      for (int64_t i = 0; i < value_bytes; ++i) o[i] = static_cast<uint8_t>(c[2 * i] | c[2 * i + 1] << 4);
    }
  });
  return first_noted(bad);
}

// fp32 bits of the E2M1 value of code c (0..15), by arithmetic so that the loop vectorises
inline uint32_t grid_bits(uint32_t c) {
  uint32_t m = c & 7;
  uint32_t mag = m <= 1 ? (m == 1 ? 0x3F000000u : 0u) : ((126 + (m >> 1)) << 23) | ((m & 1) << 22);
  return mag | (c & 8) << 28;
}


template <typename O, int Block>
int64_t decode_rows(const uint8_t* p, int64_t n, int64_t row_stride, int64_t dim, int lo, int hi, O* out) {
  constexpr int recipe = Block == 16 ? kE4M3 : kUE8M0;
  const int64_t nb = dim / Block, value_bytes = dim / 2;
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> c(dim);
    std::vector<float> s(nb), v(dim);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* pr = p + r * row_stride;
      int ok = 1;
      for (int64_t b = 0; b < nb; ++b) ok &= (pr[value_bytes + b] >= lo) & (pr[value_bytes + b] <= hi);
      if (!ok) note_row(bad, r);
      for (int64_t b = 0; b < nb; ++b) s[b] = scale_value(recipe, pr[value_bytes + b]);  // any byte: masked
      for (int64_t i = 0; i < value_bytes; ++i) {
        c[2 * i] = pr[i] & 15;
        c[2 * i + 1] = pr[i] >> 4;
      }
      float* vo = std::is_same_v<O, float> ? reinterpret_cast<float*>(out + r * dim) : v.data();
      for (int64_t b = 0; b < nb; ++b) {
        const float sb = s[b];
        for (int i = 0; i < Block; ++i) vo[b * Block + i] = float_of(grid_bits(c[b * Block + i])) * sb;
      }
      if constexpr (!std::is_same_v<O, float>) {
        uint16_t* o16 = reinterpret_cast<uint16_t*>(out + r * dim);
        for (int64_t i = 0; i < dim; ++i) o16[i] = static_cast<uint16_t>(bits_of(vo[i]) >> 16);  // exact in bf16
      }
    }
  });
  return first_noted(bad);
}

template <int Block>
int64_t encode_block(const at::Tensor& x, int recipe, at::Tensor& out) {
  const int64_t n = x.size(0), dim = x.size(1);
  uint8_t* o = out.data_ptr<uint8_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      return encode_rows<float, Block>(x.data_ptr<float>(), n, dim, o);
    case at::kBFloat16:
      return encode_rows<c10::BFloat16, Block>(x.data_ptr<c10::BFloat16>(), n, dim, o);
    case at::kHalf:
      return encode_rows<c10::Half, Block>(x.data_ptr<c10::Half>(), n, dim, o);
    default:
      TORCH_CHECK(false, "fp4 encode: unsupported dtype ", x.scalar_type());
  }
}

template <int Block>
int64_t decode_block(const at::Tensor& p, int64_t dim, int recipe, int lo, int hi, at::Tensor& out) {
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const int64_t n = p.size(0), stride = p.stride(0);
  if (out.scalar_type() == at::kFloat) {
    return decode_rows<float, Block>(pp, n, stride, dim, lo, hi, out.data_ptr<float>());
  }
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "fp4 decode: output must be float32 or bfloat16");
  return decode_rows<c10::BFloat16, Block>(pp, n, stride, dim, lo, hi, out.data_ptr<c10::BFloat16>());
}


// ---- indexer scores on stored index keys (v41-spec §4): score(t, j) = sum_h relu(q[t,h] . k_j) * w[t,h] ----
// Keys are packed MXFP4 entries (uint8 [R, d/2 + d/32], decoded into a small tile on the fly, never written
// out) or fp32 rows [R, d]; entry j lives in row table[j / per_block] * per_block + j % per_block. The order of
// every fp32 operation is fixed, so a (query, entry) score never depends on which other entries are scored
// (index_scores.py holds the same order in torch):
//   dot: 8 lanes; lane l sums q[i] * k[i] over i = l, l+8, ... in increasing i (each product rounded, then
//        added: no FMA); lanes folded (l, l+4), then (l, l+2), then (0, 1).
//   relu(x) = x < 0 ? 0 : x (NaN kept); heads summed in order 0..H-1 from head 0's term relu(dot_0) * w_0.
// Vectors only hold more keys side by side: 16 entries are decoded together into a tile transposed to value-major
// order (tile[i * 16 + k]: value i of entry k), so one 16-float vector holds value i of 16 keys and every step
// above (the lane sums, the folds, relu, the head sum) is one vector operation for 16 keys, with no shuffles.
// Each tile vector, once loaded, serves 4 heads (16 accumulators: 4 heads x lanes 0..3, then lanes 4..7).

using v16 = float __attribute__((vector_size(64)));
using v16i = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));

template <typename V>
inline V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store_vec(void* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// fp32 bits of the E2M1 values as one 16-float vector, indexed by code
inline v16 grid_vector() {
  v16 g;
  for (uint32_t c = 0; c < 16; ++c) g[c] = float_of(grid_bits(c));
  return g;
}

constexpr int64_t kGroup = 16;  // entries decoded and scored together: a vector holds one value of each
constexpr int64_t kTile = 64;   // entries per task (a multiple of kGroup)
constexpr int kHeadsAtOnce = 4;  // heads whose accumulators stay in registers together
constexpr int64_t kMaxDim = 1024;  // the largest head dim index_scores takes (sizes kZeroRow and the scales)
alignas(64) const uint8_t kZeroRow[kMaxDim * sizeof(float)] = {};  // stands in for absent entries (d fp32 values)

struct ScoreArgs {
  const float* q;        // [Q, H, d]
  const float* w;        // [Q, H]
  const uint8_t* keys;   // [R, row_bytes] packed, or fp32 rows when packed == false
  int64_t row_bytes, heads, dim;
  bool packed;
  const int64_t* table;  // block ids
  int64_t per_block;
  const int64_t* limit;  // [Q]: entries j < limit[t] are visible to query t
};

// Bit k set where lane k of v is nonzero
inline uint32_t mask_of(const v16i& v) {
#ifdef __AVX512F__
  const __m512i x = reinterpret_cast<__m512i>(v);
  return _mm512_test_epi32_mask(x, x);
#else
  uint32_t m = 0;
  for (int k = 0; k < 16; ++k) m |= static_cast<uint32_t>(v[k] != 0) << k;
  return m;
#endif
}

// Rows r[0..16) of 16 dwords transposed in place: r[c][k] becomes the old r[k][c].
inline void transpose16(u32x16* r) {
#ifdef __AVX512F__
  __m512i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = reinterpret_cast<__m512i>(r[i]);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: (row i, row i+1) at columns 4L, 4L+1 / 4L+2, 4L+3
    b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // a[4g + m] lane L: column 4L + m of rows 4g .. 4g+3
    a[i] = _mm512_unpacklo_epi64(b[i], b[i + 2]);
    a[i + 1] = _mm512_unpackhi_epi64(b[i], b[i + 2]);
    a[i + 2] = _mm512_unpacklo_epi64(b[i + 1], b[i + 3]);
    a[i + 3] = _mm512_unpackhi_epi64(b[i + 1], b[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // the four lanes of columns m, 4+m, 8+m, 12+m gathered
    const __m512i t = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x88), tp = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xdd);
    const __m512i s = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x88);
    const __m512i sp = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xdd);
    r[m] = reinterpret_cast<u32x16>(_mm512_shuffle_i32x4(t, s, 0x88));
    r[8 + m] = reinterpret_cast<u32x16>(_mm512_shuffle_i32x4(t, s, 0xdd));
    r[4 + m] = reinterpret_cast<u32x16>(_mm512_shuffle_i32x4(tp, sp, 0x88));
    r[12 + m] = reinterpret_cast<u32x16>(_mm512_shuffle_i32x4(tp, sp, 0xdd));
  }
#else
  for (int i = 0; i < 16; ++i) {
    for (int k = i + 1; k < 16; ++k) std::swap(r[i][k], r[k][i]);
  }
#endif
}

// The entries of rows[0..16) (kZeroRow for an absent one) decoded into tile[i * 16 + k] = value i of entry k.
// Returns the mask of entries holding a scale byte outside 1..252 (packed keys).
template <int64_t D>
inline uint32_t decode_group(const ScoreArgs& a, const uint8_t* const* rows, float* tile, const v16& grid) {
  const int64_t d = D > 0 ? D : a.dim, words = a.packed ? d / 8 : d;  // dwords per row: codes, or fp32 values
  uint32_t bad = 0;
  v16 scale[kMaxDim / 32];  // packed: scale[b][k] = the scale of values 32b .. 32b+31 of entry k
  if (a.packed) {
    const int64_t nb = d / 32;
    for (int64_t b4 = 0; b4 < nb; b4 += 4) {  // scale bytes b4 .. b4+3 of each entry in one dword
      u32x16 bytes4{};
      for (int k = 0; k < 16; ++k) {
        uint32_t v = 0;
        std::memcpy(&v, rows[k] + d / 2 + b4, std::min<int64_t>(4, nb - b4));
        bytes4[k] = v;
      }
      for (int64_t b = b4; b < std::min<int64_t>(nb, b4 + 4); ++b) {
        const u32x16 s = bytes4 >> (8 * (b - b4)) & 255u;
        bad |= mask_of(reinterpret_cast<v16i>(s - 1u > 251u));
        scale[b] = reinterpret_cast<v16>(s << 23);
      }
    }
  }
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, words - w0);
    u32x16 r[16];
    for (int k = 0; k < 16; ++k) {
      if (cnt == 16) {
        r[k] = load_vec<u32x16>(rows[k] + 4 * w0);
      } else {
        r[k] = u32x16{};
        std::memcpy(&r[k], rows[k] + 4 * w0, 4 * cnt);
      }
    }
    transpose16(r);  // r[c][k]: dword w0 + c of entry k
    for (int64_t c = 0; c < cnt; ++c) {
      if (!a.packed) {
        store_vec(tile + (w0 + c) * 16, r[c]);
        continue;
      }
      // dword w0 + c holds codes of values 8(w0 + c) + j, j = 0..7, at bits 4j .. 4j+3 (low nibble first);
      // __builtin_shuffle reads each index modulo 16, so the bits above a code select nothing
      const v16 s = scale[(w0 + c) / 4];
      float* o = tile + (w0 + c) * 8 * 16;
      for (int j = 0; j < 8; ++j) {
        store_vec(o + j * 16, __builtin_shuffle(grid, reinterpret_cast<v16i>(r[c] >> (4 * j))) * s);
      }
    }
  }
  return bad;
}

// The dots of heads h0 .. h0 + HG - 1 of one query (qh: head h0's d values, the next heads d apart) with the 16
// entries of the tile, each in 8 lanes folded as the comment above says.
template <int HG, int64_t D>
inline void dots16(const float* tile, const float* qh, int64_t d, v16* dots) {
  if constexpr (D > 0) d = D;
  v16 acc[HG][4];
  alignas(64) float low[HG][4][16];  // lanes 0..3, kept while lanes 4..7 are summed
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 4; ++l) {
      const v16 k = load_vec<v16>(tile + (4 * half + l) * 16);
      for (int h = 0; h < HG; ++h) acc[h][l] = qh[h * d + 4 * half + l] * k;
    }
    for (int64_t c = 1; c < d / 8; ++c) {
      for (int l = 0; l < 4; ++l) {
        const int64_t i = 8 * c + 4 * half + l;
        const v16 k = load_vec<v16>(tile + i * 16);
        for (int h = 0; h < HG; ++h) acc[h][l] += qh[h * d + i] * k;
      }
    }
    if (half == 0) {
      for (int h = 0; h < HG; ++h) {
        for (int l = 0; l < 4; ++l) store_vec(low[h][l], acc[h][l]);
      }
    }
  }
  for (int h = 0; h < HG; ++h) {
    v16 r[4];
    for (int l = 0; l < 4; ++l) r[l] = load_vec<v16>(low[h][l]) + acc[h][l];
    dots[h] = (r[0] + r[2]) + (r[1] + r[3]);
  }
}

// Scores of query t (its heads at qt, weights at wt) against the tile's 16 entries.
template <int64_t D>
inline v16 score_group(const ScoreArgs& a, const float* tile, const float* qt, const float* wt) {
  const int64_t d = D > 0 ? D : a.dim;
  v16 total{}, dots[kHeadsAtOnce];
  for (int64_t h0 = 0; h0 < a.heads; h0 += kHeadsAtOnce) {
    const int64_t hg = std::min<int64_t>(kHeadsAtOnce, a.heads - h0);
    const float* qh = qt + h0 * d;
    switch (hg) {
      case 4: dots16<4, D>(tile, qh, d, dots); break;
      case 3: dots16<3, D>(tile, qh, d, dots); break;
      case 2: dots16<2, D>(tile, qh, d, dots); break;
      default: dots16<1, D>(tile, qh, d, dots); break;
    }
    for (int64_t h = 0; h < hg; ++h) {
      const v16 r = (dots[h] < 0.0f ? v16{} : dots[h]) * wt[h0 + h];
      total = h0 + h == 0 ? r : total + r;
    }
  }
  return total;
}

// The row of entry j
inline const uint8_t* row_of(const ScoreArgs& a, int64_t j) {
  return a.keys + (a.table[j / a.per_block] * a.per_block + j % a.per_block) * a.row_bytes;
}

// Score entries ids[0..n) (id < 0: not scored; ids[n..kTile) are -1) for queries t0..t1; out[t][e] at
// out + (t - t0) * out_stride + e. rows[e]: entry e's row (kZeroRow where ids[e] < 0). Returns -1 or the first
// entry with a scale byte outside 1..252. D: the head dim when known at compile time (0: a.dim).
template <int64_t D>
int64_t score_tile(const ScoreArgs& a, const int64_t* ids, const uint8_t* const* rows, int64_t n, int64_t t0,
                   int64_t t1, float* out, int64_t out_stride, float* tile, const v16& grid) {
  const int64_t d = D > 0 ? D : a.dim;
  constexpr float kNeg = -std::numeric_limits<float>::infinity();
  int64_t bad = -1;
  for (int64_t g = 0; g * kGroup < n; ++g) {
    const int64_t* gid = ids + g * kGroup;
    const int64_t cnt = std::min(kGroup, n - g * kGroup);
    uint32_t present = 0;
    for (int k = 0; k < kGroup; ++k) present |= static_cast<uint32_t>(gid[k] >= 0) << k;
    if (present != 0) {
      uint32_t flagged = decode_group<D>(a, rows + g * kGroup, tile, grid) & present;
      for (int k = 0; flagged != 0; ++k, flagged >>= 1) {
        if ((flagged & 1) && (bad < 0 || gid[k] < bad)) bad = gid[k];
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + (t - t0) * out_stride + g * kGroup;
      const int64_t lim = a.limit[t];
      v16i visible;
      for (int k = 0; k < kGroup; ++k) visible[k] = gid[k] >= 0 && gid[k] < lim ? -1 : 0;
      v16 s = v16{} + kNeg;
      if (mask_of(visible) != 0) {
        s = visible != 0 ? score_group<D>(a, tile, a.q + t * a.heads * d, a.w + t * a.heads) : s;
      }
      std::memcpy(o, &s, cnt * sizeof(float));
    }
  }
  return bad;
}

}  // namespace

// x [n, dim] contiguous -> out uint8 [n, dim/2 + dim/block] contiguous; -1 or the first non-finite row
int64_t encode_fp4(at::Tensor x, int64_t recipe, at::Tensor out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.dim() == 2 && out.dim() == 2, "fp4 encode: layout");
  return recipe == kE4M3 ? encode_block<16>(x, kE4M3, out) : encode_block<32>(x, kUE8M0, out);
}

// packed uint8 [n, width] (unit element stride) -> out [n, dim] contiguous; -1 or the first bad-scale row
int64_t decode_fp4(at::Tensor packed, int64_t recipe, int64_t lo, int64_t hi, at::Tensor out) {
  TORCH_CHECK(packed.dim() == 2 && (packed.size(1) <= 1 || packed.stride(1) == 1) && out.is_contiguous(),
              "fp4 decode: layout");
  const int64_t dim = out.size(1);
  return recipe == kE4M3 ? decode_block<16>(packed, dim, kE4M3, lo, hi, out)
                         : decode_block<32>(packed, dim, kUE8M0, lo, hi, out);
}

// Index scores of queries q fp32 [Q, H, d] (weights w fp32 [Q, H]) against stored keys (packed uint8
// [R, d/2 + d/32] or fp32 [R, d], unit element stride), entry j at row table[j / per_block] * per_block + j %
// per_block.
// entries int64 [Q, C]: score those entries (< 0: not scored) into out [Q, C]; entries empty ([0, 0]): score
// entries 0..N-1 into out [Q, N]. Entries at or past limit[t] get -inf. Returns -1 or the first entry id holding
// a scale byte outside 1..252.
int64_t index_scores(at::Tensor q, at::Tensor w, at::Tensor keys, at::Tensor table, int64_t per_block,
                     at::Tensor limit, at::Tensor entries, at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && w.is_contiguous() && table.is_contiguous() && limit.is_contiguous() &&
                  entries.is_contiguous() && out.is_contiguous() && q.dim() == 3 && out.dim() == 2 &&
                  keys.dim() == 2 && (keys.size(1) <= 1 || keys.stride(1) == 1),
              "index scores: layout");
  const int64_t nq = q.size(0), d = q.size(2);
  TORCH_CHECK(d % 32 == 0 && d <= kMaxDim, "index scores: head dim must be a multiple of 32, at most ", kMaxDim);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == nq && w.size(1) == q.size(1) && limit.numel() == nq &&
                  out.size(0) == nq && (entries.numel() == 0 || (entries.dim() == 2 && entries.sizes() == out.sizes())),
              "index scores: w [Q, H], limit [Q], out [Q, C] and entries [Q, C] or empty");
  TORCH_CHECK(per_block >= 1, "index scores: per_block must be at least 1");
  const bool packed = keys.scalar_type() == at::kByte;
  TORCH_CHECK(packed || keys.scalar_type() == at::kFloat, "index scores: keys are uint8 (MXFP4) or float32");
  TORCH_CHECK(keys.size(1) == (packed ? d / 2 + d / 32 : d), "index scores: key rows of ", keys.size(1),
              packed ? " bytes for head dim " : " values for head dim ", d);
  ScoreArgs a{q.data_ptr<float>(), w.data_ptr<float>(), static_cast<const uint8_t*>(keys.data_ptr()),
              keys.stride(0) * keys.element_size(), q.size(1), d, packed, table.data_ptr<int64_t>(), per_block,
              limit.data_ptr<int64_t>()};
  const bool dense = entries.numel() == 0;
  const int64_t width = out.size(1), tiles = (width + kTile - 1) / kTile;
  const int64_t qblock = dense ? 16 : 1, qblocks = (nq + qblock - 1) / qblock;
  float* o = out.data_ptr<float>();
  const int64_t* ent = dense ? nullptr : entries.data_ptr<int64_t>();
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, qblocks * tiles, std::max<int64_t>(1, 2048 / (qblock * kTile)), [&](int64_t b0, int64_t b1) {
    std::vector<v16> tile(d);  // 16 entries x d values
    const v16 grid = grid_vector();
    int64_t ids[kTile];
    const uint8_t* rows[kTile];
    const bool pow2 = (per_block & (per_block - 1)) == 0;
    const int shift = __builtin_ctzll(static_cast<uint64_t>(per_block));
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t qb = task / tiles, c0 = (task % tiles) * kTile, n = std::min(kTile, width - c0);
      const int64_t t0 = qb * qblock, t1 = std::min(nq, t0 + qblock);
      if (dense) {  // entries c0 .. c0 + n - 1: rows found by stepping through the blocks, no division per entry
        int64_t reach = 0;
        for (int64_t t = t0; t < t1; ++t) reach = std::max(reach, a.limit[t]);
        const int64_t seen = std::clamp<int64_t>(reach - c0, 0, n);
        int64_t block = c0 / per_block, offset = c0 % per_block;
        for (int64_t e = 0; e < seen; ++e) {
          ids[e] = c0 + e;
          rows[e] = a.keys + (a.table[block] * per_block + offset) * a.row_bytes;
          if (++offset == per_block) offset = 0, ++block;
        }
        for (int64_t e = seen; e < n; ++e) ids[e] = -1, rows[e] = kZeroRow;
      } else {
        for (int64_t e = 0; e < n; ++e) {  // one query per task: read only what it sees
          const int64_t j = ent[t0 * width + c0 + e];
          ids[e] = j < a.limit[t0] ? j : -1;
          if (ids[e] < 0) {
            rows[e] = kZeroRow;
            continue;
          }
          rows[e] = pow2 ? a.keys + ((a.table[j >> shift] << shift) + (j & (per_block - 1))) * a.row_bytes
                         : row_of(a, j);
          __builtin_prefetch(rows[e]);  // named entries lie anywhere in the pool: start every read now
          __builtin_prefetch(rows[e] + a.row_bytes - 1);
        }
      }
      for (int64_t e = n; e < kTile; ++e) ids[e] = -1, rows[e] = kZeroRow;
      float* ot = o + t0 * width + c0;
      float* tp = reinterpret_cast<float*>(tile.data());
      const int64_t r = d == 128 ? score_tile<128>(a, ids, rows, n, t0, t1, ot, width, tp, grid)
                                 : score_tile<0>(a, ids, rows, n, t0, t1, ot, width, tp, grid);
      if (r >= 0) note_row(bad, r);
    }
  });
  return first_noted(bad);
}
