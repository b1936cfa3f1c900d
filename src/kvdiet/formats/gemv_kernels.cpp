// Decode-row products y = x · wᵀ for a few rows of x, in kvdiet's fixed fp32 order (kvdiet/model/gemv.py holds
// the pure-torch path with the same order and bits). Compiled after fp4_kernels.cpp and topk_kernels.cpp into the
// same module (fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// row_products_each: pairs of x float32 [M, K] (contiguous, 1 <= M <= 16) and w float32 [N, K] (contiguous)
//   -> out float32 [M, N] (contiguous), in one parallel region (run_row_products, which expert_kernels.cpp calls
//   on its own buffers: every w1 and w3 of an MoE layer's experts in one call, every w2 in another). row_products: one pair, x [..., K] of 1..16 rows in any layout -> [..., N]. Each y[m, n] is one dot product in 16 lanes: lane l sums x[i]·w[i] for i = l, l+16, …
//   in increasing i, from +0 (each product rounded, then added; no fused multiply-add: the module is built
//   with -ffp-contract=off); a last partial chunk reads zeros past K. The lanes fold as (l, l+8), (l, l+4),
//   (l, l+2), then (0, 1).
//   Why: a decode step reads each weight once for one row, and torch's BLAS product runs such a row at 12-18 GB/s
//   on the CPU (v4.1-mini's 132 MB LM head in 10.5 ms); this runs at the read bandwidth (about 30 GB/s on 2
//   cores) and with one order on every machine. The order is this kernel's own: it rounds differently from the
//   BLAS (as the BLAS's one-row and many-row kernels already do from each other), within fp32 rounding.
//   Rows of w are split over torch's intra-op threads (a call of fewer than 64K products in all, elements of w
//   times rows of x, runs on the calling thread: each output is one dot_rows call whatever the split, so the same
//   bits); within a task, four rows of w are scored against the rows of x four at a time, so each w row is read
//   from memory once; for one row of x, sixteen rows of w at a time, whose 16 outputs fold side by side
//   (fold_lanes16) rather than one by one (a fold alone is some 15 dependent adds and their shuffles: at K = 128
//   about as many steps as the row).
//   While a block is scored, the next block of w's rows is read ahead where it lies in w: its R rows are R·K
//   contiguous floats, and its 64-byte lines are prefetched in order, a few a step of 16 values, so the
//   whole block (less a K % 16 tail) is asked for by the time this one is done: a decode step's weights come cold
//   from DRAM, a few hundred KB per call, too short a run for the hardware prefetchers to reach the read
//   bandwidth on their own. For one row of x the block's rows are read one after another (each row's 16-value
//   steps in order, then the next row), so its bytes come in address order: the LM head's 132 MB cold in 2.6
//   against 3.0 ms with the rows read side by side, and a v4.1-mini decode step 0.75 ms faster at 4K and 1M
//   (stop 51, in one process alternating the two); the sums are the same, lane by lane in the same order.

