// An attention layer's projections of a few rows (a decode step's, one per request), each in one call, with the
// bits of Attention.project_q, project_window_kv, project_out (kvdiet/model/attention.py) and Indexer.queries
// (kvdiet/model/indexer.py). Compiled after fp4_kernels.cpp, gemv_kernels.cpp, rmsnorm_kernels.cpp and
// rope_kernels.cpp into the same module (their encode_fp4, decode_fp4, row_products, rms_norm and rope_rotate are
// in scope; fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// project_rows(x, w_a, norm_weight, norm_eps, w_b, heads, head_dim, cis, rope_dim): x float32 [B, hidden] (1..16
//   rows, any layout), w_a float32 [R, hidden] and w_b float32 [heads·D, R] (D = head_dim) or None (contiguous),
//   norm_weight float32 [R],
//   cis complex64 [B, rope_dim/2] -> (n float32 [B, R], y float32), or std::nullopt for any other input and wherever
//   rms_norm or rope_rotate declines (a NaN). The same calls in the same order as the Python path, so its bits by
//   construction: n = rms_norm(row_products(x, w_a)); with w_b, y = rope_rotate(row_products(n, w_b) viewed
//   [B, heads, D] and transposed to [heads, B, D], cis) transposed back (project_q: qr = n, q = y [B, heads, D]);
//   without, y = rope_rotate(n, cis) [B, R] (project_window_kv).
// project_q_kv_rows(x, wq_a, q_norm_weight, q_norm_eps, wq_b, heads, head_dim, wkv, kv_norm_weight, kv_norm_eps, cis,
//   rope_dim): project_rows for the query (wq_a, wq_b: (qr, q)) and for the window KV (wkv, no w_b: kv) of the same
//   rows, or std::nullopt where either declines; the two first products in one parallel region
//   (row_products_each: each output the same dot_rows call as alone, so the same bits). Why: the query's first
//   product alone (v4.1-mini: 128 x 256) is below row_products's parallel size and ran on one thread before
//   the window KV's; together they stream on every thread (a 4K decode step 0.13 ms faster, 11 of 14 rounds).
// project_out_rows(o, cis_inverse, rope_dim, wo_a, groups, wo_b): o float32 [B, H, D] (1..16 rows, contiguous),
//   cis_inverse complex64 [B, rope_dim/2], wo_a float32 [G·R, H·D/G] and wo_b float32 [hidden, G·R] (contiguous)
//   -> float32 [B, hidden], or std::nullopt for any other input and wherever rope_rotate declines. The calls of
//   Attention.project_out in its order: the inverse rotation rope_rotate(o transposed to [H, B, D]) transposed
//   back, viewed [B, G, H·D/G]; grouped_product's one bmm of the same operand views (einsum's); reshaped
//   [B, G·R]; row_products with wo_b.
// index_query_rows(qr, wq_b, heads, dim, cis, rope_dim, x, w_proj, scale, recipe, lo, hi, entry_bytes): the
//   indexer's queries of Indexer.queries: qr float32 [B, R] (1..16 rows), wq_b float32 [heads·d, R] (d = dim),
//   cis complex64 [B, rope_dim/2], x float32 [B, hidden], w_proj float32 [heads, hidden] (contiguous), the
//   index-key codec's recipe, scale-byte range and entry bytes (which must be the recipe's for d: d/2 + d/block)
//   -> (q float32 [B, heads, d], w float32 [B, heads]), or std::nullopt for any other input and wherever a step
//   declines (rope_rotate: a NaN; encode_fp4: a non-finite value, which the Python path then reports):
//   q = rope_rotate(row_products(qr, wq_b) viewed [B, heads, d], transposed as
//   project_rows does) and its round trip through the codec (encode_fp4 then decode_fp4 of the rows, as
//   Codec.roundtrip runs them); w = row_products(x, w_proj) · float(scale), one IEEE multiply each.
//   Why: in Python each step is a module call (Linear, RMSNorm, Rotation.apply: some 15 µs of dispatch each here)
//   around a kernel call; these are one call for the three to five.

