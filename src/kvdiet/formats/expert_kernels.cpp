// A decode step's SwiGLU experts in one call (kvdiet/model/moe.py, run_experts): every expert's w1 and w3
// products, its activation, then every w2 product. Compiled after gemv_kernels.cpp into the same module
// (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// expert_rows(xs, w1s, w3s, w2s, weights, limits): expert i takes rows xs[i] float32 [M_i, hidden] (1..16
//   rows), weights w1s[i], w3s[i] float32 [inter_i, hidden] and w2s[i] [hidden, inter_i] (contiguous), routing
//   weights weights[i] float32 [M_i, 1] or None (the shared expert), and its swiglu clamp limits[i] (≤ 0: none)
//   -> float32 [M_i, hidden] each: gate = x·w1ᵀ and up = x·w3ᵀ (row_products_each, one parallel region for
//   every expert), then up.clamp(−L, L), gate.clamp(max=L), silu(gate)·up, weight·that, then ·w2ᵀ (a second
//   region). The activation runs torch's own ops from C++ (at::clamp, at::silu, at::mul: the values of
//   Expert.activation bit for bit, without a Python call per op); the products are row_products_each's.
//   Why: a one-request decode step of v4.1-mini runs 3 experts in each of 40 layers, and the Python around
//   the two product calls (the outputs' allocation, five activation ops per expert) cost as much as the
//   products themselves.
// expert_row(x, w1s, w3s, w2s, weights, limits): one row x float32 [1, hidden] through k routed experts and the
//   shared one (the last of each list), routing weights float32 [1, k] -> float32 [1, hidden]: MoE._one_row's
//   Σ_j routed_j + shared, where routed_j = expert_rows' output of expert j with routing weight weights[:, j]
//   (a [1, 1] view, as Python's split gives) and the sum over the k slots runs as torch sums a strided dim of
//   fewer than 16 values: one at a time from +0, ((0 + r₀) + r₁) + …, then one add of the shared output.
//   k >= 16 throws (torch's sum then splits into partial sums; MoE checks k first).

std::vector<at::Tensor> expert_rows(std::vector<at::Tensor> xs, std::vector<at::Tensor> w1s,
                                    std::vector<at::Tensor> w3s, std::vector<at::Tensor> w2s,
                                    std::vector<c10::optional<at::Tensor>> weights, std::vector<double> limits) {
  const size_t n = xs.size();
  TORCH_CHECK(w1s.size() == n && w3s.size() == n && w2s.size() == n && weights.size() == n && limits.size() == n,
              "expert_rows: as many rows, w1, w3, w2, weights and limits");
  std::vector<at::Tensor> px, pw, po, acts, outs;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(xs[i].dim() == 2 && w1s[i].dim() == 2 && w3s[i].dim() == 2 && w2s[i].dim() == 2 &&
                    w1s[i].sizes() == w3s[i].sizes() && w2s[i].size(1) == w1s[i].size(0) &&
                    w2s[i].size(0) == xs[i].size(1),
                "expert_rows: x [M, hidden], w1 and w3 [inter, hidden], w2 [hidden, inter] (expert ", i, ")");
    const at::Tensor x = xs[i].contiguous();
    const auto options = x.options();
    for (const at::Tensor& w : {w1s[i], w3s[i]}) {
      px.push_back(x);
      pw.push_back(w);
      po.push_back(at::empty({x.size(0), w.size(0)}, options));
    }
  }
  row_products_each(px, pw, po);
  for (size_t i = 0; i < n; ++i) {
    at::Tensor gate = po[2 * i], up = po[2 * i + 1];
    if (limits[i] > 0) {
      up = at::clamp(up, -limits[i], limits[i]);
      gate = at::clamp(gate, c10::nullopt, limits[i]);
    }
    at::Tensor act = at::silu(gate) * up;
    if (weights[i].has_value()) act = *weights[i] * act;
    acts.push_back(act.contiguous());
    outs.push_back(at::empty({xs[i].size(0), w2s[i].size(0)}, act.options()));
  }
  row_products_each(acts, w2s, outs);
  return outs;
}

at::Tensor expert_row(const at::Tensor& x, std::vector<at::Tensor> w1s, std::vector<at::Tensor> w3s,
                      std::vector<at::Tensor> w2s, const at::Tensor& weights, std::vector<double> limits) {
  const int64_t k = static_cast<int64_t>(w1s.size()) - 1;
  TORCH_CHECK(k >= 1 && k < 16, "expert_row: 1..15 routed experts and the shared one");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "expert_row: x [1, hidden]");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == 1 && weights.size(1) == k, "expert_row: weights [1, k]");
  std::vector<c10::optional<at::Tensor>> slots;
  for (int64_t j = 0; j < k; ++j) slots.push_back(weights.narrow(1, j, 1));
  slots.push_back(c10::nullopt);
  const std::vector<at::Tensor> outs =
      expert_rows(std::vector<at::Tensor>(k + 1, x), std::move(w1s), std::move(w3s), std::move(w2s), slots, limits);
  const int64_t hidden = outs[k].size(1);
  at::Tensor out = at::empty({1, hidden}, outs[k].options());
  float* op = out.mutable_data_ptr<float>();
  const float* shared = outs[k].const_data_ptr<float>();
  std::vector<const float*> routed;
  for (int64_t j = 0; j < k; ++j) routed.push_back(outs[j].const_data_ptr<float>());
  for (int64_t d = 0; d < hidden; ++d) {
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) acc = acc + routed[j][d];
    op[d] = acc + shared[d];
  }
  return out;
}
