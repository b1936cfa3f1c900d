// A decode step's SwiGLU experts in one call (kvdiet/model/moe.py, run_experts): every expert's w1 and w3
// products, its activation, then every w2 product. Compiled after gemv_kernels.cpp into the same module
// (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// expert_rows(xs, w1s, w3s, w2s, weights, limits): expert i takes rows xs[i] float32 [M_i, hidden] (1..16
//   rows), weights w1s[i], w3s[i] float32 [inter_i, hidden] and w2s[i] [hidden, inter_i] (contiguous), routing
//   weights weights[i] float32 [M_i, 1] or None (the shared expert; the weighted experts come first), and its
//   swiglu clamp limits[i] (≤ 0: none) -> float32 [M_i, hidden] each (views of one buffer): gate = x·w1ᵀ and
//   up = x·w3ᵀ (run_row_products, one parallel region for every expert), then up.clamp(−L, L),
//   gate.clamp(max=L), silu(gate)·up, weight·that, then ·w2ᵀ (a second region). The activation runs torch's own
//   ops from C++ (at::clamp, at::silu, at::mul: the values of Expert.activation bit for bit, without a Python
//   call per op), one op per step over every expert's rows where that gives the same bits (run_experts), else
//   per expert; the products are row_products_each's (the same dot_rows calls on the same rows).
//   Why: a one-request decode step of v4.1-mini runs 3 experts in each of 40 layers, and the Python around
//   the two product calls (the outputs' allocation, five activation ops per expert) cost as much as the
//   products themselves; then the ATen ops per expert (allocations, the activation) cost more than the products.
// expert_groups(x, ids, weights, experts, w1s, w3s, w2s, limits): rows x float32 [T, hidden] (1..16), each naming k
//   experts ids int64 [T, k] with routing weights float32 [T, k]; experts: the used expert ids in increasing order,
//   w1s/w3s/w2s/limits theirs, then the shared expert's -> float32 [T, hidden]: MoE._routed_grouped's decode rows.
//   The (row, slot) pairs grouped by expert, in increasing expert id, each group's pairs in increasing (row, slot)
//   order (torch.argsort(stable=True) of the flattened ids); each group's rows and weights copied (plain copies,
//   the bits unchanged) into one buffer, every group and the shared expert (all T rows) through run_experts, as
//   expert_rows does; the outputs put back in (row, slot) order as one contiguous [T, k, hidden] tensor and
//   summed over k by torch's own at::sum (its order depends on k and on the column's place in its vector loop,
//   so it is called, not repeated), plus the shared output (one IEEE add). MoE._one_row's row is the case T = 1.
//   The same values reach the activation ops, the products and at::sum as in Python, so the same bits;
//   std::nullopt where an output is NaN (where two NaNs meet in the add, which one torch keeps is its loop's) or
//   a weight is not contiguous float32 on the CPU or is a lazily negated view (checked here, not per weight in
//   Python: 27 a layer at 16 rows).
//   Throws on an id not in experts, a group of more than 16 rows, or k >= 16 (MoE checks first).
// expert_groups_with(..., shared_gate_up): expert_groups with the shared expert's gate and up products made already
//   (its [T, inter] gate rows, then its up rows; layer_kernels.cpp's ffn_rows makes them beside the router) or
//   nullptr; run_experts copies them in place of its own two products for the last expert (the same values).

