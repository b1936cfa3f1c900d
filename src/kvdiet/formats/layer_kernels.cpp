// A decode step's layer in three calls (kvdiet/model/decode_layer.py and decode_ffn.py): the attention sublayer's
// head and tail and the FFN half, each a chain of the very kernels the Python path calls, in its order, on the same
// operands, so the bits are that path's. Compiled last before fp8_kernels.cpp (which holds the bindings), so
// hc_enter, hc_expand_rows, route_rows, route_scores_agree, expert_groups, project_rows, project_out_rows and
// attend_rows are in scope.
// Built at first use by kvdiet.formats.native.
//
// FfnWeights / AttnWeights: what one layer's FFN half / attention sublayer reads besides its rows, bound once
//   (kvdiet/model/ffn_binding.py and attn_binding.py check before each step that the modules still hold them):
//   - both: an EntryWeights, the mHC entry's fn_t, scale, base (hc.py's HcWeights layout), the sublayer norm's
//     weight and eps, the config's rms_eps, hc_eps and Sinkhorn iterations, the mix kernel's addresses
//     (sinkhorn.py's hc_mix_address), the chain forms of the exit's product for one row and for more (the
//     binding's chain_fits) and the blocks of the entry's coefficient product for one row and for more (its
//     product_fits; the threads and matmul precision are read when it is made);
//   - FFN: the router's weight float32 [E, hidden], bias float32 [E], top-k, whether it normalises, its scaling
//     factor; every routed expert's w1, w3, w2 (float32, dense) and swiglu limit, then the shared expert's (index E);
//   - attention: wq_a, q_norm's weight and eps, wq_b, heads, head_dim; wkv, kv_norm's weight and eps; rope_dim; the
//     sink float32 [H] and the softmax scale; wo_a, o_groups, wo_b.
// ffn_rows(h, attn_pre, ffn): streams h float32 [B, hc, hidden] (1..16 rows), the attention sublayer's pre
//   float32 [B, hc] -> (new streams, this FFN's pre float32 [B, hc], the experts routed int64 [B, k]): hc_enter,
//   route_rows, expert_groups over the experts named (increasing), hc_expand_rows. std::nullopt where one of them
//   declines (nothing was written). The caller checks the routed experts' bindings after the call. Where two
//   threads are free, the router runs beside the shared expert's gate and up products, which need no routing (one
//   a thread: the router's small ops wait on their reads while the products stream 256 KB at v4.1-mini; a decode
//   step 0.3-0.5 ms faster; hc_kernels.cpp's beside); expert_groups then takes them as made. The same calls on the
//   same operands, so the same bits: each product output is one dot_rows call on either thread, and the router's
//   product (MKL's, nested in the region: one thread) runs there only where route_scores_agree finds its bits the
//   same inside a region as outside for that shape (router_kernels.cpp; on an AMD EPYC v4.1-micro's two-row router
//   did not), else the router runs first, outside any region.
// attn_head(h, collapse_pre, attn, cis, rings, slots, held, lo, hi, keys, entries) -> [x, pre, post, comb, qr, q,
//   kv] (+ [keys, entries]): hc_enter, then project_rows for the queries (qr [B, q_lora], q [B, H, D] rotated) and
//   for the window KV (kv [B, D], normed and rotated); empty where one declines. With rings, slots, keys and entries
//   (fp8.read_window's arguments, kvdiet/model/decode_step.py's fused_window), then read_fp8_window of kv into keys
//   and entries, both appended where it takes them (where it declines, the caller runs its own read).
// attn_tail(q, win, win_mask, comp, comp_mask, h, post, comb, attn_pre, cis_inverse, attn, ffn) -> [streams, pre,
//   experts routed] with ffn, or [streams after the attention sublayer] where ffn is None or ffn_rows declines
//   (the caller runs the FFN half), or empty where the attention's own kernels decline or its inputs do not have
//   decode_attend's shapes (the caller runs the pieces, which raise decode_attend's error): attend_rows,
//   project_out_rows, hc_expand_rows, then ffn_rows.

