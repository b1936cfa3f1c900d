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
// expert_groups(x, ids, weights, experts, w1s, w3s, w2s, limits): rows x float32 [T, hidden] (1..16), each naming k
//   experts ids int64 [T, k] with routing weights float32 [T, k]; experts: the used expert ids in increasing order,
//   w1s/w3s/w2s/limits theirs, then the shared expert's -> float32 [T, hidden]: MoE._routed_grouped's decode rows.
//   The (row, slot) pairs grouped by expert, in increasing expert id, each group's pairs in increasing (row, slot)
//   order (torch.argsort(stable=True) of the flattened ids); each group's rows gathered and its weights [n, 1],
//   every group and the shared expert (all T rows) through expert_rows; the outputs put back in (row, slot) order
//   as one contiguous [T, k, hidden] tensor and summed over k by torch's own at::sum (its order depends on k and
//   on the column's place in its vector loop, so it is called, not repeated), plus the shared output (one IEEE
//   add). MoE._one_row's row is the case T = 1. The same tensors reach expert_rows and at::sum as in Python, so
//   the same bits; std::nullopt where an output is NaN (where two NaNs meet in the add, which one torch keeps is
//   its loop's). Throws on an id not in experts, a group of more than 16 rows, or k >= 16 (MoE checks first).

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

std::optional<at::Tensor> expert_groups(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         std::vector<int64_t> experts, std::vector<at::Tensor> w1s, std::vector<at::Tensor> w3s,
                         std::vector<at::Tensor> w2s, std::vector<double> limits) {
  const int64_t used = static_cast<int64_t>(experts.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 16, "expert_groups: x [T, hidden], 1..16 rows");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "expert_groups: ids int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat, "expert_groups: weights [T, k]");
  TORCH_CHECK(static_cast<int64_t>(w1s.size()) == used + 1, "expert_groups: the used experts' weights, then the shared");
  const int64_t rows = x.size(0), k = ids.size(1);
  TORCH_CHECK(k >= 1 && k < 16, "expert_groups: 1..15 slots");
  const at::Tensor id = ids.contiguous(), w = weights.contiguous().view({-1, 1}), xs = x.contiguous();
  const int64_t* ip = id.const_data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(used);  // each used expert's (row, slot) pairs, in order
  for (int64_t p = 0; p < rows * k; ++p) {
    const auto it = std::lower_bound(experts.begin(), experts.end(), ip[p]);
    TORCH_CHECK(it != experts.end() && *it == ip[p], "expert_groups: expert ", ip[p], " is not among the used");
    pairs[it - experts.begin()].push_back(p);
  }
  std::vector<at::Tensor> inputs;
  std::vector<c10::optional<at::Tensor>> slots;
  for (int64_t g = 0; g < used; ++g) {
    TORCH_CHECK(!pairs[g].empty() && pairs[g].size() <= 16, "expert_groups: a used expert takes 1..16 pairs");
    const at::Tensor p = at::tensor(pairs[g], id.options());
    inputs.push_back(xs.index_select(0, at::floor_divide(p, k)));
    slots.push_back(w.index_select(0, p));
  }
  inputs.push_back(xs);
  slots.push_back(c10::nullopt);
  const std::vector<at::Tensor> outs =
      expert_rows(inputs, std::move(w1s), std::move(w3s), std::move(w2s), slots, limits);
  const int64_t hidden = outs[used].size(1);
  at::Tensor slot_outs = at::empty({rows, k, hidden}, outs[used].options());  // (row, slot) order
  float* sp = slot_outs.mutable_data_ptr<float>();
  for (int64_t g = 0; g < used; ++g)
    for (size_t i = 0; i < pairs[g].size(); ++i)
      std::memcpy(sp + pairs[g][i] * hidden, outs[g].const_data_ptr<float>() + i * hidden, hidden * sizeof(float));
  at::Tensor out = at::sum(slot_outs, {1});
  float* op = out.mutable_data_ptr<float>();
  const float* shared = outs[used].const_data_ptr<float>();
  for (int64_t i = 0; i < rows * hidden; ++i) op[i] = op[i] + shared[i];
  for (int64_t i = 0; i < rows * hidden; ++i)
    if (op[i] != op[i]) return {};
  return out;
}