namespace {

// The activation runs as one op per step over every expert's rows side by side (below) only where that gives
// each element what its own expert's op gives it: torch's element-wise CPU loop (ATen/native/cpu/Loops.h,
// vectorized_loop) runs whole chunks of 2·Vec::size() floats (at most 2·16: AVX-512) through the vector op and
// the rest through the scalar op (silu's std::exp vs the vector exp: other bits), and splits an op over threads
// at GRAIN_SIZE elements or more (chunks that need not start at a chunk of 32). So: every inter a multiple of 32
// (each expert's rows, and each row, whole chunks in both layouts), fewer than GRAIN_SIZE elements in all (one
// thread in both), one clamp limit, and the weighted experts first, of one inter (their weight a [R, 1] column
// as each expert's [M, 1]).
constexpr int64_t kVectorChunk = 32;

// One call's experts: expert i takes m[i] rows of hidden[i] floats at x[i] (row stride hidden[i] rounded up to
// 16, zeros past hidden[i]); the first `weighted` experts' rows take the routing weights wcol float32 [Σ m, 1]
// (contiguous, theirs in order) -> float32 [Σ m[i]·hidden_out[i]]: expert i's output rows [m[i], hidden_out[i]]
// from offset Σ_{j<i} m[j]·hidden_out[j]. Throws on weights that are not contiguous float32 [inter, hidden[i]]
// (w1, w3) and [hidden_out, inter] (w2) on the CPU, or on m[i] outside 1..16.
at::Tensor run_experts(const std::vector<const float*>& x, const std::vector<int64_t>& m,
                       const std::vector<int64_t>& hidden, const std::vector<at::Tensor>& w1s,
                       const std::vector<at::Tensor>& w3s, const std::vector<at::Tensor>& w2s, const at::Tensor& wcol,
                       size_t weighted, const std::vector<double>& limits, const float* last_gate_up = nullptr) {
  const size_t n = x.size();
  std::vector<int64_t> inter(n), act_at(n + 1, 0), out_at(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &w1 = w1s[i], &w3 = w3s[i], &w2 = w2s[i];
    for (const at::Tensor* w : {&w1, &w3, &w2})
      TORCH_CHECK(w->dtype() == at::kFloat && w->device().is_cpu() && w->is_contiguous(),
                  "expert weights: contiguous float32 on the CPU (expert ", i, ")");
    TORCH_CHECK(w1.dim() == 2 && w3.dim() == 2 && w2.dim() == 2 && w1.sizes() == w3.sizes() &&
                    w2.size(1) == w1.size(0) && w1.size(1) == hidden[i],
                "expert weights: w1 and w3 [inter, hidden], w2 [hidden_out, inter] (expert ", i, ")");
    TORCH_CHECK(m[i] >= 1 && m[i] <= 16, "an expert takes 1..16 rows, got ", m[i]);
    inter[i] = w1.size(0);
    act_at[i + 1] = act_at[i] + m[i] * inter[i];
    out_at[i + 1] = out_at[i] + m[i] * w2.size(0);
  }
  const auto options = wcol.options();
  at::Tensor gate = at::empty({act_at[n]}, options), up = at::empty({act_at[n]}, options);
  float *gp = gate.data_ptr<float>(), *upp = up.data_ptr<float>();
  std::vector<RowProduct> ps;
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = hidden[i], kp = (k + 15) / 16 * 16, size = act_at[i + 1] - act_at[i];
    if (i + 1 == n && last_gate_up != nullptr) {  // the last expert's products, made already: the same values
      std::memcpy(gp + act_at[i], last_gate_up, size * sizeof(float));
      std::memcpy(upp + act_at[i], last_gate_up + size, size * sizeof(float));
      continue;
    }
    ps.push_back({x[i], m[i], k, kp, inter[i], w1s[i].data_ptr<float>(), gp + act_at[i]});
    ps.push_back({x[i], m[i], k, kp, inter[i], w3s[i].data_ptr<float>(), upp + act_at[i]});
  }
  run_row_products(ps);
  bool together = act_at[n] < at::internal::GRAIN_SIZE;
  for (size_t i = 0; i < n; ++i)
    together = together && inter[i] % kVectorChunk == 0 && limits[i] == limits[0] &&
               (i >= weighted || inter[i] == inter[0]);
  std::vector<const float*> acts(n);  // each expert's activation [m, inter]: in gate where together
  std::vector<at::Tensor> own(n);     // else each its own tensor
  if (together) {
    const double limit = limits[0];
    if (limit > 0) {
      at::clamp_(up, -limit, limit);
      at::clamp_(gate, c10::nullopt, limit);
    }
    at::silu_(gate);
    at::mul_out(gate, gate, up);  // silu(gate) · up, in that operand order
    if (weighted > 0) {
      at::Tensor routed = gate.narrow(0, 0, act_at[weighted]).view({-1, inter[0]});
      at::mul_out(routed, wcol, routed);  // weight · act
    }
    for (size_t i = 0; i < n; ++i) acts[i] = gp + act_at[i];
  } else {
    for (size_t i = 0, row = 0; i < n; row += m[i], ++i) {
      at::Tensor g = gate.narrow(0, act_at[i], act_at[i + 1] - act_at[i]).view({m[i], inter[i]});
      at::Tensor u = up.narrow(0, act_at[i], act_at[i + 1] - act_at[i]).view({m[i], inter[i]});
      if (limits[i] > 0) {
        u = at::clamp(u, -limits[i], limits[i]);
        g = at::clamp(g, c10::nullopt, limits[i]);
      }
      at::Tensor act = at::silu(g) * u;
      if (i < weighted) act = wcol.narrow(0, row, m[i]) * act;
      own[i] = act.contiguous();
      acts[i] = own[i].const_data_ptr<float>();
    }
  }
  at::Tensor out = at::empty({out_at[n]}, options);
  std::vector<std::vector<float>> padded(n);  // activations with inter % 16 != 0, zero-padded
  ps.clear();
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = inter[i], kpi = (k + 15) / 16 * 16;
    const float* a = chunk_rows(acts[i], m[i], k, padded[i]);
    ps.push_back({a, m[i], k, kpi, w2s[i].size(0), w2s[i].data_ptr<float>(), out.data_ptr<float>() + out_at[i]});
  }
  run_row_products(ps);
  return out;
}

}  // namespace

