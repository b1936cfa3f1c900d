// Indexer scores on stored MXFP4 index keys (v41-spec §4), in the translation unit fp4_kernels.cpp opens (its
// helpers: float_of, grid_bits, note_row, first_noted). Built at first use by kvdiet.formats.native.

#include <array>
#include <cstdlib>
#ifdef __AVX512F__
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

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

// The max of row[0..n) with NaN read as -inf (-inf for none): the scalar fold in entry order, of equal largest
// scores (-0 and +0 alike) the first. block_max's rule, and the index scores' block maxima (index_scores).
inline float block_fold(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = row[j] > m ? row[j] : m;  // NaN never compares greater
  return m;
}

// Maxima of the first blocks of 8 of row[0 .. 8m) into o[0..b), two at a time: returns b, the even count taken (0
// without AVX-512; the caller folds the rest with block_fold). Each is the scalar fold's bits: vmaxps(x, y) is
// x > y ? x : y per lane, so a tree that keeps the earlier operand unless the later one is greater gives the first
// of the equal largest scores (the fold's pick, -0 or +0 alike); NaN is first read as -inf (vmaxps(x, -inf)), as
// the fold never picks it.
inline int64_t block8_max(const float* row, int64_t m, float* o) {
  int64_t b = 0;
#ifdef __AVX512F__
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; b + 2 <= m; b += 2) {  // blocks b (lanes 0..7) and b + 1 (lanes 8..15)
    __m512 v = _mm512_max_ps(_mm512_loadu_ps(row + 8 * b), neg);
    v = _mm512_max_ps(_mm512_permute_ps(v, 0xB1), v);  // lane 2i: lanes 2i, 2i + 1
    v = _mm512_max_ps(_mm512_permute_ps(v, 0x4E), v);  // lane 4i: lanes 4i .. 4i + 3
    v = _mm512_max_ps(_mm512_shuffle_f32x4(v, v, 0x31), v);  // lanes 0 and 8: lanes 0 .. 7 and 8 .. 15
    o[b] = _mm512_cvtss_f32(v);
    o[b + 1] = _mm256_cvtss_f32(_mm512_extractf32x8_ps(v, 1));
  }
#endif
  return b;
}

// Maxima of the blocks of `block` entries of row[0..n) (the last one partly filled) into o[0..ceil(n / block)):
// block8_max where block is 8, then block_fold
inline void block_maxima(const float* row, int64_t n, int64_t block, float* o) {
  const int64_t nb = (n + block - 1) / block;
  for (int64_t b = block == 8 ? block8_max(row, n / 8, o) : 0; b < nb; ++b) {
    o[b] = block_fold(row + b * block, std::min(block, n - b * block));
  }
}

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

// Bit k set where 0 <= ids[k] < limit, k = 0..15
inline uint32_t ids_below(const int64_t* ids, int64_t limit) {
#ifdef __AVX512F__
  const __m512i lim = _mm512_set1_epi64(limit), zero = _mm512_setzero_si512();
  const __m512i lo = _mm512_loadu_si512(ids), hi = _mm512_loadu_si512(ids + 8);
  const uint32_t m0 = _mm512_mask_cmplt_epi64_mask(_mm512_cmpge_epi64_mask(lo, zero), lo, lim);
  const uint32_t m1 = _mm512_mask_cmplt_epi64_mask(_mm512_cmpge_epi64_mask(hi, zero), hi, lim);
  return m0 | m1 << 8;
#else
  uint32_t m = 0;
  for (int k = 0; k < 16; ++k) m |= static_cast<uint32_t>(ids[k] >= 0 && ids[k] < limit) << k;
  return m;
#endif
}

// -1 in lane k where bit k of m is set, else 0
inline v16i lanes_of(uint32_t m) {
#ifdef __AVX512F__
  return reinterpret_cast<v16i>(_mm512_movm_epi32(static_cast<__mmask16>(m)));
#else
  v16i v;
  for (int k = 0; k < 16; ++k) v[k] = (m >> k & 1) ? -1 : 0;
  return v;
#endif
}

// Where a group's rows lie: row k at p[k] (RowList: any rows, kZeroRow for an absent one), or S bytes after row
// k - 1 (RowRun: a run of present rows in one block, S the packed row's bytes), where each address is one base
// plus a constant: the loads need no pointer loaded first, so more of them are in flight (a dense scan of 2.56M
// entries from memory 3.5% faster, a v4.1-mini decode step at 1M context some 0.5 ms; the same time hot).
struct RowList {
  const uint8_t* const* p;
  const uint8_t* operator[](int64_t k) const { return p[k]; }
};

template <int64_t S>
struct RowRun {
  const uint8_t* base;
  const uint8_t* operator[](int64_t k) const { return base + k * S; }
};

