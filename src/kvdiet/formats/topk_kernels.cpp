// Exact top-k selection over indexer scores, the same sets as the pure-torch path in kvdiet/model/selection.py.
// Compiled after fp4_kernels.cpp into the same module (fp8_kernels.cpp holds the bindings). Built at first use
// by kvdiet.formats.native.
//
// select_topk: scores float32 [Q, N] (unit element stride) -> per row the min(k, N) highest scores that are not
//   -inf or NaN, ties to the lowest index, ascending by index: idx int64 [Q, kk], valid bool [Q, kk]; the slots
//   past a row's chosen entries hold idx 0 and valid false.
//   Each score maps to a 32-bit key whose unsigned order is the fp32 order (-0 and +0 share one key, as they
//   compare equal); -inf and NaN map to key 0, never chosen. A radix select on the keys finds the k-th largest:
//   a histogram of the top 11 bits, then the entries of the threshold bin (their keys and indices, in index
//   order) refined on bits 20..10 and 9..0. Entries above the threshold key are all chosen, then the lowest-index
//   entries equal to it; the chosen indices are sorted at the end (k of them). A long row (N >= 16K and >= 16 k)
//   first keeps only the entries that reach a threshold guessed from 4,096 evenly spaced scores (aimed at a few
//   times k entries; one vectorised compare per score) and runs the radix select on those: when at least k reach
//   it the k best are among them, the same set; else (a rare unlucky guess) it runs on the whole row. Where the
//   sample holds too few valid scores to guess, the pass keeps every valid entry. Given the rows' block maxima
//   (blocks of any size: index_scores takes them as it scores), a row of 16,384 blocks or more (and N >= 16 k)
//   guesses its threshold from 4,096 sampled maxima instead and reads only the blocks whose max reaches it (an
//   entry that reaches it lies in one): no pass over the row; fewer than k entries found, it takes the pass above.
// block_max: scores float32 [Q, N] -> out float32 [Q, ceil(N / B)], each block's max with NaN read as -inf
//   (-inf for a block of only -inf / NaN; the last block's missing entries count as -inf), the bits of a scalar fold
//   in entry order (of equal largest scores, -0 and +0 alike, the first). Full blocks of B = 8 (V4.1's
//   candidate_block_size) take two blocks per 16-float vector (block8_max) in AVX-512 builds, the rest (and every
//   block elsewhere) the scalar fold.

#include <functional>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kNoKey = 0;  // -inf and NaN: never chosen

// The unsigned key of a score: x < y (fp32) iff key(x) < key(y), and x == y iff the keys are equal, for every
// x, y that are not -inf or NaN.
// Branch-free on the bits (random signs would mispredict): negative scores flip every bit, others the sign bit.
inline uint32_t order_key(float x) {
  const uint32_t u = bits_of(x), magnitude = u & 0x7FFFFFFFu;
  uint32_t key = u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
  key = magnitude == 0 ? 0x80000000u : key;                             // -0 == +0
  return (magnitude > 0x7F800000u || u == 0xFF800000u) ? kNoKey : key;  // NaN or -inf
}

struct Digit {
  int shift, bins;
};
constexpr Digit kDigits[3] = {{21, 2048}, {10, 2048}, {0, 1024}};  // bits 31..21, 20..10, 9..0 of a key

// The bin b holding the want-th largest key of a histogram (want >= 1, at most the keys counted), and the keys
// in bins above it.
inline int threshold_bin(const uint32_t* hist, int bins, int64_t want, int64_t* above) {
  int64_t acc = 0;
  int b = bins - 1;
  for (; b > 0 && acc + hist[b] < want; --b) acc += hist[b];
  *above = acc;
  return b;
}

struct Scratch {
  std::vector<uint32_t> sample, pool;               // sampled keys; entries at or above the sampled threshold
  std::vector<std::pair<uint32_t, uint32_t>> cand;  // (key, entry) of the threshold bin, in entry order
  std::vector<int64_t> chosen;
};

