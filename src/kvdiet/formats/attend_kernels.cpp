// A decode step's attention of one layer in one call (kvdiet/model/decode_attend.py holds the pure-torch path
// with the same order and bits). Compiled after gemv_kernels.cpp into the same module (its lane helpers are in
// scope; fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// attend_rows(q, win, win_mask, comp, comp_mask, sink, scale): q float32 [B, H, D], win float32 [B, W, D], win_mask
//   bool [B, W], comp float32 or bfloat16 [B, K, D] (bf16 read as its exact fp32 values: the decode step's gathered
//   FP4 entries, gather_kernels.cpp, at half the bytes to re-read) and comp_mask bool [B, K] (or both None: K = 0),
//   sink float32 [H], on the CPU in any layout -> float32 [B, H, D]. With keys k_j = win[b, j] (j < W), then
//   comp[b, j − W]:
//   - logit[b, h, j] = dot(q[b, h], k_j) · float(scale), the dot in row_products's order (16 lanes over D, the
//     fold (l, l+8), (l, l+4), (l, l+2), (0, 1): gemv_kernels.cpp's dot_rows), then one fp32 multiply; a masked
//     key's logit is −inf; logit[b, h, W + K] = sink[h].
//   - p = softmax(logits, −1) on the contiguous [B, H, W + K + 1] logits (on each group of requests below, a
//     contiguous [b, H, W + K + 1] slice: a row's softmax does not depend on the rows beside it), outside any
//     parallel region: softmax_kernels.cpp's rows with torch.softmax's bits where it takes them (wide rows once
//     softmax_wide_agrees), else at::softmax itself.
//   - o[b, h, d] = Σ_j p[b, h, j] · k_j[d] over the W + K keys (the sink's value is 0) as ONE sum in the same
//     order with j as the summed index: 16 lanes, lane l summing the keys j = l, l + 16, … in increasing j from
//     +0 (each product rounded, then added; no FMA: the module is built with -ffp-contract=off), then the fold
//     (l, l+8), (l, l+4), (l, l+2), (0, 1) — row_products(p[b, h, :W+K], keysᵀ)'s order.
//   Why: `attend` runs four bmm and seven other torch ops per layer (some 330 µs at v4.1-mini's 4 heads × 512
//   dims over 128 + 512 keys); this is one call on torch's intra-op threads. Requests run in rounds (scores,
//   softmax, values, fold) of one per thread, or as many as keep 256 KB of keys per thread, so a request's keys
//   (1.3 MB at v4.1-mini) stay in cache between the two passes. Requests of at least kLaneKeys keys take lane
//   tasks: the value tasks are (request, lane l): lane l's partial sums over its keys j = l, l + 16, … for every
//   head and dim (whole key rows, read once per lane), then the fold of the 16 partials, 16 outputs per vector;
//   the score tasks are blocks of 4 keys ordered by their lane quad, so the thread that scores a key is mostly
//   the one whose lanes sum it (at::parallel_for splits both ranges alike, though the quads hold unequal numbers
//   of blocks): a one-request step splits over both threads and reads its keys mostly from its own core's cache.
//   Fewer keys (the 40-layer tiny plan's 8 + 4) take row tasks: (request, 4 heads, 64 dims), all 16 lanes in
//   registers and folded there (lane tasks would write and re-read 16 partials of every output for a key or two
//   each). Only where work runs changes, never a sum's order.

#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

// softmax_kernels.cpp (compiled after this file): rows x [rows, n] into out with torch.softmax's bits, or false
bool softmax_logits(const float* x, float* out, int64_t rows, int64_t n);