// Rows r[0..16) of 16 dwords transposed in place: r[c][k] becomes the old r[k][c]. Always inlined (here and in
// load_transposed): GCC kept it a call, its 16 vectors passed through memory, 15% of an index scan at one thread.
__attribute__((always_inline)) inline void transpose16(u32x16* r) {
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

// Dwords w0 .. w0 + cnt - 1 (cnt <= 16) of rows[0..16) into r, transposed: r[c][k] = dword w0 + c of row k
// (0 for c >= cnt).
template <class R>
__attribute__((always_inline)) inline void load_transposed(const R& rows, int64_t w0, int64_t cnt, u32x16* r) {
  for (int k = 0; k < 16; ++k) {
    if (cnt == 16) {
      r[k] = load_vec<u32x16>(rows[k] + 4 * w0);
    } else {
      r[k] = u32x16{};
      std::memcpy(&r[k], rows[k] + 4 * w0, 4 * cnt);
    }
  }
  transpose16(r);
}

// Scale bytes b4 .. b4+3 of packed rows[0..16) (head dim d), lane k from row k's dword, low byte first (bytes past
// the row's last scale read as 0).
template <class R>
inline u32x16 scale_dwords(const R& rows, int64_t d, int64_t b4) {
  const int64_t have = std::min<int64_t>(4, d / 32 - b4);
#ifdef __AVX512F__
  if (have == 4) {  // one dword from each row, broadcast into its lane, in four independent chains (two 8-lane
                    // gathers took a quarter of int_expand on Zen 5; these loads 6% less of the whole scan)
    const int64_t at = d / 2 + b4;
    __m512i part[4];
    for (int c = 0; c < 4; ++c) {
      int32_t v = 0;
      std::memcpy(&v, rows[c] + at, 4);
      part[c] = _mm512_maskz_set1_epi32(static_cast<__mmask16>(1u << c), v);
    }
    for (int k = 4; k < 16; ++k) {
      int32_t v = 0;
      std::memcpy(&v, rows[k] + at, 4);
      part[k % 4] = _mm512_mask_set1_epi32(part[k % 4], static_cast<__mmask16>(1u << k), v);
    }
    return reinterpret_cast<u32x16>(
        _mm512_or_si512(_mm512_or_si512(part[0], part[1]), _mm512_or_si512(part[2], part[3])));
  }
#endif
  u32x16 bytes4{};
  for (int k = 0; k < 16; ++k) {
    uint32_t v = 0;
    std::memcpy(&v, rows[k] + d / 2 + b4, have);
    bytes4[k] = v;
  }
  return bytes4;
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
    for (int64_t b4 = 0; b4 < nb; b4 += 4) {
      const u32x16 bytes4 = scale_dwords(RowList{rows}, d, b4);
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
    load_transposed(RowList{rows}, w0, cnt, r);  // r[c][k]: dword w0 + c of entry k
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

// ---- the integer path: the same scores from int8 products, where they are provably the same bits ----
// A query that went through the MXFP4 round trip (Indexer.queries) holds, per head and 32-value block b,
// q[i] = a[i] * 2^u_b with a[i] in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}; a stored key holds
// k[i] = c[i] * 2^(s_b - 128) (c = twice the E2M1 value, s_b the block's scale byte). Every product is then
// a[i] c[i] * 2^E_b with E_b = u_b + s_b - 128, and a block's dot is the integer I_b = sum a[i] c[i]
// (|I_b| <= 32 * 144) times 2^E_b: vpdpbusd sums those int8 products exactly.
// The fp32 order above adds subsets of the same products. Where 2^Emin (Emin = min_b E_b over the query's nonzero
// blocks) is a normal float and sum_b B_b 2^(E_b - Emin) < 2^24 (B_b = 12 sum_i |a[i]| bounds sum_i |a[i] c[i]|),
// every product and every partial sum it can form is a multiple of 2^Emin below 2^24 * 2^Emin: exact. Its result
// is then the exact dot, and so is the integer sum_b I_b 2^(E_b - Emin) here, scaled once by 2^Emin: the same
// bits. Each (entry, head) is checked against the stronger (sum_b B_b) 2^(Emax - Emin) < 2^24 before its score is
// used. The argument holds as well for any L <= Emin in place of Emin (2^L normal, (sum_b B_b) 2^(Emax - L) < 2^24,
// L <= 104): a group whose entries all pass with L = S + U (S the entry's least s_b - 128 over every block, U the
// head's least u_b) skips the per-head check and sums in units of 2^L (int_dots' wide), a few vector operations per
// group instead of several per block and head.
// An exact zero dot gets the fp32 order's sign from a scalar pass over its products (zero_dot). An entry that
// fails the check, a query that is not MXFP4 or has a head of zeros, a scale byte outside 1..252 and a thread
// with flush-to-zero or denormals-are-zero set all take the fp32 order above. relu, the weights and the head sum
// are the same vector operations as score_group's.
#ifdef __AVX512F__
constexpr int32_t kNoBlock = INT32_MIN;  // unit of a query block of zeros: it adds nothing and bounds nothing
// A block of zeros' unit where the least E_b is taken, negated where the largest is: past every E_b (|s_b - 128|
// <= 127, |u_b| <= 152), so neither sees it; its sum, 0, shifted by any count adds nothing.
constexpr int32_t kFarUnit = 1 << 28;

struct IntQueries {
  int64_t heads = 0, words = 0, blocks = 0;  // words: d / 8 (8 values each), blocks: d / 32
  std::vector<uint32_t> pattern;             // [t, h, 2w + p]: a[8w + p], a[8w + p + 2], .. a[8w + p + 6] as int8
                                             // bytes, low byte first (p = 0: even values of word w, 1: odd)
  std::vector<int32_t> start;                // [t, h, b]: -12 sum a[i] (vpdpbusd reads c + 12, unsigned)
  std::vector<int32_t> below;                // [t, h, b]: u_b, or kFarUnit for a block of zeros
  std::vector<int32_t> above;                // [t, h, b]: u_b, or -kFarUnit for a block of zeros
  std::vector<int32_t> spread;               // [t, h]: the largest Emax - Emin the bound allows
  std::vector<uint8_t> ok;                   // [t]: every head MXFP4 with a nonzero block
  // the group-wide check (int_score): with U = min_b u_b over the head's nonzero blocks,
  std::vector<int32_t> lowest;               // [t, h]: U
  std::vector<int32_t> rise;                 // [t, h, b]: u_b - U, or kFarUnit for a block of zeros
  std::vector<int32_t> room;                 // [t]: min_h (spread - (max_b u_b - U)), nonzero blocks
  std::vector<int32_t> least_min, least_max;  // [t]: max_h (-126 - U), min_h (104 - U)
  // AMX tiles (amx_multiply; d = 128 only), per query and group of kAmxHeads heads: [t, group, p, r, n] = the four
  // bytes a[8r + 2i + p] << (u_b - U), i = 0..3 (b = r / 4: the block), of the group's head n (0 past the last
  // head): the B tile of tdpbssd that meets the entries' values 2j + p (A_p); amx_ok[t]: every head's
  // u_b - U <= 3 over its nonzero blocks (so |a| << (u_b - U) <= 96 fits an int8).
  std::vector<uint32_t> amx_b;
  std::vector<uint8_t> amx_ok;
};

// Block x[0..32) as a[i] * 2^(unit) for the grid above, or false. abs_sum: sum |a[i]|. Magnitudes and zeros are
// read from the bits, so a subnormal value is never taken for zero (even with denormals-are-zero set); a value
// that flush-to-zero or rounding changes is not a grid integer and declines the block.
inline bool int_block(const float* x, int8_t* a, int32_t& unit, int32_t& sum, int32_t& abs_sum) {
  uint32_t top = 0;  // the largest |x| as bits: for non-NaN values, the order of the bits is that of the magnitudes
  for (int i = 0; i < 32; ++i) top = std::max(top, bits_of(x[i]) & 0x7FFFFFFFu);
  if (top >= 0x7F800000u) return false;  // inf or NaN
  sum = abs_sum = 0;
  if (top == 0) {
    std::memset(a, 0, 32);
    unit = kNoBlock;
    return true;
  }
  int ex = 0;
  std::frexp(float_of(top), &ex);  // |x| max = m 2^ex, m in [0.5, 1): it scales by 2^(4 - ex) into [8, 16)
  // 2^(4 - ex) as a normal float where it is one (x times it is exact unless it lands below the normal range,
  // where no nonzero grid integer lies), else std::ldexp per value
  const bool normal = 4 - ex >= -126 && 4 - ex <= 127;
  const float factor = normal ? float_of(static_cast<uint32_t>(4 - ex + 127) << 23) : 0.0f;
  for (int i = 0; i < 32; ++i) {
    const float v = normal ? x[i] * factor : std::ldexp(x[i], 4 - ex);  // exact where v is a grid integer
    if (!(std::fabs(v) <= 12.0f)) return false;
    const int32_t n = static_cast<int32_t>(v);
    const bool nonzero = (bits_of(x[i]) & 0x7FFFFFFFu) != 0;
    if (static_cast<float>(n) != v || ((0x115Fu >> std::abs(n)) & 1u) == 0 || (n == 0 && nonzero)) {
      return false;  // not on the grid {0, 1, 2, 3, 4, 6, 8, 12}, or a nonzero value that scaled to zero
    }
    a[i] = static_cast<int8_t>(n);
    sum += n;
    abs_sum += std::abs(n);
  }
  unit = ex - 4;
  return true;
}

constexpr int64_t kAmxHeads = 16;  // heads of one AMX product: the 16 int32 columns of a 64-byte tile row

// Head h of query t's AMX tiles (IntQueries' amx_b) from its int8 values a[0..128), or amx_ok[t] = 0 where a
// nonzero block's u_b - U exceeds 3.
inline void amx_query(IntQueries& iq, int64_t t, int64_t h, const int8_t* a) {
  const int64_t th = t * iq.heads + h;
  int32_t rise[4];
  for (int64_t b = 0; b < 4; ++b) {
    rise[b] = iq.rise[th * 4 + b] == kFarUnit ? 0 : iq.rise[th * 4 + b];  // a block of zeros: a = 0, any rise
    if (rise[b] > 3) {
      iq.amx_ok[t] = 0;
      return;
    }
  }
  const int64_t groups = (iq.heads + kAmxHeads - 1) / kAmxHeads;
  uint32_t* tiles = iq.amx_b.data() + (t * groups + h / kAmxHeads) * 2 * 256;
  for (int64_t p = 0; p < 2; ++p) {
    for (int64_t r = 0; r < 16; ++r) {
      uint32_t word = 0;
      for (int64_t i = 0; i < 4; ++i) {
        const int32_t v = a[8 * r + 2 * i + p] * (1 << rise[r / 4]);  // |v| <= 96
        word |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(v))) << (8 * i);
      }
      tiles[p * 256 + r * 16 + h % kAmxHeads] = word;
    }
  }
}

// Query t of q fp32 [Q, H, d] into iq's rows (ok[t] = 0 where it is not MXFP4 or has a head of zeros; a: d int8 of
// scratch).
inline void int_query(const float* q, int64_t t, int64_t heads, int64_t d, IntQueries& iq, int8_t* a) {
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t th = t * heads + h;
    int64_t bound = 0;
    for (int64_t b = 0; b < iq.blocks; ++b) {
      int32_t unit = 0, sum = 0, abs_sum = 0;
      if (!int_block(q + th * d + 32 * b, a + 32 * b, unit, sum, abs_sum)) {
        iq.ok[t] = 0;
        return;
      }
      iq.start[th * iq.blocks + b] = -12 * sum;
      iq.below[th * iq.blocks + b] = unit == kNoBlock ? kFarUnit : unit;
      iq.above[th * iq.blocks + b] = unit == kNoBlock ? -kFarUnit : unit;
      bound += 12 * abs_sum;
    }
    if (bound == 0) {
      iq.ok[t] = 0;
      return;
    }
    int32_t spread = 0;
    while ((bound << (spread + 1)) < (int64_t{1} << 24)) ++spread;
    iq.spread[th] = spread;
    int32_t least = kFarUnit, most = -kFarUnit;  // over the nonzero blocks (bound > 0: there is one)
    for (int64_t b = 0; b < iq.blocks; ++b) {
      least = std::min(least, iq.below[th * iq.blocks + b]), most = std::max(most, iq.above[th * iq.blocks + b]);
    }
    iq.lowest[th] = least;
    for (int64_t b = 0; b < iq.blocks; ++b) {
      const int32_t u = iq.below[th * iq.blocks + b];
      iq.rise[th * iq.blocks + b] = u == kFarUnit ? kFarUnit : u - least;
    }
    iq.room[t] = h == 0 ? spread - (most - least) : std::min(iq.room[t], spread - (most - least));
    iq.least_min[t] = h == 0 ? -126 - least : std::max(iq.least_min[t], -126 - least);
    iq.least_max[t] = h == 0 ? 104 - least : std::min(iq.least_max[t], 104 - least);
    uint32_t* pat = iq.pattern.data() + th * 2 * iq.words;
    for (int64_t i = 0; i < d; ++i) {  // value i = 8w + 2j + p: byte j of pattern 2w + p
      pat[i / 8 * 2 + i % 2] |= static_cast<uint32_t>(static_cast<uint8_t>(a[i])) << (8 * (i % 8 / 2));
    }
    if (!iq.amx_ok.empty() && iq.amx_ok[t]) amx_query(iq, t, h, a);
  }
}

