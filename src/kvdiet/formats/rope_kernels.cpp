// Rotary position embedding of a decode step's few rows: the last rope_dim floats of each row of x, read as
// interleaved pairs (re, im), times complex64 cis, with the bits of the torch formula in kvdiet/model/layers.py
// (Rotation.apply: view_as_complex(pairs) * cis, the head copied). Compiled after rmsnorm_kernels.cpp into the
// same module (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// rope_rotate: x float32 [..., D] (last stride 1, 1..kRopeRowsMax rows, or any number with any_rows, of
//   D <= kRopeWidthMax, at most kRopeDimsMax dims), cis complex64 [..., rope_dim/2] (last stride 1; its leading
//   dims, right-aligned to x's, each 1 or x's size), rope_dim (even, <= D) -> float32 of x's shape, strides as
//   x.clone() gives them; any other input, and any output with a NaN in its rotated part, gets std::nullopt (the
//   caller runs the torch formula). Each pair (a, b) times (c, d) is torch's complex64 product as its CPU mul
//   kernel computes it: with
//   AVX-512 or AVX2, Vectorized<c10::complex<float>>::operator* (ATen/cpu/vec/vec512/vec512_complex_float.h,
//   vec256/vec256_complex_float.h), re = a·c − b·d, im = a·d − b·(−c), each product rounded, with the same
//   intrinsics in the same order; the pairs past the last whole vector, and every pair without those
//   extensions, as c10::complex's operator*= (re = a·c − b·d, im = a·d + b·c: the same values, b·(−c) being
//   −(b·c) exactly). Torch's loop runs whole vectors of 2 × 8 (AVX-512) or 2 × 4 (AVX2) complex, then that
//   scalar operator*= on the rest: rope_dim a multiple of 32 never reaches the scalar tail; other rope_dims do,
//   and match it only where torch's own build compiled that scalar formula without FMA contraction. So
//   kvdiet.model.layers checks these bits against the torch formula once per process before it uses the kernel,
//   for multiples of 32 and (separately) for other rope_dims. A product of at::internal::GRAIN_SIZE pairs or
//   more gets std::nullopt too: torch splits that loop over its threads at chunk boundaries that need not fall on
//   a whole vector, so its scalar tail lands on pairs no check covers. any_rows lifts both caps: the caller
//   passes it where torch runs one thread (kvdiet.model.layers.Rotation.apply: a prefill's rows), its loop then
//   unsplit, its tails where the checks look (on more threads torch's own bits vary with the split). No FMA
//   contraction (-ffp-contract=off).
//   Why: the torch formula is some ten ops of 5-15 µs dispatch each for a few hundred floats; this is one call.

#include <cstring>
#include <optional>

namespace {

constexpr int64_t kRopeRowsMax = 256;
constexpr int64_t kRopeWidthMax = 8192;
constexpr int64_t kRopeDimsMax = 6;

// out[0, 2n) = the n complex products x[k] · c[k], pairs interleaved (re, im), as torch's CPU kernel rounds them.
inline void rotate_pairs(const float* x, const float* c, float* out, int64_t n) {
#if defined(__AVX512F__)
  const __m512 sign_mask =
      _mm512_setr_ps(0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0);
  const __m512i idx1 = _mm512_set_epi32(30, 14, 28, 12, 26, 10, 24, 8, 22, 6, 20, 4, 18, 2, 16, 0);
  const __m512i idx2 = _mm512_set_epi32(31, 15, 29, 13, 27, 11, 25, 9, 23, 7, 21, 5, 19, 3, 17, 1);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m512 a = _mm512_loadu_ps(x + 2 * k);
    const __m512 b = _mm512_loadu_ps(c + 2 * k);
    const __m512 ac_bd = _mm512_mul_ps(a, b);
    __m512 d_c = _mm512_permute_ps(b, 0xB1);
    d_c = _mm512_xor_ps(sign_mask, d_c);
    const __m512 ad_bc = _mm512_mul_ps(a, d_c);
    const __m512 ret = _mm512_sub_ps(_mm512_mask_permutex2var_ps(ac_bd, 0xffff, idx1, ad_bc),
                                     _mm512_mask_permutex2var_ps(ac_bd, 0xffff, idx2, ad_bc));
    _mm512_storeu_ps(out + 2 * k, ret);
  }
#elif defined(__AVX2__)
  const __m256 sign_mask = _mm256_setr_ps(0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0);
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256 a = _mm256_loadu_ps(x + 2 * k);
    const __m256 b = _mm256_loadu_ps(c + 2 * k);
    const __m256 ac_bd = _mm256_mul_ps(a, b);
    __m256 d_c = _mm256_permute_ps(b, 0xB1);
    d_c = _mm256_xor_ps(sign_mask, d_c);
    const __m256 ad_bc = _mm256_mul_ps(a, d_c);
    __m256 ret = _mm256_hsub_ps(ac_bd, ad_bc);
    ret = _mm256_permute_ps(ret, 0xD8);
    _mm256_storeu_ps(out + 2 * k, ret);
  }
