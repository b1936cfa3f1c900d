// RMSNorm of a decode step's few rows, y = x · rsqrt(mean(x²) + eps) · weight over the last dim, with the bits of
// the torch formula in kvdiet/model/layers.py (RMSNorm.forward). Compiled after gemv_kernels.cpp into the same
// module (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// rms_norm: x float32 [..., dim] (contiguous, 1..kNormRowsMax rows, or any number of rows with any_rows: a
//   prefill's, 1 <= dim <= kNormDimMax), weight float32
//   [dim] (contiguous), eps -> float32 [..., dim] (contiguous); any other input, and any output with a NaN, gets
//   std::nullopt (the caller runs the torch formula: where two NaNs meet in a product, the one torch keeps
//   depends on the element's place in its loop, vector body or scalar tail). The squares x·x are this file's
//   (one rounding each, as torch's square); their sum over the last dim is torch's own at::sum over a contiguous
//   [rows, dim] tensor, the tensor torch's mean sums (mean is that sum, then div_ by dim), so its order is
//   torch's by construction; the rest are single IEEE steps per element, in the formula's order: the sum divided
//   by float(dim), plus float(eps), 1 / sqrt (torch's CPU rsqrt, vector and scalar), x times that, times
//   weight[j]. No FMA contraction (the module is built with -ffp-contract=off). kvdiet.model.layers checks these
//   bits against the torch formula once per process before it uses the kernel.
//   Why: the torch formula is six ops of 5-15 µs dispatch each for a few hundred floats; this is one call.
//   Nothing here depends on the number of rows but torch's at::sum, which is the formula's own call on a tensor
//   of the same shape (its split over threads is over rows, each row summed by one thread in either), so a
//   prefill's rows (any_rows) get the formula's bits too; the default cap keeps a decode step's contract.

#include <cmath>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kNormRowsMax = 16;
constexpr int64_t kNormDimMax = 8192;

typedef float NormLanes __attribute__((vector_size(64)));  // 16 floats: AVX-512, 2 x AVX2, 4 x SSE
typedef int32_t NormMask __attribute__((vector_size(64)));

inline NormLanes load16(const float* p) {
  NormLanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Elementwise loops: each element's value is one IEEE product whether it falls in a vector or the tail.
void square(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const NormLanes v = load16(x + i) * load16(x + i);
    std::memcpy(out + i, &v, sizeof v);
  }
  for (; i < n; ++i) out[i] = x[i] * x[i];
}

void scale_row(const float* x, const float* w, float scale, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const NormLanes v = (load16(x + j) * scale) * load16(w + j);
    std::memcpy(out + j, &v, sizeof v);
  }
  for (; j < n; ++j) out[j] = (x[j] * scale) * w[j];
}

bool any_nan(const float* x, int64_t n) {
  NormMask nans = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const NormLanes v = load16(x + i);
    nans |= v != v;
  }
  bool any = false;
  for (int l = 0; l < 16; ++l) any |= nans[l] != 0;
  for (; i < n; ++i) any |= x[i] != x[i];
  return any;
}

}  // namespace

std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool any_rows = false) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || x.dim() < 1 || !x.is_contiguous()) return {};
  if (x.is_neg() || weight.is_neg()) return {};  // lazy neg views: the data is not the value
  if (!weight.device().is_cpu() || weight.scalar_type() != at::kFloat || weight.dim() != 1 ||
      !weight.is_contiguous())
    return {};
  const int64_t dim = x.size(-1);
  if (dim < 1 || dim > kNormDimMax || weight.size(0) != dim) return {};
  const int64_t rows = x.numel() / dim;
  if (rows < 1 || (!any_rows && rows > kNormRowsMax)) return {};
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  at::Tensor squares = at::empty({rows, dim}, x.options());
  square(xp, squares.mutable_data_ptr<float>(), rows * dim);
  const at::Tensor sums = at::sum(squares, {1}, /*keepdim=*/true);
  const float* sp = sums.const_data_ptr<float>();
  at::Tensor out = at::empty(x.sizes(), x.options());
  float* op = out.mutable_data_ptr<float>();
  const float n = static_cast<float>(dim);
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float mean = sp[r] / n;
    scale_row(xp + r * dim, wp, 1.0f / std::sqrt(mean + e), op + r * dim, dim);
  }
  if (any_nan(op, rows * dim)) return {};
  return out;
}