// q fp32 [Q, H, d] as IntQueries, the queries split over the threads; with amx (and d = 128), its AMX tiles too.
inline IntQueries int_queries(const float* q, int64_t nq, int64_t heads, int64_t d, bool amx) {
  IntQueries iq;
  iq.heads = heads, iq.words = d / 8, iq.blocks = d / 32;
  iq.pattern.assign(nq * heads * 2 * iq.words, 0);
  iq.start.resize(nq * heads * iq.blocks);
  iq.below.resize(nq * heads * iq.blocks);
  iq.above.resize(nq * heads * iq.blocks);
  iq.spread.resize(nq * heads);
  iq.ok.assign(nq, 1);
  iq.lowest.resize(nq * heads);
  iq.rise.resize(nq * heads * iq.blocks);
  iq.room.resize(nq), iq.least_min.resize(nq), iq.least_max.resize(nq);
  if (amx && d == 128) {
    iq.amx_b.assign(nq * ((heads + kAmxHeads - 1) / kAmxHeads) * 2 * 256, 0);
    iq.amx_ok.assign(nq, 1);
  }
  at::parallel_for(0, nq, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int8_t> a(d);
    for (int64_t t = t0; t < t1; ++t) int_query(q, t, heads, d, iq, a.data());
  });
  return iq;
}

// One 16-entry group's keys for the integer path: byte j of ex[2w + p] lane k holds c + 12 of value 8w + 2j + p of
// entry k (p = 0: the low nibbles of its dword w, 1: the high ones), the order of IntQueries' patterns, so one
// vpdpbusd sums four products of one entry in its own lane; unit[b] lane k: s_b - 128 of entry k.
// least lane k: S = min_b (s_b - 128) of entry k, range: max_b (s_b - 128) - S, rise[b]: s_b - 128 - S.
struct IntGroup {
  std::vector<__m512i> ex;
  v16i unit[kMaxDim / 32];
  v16i least, range, rise[kMaxDim / 32];
};

// The block units of rows[0..16) (a RowList or RowRun; head dim d): unit[b] lane k = s_b - 128 of entry k, least
// lane k its least over the blocks (S), range its largest minus S; returns the mask of entries holding a scale byte
// outside 1..252.
template <class R>
__attribute__((target("avx512f,avx512bw"))) inline uint32_t block_units(const R& rows, int64_t d, v16i* unit,
                                                                      v16i& least, v16i& range) {
  const int64_t nb = d / 32;
  uint32_t bad = 0;
  for (int64_t b4 = 0; b4 < nb; b4 += 4) {
    const u32x16 bytes4 = scale_dwords(rows, d, b4);
    for (int64_t b = b4; b < std::min<int64_t>(nb, b4 + 4); ++b) {
      const u32x16 s = bytes4 >> (8 * (b - b4)) & 255u;
      bad |= mask_of(reinterpret_cast<v16i>(s - 1u > 251u));
      unit[b] = reinterpret_cast<v16i>(s) - 128;
    }
  }
  v16i most = unit[0];
  least = unit[0];
  for (int64_t b = 1; b < nb; ++b) {
    least = unit[b] < least ? unit[b] : least;
    most = unit[b] > most ? unit[b] : most;
  }
  range = most - least;
  return bad;
}

// Expand rows[0..16) (a RowList or RowRun) into g; returns the mask of entries holding a scale byte outside 1..252.
// D: the head dim when known at compile time (0: d).
template <int64_t D, class R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline uint32_t int_expand(const R& rows, int64_t d,
                                                                                 IntGroup& g) {
  if constexpr (D > 0) d = D;
  const int64_t words = d / 8, nb = d / 32;
  const uint32_t bad = block_units(rows, d, g.unit, g.least, g.range);
  for (int64_t b = 0; b < nb; ++b) g.rise[b] = g.unit[b] - g.least;
  alignas(64) static const int8_t kLut[64] = {  // code -> c + 12, in each 128-bit lane (vpshufb's table)
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  // codes 0..7: +grid, 8..15: -grid
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  const __m512i lut = _mm512_load_si512(kLut), nibble = _mm512_set1_epi8(0x0F);
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, words - w0);
    u32x16 r[16];
    load_transposed(rows, w0, cnt, r);  // r[c] lane k: dword w0 + c of entry k (codes of values 8(w0 + c) .. +7)
    for (int64_t c = 0; c < cnt; ++c) {
      const __m512i x = reinterpret_cast<__m512i>(r[c]);
      g.ex[2 * (w0 + c)] = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, nibble));
      g.ex[2 * (w0 + c) + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi32(x, 4), nibble));
    }
  }
  return bad;
}

// The fp32 order's dot where the exact dot is zero: -0 when every product q[i] k[i] is -0, else +0 (a sum of
// exact partials is -0 only when every term is).
inline float zero_dot(const float* qh, const uint8_t* row, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t code = row[i / 2] >> (4 * (i % 2)) & 15u;
    const float k = float_of(grid_bits(code)) * float_of(static_cast<uint32_t>(row[d / 2 + i / 32]) << 23);
    const float p = qh[i] * k;
    if (p != 0.0f || !std::signbit(p)) return 0.0f;
  }
  return -0.0f;
}

// Head h's term of 16 entries' scores added to total (the first head's sets it), from its exact dots (lanes where
// seen; qh: the head's fp32 query, rows: the entries' rows, wh: its weight): a zero dot takes the fp32 order's sign
// (zero_dot), then relu as score_group's x < 0 ? 0 : x: vmaxps(+0, x) is +0 where +0 > x, else x (-0 kept; the dots
// here are exact, never NaN or subnormal).
__attribute__((target("avx512f"))) inline void add_head(v16& total, v16 dot, __mmask16 seen, int64_t h,
                                                        const float* qh, int64_t d, const uint8_t* const* rows,
                                                        float wh) {
  const __m512 zero_ps = _mm512_setzero_ps();
  for (uint32_t zero = _mm512_mask_cmp_ps_mask(seen, reinterpret_cast<__m512>(dot), zero_ps, _CMP_EQ_OQ); zero != 0;
       zero &= zero - 1) {
    const int k = __builtin_ctz(zero);
    dot[k] = zero_dot(qh, rows[k], d);
  }
  const v16 r = reinterpret_cast<v16>(_mm512_max_ps(zero_ps, reinterpret_cast<__m512>(dot))) * wh;
  total = h == 0 ? r : total + r;
}