std::vector<at::Tensor> expert_rows(std::vector<at::Tensor> xs, std::vector<at::Tensor> w1s,
                                    std::vector<at::Tensor> w3s, std::vector<at::Tensor> w2s,
                                    std::vector<c10::optional<at::Tensor>> weights, std::vector<double> limits) {
  const size_t n = xs.size();
  TORCH_CHECK(w1s.size() == n && w3s.size() == n && w2s.size() == n && weights.size() == n && limits.size() == n,
              "expert_rows: as many rows, w1, w3, w2, weights and limits");
  size_t weighted = 0;  // the weighted experts come first
  while (weighted < n && weights[weighted].has_value()) ++weighted;
  for (size_t i = weighted; i < n; ++i)
    TORCH_CHECK(!weights[i].has_value(), "expert_rows: the weighted experts first, then those without a weight");
  std::vector<at::Tensor> rows(n);
  std::vector<const float*> x(n);
  std::vector<int64_t> m(n), hidden(n);
  std::vector<std::vector<float>> padded(n);  // rows with hidden % 16 != 0, zero-padded
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(xs[i].dim() == 2 && xs[i].dtype() == at::kFloat && xs[i].device().is_cpu(),
                "expert_rows: x float32 [M, hidden] on the CPU (expert ", i, ")");
    rows[i] = xs[i].resolve_neg().contiguous();  // a lazy neg view read as its values
    m[i] = rows[i].size(0), hidden[i] = rows[i].size(1);
    x[i] = chunk_rows(rows[i].data_ptr<float>(), m[i], hidden[i], padded[i]);
  }
  std::vector<at::Tensor> columns;
  for (size_t i = 0; i < weighted; ++i) {
    const at::Tensor& w = *weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(0) == m[i] && w.size(1) == 1 && w.dtype() == at::kFloat,
                "expert_rows: routing weights float32 [M, 1] (expert ", i, ")");
    columns.push_back(w);
  }
  const at::Tensor wcol = weighted > 0 ? at::cat(columns) : at::empty({0, 1}, rows[0].options());
  const at::Tensor out = run_experts(x, m, hidden, w1s, w3s, w2s, wcol, weighted, limits);
  std::vector<at::Tensor> outs(n);
  for (int64_t i = 0, off = 0; i < static_cast<int64_t>(n); off += m[i] * w2s[i].size(0), ++i)
    outs[i] = out.narrow(0, off, m[i] * w2s[i].size(0)).view({m[i], w2s[i].size(0)});
  return outs;
}

