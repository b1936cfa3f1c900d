// An attention layer's low-rank input projections of a few rows (a decode step's, one per request) in one call,
// with the bits of Attention.project_q and Attention.project_window_kv (kvdiet/model/attention.py). Compiled after
// gemv_kernels.cpp, rmsnorm_kernels.cpp and rope_kernels.cpp into the same module (their row_products, rms_norm
// and rope_rotate are in scope; fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// project_rows(x, w_a, norm_weight, norm_eps, w_b, heads, cis, rope_dim): x float32 [B, hidden] (1..16 rows, any
//   layout), w_a float32 [R, hidden] and w_b float32 [heads·D, R] or None (contiguous), norm_weight float32 [R],
//   cis complex64 [B, rope_dim/2] -> (n float32 [B, R], y float32), or std::nullopt for any other input and wherever
//   rms_norm or rope_rotate declines (a NaN). The same calls in the same order as the Python path, so its bits by
//   construction: n = rms_norm(row_products(x, w_a)); with w_b, y = rope_rotate(row_products(n, w_b) viewed
//   [B, heads, D] and transposed to [heads, B, D], cis) transposed back (project_q: qr = n, q = y [B, heads, D]);
//   without, y = rope_rotate(n, cis) [B, R] (project_window_kv).
//   Why: in Python each step is a module call (Linear, RMSNorm, Rotation.apply: some 15 µs of dispatch each here)
//   around a kernel call; this is one call for the three or five.

std::optional<std::tuple<at::Tensor, at::Tensor>> project_rows(const at::Tensor& x, const at::Tensor& w_a,
                                                               const at::Tensor& norm_weight, double norm_eps,
                                                               const c10::optional<at::Tensor>& w_b, int64_t heads,
                                                               const at::Tensor& cis, int64_t rope_dim) {
  std::vector<const at::Tensor*> weights = {&w_a};
  if (w_b.has_value()) weights.push_back(&*w_b);
  for (const at::Tensor* w : weights)
    if (!w->device().is_cpu() || w->scalar_type() != at::kFloat || w->dim() != 2 || !w->is_contiguous() ||
        w->is_neg())
      return {};
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || x.dim() != 2 || x.is_neg()) return {};
  const int64_t rows = x.size(0);
  if (rows < 1 || rows > 16 || x.size(1) != w_a.size(1)) return {};
  if (w_b.has_value() && (w_b->size(1) != w_a.size(0) || heads < 1 || w_b->size(0) % heads)) return {};
  const std::optional<at::Tensor> n = rms_norm(row_products(x, w_a), norm_weight, norm_eps);
  if (!n.has_value()) return {};
  if (!w_b.has_value()) {
    const std::optional<at::Tensor> y = rope_rotate(*n, cis, rope_dim);
    if (!y.has_value()) return {};
    return std::make_tuple(*n, *y);
  }
  const at::Tensor q = row_products(*n, *w_b).view({rows, heads, -1});
  const std::optional<at::Tensor> y = rope_rotate(q.transpose(0, 1), cis, rope_dim);
  if (!y.has_value()) return {};
  return std::make_tuple(*n, y->transpose(0, 1));
}