// Exact dots of heads th0 .. th0 + HG - 1 (query t's rows of iq: th0 = t H + h0) with the entries of groups
// g[0..G) into dot[i][h] (group i); returns the mask of g[0]'s entries that pass the check for every one of these
// heads: emax - emin <= spread and -126 <= emin <= 104, emin / emax the least and largest E_b over the head's
// nonzero blocks. The block dots are summed as integers in units of 2^emin (sum_b I_b << (E_b - emin): below 2^24
// where the check passes), then scaled once.
// wide: every entry the caller uses passed the group-wide check of int_score (L = S + U <= emin, emax - L <= spread,
// -126 <= L <= 104); the argument above holds with L for emin (every product a multiple of 2^L, each partial sum
// below 2^24 2^L), so the sums are taken in units of 2^L, shifted by the entry's rise[b] plus the head's: no
// per-head least and largest, and the mask returned is all entries. G = 2 (only wide): each broadcast of the
// query's pattern serves both groups' vpdpbusd. Integer sums are exact, so how they are grouped changes no bit.
// D: the head dim when known at compile time (0: from iq).
template <int G, int HG, int64_t D>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline uint32_t int_dots(const IntQueries& iq, int64_t th0,
                                                                               const IntGroup* const* g, bool wide,
                                                                               v16 (*dot)[kHeadsAtOnce]) {
  static_assert(G == 1 || G == 2, "one group, or two scored wide");
  const int64_t nb = D > 0 ? D / 32 : iq.blocks, words = nb * 4;
  const uint32_t* pat = iq.pattern.data() + th0 * 2 * words;
  const int32_t *start = iq.start.data() + th0 * nb, *below = iq.below.data() + th0 * nb;
  const int32_t *above = iq.above.data() + th0 * nb, *spread = iq.spread.data() + th0;
  const int32_t *lowest = iq.lowest.data() + th0, *rise = iq.rise.data() + th0 * nb;
  constexpr int C = G == 1 ? 2 : 1;  // vpdpbusd chains per (group, head): C G HG chains of 8 / C overlap
  __m512i acc[G == 1 ? (D > 0 ? D / 32 : kMaxDim / 32) : 1][HG];  // not wide: acc[b][h] lane k: I_b of entry k
  __m512i total[G][HG];  // wide: sum_b I_b << (rise[b] + the head's rise[b])
  for (int i = 0; i < G; ++i) {
    for (int h = 0; h < HG; ++h) total[i][h] = _mm512_setzero_si512();
  }
  for (int64_t b = 0; b < nb; ++b) {  // the HG heads' sums over block b from start
    __m512i part[C][G][HG];
    for (int h = 0; h < HG; ++h) {
      for (int i = 0; i < G; ++i) {
        part[0][i][h] = _mm512_set1_epi32(start[h * nb + b]);
        if constexpr (C == 2) part[1][i][h] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int x = 0; x < 8; ++x) {  // ex[8b + x]: 4 of the block's 32 values
      __m512i k[G];
      for (int i = 0; i < G; ++i) k[i] = g[i]->ex[8 * b + x];
      for (int h = 0; h < HG; ++h) {
        const __m512i qv = _mm512_set1_epi32(static_cast<int32_t>(pat[h * 2 * words + 8 * b + x]));
        for (int i = 0; i < G; ++i) part[x % C][i][h] = _mm512_dpbusd_epi32(part[x % C][i][h], k[i], qv);
      }
    }
    for (int i = 0; i < G; ++i) {
      for (int h = 0; h < HG; ++h) {
        __m512i sum = part[0][i][h];
        if constexpr (C == 2) sum = _mm512_add_epi32(sum, part[1][i][h]);
        if (wide) {  // a block of zeros: its sum 0 shifted by kFarUnit + rise_s (> 31 bits: 0)
          const v16i by = g[i]->rise[b] + rise[h * nb + b];
          total[i][h] = _mm512_add_epi32(total[i][h], _mm512_sllv_epi32(sum, reinterpret_cast<__m512i>(by)));
        } else if constexpr (G == 1) {
          acc[b][h] = sum;
        }
      }
    }
  }
  if (wide) {
    for (int i = 0; i < G; ++i) {
      for (int h = 0; h < HG; ++h) {
        const v16 unit_value = reinterpret_cast<v16>(reinterpret_cast<u32x16>(g[i]->least + (lowest[h] + 127)) << 23);
        dot[i][h] = __builtin_convertvector(reinterpret_cast<v16i>(total[i][h]), v16) * unit_value;
      }
    }
    return 0xFFFF;
  }
  __mmask16 pass = 0xFFFF;
  if constexpr (G == 1) {
    const IntGroup& e = *g[0];
    for (int h = 0; h < HG; ++h) {  // after the sums, one head at a time: few vectors live at once
      v16i lo = e.unit[0] + below[h * nb], hi = e.unit[0] + above[h * nb];
      for (int64_t b = 1; b < nb; ++b) {
        const v16i u = e.unit[b] + below[h * nb + b], f = e.unit[b] + above[h * nb + b];
        lo = u < lo ? u : lo;
        hi = f > hi ? f : hi;
      }
      const __m512i least = reinterpret_cast<__m512i>(lo);
      pass = _mm512_mask_cmple_epi32_mask(pass, reinterpret_cast<__m512i>(hi - lo), _mm512_set1_epi32(spread[h]));
      pass = _mm512_mask_cmpge_epi32_mask(pass, least, _mm512_set1_epi32(-126));
      pass = _mm512_mask_cmple_epi32_mask(pass, least, _mm512_set1_epi32(104));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t b = 0; b < nb; ++b) {  // a block of zeros: its sum 0 shifted by kFarUnit - least (> 31 bits: 0)
        const v16i u = e.unit[b] + below[h * nb + b];
        sum = _mm512_add_epi32(sum, _mm512_sllv_epi32(acc[b][h], reinterpret_cast<__m512i>(u - lo)));
      }
      // 2^emin as fp32 bits where emin is in the normal range (else the check fails)
      const v16 unit_value = reinterpret_cast<v16>(reinterpret_cast<u32x16>(lo + 127) << 23);
      dot[0][h] = __builtin_convertvector(reinterpret_cast<v16i>(sum), v16) * unit_value;
    }
  }
  return pass;
}