namespace {

// a sublayer's mHC entry: hc_enter's arguments besides the rows and their collapse pre-mix; and its exit's
// product, hc_expand_rows' at::bmm, as the compiled chain in the form kvdiet.model.chain_products.chain_fits found
// for one row (exit_one) and for more (exit_more) (ChainForm: 0 none, 1 the chain, 2 settled, 3 from -0), and its
// entry's coefficient product, at::mm, as chain_mm in the blocks kvdiet.model.chain_products.product_fits found for
// one row (entry_one) and for more (entry_more) (0: at::mm), at the intra-op threads and fp32 matmul precision
// current when the binding was made (at::bmm and at::mm where either has changed, or where torch cannot name one
// precision)
struct EntryWeights {
  at::Tensor fn_t, scale, base, norm_weight;
  double norm_eps, rms_eps, hc_eps;
  int64_t iters;
  std::tuple<int64_t, int64_t, int64_t> mix;
  int64_t exit_one = 0, exit_more = 0;
  int64_t entry_one = 0, entry_more = 0;  // the coefficients' product as chain_mm in blocks of these (0: at::mm)
  int threads = 0;
  int precision = -1;  // matmul_precision() when the binding was made
};

// torch's fp32 matmul precision as an int, or -1 where it cannot name one (the per-backend fp32_precision settings
// make its getter throw): the exit then runs at::bmm
int matmul_precision() {
  try {
    return static_cast<int>(at::globalContext().float32MatmulPrecision());
  } catch (const c10::Error&) {
    return -1;
  }
}

struct FfnWeights {
  EntryWeights entry;
  at::Tensor gate_weight, gate_bias;
  int64_t topk;
  bool normalize;
  double route_scale;
  std::vector<at::Tensor> w1s, w3s, w2s;  // routed experts 0..E-1, then the shared one
  std::vector<double> limits;
};

struct AttnWeights {
  EntryWeights entry;
  at::Tensor wq_a, q_norm_weight;
  double q_norm_eps;
  at::Tensor wq_b;
  int64_t heads, head_dim;
  at::Tensor wkv, kv_norm_weight;
  double kv_norm_eps;
  int64_t rope_dim;
  at::Tensor sink;
  double attn_scale;
  at::Tensor wo_a;
  int64_t groups;
  at::Tensor wo_b;
};

// the intra-op threads and fp32 matmul precision are those the binding checked its products at
bool same_settings(const EntryWeights& e) {
  return at::get_num_threads() == e.threads && e.precision >= 0 && matmul_precision() == e.precision;
}

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> enter(const at::Tensor& h,
                                                                                 const at::Tensor& collapse_pre,
                                                                                 const EntryWeights& e) {
  const int64_t block = !same_settings(e) || h.dim() != 3 ? 0 : h.size(0) == 1 ? e.entry_one : e.entry_more;
  return hc_enter(h, e.fn_t, e.scale, e.base, collapse_pre, e.norm_weight, e.norm_eps, e.rms_eps, e.hc_eps, e.iters,
                  e.mix, false, block);
}

// the sublayer's exit (hc_expand_rows): residual h [B, hc, hidden], its output x [B, hidden]
std::optional<at::Tensor> leave(const at::Tensor& x, const at::Tensor& h, const at::Tensor& post, const at::Tensor& comb,
                                const EntryWeights& e) {
  const int64_t form = !same_settings(e) || h.dim() != 3 ? 0 : h.size(0) == 1 ? e.exit_one : e.exit_more;
  return hc_expand_rows(x, h, post, comb, false, form != 0, form == 2, form == 3);
}

bool float_cpu(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

bool mask_fits(const at::Tensor& m, int64_t b, int64_t n) {
  return m.device().is_cpu() && m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == b && m.size(1) == n;
}

// the inputs decode_attend takes without raising (decode_attend.py's _check) and attend_rows reads
bool attend_fits(const at::Tensor& q, const at::Tensor& win, const at::Tensor& win_mask,
                 const c10::optional<at::Tensor>& comp, const c10::optional<at::Tensor>& comp_mask,
                 const at::Tensor& sink) {
  if (!float_cpu(q) || !float_cpu(win) || !float_cpu(sink) || q.dim() != 3 || win.dim() != 3) return false;
  const int64_t b = q.size(0), heads = q.size(1), dim = q.size(2);
  if (win.size(0) != b || win.size(2) != dim || !mask_fits(win_mask, b, win.size(1))) return false;
  if (sink.dim() != 1 || sink.size(0) != heads || comp.has_value() != comp_mask.has_value()) return false;
  if (!comp.has_value()) return true;
  const bool entries = float_cpu(*comp) || (comp->device().is_cpu() && comp->scalar_type() == at::kBFloat16);
  return entries && comp->dim() == 3 && comp->size(0) == b && comp->size(2) == dim &&
         mask_fits(*comp_mask, b, comp->size(1));
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> ffn_rows(const at::Tensor& h,
                                                                       const at::Tensor& attn_pre,
                                                                       const FfnWeights& f) {
  const int64_t experts = f.gate_weight.size(0);
  if (static_cast<int64_t>(f.w1s.size()) != experts + 1) return {};
  // the gate weight as Gate.forward's compiled path reads it (gemv.py's applies): in place
  if (!f.gate_weight.is_contiguous() || f.gate_weight.is_neg()) return {};
  auto entered = enter(h, attn_pre, f.entry);
  if (!entered.has_value()) return {};
  const auto& [x, pre, post, comb] = *entered;
  // the router beside the shared expert's gate and up products, which need no routing (each output is the same call
  // on either thread, so the same bits)
  std::optional<std::tuple<at::Tensor, at::Tensor>> routed;
  const auto route = [&] { routed = route_rows(x, f.gate_weight, f.gate_bias, f.topk, f.normalize, f.route_scale); };
  const at::Tensor &sw1 = f.w1s[experts], &sw3 = f.w3s[experts];
  const int64_t rows = x.size(0), hidden = x.size(1);
  const bool shared_fits = x.is_contiguous() && rows <= 16 && float_cpu(sw1) && float_cpu(sw3) && !sw1.is_neg() &&
                           !sw3.is_neg() && sw1.is_contiguous() && sw3.is_contiguous() && sw1.dim() == 2 &&
                           sw1.sizes() == sw3.sizes() && sw1.size(1) == hidden;
  std::vector<float> shared_gate_up;  // [T, inter] gate rows, then up rows (made beside the router, else empty)
  // beside only where the router's product takes the same bits inside a region as outside (route_scores_agree)
  if (shared_fits && route_scores_agree(rows, hidden, f.gate_weight.size(0))) {
    const int64_t inter = sw1.size(0), kp = (hidden + 15) / 16 * 16;
    shared_gate_up.resize(2 * rows * inter);
    std::vector<float> padded;
    const float* xs = chunk_rows(x.const_data_ptr<float>(), rows, hidden, padded);
    const auto shared = [&] {
      float* gate = shared_gate_up.data();
      run_row_products({{xs, rows, hidden, kp, inter, sw1.const_data_ptr<float>(), gate},
                        {xs, rows, hidden, kp, inter, sw3.const_data_ptr<float>(), gate + rows * inter}});
    };
    beside(route, shared);  // hc_kernels.cpp
  } else {
    route();
  }
  if (!routed.has_value()) return {};
  const auto& [weights, ids] = *routed;
  // the experts named, increasing (decode_ffn's `used`), with their weights, then the shared expert's
  const int64_t* ip = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> used(ip, ip + ids.numel());
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  std::vector<at::Tensor> w1s, w3s, w2s;
  std::vector<double> limits;
  for (const int64_t e : used) {
    if (e < 0 || e >= experts) return {};
    w1s.push_back(f.w1s[e]), w3s.push_back(f.w3s[e]), w2s.push_back(f.w2s[e]), limits.push_back(f.limits[e]);
  }
  w1s.push_back(f.w1s[experts]), w3s.push_back(f.w3s[experts]), w2s.push_back(f.w2s[experts]);
  limits.push_back(f.limits[experts]);
  std::optional<at::Tensor> out =
      expert_groups_with(x, ids, weights, used, w1s, w3s, w2s, limits,
                         shared_gate_up.empty() ? nullptr : shared_gate_up.data());
  if (!out.has_value()) return {};
  std::optional<at::Tensor> streams = leave(*out, h, post, comb, f.entry);
  if (!streams.has_value()) return {};
  return std::make_tuple(*streams, pre, ids);
}

// fp8_kernels.cpp (compiled after this file)
bool read_fp8_window(const std::vector<at::Tensor>& rings, const at::Tensor& slots,
                     const std::optional<at::Tensor>& held, const at::Tensor& kv, int64_t lo, int64_t hi,
                     at::Tensor out, at::Tensor fresh);

std::vector<at::Tensor> attn_head(const at::Tensor& h, const at::Tensor& collapse_pre, const AttnWeights& a,
                                  const at::Tensor& cis, const std::optional<std::vector<at::Tensor>>& rings,
                                  const std::optional<at::Tensor>& slots, const std::optional<at::Tensor>& held,
                                  int64_t lo, int64_t hi, const std::optional<at::Tensor>& keys,
                                  const std::optional<at::Tensor>& entries) {
  auto entered = enter(h, collapse_pre, a.entry);
  if (!entered.has_value()) return {};
  const auto& [x, pre, post, comb] = *entered;
  auto both = project_q_kv_rows(x, a.wq_a, a.q_norm_weight, a.q_norm_eps, a.wq_b, a.heads, a.head_dim, a.wkv,
                                a.kv_norm_weight, a.kv_norm_eps, cis, a.rope_dim);
  if (!both.has_value()) return {};
  const auto& [q, kv] = *both;
  std::vector<at::Tensor> out{x, pre, post, comb, std::get<0>(q), std::get<1>(q), kv};
  // the window read of the new entries kv, where asked and where it takes them (else the caller's read runs)
  if (rings.has_value() && slots.has_value() && keys.has_value() && entries.has_value() &&
      read_fp8_window(*rings, *slots, held, kv, lo, hi, *keys, *entries)) {
    out.push_back(*keys);
    out.push_back(*entries);
  }
  return out;
}

std::vector<at::Tensor> attn_tail(const at::Tensor& q, const at::Tensor& win, const at::Tensor& win_mask,
                                  const c10::optional<at::Tensor>& comp, const c10::optional<at::Tensor>& comp_mask,
                                  const at::Tensor& h, const at::Tensor& post, const at::Tensor& comb,
                                  const at::Tensor& attn_pre, const at::Tensor& cis_inverse, const AttnWeights& a,
                                  const FfnWeights* f) {
  if (!attend_fits(q, win, win_mask, comp, comp_mask, a.sink)) return {};
  const at::Tensor o = attend_rows(q, win, win_mask, comp, comp_mask, a.sink, a.attn_scale);
  std::optional<at::Tensor> out = project_out_rows(o, cis_inverse, a.rope_dim, a.wo_a, a.groups, a.wo_b);
  if (!out.has_value()) return {};
  std::optional<at::Tensor> streams = leave(*out, h, post, comb, a.entry);
  if (!streams.has_value()) return {};
  if (f == nullptr) return {*streams};
  auto done = ffn_rows(*streams, attn_pre, *f);
  if (!done.has_value()) return {*streams};
  return {std::get<0>(*done), std::get<1>(*done), std::get<2>(*done)};
}