namespace {

constexpr int64_t kAttendHeads = 4;  // heads of one value block (their accumulators stay in registers)
constexpr int64_t kAttendDims = 64;  // dims of one row-task value block: four 16-float vectors
constexpr int64_t kRoundBytes = 256 * 1024;  // keys per thread of one round of requests (well inside a core's L2)
constexpr int64_t kLaneKeys = 64;  // the fewest keys per request that take lane tasks (else row tasks)

// The W + K keys of one request, window first: the window's fp32, the selected entries' fp32 or bf16 (T; read
// as their exact fp32 values).
template <typename T>
struct AttendKeys {
  const float* win;
  const T* comp;
  int64_t w, n, dim;
};

// Lane l's partial sums of G heads of probabilities p (row stride ps) for dims d0 .. d0 + 16V: Σ p[g, j]·k_j[d]
// over j = l, l + 16, … in increasing j from +0, into part[g·pst + d − d0] (vector lanes are output dims).
template <int G, int V, typename T>
void lane_block(const float* p, int64_t ps, const AttendKeys<T>& keys, int64_t l, int64_t d0, float* part,
                int64_t pst) {
  Lanes16 acc[G][V] = {};
  auto add = [&](const auto* row, int64_t j) {  // key j's values d0 .. d0 + 16V, at row
    Lanes16 v[V];
    for (int c = 0; c < V; ++c) v[c] = load_lanes(row + 16 * c);
    for (int g = 0; g < G; ++g) {
      const float pj = p[g * ps + j];
      for (int c = 0; c < V; ++c) acc[g][c] = acc[g][c] + pj * v[c];
    }
  };
  int64_t j = l;
  for (; j < keys.w; j += 16) add(keys.win + j * keys.dim + d0, j);  // the window's keys, then the entries'
  for (; j < keys.n; j += 16) add(keys.comp + (j - keys.w) * keys.dim + d0, j);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) std::memcpy(part + g * pst + 16 * c, &acc[g][c], sizeof(Lanes16));
}

// lane_block's order for one dim d of G heads, in scalars (dims past the last whole 16), into part[g·pst].
template <int G, typename T>
void lane_dim(const float* p, int64_t ps, const AttendKeys<T>& keys, int64_t l, int64_t d, float* part,
              int64_t pst) {
  for (int g = 0; g < G; ++g) {
    float acc = 0.0f;
    for (int64_t j = l; j < keys.n; j += 16) {
      const float v = j < keys.w ? keys.win[j * keys.dim + d] : load(keys.comp[(j - keys.w) * keys.dim + d]);
      acc = acc + p[g * ps + j] * v;
    }
    part[g * pst] = acc;
  }
}

// Lane l's partial sums of G heads over all dims: blocks of 64, 32 and 16 dims, then single dims.
template <int G, typename T>
void lane_dims(const float* p, int64_t ps, const AttendKeys<T>& keys, int64_t l, float* part) {
  int64_t d = 0;
  for (; d + 64 <= keys.dim; d += 64) lane_block<G, 4>(p, ps, keys, l, d, part + d, keys.dim);
  for (; d + 32 <= keys.dim; d += 32) lane_block<G, 2>(p, ps, keys, l, d, part + d, keys.dim);
  for (; d + 16 <= keys.dim; d += 16) lane_block<G, 1>(p, ps, keys, l, d, part + d, keys.dim);
  for (; d < keys.dim; ++d) lane_dim<G>(p, ps, keys, l, d, part + d, keys.dim);
}

// o[i] = the fold (l, l+8), (l, l+4), (l, l+2), (0, 1) of the 16 lanes' partials part[l·ls + i], i < count:
// 16 outputs side by side per vector, each element's adds in that order.
void fold_partials(const float* part, int64_t ls, int64_t count, float* o) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    Lanes16 s8[8], s4[4], s2[2];
    for (int l = 0; l < 8; ++l) s8[l] = load_lanes(part + l * ls + i) + load_lanes(part + (l + 8) * ls + i);
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
    const Lanes16 r = s2[0] + s2[1];
    std::memcpy(o + i, &r, sizeof r);
  }
  for (; i < count; ++i) {
    float s8[8], s4[4], s2[2];
    for (int l = 0; l < 8; ++l) s8[l] = part[l * ls + i] + part[(l + 8) * ls + i];
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
    o[i] = s2[0] + s2[1];
  }
}