// The group-wide check for query t (int_dots' wide): S >= -126 - U and S <= 104 - U and range + max_b u_b - U <=
// spread for every head (IntQueries' room, least_min, least_max). wide_fits: the entries (least S and range as
// block_units gives them) that pass it with their range at most room (iq.room[t], or less); group_wide: whether
// every entry of seen (a mask of g's entries) passes it.
__attribute__((target("avx512f"))) inline uint32_t wide_fits(const IntQueries& iq, int64_t t, const v16i& least,
                                                             const v16i& range, int32_t room) {
  const __m512i low = reinterpret_cast<__m512i>(least);
  __mmask16 fits = _mm512_cmple_epi32_mask(reinterpret_cast<__m512i>(range), _mm512_set1_epi32(room));
  fits = _mm512_mask_cmpge_epi32_mask(fits, low, _mm512_set1_epi32(iq.least_min[t]));
  fits = _mm512_mask_cmple_epi32_mask(fits, low, _mm512_set1_epi32(iq.least_max[t]));
  return fits;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline bool group_wide(const IntQueries& iq, int64_t t,
                                                                             const IntGroup& g, uint32_t seen) {
  return (seen & ~wide_fits(iq, t, g.least, g.range, iq.room[t])) == 0;
}

// Scores of query t (q: its fp32 values [H, d]) against the 16 entries of each group g[0..G) (rows[16 i + k]: entry
// k of group i's row) into s[i] (lanes where visible[i]), or false where the check above fails for a visible entry
// (nothing written then). wide: every visible entry of every group passed group_wide (G = 2: always so; G = 1:
// else each entry takes the exact check). D: the head dim when known at compile time (0: from iq).
template <int G, int64_t D>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline bool int_score(const IntQueries& iq, int64_t t,
                                                                            const IntGroup* const* g, bool wide,
                                                                            const float* q,
                                                                            const uint8_t* const* rows,
                                                                            const float* wt, const v16i* visible,
                                                                            v16* s) {
  const int64_t heads = iq.heads, d = D > 0 ? D : iq.words * 8;
  v16 total[G], dot[G][kHeadsAtOnce];
  __mmask16 seen[G];  // the visible entries of each group
  for (int i = 0; i < G; ++i) seen[i] = static_cast<__mmask16>(mask_of(visible[i]));
  for (int64_t h0 = 0; h0 < heads; h0 += kHeadsAtOnce) {
    const int64_t hg = std::min<int64_t>(kHeadsAtOnce, heads - h0), th0 = t * heads + h0;
    uint32_t pass = 0;
    switch (hg) {
      case 4: pass = int_dots<G, 4, D>(iq, th0, g, wide, dot); break;
      case 3: pass = int_dots<G, 3, D>(iq, th0, g, wide, dot); break;
      case 2: pass = int_dots<G, 2, D>(iq, th0, g, wide, dot); break;
      default: pass = int_dots<G, 1, D>(iq, th0, g, wide, dot); break;
    }
    if ((seen[0] & ~pass) != 0) return false;  // G = 1 only: wide passes every entry
    for (int i = 0; i < G; ++i) {
      for (int64_t h = 0; h < hg; ++h) {
        add_head(total[i], dot[i][h], seen[i], h0 + h, q + (h0 + h) * d, d, rows + kGroup * i, wt[h0 + h]);
      }
    }
  }
  for (int i = 0; i < G; ++i) s[i] = visible[i] != 0 ? total[i] : s[i];
  return true;
}

// ---- AMX: the integer path's dots of 16 entries as two tile products (Intel AMX-INT8: Sapphire Rapids on) ----
// At d = 128, where an entry's block units s_b - 128 lie within 3 of its least S (rise r_b = s_b - 128 - S) and
// the query's within 3 of U (IntQueries' amx_ok), c << r_b and a << (u_b - U) are int8 (|c|, |a| <= 12: at most
// 96), and one product sums a whole dot in units of 2^(S + U): sum_i (c[i] << r_b) (a[i] << (u_b - U)) =
// sum_b I_b 2^(E_b - S - U), the wide path's integer (int_dots), so its bits. The entries are tile A (row k: entry
// k, no transpose), its 64 bytes of codes read as two rows of values (A_0: the low nibbles, values 2j; A_1: the
// high ones, 2j + 1), each code looked up as c << r_b in a table chosen by the entry's four rises (kRiseTables: one
// vpshufb per 64 values, lane b holding block b's table); the query's heads are tile B's columns (IntQueries'
// amx_b), so C = A_0 B_0 + A_1 B_1 holds, row k, column n, the dot of entry k and head n. The group-wide check
// (group_wide) still bounds each sum below 2^24, and the same head terms follow (add_head).
struct alignas(64) AmxScratch {  // one group in flight
  int8_t a[2][16][64];            // A_0, A_1
  std::vector<int32_t> c;         // [head group, 256]: C, rows of 64 bytes (16 x 4 packed where H = 4)
  alignas(16) uint8_t table[16];  // each entry's rises r_0 | r_1 << 2 | r_2 << 4 | r_3 << 6
  v16i least;                     // lane k: entry k's S
  uint32_t seen = 0;              // the group's entries the query sees
  int64_t group = 0;              // which group of the task
};

struct alignas(64) AmxConfig {  // palette 1; tile 0: C, 1 and 2: A_0 and A_1, 3 and 4: B_0 and B_1; 5, 6, 7: C, A_0, A_1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// kRiseTables[i]: vpshufb's table for rises i = r_0 | r_1 << 2 | r_2 << 4 | r_3 << 6, lane b: code -> c << r_b
constexpr std::array<std::array<int8_t, 64>, 256> rise_tables() {
  constexpr int8_t kValue[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // twice E2M1
  std::array<std::array<int8_t, 64>, 256> t{};
  for (int i = 0; i < 256; ++i) {
    for (int b = 0; b < 4; ++b) {
      for (int code = 0; code < 16; ++code) {
        t[i][16 * b + code] = static_cast<int8_t>(kValue[code] * (1 << (i >> (2 * b) & 3)));
      }
    }
  }
  return t;
}
alignas(64) constexpr std::array<std::array<int8_t, 64>, 256> kRiseTables = rise_tables();

// Whether this CPU has AMX-INT8 and Linux lets this process use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16 on; asked once, for the whole process)
inline bool amx_usable() {
  static const bool yes = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx >> 24 & 1u) == 0 || (edx >> 25 & 1u) == 0) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return yes;
}

// Whether index_scores takes its AMX products now: usable here and not turned off (KVDIET_INDEX_AMX=0, read on each
// call, so tests compare both ways)
inline bool amx_wanted() {
  const char* off = std::getenv("KVDIET_INDEX_AMX");
  return (off == nullptr || std::strcmp(off, "0") != 0) && amx_usable();
}

// The calling thread's tiles configured for B and C of `cols` columns (a parallel task's, before its first product)
__attribute__((target("amx-tile"))) inline void amx_begin(int64_t cols) {
  AmxConfig config;
  config.colsb[0] = config.colsb[3] = config.colsb[4] = config.colsb[5] = static_cast<uint16_t>(4 * cols);
  config.colsb[1] = config.colsb[2] = config.colsb[6] = config.colsb[7] = 64;
  for (int i = 0; i < 8; ++i) config.rows[i] = 16;
  // GCC's _tile_loadconfig tells the compiler it reads only a pointer's worth of the config: without this barrier
  // the stores above are dropped as dead
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void amx_end() { _tile_release(); }

// Query t's B tiles of head group g into tiles 3 and 4
__attribute__((target("amx-tile"))) inline void amx_load_query(const IntQueries& iq, int64_t t, int64_t g) {
  const uint32_t* b = iq.amx_b.data() + (t * ((iq.heads + kAmxHeads - 1) / kAmxHeads) + g) * 2 * 256;
  asm volatile("" : : "r"(b) : "memory");  // (as in amx_multiply)
  _tile_loadd(3, b, 64);
  _tile_loadd(4, b + 256, 64);
}

// The four stages of a group on the AMX path, each a group after the one before (score_tile), so that no tile load
// or store waits on the work just before it: amx_expand writes A, amx_multiply loads it and runs the products,
// amx_store stores C, and amx_finish reads it.
//
// amx_expand: the 16 entries rows[0..16) of query t's group into slot (A_0, A_1, each entry's least unit S), or
// false where a seen entry has a scale byte outside 1..252, a rise past 3, or fails group_wide (slot unchanged).
template <class R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline bool amx_expand(const IntQueries& iq, int64_t t,
                                                                              const R& rows, uint32_t seen,
                                                                              AmxScratch& slot) {
  v16i unit[4], least, range;
  const uint32_t bad = block_units(rows, 128, unit, least, range);
  const uint32_t fits = wide_fits(iq, t, least, range, std::min(3, iq.room[t])) & ~bad;  // rises up to 3
  if ((seen & ~fits) != 0) return false;
  const v16i table = (unit[0] - least) | (unit[1] - least) << 2 | (unit[2] - least) << 4 | (unit[3] - least) << 6;
  _mm_store_si128(reinterpret_cast<__m128i*>(slot.table),
                  _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(static_cast<__mmask16>(fits),
                                                              reinterpret_cast<__m512i>(table))));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 16; ++k) {
    const __m512i x = _mm512_loadu_si512(rows[k]);
    const __m512i lut = _mm512_load_si512(kRiseTables[slot.table[k]].data());
    _mm512_store_si512(slot.a[0][k], _mm512_shuffle_epi8(lut, _mm512_and_si512(x, nibble)));
    _mm512_store_si512(slot.a[1][k], _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble)));
  }
  slot.least = least;
  slot.seen = seen;
  return true;
}

// amx_multiply: the products of slot's group with query t's first head group (its B tiles in tiles 3 and 4), into
// C tile 0 from A tiles 1 and 2 (odd: 5 from 6 and 7, so that consecutive groups' tile loads need not wait for the
// products still reading the tiles before them). amx_store, a group later, stores that C: a tile store waits for
// its products, and waited on at once it stalls the vector work behind it. Past 16 heads (H > kAmxHeads) both run
// at once, head group by head group.
__attribute__((target("amx-tile,amx-int8"))) inline void amx_multiply(const IntQueries& iq, int64_t t, bool odd,
                                                                     AmxScratch& slot) {
  const int64_t groups = (iq.heads + kAmxHeads - 1) / kAmxHeads;
  // GCC's _tile_loadd, like _tile_loadconfig, declares no read of memory: the barrier keeps A's stores before it
  asm volatile("" : : "r"(slot.a) : "memory");
  if (odd) {
    _tile_loadd(6, slot.a[0], 64);
    _tile_loadd(7, slot.a[1], 64);
  } else {
    _tile_loadd(1, slot.a[0], 64);
    _tile_loadd(2, slot.a[1], 64);
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (groups > 1) amx_load_query(iq, t, g);
    if (odd) {
      _tile_zero(5);
      _tile_dpbssd(5, 6, 3);
      _tile_dpbssd(5, 7, 4);
    } else {
      _tile_zero(0);
      _tile_dpbssd(0, 1, 3);
      _tile_dpbssd(0, 2, 4);
    }
    if (groups > 1 && g + 1 < groups) {
      _tile_stored(0, slot.c.data() + g * 256, 64);  // (H > 16: never odd, see score_tile)
    }
  }
}

__attribute__((target("amx-tile,amx-int8"))) inline void amx_store(const IntQueries& iq, bool odd, AmxScratch& slot) {
  const int64_t stride = iq.heads == 4 ? 16 : 64;  // C packed 16 x 4 where it has 4 columns
  int32_t* c = slot.c.data() + (iq.heads - 1) / kAmxHeads * 256;  // the last head group's
  if (odd) {
    _tile_stored(5, c, stride);
  } else {
    _tile_stored(0, c, stride);
  }
}

