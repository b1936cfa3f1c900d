// Decode-row products y = x · wᵀ for a few rows of x, in kvdiet's fixed fp32 order (kvdiet/model/gemv.py holds
// the pure-torch path with the same order and bits). Compiled after fp4_kernels.cpp and topk_kernels.cpp into the
// same module (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// row_products: x float32 [M, K] (contiguous, 1 <= M <= 16), w float32 [N, K] (contiguous) -> out float32
//   [M, N] (contiguous). Each y[m, n] is one dot product in 16 lanes: lane l sums x[i]·w[i] for i = l, l+16, …
//   in increasing i, from +0 (each product rounded, then added; no fused multiply-add: the module is built
//   with -ffp-contract=off); a last partial chunk reads zeros past K. The lanes fold as (l, l+8), (l, l+4),
//   (l, l+2), then (0, 1).
//   Why: a decode step reads each weight once for one row, and torch's BLAS product runs such a row at 12-18 GB/s
//   on the CPU (v4.1-mini's 132 MB LM head in 10.5 ms); this runs at the read bandwidth (about 30 GB/s on 2
//   cores) and with one order on every machine. The order is this kernel's own: it rounds differently from the
//   BLAS (as the BLAS's one-row and many-row kernels already do from each other), within fp32 rounding.
//   Rows of w are split over torch's intra-op threads; within a task, four rows of w are scored against the
//   rows of x four at a time, so each w row is read from memory once.

namespace {

typedef float Lanes16 __attribute__((vector_size(64)));  // one vector per lane set: AVX-512, 2 x AVX2, 4 x SSE

inline Lanes16 load_lanes(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float fold_lanes(Lanes16 a) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

// Rows j0 .. j0+R of w against G rows of x (xs: G rows of padded length kp, zeros past K), into y[g, j0 + r].
// wt: the R rows' last partial chunk, zero-padded (unused when K % 16 == 0).
template <int R, int G>
inline void dot_block(const float* xs, int64_t kp, const float* w, int64_t k, int64_t j0, const float* wt,
                      float* y, int64_t n) {
  const int64_t full = k / 16;
  Lanes16 acc[R][G] = {};
  for (int64_t c = 0; c < full; ++c) {
    Lanes16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_lanes(w + (j0 + r) * k + c * 16);
    for (int g = 0; g < G; ++g) {
      const Lanes16 xv = load_lanes(xs + g * kp + c * 16);
      for (int r = 0; r < R; ++r) acc[r][g] = acc[r][g] + xv * wv[r];
    }
  }
  if (full * 16 < k) {
    for (int r = 0; r < R; ++r) {
      const Lanes16 wv = load_lanes(wt + r * 16);
      for (int g = 0; g < G; ++g) acc[r][g] = acc[r][g] + load_lanes(xs + g * kp + full * 16) * wv;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) y[g * n + j0 + r] = fold_lanes(acc[r][g]);
}

template <int R>
void dot_rows(const float* xs, int64_t m, int64_t kp, const float* w, int64_t k, int64_t j0, float* y, int64_t n) {
  alignas(64) float wt[R * 16] = {};
  const int64_t full = k / 16;
  for (int r = 0; r < R; ++r) std::memcpy(wt + r * 16, w + (j0 + r) * k + full * 16, (k - full * 16) * 4);
  for (int64_t g0 = 0; g0 < m; g0 += 4) {
    const float* xg = xs + g0 * kp;
    float* yg = y + g0 * n;
    switch (std::min<int64_t>(4, m - g0)) {
      case 1: dot_block<R, 1>(xg, kp, w, k, j0, wt, yg, n); break;
      case 2: dot_block<R, 2>(xg, kp, w, k, j0, wt, yg, n); break;
      case 3: dot_block<R, 3>(xg, kp, w, k, j0, wt, yg, n); break;
      default: dot_block<R, 4>(xg, kp, w, k, j0, wt, yg, n); break;
    }
  }
}

}  // namespace

void row_products(at::Tensor x, at::Tensor w, at::Tensor out) {
  TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat && out.dtype() == at::kFloat,
              "row_products takes float32 tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "row_products: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "row_products takes 1..16 rows, got ", x.size(0));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == w.size(0), "row_products: out [M, N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "row_products needs contiguous tensors");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t kp = (k + 15) / 16 * 16;
  std::vector<float> xs(m * kp, 0.0f);  // x with its rows zero-padded to whole chunks
  for (int64_t i = 0; i < m; ++i) std::memcpy(xs.data() + i * kp, x.data_ptr<float>() + i * k, k * 4);
  const float* wp = w.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  // tasks of whole 4-row blocks, about 64 KB of w each
  const int64_t blocks = n / 4, grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) dot_rows<4>(xs.data(), m, kp, wp, k, b * 4, yp, n);
  });
  for (int64_t j = blocks * 4; j < n; ++j) dot_rows<1>(xs.data(), m, kp, wp, k, j, yp, n);
}