// Row tasks: o[g, d] (row stride os) for G heads and dims d0 .. d1: each block of 64, 32 or 16 dims (then each
// single dim) as all 16 lanes' partials (lane_block, lane_dim) into a buffer on the stack, then their fold.
template <int G, typename T>
void value_dims(const float* p, int64_t ps, const AttendKeys<T>& keys, int64_t d0, int64_t d1, float* o,
                int64_t os) {
  alignas(64) float buf[16 * G * 64];  // [lane, head, dim of the block]
  auto block = [&](auto vectors, int64_t d) {
    constexpr int V = decltype(vectors)::value, width = 16 * V;
    for (int l = 0; l < 16; ++l) lane_block<G, V>(p, ps, keys, l, d, buf + l * G * width, width);
    for (int g = 0; g < G; ++g) fold_partials(buf + g * width, G * width, width, o + g * os + d);
  };
  int64_t d = d0;
  for (; d + 64 <= d1; d += 64) block(std::integral_constant<int, 4>{}, d);
  for (; d + 32 <= d1; d += 32) block(std::integral_constant<int, 2>{}, d);
  for (; d + 16 <= d1; d += 16) block(std::integral_constant<int, 1>{}, d);
  for (; d < d1; ++d) {
    for (int l = 0; l < 16; ++l) lane_dim<G>(p, ps, keys, l, d, buf + l * G, 1);
    for (int g = 0; g < G; ++g) fold_partials(buf + g, G, 1, o + g * os + d);
  }
}

// Logits of keys j0 .. j0 + r of one request (r <= 4) for all its heads: row_products's dots of the keys at
// rows of `rows` (row stride dim) against the padded queries, then · scale, −inf where masked.
template <typename T>
void score_block(const float* qpad, int64_t heads, int64_t kp, const T* rows, int64_t dim, int64_t j0, int64_t r,
                 const bool* mask, float scale, float* y, int64_t n1) {
  if (r == 4) {
    dot_rows<4>(qpad, heads, kp, rows, dim, j0, y, n1);
  } else {
    for (int64_t j = j0; j < j0 + r; ++j) dot_rows<1>(qpad, heads, kp, rows, dim, j, y, n1);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = j0; j < j0 + r; ++j) y[h * n1 + j] = mask[j] ? y[h * n1 + j] * scale : neg_inf;
}