// amx_finish: the scores of slot's group (rows: its entries' rows, for zero_dot) for query t (q: its fp32 values
// [H, 128], wt: its weights), -inf where not seen
__attribute__((target("avx512f,avx512bw"))) inline v16 amx_finish(const IntQueries& iq, int64_t t,
                                                                  const AmxScratch& slot, const uint8_t* const* rows,
                                                                  const float* q, const float* wt) {
  const int64_t heads = iq.heads, groups = (heads + kAmxHeads - 1) / kAmxHeads;
  v16 total{};
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* c = slot.c.data() + g * 256;
    v16i dots[kAmxHeads];  // dots[n] lane k: the integer dot of entry k and head 16g + n
    if (heads == 4) {  // C packed 16 x 4: vector j holds entries 4j .. 4j + 3, column n at lane 4(k % 4) + n
      for (int n = 0; n < 4; ++n) {
        const __m512i pick = _mm512_setr_epi32(n, 4 + n, 8 + n, 12 + n, 16 + n, 20 + n, 24 + n, 28 + n, 0, 0, 0, 0,
                                               0, 0, 0, 0);
        const __m512i lo = _mm512_permutex2var_epi32(_mm512_loadu_si512(c), pick, _mm512_loadu_si512(c + 16));
        const __m512i hi = _mm512_permutex2var_epi32(_mm512_loadu_si512(c + 32), pick, _mm512_loadu_si512(c + 48));
        dots[n] = reinterpret_cast<v16i>(_mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1));
      }
    } else {
      u32x16 r[16];
      for (int k = 0; k < 16; ++k) r[k] = load_vec<u32x16>(c + 16 * k);
      transpose16(r);
      for (int n = 0; n < 16; ++n) dots[n] = reinterpret_cast<v16i>(r[n]);
    }
    for (int64_t n = 0; n < std::min(kAmxHeads, heads - g * kAmxHeads); ++n) {
      const int64_t h = g * kAmxHeads + n;
      const v16 unit_value =
          reinterpret_cast<v16>(reinterpret_cast<u32x16>(slot.least + (iq.lowest[t * heads + h] + 127)) << 23);
      add_head(total, __builtin_convertvector(dots[n], v16) * unit_value, static_cast<__mmask16>(slot.seen), h,
               q + h * 128, 128, rows, wt[h]);
    }
  }
  return lanes_of(slot.seen) != 0 ? total : v16{} - std::numeric_limits<float>::infinity();
}

std::atomic<int64_t> g_integer_groups{0};  // (query, 16-entry group) pairs scored on the integer path
std::atomic<int64_t> g_amx_groups{0};      // of those, the pairs scored by AMX products

inline bool integer_path_available() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
}
#endif

// Lanes 0 .. cnt - 1 of s to o
inline void store_scores(float* o, const v16& s, int64_t cnt) {
  if (cnt == kGroup) {
    store_vec(o, s);
  } else {
    std::memcpy(o, &s, cnt * sizeof(float));
  }
}

// The row of entry j
inline const uint8_t* row_of(const ScoreArgs& a, int64_t j) {
  return a.keys + (a.table[j / a.per_block] * a.per_block + j % a.per_block) * a.row_bytes;
}

#ifdef __AVX512F__
struct IntPath {               // the integer path of one parallel task
  const IntQueries* queries;   // set for a task of one MXFP4 query where the path is taken (see index_scores)
  IntGroup* group;             // [2]: two groups expanded at once, scored together where both are wide
  AmxScratch* amx = nullptr;   // [4] set where this thread's tiles are configured (amx_expand)
  int64_t scored = 0;          // (query, group) pairs it scored
  int64_t amx_scored = 0;      // of those, by AMX products
};

// Whether this thread computes with IEEE subnormals (the exactness argument above needs them): neither
// flush-to-zero (MXCSR bit 15) nor denormals-are-zero (bit 6), as torch.set_flush_denormal(True) sets them.
inline bool ieee_subnormals() { return (_mm_getcsr() & 0x8040u) == 0; }
#else
struct IntPath {};
#endif