namespace {

// Whether project_rows takes these rows and weights (w_b: nullptr for none).
bool projection_fits(const at::Tensor& x, const at::Tensor& w_a, const at::Tensor* w_b, int64_t heads,
                     int64_t head_dim) {
  for (const at::Tensor* w : {&w_a, w_b})
    if (w != nullptr && (!w->device().is_cpu() || w->scalar_type() != at::kFloat || w->dim() != 2 ||
                         !w->is_contiguous() || w->is_neg()))
      return false;
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || x.dim() != 2 || x.is_neg()) return false;
  const int64_t rows = x.size(0);
  if (rows < 1 || rows > 16 || x.size(1) != w_a.size(1)) return false;
  return w_b == nullptr ||
         (w_b->size(1) == w_a.size(0) && heads >= 1 && head_dim >= 1 && w_b->size(0) == heads * head_dim);
}

// project_rows after its first product p = row_products(x, w_a) [B, R].
std::optional<std::tuple<at::Tensor, at::Tensor>> finish_projection(const at::Tensor& p,
                                                                    const at::Tensor& norm_weight, double norm_eps,
                                                                    const at::Tensor* w_b, int64_t heads,
                                                                    int64_t head_dim, const at::Tensor& cis,
                                                                    int64_t rope_dim) {
  const std::optional<at::Tensor> n = rms_norm(p, norm_weight, norm_eps);
  if (!n.has_value()) return {};
  if (w_b == nullptr) {
    const std::optional<at::Tensor> y = rope_rotate(*n, cis, rope_dim);
    if (!y.has_value()) return {};
    return std::make_tuple(*n, *y);
  }
  const at::Tensor q = row_products(*n, *w_b).view({p.size(0), heads, head_dim});
  const std::optional<at::Tensor> y = rope_rotate(q.transpose(0, 1), cis, rope_dim);
  if (!y.has_value()) return {};
  return std::make_tuple(*n, y->transpose(0, 1));
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> project_rows(const at::Tensor& x, const at::Tensor& w_a,
                                                               const at::Tensor& norm_weight, double norm_eps,
                                                               const c10::optional<at::Tensor>& w_b, int64_t heads,
                                                               int64_t head_dim, const at::Tensor& cis,
                                                               int64_t rope_dim) {
  const at::Tensor* b = w_b.has_value() ? &*w_b : nullptr;
  if (!projection_fits(x, w_a, b, heads, head_dim)) return {};
  return finish_projection(row_products(x, w_a), norm_weight, norm_eps, b, heads, head_dim, cis, rope_dim);
}

std::optional<std::pair<std::tuple<at::Tensor, at::Tensor>, at::Tensor>> project_q_kv_rows(
    const at::Tensor& x, const at::Tensor& wq_a, const at::Tensor& q_norm_weight, double q_norm_eps,
    const at::Tensor& wq_b, int64_t heads, int64_t head_dim, const at::Tensor& wkv, const at::Tensor& kv_norm_weight,
    double kv_norm_eps, const at::Tensor& cis, int64_t rope_dim) {
  if (!projection_fits(x, wq_a, &wq_b, heads, head_dim) || !projection_fits(x, wkv, nullptr, 1, head_dim)) return {};
  const at::Tensor rows = x.contiguous();
  at::Tensor pq = at::empty({rows.size(0), wq_a.size(0)}, rows.options());
  at::Tensor pkv = at::empty({rows.size(0), wkv.size(0)}, rows.options());
  row_products_each({rows, rows}, {wq_a, wkv}, {pq, pkv});
  auto q = finish_projection(pq, q_norm_weight, q_norm_eps, &wq_b, heads, head_dim, cis, rope_dim);
  if (!q.has_value()) return {};
  auto kv = finish_projection(pkv, kv_norm_weight, kv_norm_eps, nullptr, 1, head_dim, cis, rope_dim);
  if (!kv.has_value()) return {};
  return std::make_pair(*q, std::get<1>(*kv));
}

std::optional<at::Tensor> project_out_rows(const at::Tensor& o, const at::Tensor& cis_inverse, int64_t rope_dim,
                                           const at::Tensor& wo_a, int64_t groups, const at::Tensor& wo_b) {
  for (const at::Tensor* t : {&o, &wo_a, &wo_b})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous() || t->is_neg()) return {};
  if (o.dim() != 3 || wo_a.dim() != 2 || wo_b.dim() != 2 || groups < 1) return {};
  const int64_t rows = o.size(0), width = o.size(1) * o.size(2);
  if (rows < 1 || rows > 16 || width % groups || wo_a.size(1) != width / groups || wo_a.size(0) % groups ||
      wo_b.size(1) != wo_a.size(0))
    return {};
  const std::optional<at::Tensor> rotated = rope_rotate(o.transpose(0, 1), cis_inverse, rope_dim);
  if (!rotated.has_value()) return {};
  const at::Tensor grouped = rotated->transpose(0, 1).reshape({rows, groups, -1});
  const at::Tensor w = wo_a.view({groups, -1, width / groups});
  const at::Tensor left = rows == 1 ? grouped.view({groups, 1, width / groups}) : grouped.transpose(0, 1);
  return row_products(at::bmm(left, w.transpose(1, 2)).transpose(0, 1).reshape({rows, -1}), wo_b);
}

