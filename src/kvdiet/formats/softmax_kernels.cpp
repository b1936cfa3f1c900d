// Softmax over the last dim with the bits of torch.softmax(x, -1) on the CPU, in one compiled pass a row: narrow
// rows (fewer than 16 floats: a prefill's attention logits, window + top-k + sink) and wide ones (a decode step's,
// window + top-k + sink of v4.1-mini: 641). Compiled after attend_kernels.cpp into the same module (fp8_kernels.cpp
// holds the bindings). Built at first use by kvdiet.formats.native.
//
// Both compute what torch's CPU softmax over the last dim computes for a float row (_vec_softmax_lastdim with
// vec::reduce_all and vec::map, ATen/cpu/vec/functional_base.h): m = the max of the row (exact in any order; the sign
// of a zero max changes no x − m of a finite x, nor its exp); e_j = exp(x_j − m) by torch's own Sleef_expf16_u10
// (Vectorized<float>::exp, exported by libtorch_cpu; where it is not, every call is declined); s = the sum of the
// e_j in reduce_all's order; r = 1 / s; p_j = e_j · r. No FMA contraction (-ffp-contract=off). A NaN input, a row
// whose max is ±inf (x − max is then NaN for some x) and any output with a NaN are declined (the caller runs
// torch's softmax). The sum's order:
//   - narrow (n < 16): e_0 + e_1 + … + e_{n−1} left to right (reduce_all under one vector: vec_reduce_all's lane-0
//     loop);
//   - wide (n >= 16): 16 lanes, lane l summing e_l, e_{l+16}, … in order from e_l (the last partial vector's
//     lanes added where they hold a value: Vec::set), then folded by torch's AVX-512 VecReduceAllSIMD: lanes
//     (l, l+8) by a 256-bit shuffle, then 128-, 64- and 32-bit shuffles, lane 0 the sum.
// softmax_rows(x): x float32 [..., n] (contiguous, 1 <= n <= kSoftmaxWidthMax, at least one row) -> float32 [..., n]
//   (contiguous), or std::nullopt for any other input, every build without AVX-512 and the rows declined above.
//   kvdiet.model.narrow_softmax checks these bits against torch.softmax once per process before it uses the kernel.
//   Why: torch's reduce_all under one vector runs a vector store, load and op per element (some 250 ns a row of
//   13 floats, 12 times its time per row of 16); this is one masked vector pass per row.
// softmax_wide(x): the same for wide rows, 16 <= n (std::nullopt for narrower ones), where softmax_wide_agrees.
// softmax_wide_agrees(): whether the wide rows' bits equal at::softmax's on adversarial rows on this machine (widths
//   16..1,031, values from all-underflow to ties, −inf keys, ±0 and subnormals), checked once per process; where
//   they do not, softmax_wide and attend_rows run torch's. Why: a decode step's attention (attend_kernels.cpp)
//   called at::softmax on [B, H, 641] logits; after the layer's weights have streamed through the caches its
//   dispatch ran some 30-45 µs a layer in a v4.1-mini step against 4 µs hot (a 40-layer step: 1.2-1.8 ms).

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
// weak: a torch build that does not export it leaves it null, and softmax_rows declines (the module still loads)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#endif

namespace {

constexpr int64_t kSoftmaxWidthMax = 15;  // under one AVX-512 vector of floats

#if defined(__AVX512F__)
// One narrow row (1 <= n < 16) into out: false (out unspecified) where it is declined
inline bool softmax_row_narrow(const float* in, float* out, int64_t n) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
  float m = in[0];
  bool nan_in = in[0] != in[0];
  for (int64_t j = 1; j < n; ++j) {
    m = m > in[j] ? m : in[j];
    nan_in |= in[j] != in[j];
  }
  if (nan_in || !std::isfinite(m)) return false;
  alignas(64) float e[16];
  const __m512 ev = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, in), _mm512_set1_ps(m)));
  _mm512_store_ps(e, ev);
  float s = e[0];
  for (int64_t j = 1; j < n; ++j) s = s + e[j];
  const float inv = 1 / s;
  const __m512 p = _mm512_mul_ps(ev, _mm512_set1_ps(inv));
  _mm512_mask_storeu_ps(out, lanes, p);
  return _mm512_mask_cmp_ps_mask(lanes, p, p, _CMP_UNORD_Q) == 0;
}

