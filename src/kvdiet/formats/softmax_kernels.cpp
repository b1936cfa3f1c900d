// Softmax over narrow rows (fewer than 16 floats: a prefill's attention logits, window + top-k + sink) with the
// bits of torch.softmax(x, -1) on the CPU. Compiled after attend_kernels.cpp into the same module (fp8_kernels.cpp
// holds the bindings). Built at first use by kvdiet.formats.native.
//
// softmax_rows: x float32 [..., n] (contiguous, 1 <= n <= kSoftmaxWidthMax, at least one row) -> float32 [..., n]
//   (contiguous); any other input, every build without AVX-512, a NaN input, a row whose max is ±inf (x − max is
//   then NaN for some x) and any output with a NaN get std::nullopt (the caller runs torch.softmax). Each row is
//   what torch's CPU softmax over the last dim computes for a row narrower than one vector (_vec_softmax_lastdim
//   with vec::reduce_all and vec::map, ATen/cpu/vec/functional_base.h): m = the max of the row (exact in any
//   order; the sign of a zero max changes no x − m of a finite x, nor its exp); e_j = exp(x_j − m) by torch's own
//   Sleef_expf16_u10 (Vectorized<float>::exp, exported by libtorch_cpu; where it is not, every call is
//   declined); s = e_0 + e_1 + … + e_{n−1} left to right (reduce_all under one vector: vec_reduce_all's lane-0
//   loop); r = 1 / s; p_j = e_j · r. No FMA contraction (-ffp-contract=off). kvdiet.model.narrow_softmax checks
//   these bits against torch.softmax once per process before it uses the kernel.
//   Why: torch's reduce_all under one vector runs a vector store, load and op per element (some 250 ns a row of
//   13 floats, 12 times its time per row of 16); this is one masked vector pass per row.

#include <atomic>
#include <cmath>
#include <optional>

#if defined(__AVX512F__)
// weak: a torch build that does not export it leaves it null, and softmax_rows declines (the module still loads)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#endif

namespace {

constexpr int64_t kSoftmaxWidthMax = 15;  // under one AVX-512 vector of floats

}  // namespace

std::optional<at::Tensor> softmax_rows(const at::Tensor& x) {
#if defined(__AVX512F__)
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() < 1) return {};
  if (x.is_neg() || Sleef_expf16_u10 == nullptr) return {};  // a lazy negative view: the data is not the value
  const int64_t n = x.size(-1);
  if (n < 1 || n > kSoftmaxWidthMax || x.numel() == 0) return {};
  const int64_t rows = x.numel() / n;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
  std::atomic<int32_t> declined{0};
  at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
    int32_t found = 0;
    alignas(64) float e[16];
    for (int64_t r = begin; r < end && !found; ++r) {
      const float* in = xp + r * n;
      float m = in[0];
      bool nan_in = in[0] != in[0];
      for (int64_t j = 1; j < n; ++j) {
        m = m > in[j] ? m : in[j];
        nan_in |= in[j] != in[j];
      }
      if (nan_in || !std::isfinite(m)) {
        found = 1;
        break;
      }
      const __m512 ev = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, in), _mm512_set1_ps(m)));
      _mm512_store_ps(e, ev);
      float s = e[0];
      for (int64_t j = 1; j < n; ++j) s = s + e[j];
      const float inv = 1 / s;
      const __m512 p = _mm512_mul_ps(ev, _mm512_set1_ps(inv));
      _mm512_mask_storeu_ps(op + r * n, lanes, p);
      found |= static_cast<int32_t>(_mm512_mask_cmp_ps_mask(lanes, p, p, _CMP_UNORD_Q) != 0);
    }
    if (found) declined.store(1);
  });
  if (declined.load()) return {};
  return out;
#else
  (void)x;
  return {};
#endif
}