// expert_groups, with the shared expert's gate and up products made already where shared_gate_up is given (its
// [T, inter] gate rows, then its up rows: layer_kernels.cpp's ffn_rows makes them beside the router)
std::optional<at::Tensor> expert_groups_with(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                                             const std::vector<int64_t>& experts, const std::vector<at::Tensor>& w1s,
                                             const std::vector<at::Tensor>& w3s, const std::vector<at::Tensor>& w2s,
                                             const std::vector<double>& limits, const float* shared_gate_up) {
  const int64_t used = static_cast<int64_t>(experts.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 16 && x.dtype() == at::kFloat && x.device().is_cpu(),
              "expert_groups: x float32 [T, hidden] on the CPU, 1..16 rows");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "expert_groups: ids int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, "expert_groups: weights [T, k]");
  TORCH_CHECK(static_cast<int64_t>(w1s.size()) == used + 1 && w3s.size() == w1s.size() &&
                  w2s.size() == w1s.size() && limits.size() == w1s.size(),
              "expert_groups: the used experts' weights and limits, then the shared's");
  const int64_t rows = x.size(0), k = ids.size(1), hidden = x.size(1), kp = (hidden + 15) / 16 * 16;
  TORCH_CHECK(k >= 1 && k < 16, "expert_groups: 1..15 slots");
  for (size_t g = 0; g < w1s.size(); ++g)  // weights the products cannot read in place: the caller's modules run
    for (const at::Tensor* t : {&w1s[g], &w3s[g], &w2s[g]})
      if (t->scalar_type() != at::kFloat || !t->device().is_cpu() || !t->is_contiguous() || t->is_neg())
        return std::nullopt;
  // lazy neg views read as their values (their storage holds the negation)
  const at::Tensor id = ids.contiguous(), w = weights.resolve_neg().contiguous(), xs = x.resolve_neg().contiguous();
  const int64_t* ip = id.const_data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(used);  // each used expert's (row, slot) pairs, in order
  for (int64_t p = 0; p < rows * k; ++p) {
    const auto it = std::lower_bound(experts.begin(), experts.end(), ip[p]);
    TORCH_CHECK(it != experts.end() && *it == ip[p], "expert_groups: expert ", ip[p], " is not among the used");
    pairs[it - experts.begin()].push_back(p);
  }
  // every group's rows, then all rows for the shared expert, zero-padded to kp; the groups' weights [pairs, 1]
  std::vector<float> gathered((rows * k + rows) * kp, 0.0f);
  at::Tensor wcol = at::empty({rows * k, 1}, w.options());
  const float *xp = xs.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  float* cp = wcol.mutable_data_ptr<float>();
  std::vector<const float*> starts;
  std::vector<int64_t> m, hiddens(used + 1, hidden);
  int64_t at_row = 0;
  for (int64_t g = 0; g < used; ++g) {
    TORCH_CHECK(!pairs[g].empty() && pairs[g].size() <= 16, "expert_groups: a used expert takes 1..16 pairs");
    starts.push_back(gathered.data() + at_row * kp);
    m.push_back(static_cast<int64_t>(pairs[g].size()));
    for (const int64_t p : pairs[g]) {
      std::memcpy(gathered.data() + at_row * kp, xp + p / k * hidden, hidden * sizeof(float));
      std::memcpy(cp + at_row, wp + p, sizeof(float));
      ++at_row;
    }
  }
  starts.push_back(gathered.data() + at_row * kp);
  m.push_back(rows);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(gathered.data() + (at_row + r) * kp, xp + r * hidden, hidden * sizeof(float));
  for (int64_t g = 0; g <= used; ++g)
    TORCH_CHECK(w2s[g].dim() == 2 && w2s[g].size(0) == hidden, "expert_groups: w2 [hidden, inter] (expert ", g, ")");
  const at::Tensor outs = run_experts(starts, m, hiddens, w1s, w3s, w2s, wcol, used, limits, shared_gate_up);
  const float* op_routed = outs.const_data_ptr<float>();
  at::Tensor slot_outs = at::empty({rows, k, hidden}, outs.options());  // (row, slot) order
  float* sp = slot_outs.mutable_data_ptr<float>();
  at_row = 0;
  for (int64_t g = 0; g < used; ++g)
    for (const int64_t p : pairs[g])
      std::memcpy(sp + p * hidden, op_routed + at_row++ * hidden, hidden * sizeof(float));
  at::Tensor out = at::sum(slot_outs, {1});
  float* op = out.mutable_data_ptr<float>();
  const float* shared = op_routed + at_row * hidden;
  for (int64_t i = 0; i < rows * hidden; ++i) op[i] = op[i] + shared[i];
  for (int64_t i = 0; i < rows * hidden; ++i)
    if (op[i] != op[i]) return {};
  return out;
}

std::optional<at::Tensor> expert_groups(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                                        std::vector<int64_t> experts, std::vector<at::Tensor> w1s,
                                        std::vector<at::Tensor> w3s, std::vector<at::Tensor> w2s,
                                        std::vector<double> limits) {
  return expert_groups_with(x, ids, weights, experts, w1s, w3s, w2s, limits, nullptr);
}
