// The MoE router of a few rows (a decode step's, one per request) in one call, with the bits of Gate.forward's torch
// ops (kvdiet/model/moe.py). Compiled into the same module as the other kernels (fp8_kernels.cpp holds the
// bindings). Built at first use by kvdiet.formats.native.
//
// route_rows(x, weight, bias, topk, normalize, scale): x float32 [T, hidden] (1..16 rows, any layout), weight
//   float32 [E, hidden], bias float32 [E] -> (weights float32 [T, topk], ids int64 [T, topk]), or std::nullopt for
//   any other input. The steps of Gate.forward's top-k routing (v41-spec §8.2a), each as torch runs it:
//   - scores = at::sqrt(at::softplus(at::mm(x, weightᵀ))): torch's own product (at::matmul's call for two
//     matrices), softplus and square root of the same [T, E] tensors (torch's CPU sqrt is not always the
//     correctly rounded one: with MKL it runs VML's, which rounds some values the other way, e.g. one of eight
//     router scores in a 40-layer tiny-plan step);
//   - ids: the first topk of a stable descending sort of scores + bias (one IEEE add each), as torch.sort orders
//     them: NaN first, then by value, equal values (−0 = +0) and NaNs in index order;
//   - weights = the chosen scores; with normalize and topk > 1 each divided by (at::sum of the row's chosen
//     scores, torch's own sum of the same [T, topk] tensor, + float(1e-20)); then times float(scale).
//   Why: Gate.forward is some twelve torch ops of 5-15 µs dispatch each on a few dozen floats per row.
// route_scores_agree(rows, hidden, experts): whether route_rows' scores (at::sqrt(at::softplus(at::mm(x, weightᵀ))),
//   x [rows, hidden], weight [experts, hidden], both contiguous) take the same bits on the calling thread inside a
//   parallel region as outside one at torch's present thread count, on probe rows (fixed pseudo-random values at
//   three scales), checked once per (shape, thread count) in a process; true at one thread (the region runs inline),
//   false, unchecked, inside a parallel region. layer_kernels.cpp's ffn_rows runs the router beside other work
//   (inside a region) only where they agree. Why: torch's BLAS (MKL) may split a product of a few rows over the
//   threads outside a region and run it on one inside, in another order. Measured on an AMD EPYC (Zen 4; oneMKL
//   2024.0, in the strict CNR mode kvdiet/threads.py sets): [2, 64]·[64, 4], [2, 64]·[64, 6] and [4, 64]·[64, 16]
//   (v4.1-micro's router of two rows) gave other bits at one thread than at two, every probe; the routers of
//   v4.1-mini (hidden 256, 8 experts) and V4.1-Flash (4,096, 256) at 1..16 rows did not. On an Intel Xeon VM the
//   decode tests that compare the two passed with the router always beside.

#include <array>
#include <map>
#include <mutex>
#include <numeric>

namespace {

constexpr int64_t kRouteRowsMax = 16;

// torch.sort(descending=True, stable=True)'s order: whether entry a goes before entry b (a < b by index).
inline bool routed_before(float va, int64_t a, float vb, int64_t b) {
  const bool na = va != va, nb = vb != vb;
  if (na || nb) return na && (!nb || a < b);
  return va > vb || (va == vb && a < b);
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> route_rows(const at::Tensor& x, const at::Tensor& weight,
                                                             const at::Tensor& bias, int64_t topk, bool normalize,
                                                             double scale) {
  for (const at::Tensor* t : {&x, &weight, &bias})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->is_neg()) return {};
  if (x.dim() != 2 || weight.dim() != 2 || bias.dim() != 1 || x.size(1) != weight.size(1)) return {};
  const int64_t rows = x.size(0), experts = weight.size(0);
  if (rows < 1 || rows > kRouteRowsMax || bias.size(0) != experts || topk < 1 || topk > experts) return {};
  // at::matmul of two matrices is at::mm (ATen passes them on unchanged); sqrt's new output is contiguous
  at::Tensor scores = at::sqrt(at::softplus(at::mm(x, weight.t())));
  const float* sp = scores.const_data_ptr<float>();
  const at::Tensor b = bias.contiguous();
  const float* bp = b.const_data_ptr<float>();
  at::Tensor ids = at::empty({rows, topk}, x.options().dtype(at::kLong));
  at::Tensor chosen = at::empty({rows, topk}, x.options());
  int64_t* ip = ids.mutable_data_ptr<int64_t>();
  float* cp = chosen.mutable_data_ptr<float>();
  std::vector<float> biased(experts);
  std::vector<int64_t> order(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sp + r * experts;
    for (int64_t e = 0; e < experts; ++e) biased[e] = s[e] + bp[e];
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                      [&](int64_t a, int64_t c) { return routed_before(biased[a], a, biased[c], c); });
    for (int64_t j = 0; j < topk; ++j) {
      ip[r * topk + j] = order[j];
      cp[r * topk + j] = s[order[j]];
    }
  }
  const float factor = static_cast<float>(scale);
  if (normalize && topk > 1) {
    const at::Tensor sums = at::sum(chosen, {1});
    const float* sum = sums.const_data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float denominator = sum[r] + 1e-20f;
      for (int64_t j = 0; j < topk; ++j) cp[r * topk + j] = cp[r * topk + j] / denominator;
    }
  }
  for (int64_t i = 0; i < rows * topk; ++i) cp[i] = cp[i] * factor;
  return std::make_tuple(chosen, ids);
}

bool route_scores_agree(int64_t rows, int64_t hidden, int64_t experts) {
  TORCH_CHECK(rows >= 1 && hidden >= 1 && experts >= 1, "route_scores_agree: rows, hidden and experts must be >= 1");
  if (at::in_parallel_region()) return false;  // no "outside a region" to compare here (and nothing kept)
  static std::mutex mutex;
  static std::map<std::array<int64_t, 4>, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const std::array<int64_t, 4> key{rows, hidden, experts, at::get_num_threads()};
  if (const auto it = known.find(key); it != known.end()) return it->second;
  uint64_t state = 0x9E3779B97F4A7C15ull;  // a fixed LCG: the same probes in every process
  const auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<float>(static_cast<uint32_t>(state >> 40)) / 16777216.0f - 0.5f) * 2.0f;  // [-1, 1)
  };
  bool same = true;
  for (const float scale : {1.0f, 1e-3f, 30.0f}) {
    const auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor x = at::empty({rows, hidden}, options), weight = at::empty({experts, hidden}, options);
    for (at::Tensor* t : {&x, &weight}) {
      float* p = t->mutable_data_ptr<float>();
      for (int64_t i = 0; i < t->numel(); ++i) p[i] = next() * scale;
    }
    const auto scores = [&] { return at::sqrt(at::softplus(at::mm(x, weight.t()))).contiguous(); };
    const at::Tensor outside = scores();
    at::Tensor inside;
    at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task)
        if (task == 0) inside = scores();  // on the calling thread, as ffn_rows' router (hc_kernels.cpp's beside)
    });
    same = same && std::memcmp(outside.const_data_ptr<float>(), inside.const_data_ptr<float>(),
                               outside.numel() * sizeof(float)) == 0;
  }
  known.emplace(key, same);
  return same;
}
