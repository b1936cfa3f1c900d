// mHC around a sublayer for a few rows (a decode step's, one per request), with the bits of the torch formulas in
// kvdiet/model/hc.py. Compiled after rmsnorm_kernels.cpp into the same module (its square, any_nan and rms_norm are
// in scope; fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// hc_enter(h, fn_t, scale, base, collapse_pre, norm_weight, norm_eps, rms_eps, hc_eps, iters, mix, any_rows,
//   mix_block): h
//   float32 [T, hc, hidden] (contiguous, 1..16 rows, or with any_rows any number: a prefill chunk's, up to
//   sinkhorn.py's MAX_MIX_ROWS, which the caller (hc.py's sublayer_entry) keeps; 1 <= hc <= 4), fn_t float32
//   [hc·hidden, (2+hc)·hc] (any layout),
//   scale float32 [3] (the parameter: each mix's scale is hc x scale[0], hc x scale[1], hc^2 x scale[2]) and base
//   float32 [(2+hc)·hc] (contiguous), collapse_pre float32 [T, hc], norm_weight float32 [hidden];
//   mix: (address of sinkhorn.c's kvdiet_hc_mix_f32, address of torch's vector exp, its lanes), from
//   kvdiet.model.sinkhorn.hc_mix_address -> (x float32 [T, hidden], pre [T, hc], post [T, hc], comb [T, hc, hc]),
//   or std::nullopt for any other input, where rms_norm declines (a NaN in x) or the mix kernel refuses. What a
//   sublayer takes from its input streams before its own work (v41-spec §8.1a), each step as hc.py computes it:
//   - the coefficients' product at::mm(flatten(h), fn_t): torch's own product of the same operands (at::matmul
//     of two matrices is that call), or with mix_block != 0 chain_mm(flatten(h), fn_t, mix_block), which the caller
//     has checked gives its bits at that shape class (kvdiet.model.chain_products.product_fits);
//   - their mean(flatten(h)²): the squares one IEEE product each, their sum at::sum over the contiguous
//     [T, hc·hidden] squares, then divided by float(hc·hidden) (torch's CPU mean is that sum, then div_);
//   - pre, post, comb from those two: kvdiet_hc_mix_f32, the very call kvdiet.model.sinkhorn.hc_mix makes;
//   - x = rms_norm(Σ_i collapse_pre[t, i] · h[t, i]): the products one IEEE multiply each, added one at a time in
//     increasing i to a sum from +0, the order of torch's CPU sum over a dim of at most 4 values (hc_collapse's
//     at::sum over hc; sinkhorn.c's column sums rely on it too, and the tests hold this kernel to hc_collapse's
//     bits, zeros' signs included), then rmsnorm_kernels.cpp's rms_norm.
// hc_expand_rows(x, residual, post, comb, any_rows, chain, settle_zero, start_negative): x float32 [T, hidden],
//   residual float32 [T, hc, hidden], post float32 [T, hc], comb float32 [T, hc, hc] (any layout, 1..16 rows, or any
//   number with any_rows: a prefill's) -> float32 [T, hc, hidden], or std::nullopt for any other input or a NaN
//   output: out[t, i] = post[t, i] · x[t] + mixed[t, i] with mixed = at::bmm(combᵀ, residual), torch's own product on
//   the formula's operands (then one IEEE multiply and one add per element: hc_expand's formula), so no step depends
//   on the number of rows but torch's own; with chain and contiguous comb and residual, mixed is chain_kernels.cpp's
//   chain_bmm instead, in the form settle_zero and start_negative name (the caller has checked that it gives
//   at::bmm's bits at that shape class: kvdiet.model.chain_products.chain_fits).
//   Why: in torch a sublayer's entry is some 12 ops and two foreign calls of 5-30 µs each on a few thousand floats
//   (the collapse, the norm, the coefficients), its exit 8 ops; these are one call each. Where the coefficients run
//   in chain_mm and two threads are free, the entry's two independent parts run one a thread: chain_mm, which
//   reads fn_t from memory (96 KB at v4.1-mini), beside the collapse, its norm and the squares' mean, a chain of
//   small steps that wait on their own reads (a v4.1-mini decode step 0.7 ms faster: 80 entries a step). The same
//   calls on the same operands, so the same bits; only where the squares hold fewer than GRAIN_SIZE elements, as
//   at::sum inside the region runs on its thread and torch splits a longer row over the threads outside one (one
//   row of 65,536 floats measured other bits at two threads than at one).