// Score entries ids[0..n) (id < 0: not scored; ids[n..kTile) are -1) for queries t0..t1; out[t][e] at
// out + (t - t0) * out_stride + e. rows[e]: entry e's row (kZeroRow where ids[e] < 0); ahead: nullptr or the
// next tile's kTile rows, prefetched a group at a time (each group's reads then start a tile ahead, spread over
// the tile instead of all at once, which stalls on the few outstanding misses a core can track). Returns -1 or
// the first entry with a scale byte outside 1..252. D: the head dim when known at compile time (0: a.dim). ip: this
// task's integer path (its queries nullptr where it is not taken; where it is, groups go two at a time, and a pair
// whose visible entries all pass the group-wide check is scored in one int_score; else each group on its own).
template <int64_t D>
int64_t score_tile(const ScoreArgs& a, const int64_t* ids, const uint8_t* const* rows, int64_t run,
                   const uint8_t* const* ahead, int64_t n, int64_t t0, int64_t t1, float* out, int64_t out_stride,
                   float* tile, const v16& grid, IntPath& ip) {
  const int64_t d = D > 0 ? D : a.dim, groups = (n + kGroup - 1) / kGroup;
  constexpr int64_t S = D > 0 ? D / 2 + D / 32 : 0;  // a packed row's bytes, where D is known
  // whether group g's rows all lie in the task's leading run of `run` rows (rows[0] on, S bytes apart): expanded
  // from one base address
  const bool packed_rows = S > 0 && a.packed && a.row_bytes == S;
  const auto in_run = [&](int64_t g) { return packed_rows && (g + 1) * kGroup <= run; };
  constexpr float kNeg = -std::numeric_limits<float>::infinity();
  int64_t bad = -1, in_tile = -1;  // in_tile: the group decoded in tile
  bool integer[2] = {};            // group g0 + i expanded for the integer path, every scale byte valid
  // group g's reads ahead, and its expansion (into ip.group[g % 2]) or decoding (noting bad scale bytes)
  const auto read_ahead = [&](int64_t g) {
    for (int64_t k = 0; ahead != nullptr && k < kGroup; ++k) {
      __builtin_prefetch(ahead[g * kGroup + k]);
      __builtin_prefetch(ahead[g * kGroup + k] + a.row_bytes - 1);
    }
  };
  const auto prepare = [&](int64_t g) {
    const int64_t* gid = ids + g * kGroup;
    read_ahead(g);
    const uint32_t present = ids_below(gid, std::numeric_limits<int64_t>::max());
    integer[g % 2] = false;
#ifdef __AVX512F__
    if (ip.queries != nullptr && present != 0) {
      uint32_t bad_scales = 0;
      if constexpr (S > 0) {
        bad_scales = in_run(g) ? int_expand<D>(RowRun<S>{rows[g * kGroup]}, d, ip.group[g % 2])
                               : int_expand<D>(RowList{rows + g * kGroup}, d, ip.group[g % 2]);
      } else {
        bad_scales = int_expand<D>(RowList{rows + g * kGroup}, d, ip.group[g % 2]);
      }
      integer[g % 2] = (bad_scales & present) == 0;
    }
#endif
    if (present != 0 && !integer[g % 2]) {
      uint32_t flagged = decode_group<D>(a, rows + g * kGroup, tile, grid) & present;
      in_tile = g;
      for (int k = 0; flagged != 0; ++k, flagged >>= 1) {
        if ((flagged & 1) && (bad < 0 || gid[k] < bad)) bad = gid[k];
      }
    }
  };
  // group g's scores for query t
  const auto score = [&](int64_t g, int64_t t) {
    float* o = out + (t - t0) * out_stride + g * kGroup;
    const uint32_t seen = ids_below(ids + g * kGroup, a.limit[t]);
    const v16i visible = lanes_of(seen);
    v16 s = v16{} + kNeg;
    if (seen != 0) {
#ifdef __AVX512F__
      const IntGroup* one = ip.group + g % 2;
      if (integer[g % 2] &&
          int_score<1, D>(*ip.queries, t, &one, group_wide(*ip.queries, t, *one, seen), a.q + t * a.heads * d,
                          rows + g * kGroup, a.w + t * a.heads, &visible, &s)) {
        ++ip.scored;
        store_scores(o, s, std::min(kGroup, n - g * kGroup));
        return;
      }
#endif
      if (in_tile != g) {
        decode_group<D>(a, rows + g * kGroup, tile, grid);  // no bad scale byte: prepare noted them
        in_tile = g;
      }
      s = visible != 0 ? score_group<D>(a, tile, a.q + t * a.heads * d, a.w + t * a.heads) : s;
    }
    store_scores(o, s, std::min(kGroup, n - g * kGroup));
  };
#ifdef __AVX512F__
  if constexpr (D == 128) {  // AMX products, a group's stages a group apart (amx_expand); a group they decline
                             // takes the paths below at once
    if (ip.amx != nullptr && ip.queries != nullptr && ip.queries->amx_ok[t0]) {  // one query: t0
      const IntQueries& iq = *ip.queries;
      const float *qt = a.q + t0 * a.heads * d, *wt = a.w + t0 * a.heads;
      // group k of those taken: expanded (into slot k % 4) as it comes, its products a group later, C stored
      // a group after that and scored a group later still. Past 16 heads, the products and the store run
      // together on tiles 0..2 (each head group's B tiles loaded in turn): one group later, then scored. Tiles
      // stay live across the calls between (no function they call touches the tiles).
      const bool split = a.heads <= kAmxHeads;
      if (split) amx_load_query(iq, t0, 0);
      int64_t taken = 0;
      const auto finish = [&](const AmxScratch& slot) {
        const int64_t g = slot.group;
        store_scores(out + g * kGroup, amx_finish(iq, t0, slot, rows + g * kGroup, qt, wt),
                     std::min(kGroup, n - g * kGroup));
        ++ip.scored, ++ip.amx_scored;
      };
      // the stages due once group k (k <= taken) is expanded
      const auto advance = [&](int64_t k) {
        if (split) {
          if (k >= 1 && k - 1 < taken) amx_multiply(iq, t0, (k - 1) % 2 == 1, ip.amx[(k - 1) % 4]);
          if (k >= 2 && k - 2 < taken) amx_store(iq, (k - 2) % 2 == 1, ip.amx[(k - 2) % 4]);
          if (k >= 3 && k - 3 < taken) finish(ip.amx[(k - 3) % 4]);
        } else {
          if (k >= 1 && k - 1 < taken) {
            amx_multiply(iq, t0, false, ip.amx[(k - 1) % 4]);
            amx_store(iq, false, ip.amx[(k - 1) % 4]);
          }
          if (k >= 2 && k - 2 < taken) finish(ip.amx[(k - 2) % 4]);
        }
      };
      for (int64_t g = 0; g < groups; ++g) {
        const uint32_t seen = ids_below(ids + g * kGroup, a.limit[t0]);
        if (seen == 0) {
          store_scores(out + g * kGroup, v16{} + kNeg, std::min(kGroup, n - g * kGroup));
          continue;
        }
        read_ahead(g);
        AmxScratch& slot = ip.amx[taken % 4];
        const uint8_t* const* gr = rows + g * kGroup;
        if (!(in_run(g) ? amx_expand(iq, t0, RowRun<S>{gr[0]}, seen, slot)
                        : amx_expand(iq, t0, RowList{gr}, seen, slot))) {
          prepare(g);
          score(g, t0);
          continue;
        }
        slot.group = g;
        advance(++taken - 1);
      }
      for (int64_t k = taken; k < taken + 3; ++k) advance(k);
      return bad;
    }
  }
  const int64_t step = ip.queries != nullptr ? 2 : 1;  // the integer path's tasks have one query
#else
  constexpr int64_t step = 1;
#endif
  for (int64_t g0 = 0; g0 < groups; g0 += step) {
    const int64_t ng = std::min(step, groups - g0);
    for (int64_t i = 0; i < ng; ++i) prepare(g0 + i);
    for (int64_t t = t0; t < t1; ++t) {
#ifdef __AVX512F__
      if (ng == 2 && integer[0] && integer[1]) {  // g0 is even: group g0 + i in ip.group[i]
        const uint32_t seen[2] = {ids_below(ids + g0 * kGroup, a.limit[t]),
                                  ids_below(ids + (g0 + 1) * kGroup, a.limit[t])};
        const IntGroup* pair[2] = {ip.group, ip.group + 1};
        if (seen[0] != 0 && seen[1] != 0 && group_wide(*ip.queries, t, ip.group[0], seen[0]) &&
            group_wide(*ip.queries, t, ip.group[1], seen[1])) {
          const v16i visible[2] = {lanes_of(seen[0]), lanes_of(seen[1])};
          v16 s[2] = {v16{} + kNeg, v16{} + kNeg};
          int_score<2, D>(*ip.queries, t, pair, true, a.q + t * a.heads * d, rows + g0 * kGroup,
                          a.w + t * a.heads, visible, s);
          ip.scored += 2;
          float* o = out + (t - t0) * out_stride + g0 * kGroup;
          store_scores(o, s[0], kGroup);
          store_scores(o + kGroup, s[1], std::min(kGroup, n - (g0 + 1) * kGroup));
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < ng; ++i) score(g0 + i, t);
    }
  }
  return bad;
}

}  // namespace

