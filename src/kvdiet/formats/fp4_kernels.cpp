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
// Wider registers only hold more keys side by side: a 16-float vector holds the same 8 lanes of two keys (the
// tile stores each pair of entries chunk by chunk: 8 values of the even entry, then the same 8 of the odd one).

using v8 = float __attribute__((vector_size(32)));
using v8i = int32_t __attribute__((vector_size(32)));
using v16 = float __attribute__((vector_size(64)));
using v16i = int32_t __attribute__((vector_size(64)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
// 16 bytes zero-extended to 16 int32 lanes (GCC lowers __builtin_convertvector of bytes lane by lane: one
// vpmovzxbd where AVX-512 is enabled)
inline v16i widen(const uint8_t* p) {
#ifdef __AVX512F__
  return reinterpret_cast<v16i>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  u8x16 raw;
  std::memcpy(&raw, p, 16);
  return __builtin_convertvector(raw, v16i);
#endif
}

template <typename V>
inline V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// lanes (l, l+4) of two accumulators: [a0+a4 .. a3+a7, b0+b4 .. b3+b7]
inline v8 fold_halves(v8 a, v8 b) {
  return __builtin_shuffle(a, b, v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(a, b, v8i{4, 5, 6, 7, 12, 13, 14, 15});
}

// The 8-lane accumulators of keys kOrder[0..7] (c[p] belongs to key kOrder[p]) folded into the 8 dots in key
// order: the folds run across the 8 accumulators at once.
constexpr int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};

inline v8 fold8(const v8* c) {
  v8 h[4];  // h[m]: lanes r0..r3 of accumulators 2m, 2m+1 (r_l = a_l + a_{l+4})
  for (int m = 0; m < 4; ++m) h[m] = fold_halves(c[2 * m], c[2 * m + 1]);
  v8 g[2];  // (r0 + r2, r1 + r3) of accumulators 4m .. 4m+3
  for (int m = 0; m < 2; ++m) {
    g[m] = __builtin_shuffle(h[2 * m], h[2 * m + 1], v8i{0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(h[2 * m], h[2 * m + 1], v8i{2, 3, 10, 11, 6, 7, 14, 15});
  }
  return __builtin_shuffle(g[0], g[1], v8i{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(g[0], g[1], v8i{1, 3, 9, 11, 5, 7, 13, 15});
}

inline v8 low(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8 high(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

// The dots of one query head (qq: its d values chunk by chunk, each chunk of 8 twice) with the 16 keys of
// pairs pairs[0..8) (pair p: chunk c at pairs + (p * chunks + c) * 16); out[0..16) in key order.
template <int64_t Chunks>
inline void dot16(const float* qq, const float* pairs, int64_t chunks, v8* out) {
  if constexpr (Chunks > 0) chunks = Chunks;
  v16 acc[8];
  v16 x = load_vec<v16>(qq);
  for (int p = 0; p < 8; ++p) acc[p] = x * load_vec<v16>(pairs + p * chunks * 16);
  for (int64_t c = 1; c < chunks; ++c) {
    x = load_vec<v16>(qq + c * 16);
    for (int p = 0; p < 8; ++p) acc[p] += x * load_vec<v16>(pairs + (p * chunks + c) * 16);
  }
  for (int half = 0; half < 2; ++half) {  // keys 8·half .. 8·half + 7: pairs 4·half .. 4·half + 3
    v8 c[8];
    for (int p = 0; p < 8; ++p) {
      const int key = kOrder[p], pair = 4 * half + key / 2;
      c[p] = key % 2 ? high(acc[pair]) : low(acc[pair]);
    }
    out[half] = fold8(c);
  }
}

// fp32 bits of the E2M1 values as one 16-float vector, indexed by code
inline v16 grid_vector() {
  v16 g;
  for (uint32_t c = 0; c < 16; ++c) g[c] = float_of(grid_bits(c));
  return g;
}

constexpr int64_t kTile = 64;  // entries decoded and scored together (a multiple of 16)

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

// Entry e's d values into the tile (chunk c of 8 at tile + ((e / 2) * d / 8 + c) * 16 + (e % 2) * 8); zeros
// when p is null. Returns false when a packed entry holds a scale byte outside 1..252.
template <int64_t D>
inline bool put_entry(const ScoreArgs& a, const uint8_t* p, int64_t e, float* tile, const v16& grid) {
  const int64_t d = D > 0 ? D : a.dim, chunks = d / 8;
  float* base = tile + (e / 2) * chunks * 16 + (e % 2) * 8;
  if (p == nullptr || !a.packed) {
    for (int64_t c = 0; c < chunks; ++c) {
      if (p == nullptr) {
        std::memset(base + c * 16, 0, 8 * sizeof(float));
      } else {
        std::memcpy(base + c * 16, reinterpret_cast<const float*>(p) + c * 8, 8 * sizeof(float));
      }
    }
    return true;
  }
  bool ok = true;
  for (int64_t b = 0; b < d / 32; ++b) {  // block b: bytes 16b .. 16b+15, values 32b .. 32b+31
    const uint32_t byte = p[d / 2 + b];
    ok &= byte >= 1 && byte <= 252;
    const v16 s = v16{} + float_of(byte << 23);
    const v16i codes = widen(p + 16 * b);
    const v16 lo = __builtin_shuffle(grid, codes & 15), hi = __builtin_shuffle(grid, codes >> 4);
    const v16 first = __builtin_shuffle(lo, hi, v16i{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}) * s;
    const v16 second =
        __builtin_shuffle(lo, hi, v16i{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}) * s;
    float* o = base + 4 * b * 16;
    const v8 parts[4] = {low(first), high(first), low(second), high(second)};
    for (int k = 0; k < 4; ++k) std::memcpy(o + 16 * k, &parts[k], sizeof(v8));
  }
  return ok;
}

// Score entries ids[0..n) (id < 0: not scored) for queries t0..t1; out[t][e] at out + (t - t0) * out_stride + e.
// qq: the queries' heads as dot16 reads them ([t1 - t0, H, 2d]). Returns -1 or the first entry with a scale
// byte outside 1..252. D: the head dim when known at compile time (0: a.dim).
template <int64_t D>
int64_t score_tile(const ScoreArgs& a, const int64_t* ids, int64_t n, int64_t t0, int64_t t1, const float* qq,
                   float* out, int64_t out_stride, float* tile, const v16& grid) {
  const int64_t d = D > 0 ? D : a.dim, chunks = d / 8, padded = (n + 15) / 16 * 16;
  int64_t bad = -1;
  for (int64_t e = 0; e < padded; ++e) {
    const uint8_t* p = nullptr;
    if (e < n && ids[e] >= 0) {
      const int64_t j = ids[e];
      p = a.keys + (a.table[j / a.per_block] * a.per_block + j % a.per_block) * a.row_bytes;
    }
    if (!put_entry<D>(a, p, e, tile, grid) && (bad < 0 || ids[e] < bad)) bad = ids[e];
  }
  v8 part[kTile / 8], dots[2];
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + (t - t0) * out_stride;
    const int64_t lim = a.limit[t];
    int64_t m = 0;  // entries past the last visible one are not scored
    for (int64_t e = 0; e < n; ++e) m = (ids[e] >= 0 && ids[e] < lim) ? e + 1 : m;
    for (int64_t h = 0; h < a.heads; ++h) {
      const float* qh = qq + ((t - t0) * a.heads + h) * 2 * d;
      const v8 wh = v8{} + a.w[t * a.heads + h];
      for (int64_t g = 0; g * 16 < m; ++g) {
        dot16<D / 8>(qh, tile + g * 8 * chunks * 16, chunks, dots);
        for (int k = 0; k < 2; ++k) {
          const v8 r = (dots[k] < 0.0f ? v8{} : dots[k]) * wh;
          part[2 * g + k] = h == 0 ? r : part[2 * g + k] + r;
        }
      }
    }
    for (int64_t e = 0; e < n; ++e) {
      o[e] = (e < m && ids[e] >= 0 && ids[e] < lim) ? part[e / 8][e % 8] : -std::numeric_limits<float>::infinity();
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

// Index scores of queries q fp32 [Q, H, d] (weights w fp32 [Q, H]) against stored keys (packed uint8 [R, width]
// or fp32 [R, d], unit element stride), entry j at row table[j / per_block] * per_block + j % per_block.
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
  TORCH_CHECK(d % 32 == 0 && d <= 1024, "index scores: head dim must be a multiple of 32, at most 1024");
  const bool packed = keys.scalar_type() == at::kByte;
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
    std::vector<float> tile(kTile * d), qq(qblock * a.heads * 2 * d);
    const v16 grid = grid_vector();
    int64_t ids[kTile], filled = -1;  // qq holds the queries of block `filled`
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t qb = task / tiles, c0 = (task % tiles) * kTile, n = std::min(kTile, width - c0);
      const int64_t t0 = qb * qblock, t1 = std::min(nq, t0 + qblock);
      if (qb != filled) {  // each query head's chunks of 8, each twice (the lanes of two keys)
        for (int64_t i = 0; i < (t1 - t0) * a.heads * d; i += 8) {
          std::memcpy(qq.data() + 2 * i, a.q + t0 * a.heads * d + i, 8 * sizeof(float));
          std::memcpy(qq.data() + 2 * i + 8, a.q + t0 * a.heads * d + i, 8 * sizeof(float));
        }
        filled = qb;
      }
      if (dense) {
        int64_t reach = 0;
        for (int64_t t = t0; t < t1; ++t) reach = std::max(reach, a.limit[t]);
        for (int64_t e = 0; e < n; ++e) ids[e] = c0 + e < reach ? c0 + e : -1;
      } else {
        for (int64_t e = 0; e < n; ++e) {  // one query per task: read only what it sees
          const int64_t j = ent[t0 * width + c0 + e];
          ids[e] = j < a.limit[t0] ? j : -1;
        }
      }
      float* ot = o + t0 * width + c0;
      const int64_t r = d == 128 ? score_tile<128>(a, ids, n, t0, t1, qq.data(), ot, width, tile.data(), grid)
                                 : score_tile<0>(a, ids, n, t0, t1, qq.data(), ot, width, tile.data(), grid);
      if (r >= 0) note_row(bad, r);
    }
  });
  return first_noted(bad);
}