// first() on the calling thread and second() on another at once, where two of torch's threads are free (outside any
// parallel region: at::parallel_for gives task 0 to the calling thread), else one after the other. For two
// independent parts of a decode step's serial work (this file's hc_enter, layer_kernels.cpp's ffn_rows): the
// calling thread takes the chain of small steps that wait on their own reads, the other a product that streams its
// weights; the other way round measured slower. Each part runs the same calls on either thread.
template <class First, class Second>
void beside(const First& first, const Second& second) {
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) task == 0 ? first() : second();
    });
  } else {
    first();
    second();
  }
}

namespace {

constexpr int64_t kHcRowsMax = 16;
constexpr int64_t kHcStreamsMax = 4;  // hc_mix's widest comb (sinkhorn.c)

// kvdiet_hc_mix_f32 (kvdiet/model/sinkhorn.c)
typedef int (*HcMixFn)(float*, const float*, const float*, const float*, int64_t, int64_t, float, float, int64_t,
                       float*, float*, float*, void*, int64_t);

// The caller runs these without autograd (they keep no graph): a parameter's requires_grad does not matter here.
bool hc_float_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && !t.is_neg();
}

// o[d] = c · x[d] + o[d] for d < n: one IEEE product and one sum per element, in vector lanes or the tail alike
void add_scaled(float* o, const float* x, float c, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const NormLanes v = c * load16(x + d) + load16(o + d);
    std::memcpy(o + d, &v, sizeof v);
  }
  for (; d < n; ++d) o[d] = c * x[d] + o[d];
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> hc_enter(
    const at::Tensor& h, const at::Tensor& fn_t, const at::Tensor& scale, const at::Tensor& base,
    const at::Tensor& collapse_pre, const at::Tensor& norm_weight, double norm_eps, double rms_eps, double hc_eps,
    int64_t iters, std::tuple<int64_t, int64_t, int64_t> mix, bool any_rows = false, int64_t mix_block = 0) {
  for (const at::Tensor* t : {&h, &fn_t, &scale, &base, &collapse_pre, &norm_weight})
    if (!hc_float_cpu(*t)) return {};
  if (h.dim() != 3 || !h.is_contiguous()) return {};
  const int64_t rows = h.size(0), hc = h.size(1), hidden = h.size(2), n_mix = (2 + hc) * hc;
  if (rows < 1 || (!any_rows && rows > kHcRowsMax) || hc < 1 || hc > kHcStreamsMax || hidden < 1 || iters < 1) return {};
  if (fn_t.dim() != 2 || fn_t.size(0) != hc * hidden || fn_t.size(1) != n_mix) return {};
  if (scale.dim() != 1 || scale.size(0) != 3 || base.dim() != 1 || base.size(0) != n_mix || !base.is_contiguous())
    return {};
  if (collapse_pre.dim() != 2 || collapse_pre.size(0) != rows || collapse_pre.size(1) != hc) return {};
  if (norm_weight.dim() != 1 || norm_weight.size(0) != hidden) return {};
  const auto [mix_fn, vexp, lanes] = mix;
  if (mix_fn == 0 || vexp == 0) return {};
  const int64_t width = hc * hidden;
  const float* hp = h.const_data_ptr<float>();

  const at::Tensor pre_in = collapse_pre.contiguous();
  const float* cp = pre_in.const_data_ptr<float>();
  const at::Tensor flat = h.view({rows, width});
  // two independent parts (`beside`): the collapse, its norm and the squares' mean, and the coefficients' product,
  // which reads fn_t from memory
  std::optional<at::Tensor> x, chained;
  at::Tensor mean_sq;
  const auto collapse_and_mean = [&] {
    at::Tensor collapsed = at::zeros({rows, hidden}, h.options());  // the sums from +0
    float* sp = collapsed.mutable_data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < hc; ++i) add_scaled(sp + r * hidden, hp + (r * hc + i) * hidden, cp[r * hc + i], hidden);
    x = rms_norm(collapsed, norm_weight, norm_eps, any_rows);
    at::Tensor squares = at::empty({rows, width}, h.options());
    square(hp, squares.mutable_data_ptr<float>(), rows * width);
    mean_sq = at::sum(squares, {1});
    float* mp = mean_sq.mutable_data_ptr<float>();
    const float n = static_cast<float>(width);
    for (int64_t r = 0; r < rows; ++r) mp[r] = mp[r] / n;
  };
  // chain_mm in the blocks its caller checked against at::mm (NaN outputs: at::mm's, below)
  const auto coefficients = [&] { chained = chain_mm(flat, fn_t, mix_block); };
  // beside only where the sums inside (at::sum of the squares, rms_norm's) run on one thread outside a parallel
  // region too (fewer than GRAIN_SIZE elements: a longer one torch splits over the threads, in another order)
  if (mix_block != 0 && rows * width < at::internal::GRAIN_SIZE) {
    beside(collapse_and_mean, coefficients);
  } else {
    collapse_and_mean();
    if (mix_block != 0) coefficients();
  }
  if (!x.has_value()) return {};
  const float* mp = mean_sq.const_data_ptr<float>();
  // at::matmul of two matrices is at::mm (ATen's matmul passes them on unchanged): mm's output is contiguous
  at::Tensor mixes = chained.has_value() ? *chained : at::mm(flat, fn_t);  // overwritten by the mix kernel
  // each mix's scale, hc x scale[0], hc x scale[1], hc^2 x scale[2] (hc.py's HcWeights.mix_scales), read now
  const at::Tensor scales = scale.contiguous();
  const float* s3 = scales.const_data_ptr<float>();
  std::vector<float> mix_scale(n_mix);
  for (int64_t k = 0; k < n_mix; ++k) mix_scale[k] = s3[k < hc ? 0 : (k < 2 * hc ? 1 : 2)];
  at::Tensor pre = at::empty({rows, hc}, h.options()), post = at::empty({rows, hc}, h.options());
  at::Tensor comb = at::empty({rows, hc, hc}, h.options());
  const int status = reinterpret_cast<HcMixFn>(mix_fn)(
      mixes.mutable_data_ptr<float>(), mp, mix_scale.data(), base.const_data_ptr<float>(), rows, hc,
      static_cast<float>(rms_eps), static_cast<float>(hc_eps), iters, pre.mutable_data_ptr<float>(),
      post.mutable_data_ptr<float>(), comb.mutable_data_ptr<float>(), reinterpret_cast<void*>(vexp), lanes);
  if (status != 0) return {};
  return std::make_tuple(*x, pre, post, comb);
}