#else
  int64_t k = 0;
#endif
  for (; k < n; ++k) {  // c10::complex's operator*=
    const float a = x[2 * k], b = x[2 * k + 1], re = c[2 * k], im = c[2 * k + 1];
    out[2 * k] = a * re - b * im;
    out[2 * k + 1] = a * im + b * re;
  }
}

}  // namespace

std::optional<at::Tensor> rope_rotate(const at::Tensor& x, const at::Tensor& cis, int64_t rope_dim,
                                      bool any_rows = false) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !cis.device().is_cpu() ||
      cis.scalar_type() != at::kComplexFloat)
    return {};
  if (x.is_neg() || cis.is_conj() || cis.is_neg()) return {};  // lazy conj/neg views: the data is not the value
  const int64_t nd = x.dim();
  if (nd < 1 || nd > kRopeDimsMax || cis.dim() < 1 || cis.dim() > nd) return {};
  const int64_t width = x.size(-1), half = rope_dim / 2;
  if (rope_dim <= 0 || rope_dim % 2 || rope_dim > width || width > kRopeWidthMax) return {};
  if (x.stride(-1) != 1) return {};
  if (cis.size(-1) != half || cis.stride(-1) != 1 || x.numel() == 0) return {};
  const int64_t rows = x.numel() / width;
  if (!any_rows && (rows > kRopeRowsMax || rows * half >= at::internal::GRAIN_SIZE)) return {};  // see the header
  // leading dims of x (nd - 1 of them), with cis's strides right-aligned (0 where cis broadcasts)
  const int64_t lead = nd - 1, pad = nd - cis.dim();
  int64_t size[kRopeDimsMax], xstride[kRopeDimsMax], ostride[kRopeDimsMax], cstride[kRopeDimsMax];
  for (int64_t i = 0; i < lead; ++i) {
    size[i] = x.size(i);
    xstride[i] = x.stride(i);
    cstride[i] = 0;
    if (i >= pad) {
      const int64_t cs = cis.size(i - pad);
      if (cs != 1 && cs != size[i]) return {};
      if (cs != 1) cstride[i] = cis.stride(i - pad) * 2;  // in floats
    }
  }
  at::Tensor out = at::empty_like(x);  // x.clone()'s strides
  if (out.stride(-1) != 1) return {};
  for (int64_t i = 0; i < lead; ++i) ostride[i] = out.stride(i);
  const float* xp = x.const_data_ptr<float>();
  const float* cp = reinterpret_cast<const float*>(cis.const_data_ptr<c10::complex<float>>());
  float* op = out.mutable_data_ptr<float>();
  const int64_t head = width - rope_dim;
  int64_t index[kRopeDimsMax] = {0};
  int32_t nans = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t xo = 0, oo = 0, co = 0;
    for (int64_t i = 0; i < lead; ++i) {
      xo += index[i] * xstride[i];
      oo += index[i] * ostride[i];
      co += index[i] * cstride[i];
    }
    std::memcpy(op + oo, xp + xo, head * sizeof(float));
    rotate_pairs(xp + xo + head, cp + co, op + oo + head, half);
    for (int64_t k = 0; k < rope_dim; ++k) nans |= op[oo + head + k] != op[oo + head + k];
    for (int64_t i = lead - 1; i >= 0; --i) {  // next row index, last dim fastest
      if (++index[i] < size[i]) break;
      index[i] = 0;
    }
  }
  if (nans) return {};  // which NaN a product of two NaNs keeps is torch's compiler's choice: its formula decides
  return out;
}