namespace {

typedef float Lanes16 __attribute__((vector_size(64)));  // one vector per lane set: AVX-512, 2 x AVX2, 4 x SSE

inline Lanes16 load_lanes(const float* p) {
  Lanes16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bf16 values as fp32 (each exact: its bits shifted up), for keys a decode step gathered as bf16
// (gather_kernels.cpp: FP4 entries are exact there); vpmovzxwd and vpslld on AVX-512
inline Lanes16 load_lanes(const c10::BFloat16* p) {
  typedef uint16_t Half16 __attribute__((vector_size(32)));
  typedef uint32_t Word16 __attribute__((vector_size(64)));
  Half16 h;
  std::memcpy(&h, p, sizeof h);
  const Word16 w = __builtin_convertvector(h, Word16) << 16;
  Lanes16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline float fold_lanes(Lanes16 a) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

// fold_lanes of 16 vectors at once, the same adds in the same order, lane-parallel: level 1 puts a[l] + a[l+8]
// of two vectors side by side, level 2 s8[l] + s8[l+4] of four, level 3 s4[l] + s4[l+2] of eight, level 4
// s2[0] + s2[1] of all sixteen: out[i] = fold_lanes(v[i]).
inline void fold_lanes16(const Lanes16* v, float* out) {
  Lanes16 c[8], e[4], g[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    g[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const Lanes16 r = __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                    __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  std::memcpy(out, &r, sizeof r);
}

// Rows j0 .. j0+R of w against G rows of x (xs: G rows of padded length kp, zeros past K), into y[g, j0 + r].
// wt: the R rows' last partial chunk as fp32, zero-padded (unused when K % 16 == 0). T: float, or c10::BFloat16
// (rows read as their exact fp32 values: the same products and sums as those values stored as float).
template <int R, int G, typename T = float>
inline void dot_block(const float* xs, int64_t kp, const T* w, int64_t k, int64_t j0, const float* wt, float* y,
                      int64_t n) {
  const int64_t full = k / 16;
  Lanes16 acc[R][G] = {};
  // the next block's R rows, contiguous: R prefetches a step of 16 values, in order (a 64-byte line each for fp32,
  // half a line for bf16: each line asked for twice). Only where that block lies within n rows: inside w for
  // row_products, whose n is w's row count; the attention passes its logits' row stride as n, so there a
  // prefetch may reach a few rows past a request's keys (harmless: a prefetch never faults).
  const T* next = w + (j0 + R) * k;
  const bool ahead = j0 + 2 * R <= n;
  if constexpr (G == 1) {  // one row of x: w's rows one after another, so the block is read in address order
    for (int r = 0; r < R; ++r) {
      const T* wr = w + (j0 + r) * k;
      for (int64_t c = 0; c < full; ++c) {
        if (ahead) __builtin_prefetch(next + (r * full + c) * 16);
        acc[r][0] = acc[r][0] + load_lanes(xs + c * 16) * load_lanes(wr + c * 16);
      }
    }
  } else {  // G rows of x: each w vector read once for all of them, the R rows side by side
    for (int64_t c = 0; c < full; ++c) {
      for (int r = 0; ahead && r < R; ++r) __builtin_prefetch(next + (c * R + r) * 16);
      Lanes16 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load_lanes(w + (j0 + r) * k + c * 16);
      for (int g = 0; g < G; ++g) {
        const Lanes16 xv = load_lanes(xs + g * kp + c * 16);
        for (int r = 0; r < R; ++r) acc[r][g] = acc[r][g] + xv * wv[r];
      }
    }
  }
  if (full * 16 < k) {
    for (int r = 0; r < R; ++r) {
      const Lanes16 wv = load_lanes(wt + r * 16);
      for (int g = 0; g < G; ++g) acc[r][g] = acc[r][g] + load_lanes(xs + g * kp + full * 16) * wv;
    }
  }
  if constexpr (R * G >= 8) {  // many outputs: fold them side by side
    Lanes16 v[16] = {};
    float folded[16];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) v[g * R + r] = acc[r][g];
    fold_lanes16(v, folded);
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) y[g * n + j0 + r] = folded[g * R + r];
  } else {
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) y[g * n + j0 + r] = fold_lanes(acc[r][g]);
  }
}

template <int R, typename T = float>
void dot_rows(const float* xs, int64_t m, int64_t kp, const T* w, int64_t k, int64_t j0, float* y, int64_t n) {
  alignas(64) float wt[R * 16];
  const int64_t full = k / 16;
  if (full * 16 < k) {
    std::memset(wt, 0, sizeof wt);
    for (int r = 0; r < R; ++r) {
      for (int64_t i = full * 16; i < k; ++i) wt[r * 16 + i - full * 16] = load(w[(j0 + r) * k + i]);  // fp4_kernels.cpp's: bf16 exact
    }
  }
  if constexpr (R > 4) {  // 16 rows of w (block_rows): one row of x at a time, its 16 outputs folded together
    for (int64_t g = 0; g < m; ++g) dot_block<R, 1>(xs + g * kp, kp, w, k, j0, wt, y + g * n, n);
    return;
  }
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

// One product: m rows of x at xs (row stride kp = K rounded up to 16, zeros past K; kp == K reads x itself), the
// n rows of w [n, K], out y [m, n] (contiguous).
struct RowProduct {
  const float* xs;
  int64_t m, k, kp, n;
  const float* w;
  float* y;
};

// Rows x [m, k] (row stride k) as dot_rows reads them, padded to kp = k rounded up to 16: x itself where kp == k,
// else copies zero-padded past k in buf (which must outlive the products).
inline const float* chunk_rows(const float* x, int64_t m, int64_t k, std::vector<float>& buf) {
  const int64_t kp = (k + 15) / 16 * 16;
  if (kp == k) return x;
  buf.assign(m * kp, 0.0f);
  for (int64_t r = 0; r < m; ++r) std::memcpy(buf.data() + r * kp, x + r * k, k * sizeof(float));
  return buf.data();
}

// Below this many products in all (elements of w times rows of x: for one row, 256 KB of w), one call's products
// run on the calling thread: a parallel region costs more than it saves there. Counted by elements of w alone, a
// batch of 16 rows ran a small model's products on one thread: on the 40-layer tiny plan (hidden 64) a 16-request
// decode step was 0.79 ms faster counted by products (16.63 -> 15.85 ms, faster in 20 of 20 paired rounds; one
// request's steps unchanged). Each output is one dot_rows call whatever the split, so the same bits.
constexpr int64_t kSerialProducts = 1 << 16;

// Rows of w per task of a product of m rows of x by n rows of w: 16 for one row of x when there are at least 16
// rows of w per thread (dot_block<16, 1> folds its 16 outputs side by side, fold_lanes16), else 4 (four rows of x
// at a time already fold 16 outputs at once; a short w keeps enough tasks for every thread). wide: 16 · threads.
inline int64_t block_rows(int64_t m, int64_t n, int64_t wide) { return m == 1 && n >= wide ? 16 : 4; }

// Every product in one parallel region: the tasks are the products' blocks of block_rows rows of w.
void run_row_products(const std::vector<RowProduct>& ps) {
  std::vector<int64_t> first(ps.size() + 1, 0);  // the products' first block among all blocks
  int64_t work = 0;  // products: elements of w times rows of x, over every pair
  const int64_t wide = 16 * static_cast<int64_t>(at::get_num_threads());
  for (size_t i = 0; i < ps.size(); ++i) {
    const int64_t rb = block_rows(ps[i].m, ps[i].n, wide);
    first[i + 1] = first[i] + (ps[i].n + rb - 1) / rb;
    work += ps[i].n * ps[i].k * ps[i].m;
  }
  const int64_t blocks = first.back();
  if (blocks == 0) return;
  auto run = [&](int64_t b0, int64_t b1) {
    size_t i = std::upper_bound(first.begin(), first.end(), b0) - first.begin() - 1;
    for (int64_t b = b0; b < b1; ++b) {
      while (b >= first[i + 1]) ++i;
      const RowProduct& p = ps[i];
      const int64_t rb = block_rows(p.m, p.n, wide), j0 = (b - first[i]) * rb;
      if (rb == 16 && j0 + 16 <= p.n) {
        dot_rows<16>(p.xs, p.m, p.kp, p.w, p.k, j0, p.y, p.n);
      } else {
        int64_t j = j0;
        for (; j + 4 <= std::min(p.n, j0 + rb); j += 4) dot_rows<4>(p.xs, p.m, p.kp, p.w, p.k, j, p.y, p.n);
        for (; j < std::min(p.n, j0 + rb); ++j) dot_rows<1>(p.xs, p.m, p.kp, p.w, p.k, j, p.y, p.n);
      }
    }
  };
  if (work < kSerialProducts) return run(0, blocks);
  // tasks of about 4,096 products each (for one row of x, 16 KB of w)
  const int64_t grain = std::max<int64_t>(1, 4096 * blocks / work);
  at::parallel_for(0, blocks, grain, run);
}

// Every (x, w) pair's products in one parallel region (run_row_products), rows of x with K % 16 != 0 copied
// zero-padded.
void row_products_each(std::vector<at::Tensor> xs, std::vector<at::Tensor> ws, std::vector<at::Tensor> outs) {
  TORCH_CHECK(xs.size() == ws.size() && ws.size() == outs.size(), "row_products_each: as many x, w and out");
  std::vector<RowProduct> ps(xs.size());
  std::vector<std::vector<float>> padded(xs.size());  // the rows of x zero-padded to kp, where K % 16 != 0
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor &x = xs[i], &w = ws[i], &out = outs[i];
    TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat && out.dtype() == at::kFloat,
                "row_products takes float32 tensors");
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "row_products runs on the CPU");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "row_products: x [M, K] and w [N, K]");
    TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "row_products takes 1..16 rows, got ", x.size(0));
    TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == w.size(0), "row_products: out [M, N]");
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "row_products needs contiguous tensors");
    RowProduct& p = ps[i];
    p.m = x.size(0), p.k = x.size(1), p.kp = (p.k + 15) / 16 * 16, p.n = w.size(0);
    p.xs = chunk_rows(x.data_ptr<float>(), p.m, p.k, padded[i]);
    p.w = w.data_ptr<float>(), p.y = out.data_ptr<float>();
  }
  run_row_products(ps);
}

// x float32 [..., K] (any layout) -> float32 [..., N]
at::Tensor row_products(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() >= 1, "row_products takes x [..., K]");
  const int64_t k = x.size(-1);
  at::Tensor rows = x.reshape({-1, k}).contiguous();
  at::Tensor out = at::empty({rows.size(0), w.size(0)}, rows.options());
  row_products_each({rows}, {w}, {out});
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return out.view(shape);
}