// Index scores of queries q fp32 [Q, H, d] (weights w fp32 [Q, H]) against stored keys (packed uint8
// [R, d/2 + d/32] or fp32 [R, d], unit element stride), entry j at row table[j / per_block] * per_block + j %
// per_block.
// entries int64 [Q, C]: score those entries (< 0: not scored) into out [Q, C]; entries empty ([0, 0]): score
// entries 0..C-1 into out [Q, C]. Entries at or past limit[t] get -inf. offsets int64 [Q] (entries empty only;
// empty: all 0): query t's entry c is entry offsets[t] + c of the keys (each query its own run of one shared
// table: a batch's requests in one pool), still visible where c < limit[t]. Returns -1 or the first entry id (of
// the keys: offsets[t] + c) holding a scale byte outside 1..252.
// blocks float32 [Q, ceil(C / block)] (entries empty only; empty: none): each row's block maxima of out besides,
// block_max's bits (topk_kernels.cpp): block i of row t the max of out[t][i·block .. (i + 1)·block) with NaN read
// as -inf, taken while the tile's scores are in cache (block divides a tile's kTile entries). select_topk finds
// a long row's candidates from them without a pass over the row.
int64_t index_scores(at::Tensor q, at::Tensor w, at::Tensor keys, at::Tensor table, int64_t per_block,
                     at::Tensor limit, at::Tensor entries, at::Tensor offsets, at::Tensor out, at::Tensor blocks,
                     int64_t block) {
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
  TORCH_CHECK(offsets.numel() == 0 || (entries.numel() == 0 && offsets.dim() == 1 && offsets.size(0) == nq &&
                                       offsets.is_contiguous() && offsets.scalar_type() == at::kLong),
              "index scores: offsets int64 [Q] (contiguous), with entries empty");
  const bool maxima = blocks.numel() > 0;
  TORCH_CHECK(!maxima || (entries.numel() == 0 && block >= 1 && kTile % block == 0 && blocks.is_contiguous() &&
                          blocks.device().is_cpu() &&
                          blocks.scalar_type() == at::kFloat && blocks.dim() == 2 && blocks.size(0) == nq &&
                          blocks.size(1) == (out.size(1) + block - 1) / block),
              "index scores: blocks float32 [Q, ceil(C / block)] (contiguous, CPU), block dividing ", kTile,
              ", with entries empty");
  float* block_out = maxima ? blocks.data_ptr<float>() : nullptr;
  const int64_t block_cols = maxima ? blocks.size(1) : 0;
  const bool packed = keys.scalar_type() == at::kByte;
  TORCH_CHECK(packed || keys.scalar_type() == at::kFloat, "index scores: keys are uint8 (MXFP4) or float32");
  TORCH_CHECK(keys.size(1) == (packed ? d / 2 + d / 32 : d), "index scores: key rows of ", keys.size(1),
              packed ? " bytes for head dim " : " values for head dim ", d);
  ScoreArgs a{q.data_ptr<float>(), w.data_ptr<float>(), static_cast<const uint8_t*>(keys.data_ptr()),
              keys.stride(0) * keys.element_size(), q.size(1), d, packed, table.data_ptr<int64_t>(), per_block,
              limit.data_ptr<int64_t>()};
  const bool dense = entries.numel() == 0;
  const int64_t width = out.size(1), tiles = (width + kTile - 1) / kTile;
  const int64_t* off = offsets.numel() == 0 ? nullptr : offsets.data_ptr<int64_t>();
  for (int64_t t = 0; off != nullptr && t < nq; ++t) {  // every run inside the table: no read outside it
    const int64_t seen = std::clamp<int64_t>(limit.data_ptr<int64_t>()[t], 0, width);
    TORCH_CHECK(off[t] >= 0 && off[t] <= table.numel() * per_block - seen, "index scores: query ", t,
                "'s run of entries lies outside the table");
  }
  // queries over one run of entries share each decoded tile, 16 at a time; each their own run (offsets), none
  const int64_t qblock = dense && off == nullptr ? 16 : 1, qblocks = (nq + qblock - 1) / qblock;
  float* o = out.data_ptr<float>();
  const int64_t* ent = dense ? nullptr : entries.data_ptr<int64_t>();
  std::atomic<int64_t> bad{INT64_MAX};
#ifdef __AVX512F__
  // The integer path where every task scores one query (a decode step's call: named entries, or each query its
  // own run) and d >= 128: there its expansion and integer dots beat the fp32 decode and dots (about 2x per call
  // at d = 128 with 4 heads, 64K entries, one thread). Where 16 queries share one decoded tile, or at d = 32 and
  // 64, the fp32 order was the faster one (0.6-0.9x, measured before the integer path's one-lane-per-entry
  // layout), so it keeps them.
  IntQueries iq;
  if (packed && d >= 128 && (qblock == 1 || nq == 1) && integer_path_available()) {
    iq = int_queries(a.q, nq, a.heads, d, amx_wanted());
  }
#endif
  at::parallel_for(0, qblocks * tiles, std::max<int64_t>(1, 2048 / (qblock * kTile)), [&](int64_t b0, int64_t b1) {
    std::vector<v16> tile(d);  // 16 entries x d values
#ifdef __AVX512F__
    IntGroup group[2];
    IntPath ip{nullptr, group};
    const bool integer = !iq.ok.empty() && ieee_subnormals();
    for (int i = 0; integer && i < 2; ++i) group[i].ex.resize(d / 4);
    AmxScratch amx_slots[4];  // four groups in flight
    if (integer && !iq.amx_ok.empty()) {  // this thread's tiles, for the task's queries that take them
      for (AmxScratch& slot : amx_slots) slot.c.assign((a.heads + kAmxHeads - 1) / kAmxHeads * 256, 0);
      amx_begin(std::min(a.heads, kAmxHeads));
      ip.amx = amx_slots;
    }
#else
    IntPath ip;
#endif
    const v16 grid = grid_vector();
    int64_t ids_of[2][kTile];  // a task's entries and rows, and the next task's (read ahead)
    const uint8_t* rows_of[2][kTile];
    int64_t run_of[2] = {0, 0};  // how many leading rows of each lie one after another (dense_rows' first run)
    int64_t ready = -1;  // the task whose entries are in ids_of[1 - cur] and rows_of[1 - cur]
    int cur = 0;
    const bool pow2 = (per_block & (per_block - 1)) == 0;
    const int shift = __builtin_ctzll(static_cast<uint64_t>(per_block));
    // a dense task's entries c0 .. c0 + n - 1 (-1 past what its queries see) and their rows (kZeroRow there):
    // rows found per run of consecutive rows, no division per entry; returns the first run's length
    const auto dense_rows = [&](int64_t task, int64_t* ids, const uint8_t** rows) -> int64_t {
      const int64_t qb = task / tiles, c0 = (task % tiles) * kTile, n = std::min(kTile, width - c0);
      const int64_t t0 = qb * qblock, t1 = std::min(nq, t0 + qblock);
      int64_t reach = 0;
      for (int64_t t = t0; t < t1; ++t) reach = std::max(reach, a.limit[t]);
      const int64_t seen = std::clamp<int64_t>(reach - c0, 0, n);
      const int64_t start = (off == nullptr ? 0 : off[t0]) + c0;  // one query per task where off is set
      int64_t lead = 0;  // the first run's rows
      for (int64_t e = 0, block = start / per_block, offset = start % per_block; e < seen; ++block, offset = 0) {
        const uint8_t* first = a.keys + (a.table[block] * per_block + offset) * a.row_bytes;
        const int64_t run = std::min(seen - e, per_block - offset);  // rows one after another in the block
        lead = e == 0 ? run : lead;
        for (int64_t i = 0; i < run; ++i, ++e) ids[e] = c0 + e, rows[e] = first + i * a.row_bytes;
      }
      for (int64_t e = seen; e < kTile; ++e) ids[e] = -1, rows[e] = kZeroRow;
      return lead;
    };
    // a named task's entries (-1 past what its one query sees) and their rows; started at once (``now``: the
    // task about to be scored) or left to score_tile's reads ahead (the next task's, a group at a time)
    const auto named_rows = [&](int64_t task, int64_t* ids, const uint8_t** rows, bool now) -> int64_t {
      const int64_t t0 = task / tiles * qblock, c0 = (task % tiles) * kTile, n = std::min(kTile, width - c0);
      for (int64_t e = 0; e < n; ++e) {
        const int64_t j = ent[t0 * width + c0 + e];
        ids[e] = j < a.limit[t0] ? j : -1;
        if (ids[e] < 0) {
          rows[e] = kZeroRow;
          continue;
        }
        rows[e] = pow2 ? a.keys + ((a.table[j >> shift] << shift) + (j & (per_block - 1))) * a.row_bytes
                       : row_of(a, j);
        if (now) {  // named entries lie anywhere in the pool: start every read now
          __builtin_prefetch(rows[e]);
          __builtin_prefetch(rows[e] + a.row_bytes - 1);
        }
      }
      for (int64_t e = n; e < kTile; ++e) ids[e] = -1, rows[e] = kZeroRow;
      return int64_t{0};  // no run: each row on its own
    };
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t qb = task / tiles, c0 = (task % tiles) * kTile, n = std::min(kTile, width - c0);
      const int64_t t0 = qb * qblock, t1 = std::min(nq, t0 + qblock);
#ifdef __AVX512F__
      ip.queries = integer && iq.ok[t0] ? &iq : nullptr;  // iq is built only where every task has one query
#endif
      if (ready == task) cur = 1 - cur;  // found while the task before was scored
      int64_t* ids = ids_of[cur];
      const uint8_t** rows = rows_of[cur];
      const uint8_t* const* ahead = nullptr;  // the next task's rows, read ahead while this one is scored
      if (ready != task) run_of[cur] = dense ? dense_rows(task, ids, rows) : named_rows(task, ids, rows, true);
      if (task + 1 < b1) {  // the next task is this thread's too: its rows found now
        run_of[1 - cur] = dense ? dense_rows(task + 1, ids_of[1 - cur], rows_of[1 - cur])
                                : named_rows(task + 1, ids_of[1 - cur], rows_of[1 - cur], false);
        ready = task + 1;
        ahead = rows_of[1 - cur];
      }
      float* ot = o + t0 * width + c0;
      float* tp = reinterpret_cast<float*>(tile.data());
      const int64_t run = run_of[cur];
      const int64_t r = d == 128 ? score_tile<128>(a, ids, rows, run, ahead, n, t0, t1, ot, width, tp, grid, ip)
                                 : score_tile<0>(a, ids, rows, run, ahead, n, t0, t1, ot, width, tp, grid, ip);
      if (r >= 0) note_row(bad, r + (off == nullptr ? 0 : off[t0]));  // off: one query per task
      for (int64_t t = t0; maxima && t < t1; ++t) {  // the tile's block maxima (c0: a multiple of block)
        block_maxima(ot + (t - t0) * width, n, block, block_out + t * block_cols + c0 / block);
      }
    }
#ifdef __AVX512F__
    g_integer_groups += ip.scored;
    g_amx_groups += ip.amx_scored;
    if (ip.amx != nullptr) amx_end();
#endif
  });
  return first_noted(bad);
}

// Whether index_scores has its integer path on this CPU (AVX-512 VNNI), and the (query, 16-entry group) pairs it
// scored there in this process
bool index_integer_path() {
#ifdef __AVX512F__
  return integer_path_available();
#else
  return false;
#endif
}

int64_t index_integer_groups() {
#ifdef __AVX512F__
  return g_integer_groups.load();
#else
  return 0;
#endif
}

// Whether the integer path takes AMX products on this CPU (AMX-INT8, granted by Linux) now (KVDIET_INDEX_AMX=0 turns
// them off), and of its (query, group) pairs how many they scored in this process
bool index_amx_path() {
#ifdef __AVX512F__
  return integer_path_available() && amx_wanted();
#else
  return false;
#endif
}

int64_t index_amx_groups() {
#ifdef __AVX512F__
  return g_amx_groups.load();
#else
  return 0;
#endif
}