std::optional<at::Tensor> hc_expand_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& post,
                                         const at::Tensor& comb, bool any_rows = false, bool chain = false,
                                         bool settle_zero = false, bool start_negative = false) {
  for (const at::Tensor* t : {&x, &residual, &post, &comb})
    if (!hc_float_cpu(*t)) return {};
  if (residual.dim() != 3) return {};
  const int64_t rows = residual.size(0), hc = residual.size(1), hidden = residual.size(2);
  if (rows < 1 || (!any_rows && rows > kHcRowsMax)) return {};
  if (x.dim() != 2 || x.size(0) != rows || x.size(1) != hidden) return {};
  if (post.dim() != 2 || post.size(0) != rows || post.size(1) != hc) return {};
  if (comb.dim() != 3 || comb.size(0) != rows || comb.size(1) != hc || comb.size(2) != hc) return {};
  // mixed (contiguous), then overwritten with the sum
  // the chain for the class its caller checked (a contiguous comb's transpose, a contiguous residual) only
  const bool use_chain = chain && comb.is_contiguous() && residual.is_contiguous();
  std::optional<at::Tensor> mixed =
      use_chain ? chain_bmm(comb.transpose(1, 2), residual, settle_zero, start_negative) : std::nullopt;
  if (use_chain && !mixed.has_value()) return {};
  at::Tensor out = use_chain ? *mixed : at::bmm(comb.transpose(1, 2), residual);
  const at::Tensor xs = x.contiguous(), ps = post.contiguous();
  const float* xp = xs.const_data_ptr<float>();
  const float* pp = ps.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < hc; ++i) add_scaled(op + (r * hc + i) * hidden, xp + r * hidden, pp[r * hc + i], hidden);
  // where two NaNs meet, which one torch's vector loop keeps is not this loop's to repeat
  if (any_nan(op, out.numel())) return {};
  return out;
}