// The kk best of the entries `each` visits (each(f) calls f(j) for every entry j, ascending), into s.chosen,
// ascending: a radix select on order_key(scores[j]).
template <typename Each>
void radix_pick(const float* scores, const Each& each, int64_t kk, Scratch& s) {
  auto& chosen = s.chosen;
  auto& cand = s.cand;
  chosen.clear();
  // four interleaved histograms: runs of one key (all -inf past the visible entries) do not chain on one counter
  uint32_t hist[4][2048];
  std::memset(hist, 0, sizeof hist);
  int64_t count = 0;
  each([&](int64_t j) { ++hist[count++ & 3][order_key(scores[j]) >> 21]; });
  for (int b = 0; b < 2048; ++b) hist[0][b] += hist[1][b] + hist[2][b] + hist[3][b];
  if (count - hist[0][0] <= kk) {  // bin 0 holds key 0 only (finite keys are >= 0x00800000): take every other
    each([&](int64_t j) {
      if (order_key(scores[j]) != kNoKey) chosen.push_back(j);
    });
    return;
  }
  int64_t above;
  const uint32_t b = threshold_bin(hist[0], 2048, kk, &above);
  int64_t want = kk - above;  // from bin b: 1 .. hist[b]
  cand.clear();
  each([&](int64_t j) {
    const uint32_t key = order_key(scores[j]), top = key >> 21;
    if (top > b) {
      chosen.push_back(j);
    } else if (top == b) {
      cand.emplace_back(key, static_cast<uint32_t>(j));
    }
  });
  // refine on the lower digits: cand holds the entries whose key matches the threshold's so far, in entry order
  for (int level = 1; level < 3 && static_cast<int64_t>(cand.size()) > want; ++level) {
    const Digit dg = kDigits[level];
    const uint32_t mask = static_cast<uint32_t>(dg.bins - 1);
    uint32_t* h = hist[0];
    std::memset(h, 0, dg.bins * sizeof(uint32_t));
    for (const auto& c : cand) ++h[(c.first >> dg.shift) & mask];
    const uint32_t t = threshold_bin(h, dg.bins, want, &above);
    want -= above;
    size_t kept = 0;
    for (const auto& c : cand) {
      const uint32_t digit = (c.first >> dg.shift) & mask;
      if (digit > t) {
        chosen.push_back(c.second);
      } else if (digit == t) {
        cand[kept++] = c;
      }
    }
    cand.resize(kept);
  }
  // cand: entries whose key equals the threshold (or exactly want of them, all taken): the lowest indices first
  for (int64_t c = 0; c < want; ++c) chosen.push_back(cand[c].second);
  std::sort(chosen.begin(), chosen.end());
}

constexpr int64_t kSample = 4096;  // scores sampled (evenly spaced) to guess a threshold on a long row

// A score t that likely a few times kk entries of row[0..n) reach, from a strided sample: its (2e + 16)-th best,
// e the sampled entries expected among the kk best. False when fewer valid scores were sampled.
bool sampled_threshold(const float* row, int64_t n, int64_t kk, std::vector<uint32_t>& sample, float* t) {
  const int64_t step = n / kSample;
  sample.clear();
  for (int64_t i = 0; i < kSample; ++i) {
    const uint32_t key = order_key(row[i * step]);
    if (key != kNoKey) sample.push_back(key);
  }
  const int64_t rank = 2 * kSample * kk / n + 16;
  if (rank > static_cast<int64_t>(sample.size())) return false;
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<uint32_t>());
  const uint32_t key = sample[rank - 1];
  *t = float_of((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
  return true;
}

// The entries j of row[0..n) with row[j] >= t (fp32 compare: NaN never, -0 == +0), ascending, into pool.
void entries_reaching(const float* row, int64_t n, float t, std::vector<uint32_t>& pool) {
  pool.clear();
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 tv = _mm512_set1_ps(t);
  for (; j + 16 <= n; j += 16) {
    for (uint32_t m = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), tv, _CMP_GE_OQ); m; m &= m - 1) {
      pool.push_back(static_cast<uint32_t>(j + __builtin_ctz(m)));
    }
  }