// One wide row (n >= 16) into out: false (out unspecified) where it is declined
inline bool softmax_row_wide(const float* in, float* out, int64_t n) {
  const int64_t full = n - n % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 mv = _mm512_loadu_ps(in);
  __mmask16 nan_in = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
  for (int64_t d = 16; d < full; d += 16) {
    const __m512 v = _mm512_loadu_ps(in + d);
    nan_in |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  if (tail != 0) {
    const __m512 v = _mm512_maskz_loadu_ps(tail, in + full);
    nan_in |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
    mv = _mm512_mask_max_ps(mv, tail, mv, v);
  }
  const float m = _mm512_reduce_max_ps(mv);
  if (nan_in != 0 || !std::isfinite(m)) return false;
  const __m512 mm = _mm512_set1_ps(m);
  __m512 acc = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(in), mm));
  _mm512_storeu_ps(out, acc);
  for (int64_t d = 16; d < full; d += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(in + d), mm));
    _mm512_storeu_ps(out + d, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (tail != 0) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, in + full), mm));
    _mm512_mask_storeu_ps(out + full, tail, e);
    acc = _mm512_mask_add_ps(acc, tail, acc, e);
  }
  acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4E));
  acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1));
  acc = _mm512_add_ps(acc, _mm512_shuffle_ps(acc, acc, 0x4E));
  acc = _mm512_add_ps(acc, _mm512_shuffle_ps(acc, acc, 0xB1));
  const float inv = 1 / _mm512_cvtss_f32(acc);
  const __m512 r = _mm512_set1_ps(inv);
  __mmask16 nan_out = 0;
  for (int64_t d = 0; d < full; d += 16) {
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(out + d), r);
    nan_out |= _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    _mm512_storeu_ps(out + d, p);
  }
  if (tail != 0) {
    const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, out + full), r);
    nan_out |= _mm512_mask_cmp_ps_mask(tail, p, p, _CMP_UNORD_Q);
    _mm512_mask_storeu_ps(out + full, tail, p);
  }
  return nan_out == 0;
}
#endif

// Rows x[0 .. rows) of n floats (contiguous) into out, each narrow or wide by n, on torch's intra-op threads where
// there are many: false where any row is declined (out unspecified)
bool softmax_rows_into(const float* x, float* out, int64_t rows, int64_t n) {
#if defined(__AVX512F__)
  if (Sleef_expf16_u10 == nullptr || n < 1) return false;
  std::atomic<int32_t> declined{0};
  // narrow rows 1,024 a task; wide ones some 64K floats a task (a decode step's few rows run inline, with no
  // parallel region)
  const int64_t grain = n < 16 ? 1024 : std::max<int64_t>(1, (int64_t{1} << 16) / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = x + r * n;
      float* o = out + r * n;
      const bool ok = n < 16 ? softmax_row_narrow(in, o, n) : softmax_row_wide(in, o, n);
      if (!ok) {
        declined.store(1);
        return;
      }
    }
  });
  return declined.load() == 0;
#else
  (void)x, (void)out, (void)rows, (void)n;
  return false;
#endif
}

}  // namespace

bool softmax_wide_agrees() {
  static const bool yes = [] {
#if defined(__AVX512F__)
    if (Sleef_expf16_u10 == nullptr) return false;
    uint64_t state = 0x9E3779B97F4A7C15ull;  // a fixed LCG: the same rows in every process
    const auto next = [&state] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<uint32_t>(state >> 33);
    };
    constexpr float kSpecials[] = {-std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 1e-40f, -3e-39f, 0.5f};
    constexpr int64_t kRows = 8;
    for (const int64_t n : {16, 17, 31, 32, 33, 47, 100, 128, 255, 641, 655, 1031}) {
      at::Tensor x = at::empty({kRows, n}, at::TensorOptions().dtype(at::kFloat));
      float* xp = x.mutable_data_ptr<float>();
      for (int64_t r = 0; r < kRows; ++r) {
        // scales from all-ties to all-underflow: exp(x − m) reaches subnormals and 0 from scale 100 on
        const float scale = std::array<float, kRows>{1e-30f, 1e-3f, 1.0f, 8.0f, 30.0f, 100.0f, 1e4f, 1e30f}[r];
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t u = next();
          float v = (static_cast<float>(u & 0xFFFFFF) / 16777216.0f - 0.5f) * 2.0f * scale;
          if (u >> 24 < 64) v = kSpecials[(u >> 24) % 6];               // a quarter: −inf keys, ±0, subnormals
          else if (u >> 24 < 80 && j > 0) v = xp[r * n + (u >> 8) % j];  // ties with an earlier value
          xp[r * n + j] = v;
        }
        xp[r * n + n - 1] = 0.25f;  // a finite value per row, as the sink is
      }
      const at::Tensor want = at::softmax(x, -1);
      std::vector<float> got(kRows * n);
      if (!softmax_rows_into(xp, got.data(), kRows, n)) return false;
      if (std::memcmp(got.data(), want.const_data_ptr<float>(), got.size() * sizeof(float)) != 0) return false;
    }
    return true;
#else
    return false;
#endif
  }();
  return yes;
}

// attend_kernels.cpp's softmax of its logits: wide rows only where softmax_wide_agrees
bool softmax_logits(const float* x, float* out, int64_t rows, int64_t n) {
  return (n < 16 || softmax_wide_agrees()) && softmax_rows_into(x, out, rows, n);
}

std::optional<at::Tensor> softmax_rows(const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() < 1) return {};
  if (x.is_neg()) return {};  // a lazy negative view: the data is not the value
  const int64_t n = x.size(-1);
  if (n < 1 || n > kSoftmaxWidthMax || x.numel() == 0) return {};
  at::Tensor out = at::empty_like(x);
  if (!softmax_rows_into(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.numel() / n, n)) return {};
  return out;
}

std::optional<at::Tensor> softmax_wide(const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() < 1) return {};
  if (x.is_neg() || x.numel() == 0) return {};
  const int64_t n = x.size(-1);
  if (n < 16 || !softmax_wide_agrees()) return {};
  at::Tensor out = at::empty_like(x);
  if (!softmax_rows_into(x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), x.numel() / n, n)) return {};
  return out;
}