// attend_rows after its checks (every tensor contiguous, comp's elements T: float or c10::BFloat16)
template <typename T>
at::Tensor attend_body(const at::Tensor& q, const at::Tensor& win, const at::Tensor& win_mask,
                       const c10::optional<at::Tensor>& comp, const c10::optional<at::Tensor>& comp_mask,
                       const at::Tensor& sink, double scale) {
  const int64_t b = q.size(0), heads = q.size(1), dim = q.size(2), w = win.size(1);
  const int64_t k = comp.has_value() ? comp->size(1) : 0, n = w + k, n1 = n + 1;
  const float* qp = q.const_data_ptr<float>();
  const float* wp = win.const_data_ptr<float>();
  const T* cp = comp.has_value() ? static_cast<const T*>(comp->const_data_ptr()) : nullptr;
  const bool* wm = win_mask.const_data_ptr<bool>();
  const bool* cm = comp.has_value() ? comp_mask->const_data_ptr<bool>() : nullptr;
  const float* sp = sink.const_data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // the queries zero-padded to whole 16-float chunks, as row_products pads its rows
  const int64_t kp = (dim + 15) / 16 * 16;
  std::vector<float> qpad(b * heads * kp, 0.0f);
  for (int64_t r = 0; r < b * heads; ++r) std::memcpy(qpad.data() + r * kp, qp + r * dim, dim * 4);

  at::Tensor logits = at::empty({b, heads, n1}, q.options());
  float* lp = logits.mutable_data_ptr<float>();
  at::Tensor out = at::empty({b, heads, dim}, q.options());
  float* op = out.mutable_data_ptr<float>();
  const int64_t wb = (w + 3) / 4, per = wb + (k + 3) / 4;  // blocks of 4 keys: the window's, then comp's
  // the blocks in the order of their first key's lane quad ((j / 4) % 4 of the request's j), so a thread's share
  // of the scores is the keys whose lanes it sums in the values (they stay in its core's cache)
  const bool lanes = n >= kLaneKeys;
  std::vector<int64_t> order(per);
  for (int64_t i = 0; i < per; ++i) order[i] = i;
  if (lanes)
    std::stable_sort(order.begin(), order.end(), [wb, w](int64_t x, int64_t y) {
      return ((x < wb ? 4 * x : w + 4 * (x - wb)) / 4) % 4 < ((y < wb ? 4 * y : w + 4 * (y - wb)) / 4) % 4;
    });
  // one request per thread at a time, so its keys stay in that core's cache from the scores to the values; more
  // where several requests' keys fit there together (a round's softmax call and its parallel regions cost some
  // microseconds: at tiny widths, more than a request's whole attention)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = threads * std::max<int64_t>(1, kRoundBytes / std::max<int64_t>(1, n * dim * 4));
  const int64_t hd = heads * dim;
  // a round's lane partials [request, lane, H, D], uninitialised: every one is written before the fold reads it
  std::unique_ptr<float[]> parts(lanes ? new float[std::min(chunk, b) * 16 * hd] : nullptr);
  std::unique_ptr<float[]> probs_buf(new float[std::min(chunk, b) * heads * n1]);  // a round's probabilities
  const int64_t hg = (heads + kAttendHeads - 1) / kAttendHeads, db = (dim + kAttendDims - 1) / kAttendDims;
  for (int64_t r0 = 0; r0 < b; r0 += chunk) {
    const int64_t rn = std::min(chunk, b - r0);
    at::parallel_for(0, rn * per, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = r0 + t / per, blk = order[t % per];
        const float* qr = qpad.data() + r * heads * kp;
        float* y = lp + r * heads * n1;
        if (blk < wb) {
          const int64_t j0 = blk * 4;
          score_block(qr, heads, kp, wp + r * w * dim, dim, j0, std::min<int64_t>(4, w - j0), wm + r * w, sc, y, n1);
        } else {
          const int64_t j0 = (blk - wb) * 4;
          score_block(qr, heads, kp, cp + r * k * dim, dim, j0, std::min<int64_t>(4, k - j0), cm + r * k, sc, y + w,
                      n1);
        }
      }
    });
    for (int64_t r = r0; r < r0 + rn; ++r)
      for (int64_t h = 0; h < heads; ++h) lp[(r * heads + h) * n1 + n] = sp[h];
    // torch's softmax of each row (a row's bits do not depend on the rows beside it): the compiled one with its
    // bits (softmax_kernels.cpp) where it takes the rows, else torch's own
    at::Tensor probs;
    const float* pp = probs_buf.get();
    if (!softmax_logits(lp + r0 * heads * n1, probs_buf.get(), rn * heads, n1)) {
      probs = at::softmax(logits.narrow(0, r0, rn), -1);
      pp = probs.const_data_ptr<float>();
    }
    if (!lanes) {  // row tasks: (request, 4 heads, 64 dims)
      at::parallel_for(0, rn * hg * db, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r = r0 + t / (hg * db), g0 = (t / db) % hg * kAttendHeads, d0 = t % db * kAttendDims;
          const AttendKeys<T> keys{wp + r * w * dim, cp == nullptr ? nullptr : cp + r * k * dim, w, n, dim};
          const float* p = pp + ((r - r0) * heads + g0) * n1;
          float* o = op + (r * heads + g0) * dim;
          const int64_t d1 = std::min(dim, d0 + kAttendDims);
          switch (std::min(kAttendHeads, heads - g0)) {
            case 1: value_dims<1>(p, n1, keys, d0, d1, o, dim); break;
            case 2: value_dims<2>(p, n1, keys, d0, d1, o, dim); break;
            case 3: value_dims<3>(p, n1, keys, d0, d1, o, dim); break;
            default: value_dims<4>(p, n1, keys, d0, d1, o, dim); break;
          }
        }
      });
      continue;
    }
    // lane tasks (request, lane): a lane's sums read only its keys, whole rows
    at::parallel_for(0, rn * 16, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = r0 + t / 16, l = t % 16;
        const AttendKeys<T> keys{wp + r * w * dim, cp == nullptr ? nullptr : cp + r * k * dim, w, n, dim};
        float* part = parts.get() + ((r - r0) * 16 + l) * hd;
        for (int64_t g0 = 0; g0 < heads; g0 += kAttendHeads) {
          const float* p = pp + ((r - r0) * heads + g0) * n1;
          switch (std::min(kAttendHeads, heads - g0)) {
            case 1: lane_dims<1>(p, n1, keys, l, part + g0 * dim); break;
            case 2: lane_dims<2>(p, n1, keys, l, part + g0 * dim); break;
            case 3: lane_dims<3>(p, n1, keys, l, part + g0 * dim); break;
            default: lane_dims<4>(p, n1, keys, l, part + g0 * dim); break;
          }
        }
      }
    });
    // the fold of each request's lanes (a few µs each: on the calling thread for one request)
    at::parallel_for(0, rn, 2, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fold_partials(parts.get() + t * 16 * hd, hd, hd, op + (r0 + t) * hd);
    });
  }
  return out;
}

}  // namespace