#elif defined(__AVX2__)
  const __m256 tv = _mm256_set1_ps(t);
  for (; j + 8 <= n; j += 8) {
    for (uint32_t m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), tv, _CMP_GE_OQ)); m; m &= m - 1) {
      pool.push_back(static_cast<uint32_t>(j + __builtin_ctz(m)));
    }
  }
#endif
  for (; j < n; ++j) {
    if (row[j] >= t) pool.push_back(static_cast<uint32_t>(j));
  }
}

// The entries j of row[0..n) with row[j] >= t, ascending, into pool, read only in the blocks of `block` entries
// whose max (maxima[0..nb), NaN read as -inf) reaches t: no other entry can. Where such blocks hold over a 16th
// of the row (scores tied by the thousand), entries_reaching's pass over the whole row instead: the same pool.
void entries_reaching_in_blocks(const float* row, int64_t n, const float* maxima, int64_t nb, int64_t block, float t,
                                std::vector<uint32_t>& pool) {
  pool.clear();
  const int64_t most = n / (16 * block);  // blocks read before the pass over the row is the cheaper way
  int64_t taken = 0;
  // block blk's entries reaching t into pool; false once more than `most` blocks were read
  const auto take = [&](int64_t blk) {
    for (int64_t j = blk * block; j < std::min(n, (blk + 1) * block); ++j) {
      if (row[j] >= t) pool.push_back(static_cast<uint32_t>(j));
    }
    return ++taken <= most;
  };
  int64_t b = 0;
#ifdef __AVX512F__
  const __m512 tv = _mm512_set1_ps(t);
  for (; b + 16 <= nb; b += 16) {
    for (uint32_t m = _mm512_cmp_ps_mask(_mm512_loadu_ps(maxima + b), tv, _CMP_GE_OQ); m; m &= m - 1) {
      if (!take(b + __builtin_ctz(m))) return entries_reaching(row, n, t, pool);
    }
  }
#endif
  for (; b < nb; ++b) {
    if (maxima[b] >= t && !take(b)) return entries_reaching(row, n, t, pool);
  }
}

// Row `scores[0..n)` (element stride 1): its chosen entries into idx/valid [kk]. A long row first keeps the
// entries reaching a sampled threshold (one vectorised pass); when at least kk do, the kk best are among them.
// When the sample holds too few valid scores (a row mostly past its visible entries) the pass keeps every valid
// entry instead (threshold -FLT_MAX: -inf and NaN fail it), and the kk best are among them whatever their count.
// maxima: nullptr, or the row's nb block maxima (blocks of `block` entries, block_max's): then the threshold is
// guessed from a sample of them (aimed at a few times kk blocks, each holding at least one entry that reaches
// it), and only the blocks reaching it are read; where fewer than kk entries reach it, or the sample holds too few
// valid maxima, the row takes the pass above. The same kk best either way: every entry reaching t is in the pool.
void select_row(const float* scores, int64_t n, int64_t kk, int64_t* idx, bool* valid, Scratch& s,
                const float* maxima, int64_t nb, int64_t block) {
  bool picked = false;
  if (maxima != nullptr && nb >= 4 * kSample && n >= 16 * kk) {
    float t;
    if (sampled_threshold(maxima, nb, kk, s.sample, &t)) {
      entries_reaching_in_blocks(scores, n, maxima, nb, block, t, s.pool);
      if (static_cast<int64_t>(s.pool.size()) >= kk) {
        radix_pick(scores, [&](const auto& f) { for (const uint32_t j : s.pool) f(j); }, kk, s);
        picked = true;
      }
    }
  }
  if (!picked && n >= 4 * kSample && n >= 16 * kk) {
    float t;
    const bool guessed = sampled_threshold(scores, n, kk, s.sample, &t);
    entries_reaching(scores, n, guessed ? t : std::numeric_limits<float>::lowest(), s.pool);
    if (!guessed || static_cast<int64_t>(s.pool.size()) >= kk) {
      radix_pick(scores, [&](const auto& f) { for (const uint32_t j : s.pool) f(j); }, kk, s);
      picked = true;
    }
  }
  if (!picked) radix_pick(scores, [&](const auto& f) { for (int64_t j = 0; j < n; ++j) f(j); }, kk, s);
  const int64_t m = static_cast<int64_t>(s.chosen.size());
  for (int64_t i = 0; i < kk; ++i) {
    idx[i] = i < m ? s.chosen[i] : 0;
    valid[i] = i < m;
  }
}