std::optional<std::tuple<at::Tensor, at::Tensor>> index_query_rows(
    const at::Tensor& qr, const at::Tensor& wq_b, int64_t heads, int64_t dim, const at::Tensor& cis, int64_t rope_dim,
    const at::Tensor& x, const at::Tensor& w_proj, double scale, int64_t recipe, int64_t lo, int64_t hi,
    int64_t entry_bytes) {
  for (const at::Tensor* w : {&wq_b, &w_proj})
    if (!w->device().is_cpu() || w->scalar_type() != at::kFloat || w->dim() != 2 || !w->is_contiguous() ||
        w->is_neg())
      return {};
  for (const at::Tensor* t : {&qr, &x})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->dim() != 2 || t->is_neg()) return {};
  const int64_t rows = qr.size(0);
  if (rows < 1 || rows > 16 || x.size(0) != rows || qr.size(1) != wq_b.size(1) || x.size(1) != w_proj.size(1) ||
      heads < 1 || dim < 1 || wq_b.size(0) != heads * dim || w_proj.size(0) != heads)
    return {};
  const int64_t block = recipe == kE4M3 ? 16 : 32;  // fp4_kernels.cpp's recipes
  if (dim % block || entry_bytes != dim / 2 + dim / block) return {};
  const at::Tensor q = row_products(qr, wq_b).view({rows, heads, dim});
  const std::optional<at::Tensor> rotated = rope_rotate(q.transpose(0, 1), cis, rope_dim);
  if (!rotated.has_value()) return {};
  const at::Tensor values = rotated->transpose(0, 1).reshape({-1, dim}).contiguous();
  at::Tensor packed = at::empty({values.size(0), entry_bytes}, values.options().dtype(at::kByte));
  if (encode_fp4(values, recipe, packed) >= 0) return {};
  at::Tensor out = at::empty({values.size(0), dim}, values.options());
  if (decode_fp4(packed, recipe, lo, hi, out) >= 0) return {};
  at::Tensor w = row_products(x, w_proj);
  float* wp = w.mutable_data_ptr<float>();
  const float factor = static_cast<float>(scale);
  for (int64_t i = 0; i < w.numel(); ++i) wp[i] = wp[i] * factor;
  return std::make_tuple(out.view({rows, heads, dim}), w);
}