at::Tensor attend_rows(at::Tensor q, at::Tensor win, at::Tensor win_mask, c10::optional<at::Tensor> comp,
                       c10::optional<at::Tensor> comp_mask, at::Tensor sink, double scale) {
  TORCH_CHECK(q.dim() == 3 && win.dim() == 3 && win.size(0) == q.size(0) && win.size(2) == q.size(2),
              "attend_rows: q [B, H, D] and win [B, W, D]");
  TORCH_CHECK(comp.has_value() == comp_mask.has_value(), "attend_rows: comp and comp_mask together");
  const int64_t b = q.size(0), heads = q.size(1), dim = q.size(2), w = win.size(1);
  const int64_t k = comp.has_value() ? comp->size(1) : 0;
  std::vector<at::Tensor*> all = {&q, &win, &win_mask, &sink};
  if (comp.has_value()) {
    TORCH_CHECK(comp->dim() == 3 && comp->size(0) == b && comp->size(2) == dim, "attend_rows: comp [B, K, D]");
    TORCH_CHECK(comp_mask->dim() == 2 && comp_mask->size(0) == b && comp_mask->size(1) == k,
                "attend_rows: comp_mask [B, K]");
    all.push_back(&*comp);
    all.push_back(&*comp_mask);
  }
  TORCH_CHECK(win_mask.dim() == 2 && win_mask.size(0) == b && win_mask.size(1) == w, "attend_rows: win_mask [B, W]");
  TORCH_CHECK(sink.dim() == 1 && sink.size(0) == heads, "attend_rows: sink [H]");
  for (at::Tensor* t : all) {
    TORCH_CHECK(t->device().is_cpu(), "attend_rows runs on the CPU");
    // the gathered entries may be bf16
    const bool bf16_entries = comp.has_value() && t == &*comp && t->scalar_type() == at::kBFloat16;
    TORCH_CHECK(t->scalar_type() == (t->dim() == 2 ? at::kBool : at::kFloat) || bf16_entries,
                "attend_rows takes float32 tensors (comp: float32 or bfloat16) and bool masks");
    *t = t->resolve_neg().contiguous();  // lazy neg views read as their values; any layout
  }
  if (comp.has_value() && comp->scalar_type() == at::kBFloat16)
    return attend_body<c10::BFloat16>(q, win, win_mask, comp, comp_mask, sink, scale);
  return attend_body<float>(q, win, win_mask, comp, comp_mask, sink, scale);
}