// float32 [Q, N] rows of unit element stride (any row stride)
inline bool fp32_rows(const at::Tensor& t) {
  return t.dim() == 2 && t.scalar_type() == at::kFloat && (t.size(1) <= 1 || t.stride(1) == 1);
}

}  // namespace

// scores float32 [Q, N] (unit element stride) -> idx int64 [Q, kk], valid bool [Q, kk] (contiguous; kk <= N).
// blocks: empty, or float32 [Q, ceil(N / block)] (contiguous) the rows' block maxima (block_max's, or index_scores'):
// select_row reads a long row's candidates through them.
void select_topk(at::Tensor scores, at::Tensor idx, at::Tensor valid, at::Tensor blocks, int64_t block) {
  TORCH_CHECK(fp32_rows(scores) && idx.dim() == 2 && idx.is_contiguous() && idx.scalar_type() == at::kLong &&
                  valid.is_contiguous() && valid.scalar_type() == at::kBool && valid.sizes() == idx.sizes() &&
                  idx.size(0) == scores.size(0) && idx.size(1) <= scores.size(1) &&
                  scores.size(1) < (int64_t{1} << 32),
              "select_topk: layout");
  const int64_t q = scores.size(0), n = scores.size(1), kk = idx.size(1), stride = scores.stride(0);
  const bool maxima = blocks.numel() > 0;
  TORCH_CHECK(!maxima || (block >= 1 && blocks.is_contiguous() && blocks.device().is_cpu() &&
                          blocks.scalar_type() == at::kFloat &&
                          blocks.dim() == 2 && blocks.size(0) == q && blocks.size(1) == (n + block - 1) / block),
              "select_topk: blocks float32 [Q, ceil(N / block)] (contiguous, CPU)");
  const int64_t nb = maxima ? blocks.size(1) : 0;
  const float* s = scores.data_ptr<float>();
  const float* bm = maxima ? blocks.data_ptr<float>() : nullptr;
  int64_t* out = idx.data_ptr<int64_t>();
  bool* ok = valid.data_ptr<bool>();
  at::parallel_for(0, q, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      select_row(s + r * stride, n, kk, out + r * kk, ok + r * kk, scratch, maxima ? bm + r * nb : nullptr, nb, block);
    }
  });
}

// scores float32 [Q, N] (unit element stride) -> out float32 [Q, ceil(N / block)] contiguous
void block_max(at::Tensor scores, int64_t block, at::Tensor out) {
  TORCH_CHECK(fp32_rows(scores) && block >= 1 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  out.dim() == 2 && out.size(0) == scores.size(0) &&
                  out.size(1) == (scores.size(1) + block - 1) / block,
              "block_max: layout");
  const int64_t q = scores.size(0), n = scores.size(1), nb = out.size(1), stride = scores.stride(0);
  const float* s = scores.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, q * nb, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t t = b0; t < b1;) {  // the task's blocks of one row at a time
      const int64_t r = t / nb, first = t % nb, last = std::min(nb, first + (b1 - t));
      block_maxima(s + r * stride + first * block, std::min(n - first * block, (last - first) * block), block,
                   o + r * nb + first);
      t += last - first;
    }
  });
}
