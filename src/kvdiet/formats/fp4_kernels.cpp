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
#include <cmath>
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

#ifdef __AVX512F__
// E2M1 codes of 16 values f[0..16) of a block with scale sb (inv = 1/sb), two to a byte into o[0..8): the scalar
// loop's arithmetic lane by lane (q = f / sb, or f * inv for UE8M0; the sign bit of q; |q| against the same seven
// thresholds), 16 lanes a step (GCC vectorised the scalar loop 4 lanes wide).
template <int Recipe>
inline void encode16(const float* f, float sb, float inv, uint8_t* o) {
  const __m512 x = _mm512_loadu_ps(f);
  const __m512 q = Recipe == kE4M3 ? _mm512_div_ps(x, _mm512_set1_ps(sb)) : _mm512_mul_ps(x, _mm512_set1_ps(inv));
  const __m512i qb = _mm512_castps_si512(q);
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(qb, _mm512_set1_epi32(0x7FFFFFFF)));
  __m512i code = _mm512_slli_epi32(_mm512_srli_epi32(qb, 31), 3);
  const __m512i one = _mm512_set1_epi32(1);
  auto count = [&](float t, int op) {
    const __mmask16 m = op == _CMP_GT_OQ ? _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_GT_OQ)
                                          : _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_GE_OQ);
    code = _mm512_mask_add_epi32(code, m, code, one);
  };
  count(0.25f, _CMP_GT_OQ), count(0.75f, _CMP_GE_OQ), count(1.25f, _CMP_GT_OQ), count(1.75f, _CMP_GE_OQ);
  count(2.5f, _CMP_GT_OQ), count(3.5f, _CMP_GE_OQ), count(5.0f, _CMP_GT_OQ);
  // 16 codes as bytes, then byte 2i + 16 * byte 2i+1 per 16-bit pair (maddubs: unsigned codes x signed 1, 16)
  const __m128i bytes = _mm512_cvtepi32_epi8(code);
  const __m128i pairs = _mm_maddubs_epi16(bytes, _mm_set1_epi16(static_cast<int16_t>(0x1001)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm_packus_epi16(pairs, pairs));
}
#endif

template <typename T, int Block>
int64_t encode_rows(const T* x, int64_t n, int64_t dim, uint8_t* out) {
  constexpr int recipe = Block == 16 ? kE4M3 : kUE8M0;
  const int64_t nb = dim / Block, value_bytes = dim / 2, width = value_bytes + nb;
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    std::vector<float> f(dim), s(nb);
    std::vector<uint32_t> amax(nb);
#ifndef __AVX512F__
    std::vector<uint8_t> c(dim);  // the codes, packed two a byte at the row's end (encode16 packs its own)
#endif
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
#ifdef __AVX512F__
        for (int i = 0; i < Block; i += 16) encode16<recipe>(&f[b * Block + i], sb, inv, o + (b * Block + i) / 2);
#else
        for (int i = 0; i < Block; ++i) {
          float q = recipe == kE4M3 ? f[b * Block + i] / sb : f[b * Block + i] * inv;
          uint32_t sign = bits_of(q) >> 31 << 3;
          float a = std::fabs(q);
          uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                         (a > 5.0f);
          c[b * Block + i] = static_cast<uint8_t>(sign | idx);
        }
#endif
      }
#ifndef __AVX512F__
      for (int64_t i = 0; i < value_bytes; ++i) o[i] = static_cast<uint8_t>(c[2 * i] | c[2 * i + 1] << 4);
#endif
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


#ifdef __AVX512F__
// the 16 E2M1 values (grid_bits of codes 0..15) in one register, for decode_entry's lookup
struct Grid16 {
  __m512 v;
  Grid16() {
    alignas(64) float g[16];
    for (uint32_t c = 0; c < 16; ++c) g[c] = float_of(grid_bits(c));
    v = _mm512_load_ps(g);
  }
};
const Grid16 kGrid16;
#endif

// one entry pr (dim/2 value bytes, then dim/Block scale bytes) -> vo [dim] float32; false when a scale byte is
// outside lo..hi (decoded all the same: the caller reports the row). c, s: scratch of dim and dim/Block values.
template <int Block>
inline bool decode_entry(const uint8_t* pr, int64_t dim, int lo, int hi, uint32_t* c, float* s, float* vo) {
  constexpr int recipe = Block == 16 ? kE4M3 : kUE8M0;
  const int64_t nb = dim / Block, value_bytes = dim / 2;
  int ok = 1;
  for (int64_t b = 0; b < nb; ++b) ok &= (pr[value_bytes + b] >= lo) & (pr[value_bytes + b] <= hi);
  for (int64_t b = 0; b < nb; ++b) s[b] = scale_value(recipe, pr[value_bytes + b]);  // any byte: masked
#ifdef __AVX512F__
  // 16 values a step: their 8 bytes' nibbles interleaved (low first), widened to lanes, the E2M1 grid looked up
  // by lane (vpermps) and multiplied by the block's scale: the same product as below
  const __m512 grid = kGrid16.v;
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t i = 0; i < dim; i += 16) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(pr + i / 2));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), grid);
    _mm512_storeu_ps(vo + i, _mm512_mul_ps(v, _mm512_set1_ps(s[i / Block])));
  }
  (void)c;
#else
  for (int64_t i = 0; i < value_bytes; ++i) {
    c[2 * i] = pr[i] & 15;
    c[2 * i + 1] = pr[i] >> 4;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const float sb = s[b];
    for (int i = 0; i < Block; ++i) vo[b * Block + i] = float_of(grid_bits(c[b * Block + i])) * sb;
  }
#endif
  return ok;
}

// fp32 values v[0..n) as bf16 bits into o: the upper half of each one's bits (exact for decoded FP4 values: an
// E2M1 value times its scale has at most six significant bits)
inline void to_bf16(const float* v, int64_t n, uint16_t* o) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint16_t>(bits_of(v[i]) >> 16);
}

template <typename O, int Block>
int64_t decode_rows(const uint8_t* p, int64_t n, int64_t row_stride, int64_t dim, int lo, int hi, O* out) {
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> c(dim);
    std::vector<float> s(dim / Block), v(dim);
    for (int64_t r = begin; r < end; ++r) {
      float* vo = std::is_same_v<O, float> ? reinterpret_cast<float*>(out + r * dim) : v.data();
      if (!decode_entry<Block>(p + r * row_stride, dim, lo, hi, c.data(), s.data(), vo)) note_row(bad, r);
      if constexpr (!std::is_same_v<O, float>) {
        to_bf16(vo, dim, reinterpret_cast<uint16_t*>(out + r * dim));
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
