// Fused FP8 window codec (mxfp8: E4M3 values + one UE8M0 scale per 32), bit-identical to the pure-torch path in
// fp8.py. Compiled after fp4_kernels.cpp, topk_kernels.cpp and gemv_kernels.cpp into the same module (their
// helpers are in scope), and holds the module's bindings. Built at first use by kvdiet.formats.native.
//
// encode: rows x float32 [n, dim] (contiguous) -> entries uint8 [n, dim + dim/32]: per block,
//   amax = max(max|x| (on the bits), 1e-4), s = 2^min(ceil(log2(amax / 448)), 119) (ceil on the fp32 bits),
//   code = e4m3_rne(clamp(x / s, +-448)) as torch's float8_e4m3fn cast; then the scale bytes.
//   Returns -1, or the first row holding a non-finite value (nothing is promised about `out` then).
// decode: entries uint8 [n, width] (any row stride, unit element stride) -> float32 [n, dim]: value =
//   (half(code) * 256) * s, half(code) being fp8.py's fp16 bit trick (the byte sign-extended to int16, shifted
//   left 7, bit 14 cleared: the E4M3 value * 2^-8 exactly, subnormals included; 0x7F / 0xFF read +-480), each
//   product rounded once (both exact but the last). Vectorised with AVX-512 (vcvtph2ps zmm) or AVX2 + F16C,
//   a table lookup otherwise: the same bits. Returns -1, or the first row holding a scale byte outside lo..hi.
// read_fp8_window: the decode step's window read (fp8.read_window): per request b, e = encode(kv[b]);
//   out[b, n] = decode(e); out[b, j] = decode(rings[b][slots[b, j]]) where held[b, j] (every j when held is
//   None), else out[b, n]; fresh[b] = encode(out[b, n]). Returns false (nothing promised about out / fresh)
//   for input it does not take (a layout, dtype or width other than below, a slot outside its ring, a
//   non-finite kv row, a read entry with a scale byte outside lo..hi): the caller then runs the torch path,
//   which raises the error. Why: the torch path is two encodes, B index_selects, a where and a decode, some
//   ten calls of 5-25 us each around a few us of work per layer and step.

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kFp8MaxBiased = 119 + 127;  // the largest scale exponent the recipe writes, biased

// E4M3 byte -> fp16 bits by fp8.py's bit trick: the byte sign-extended to int16, shifted left 7, bit 14
// cleared, is an fp16 equal to the E4M3 value * 2^-8 (0x7F: 1.875 * 2^-8, so 480 and not NaN)
inline float fp8_half(uint8_t code) {
  const uint16_t half = static_cast<uint16_t>((static_cast<int16_t>(static_cast<int8_t>(code)) << 7) & 0xBFFF);
  return static_cast<float>(c10::Half(half, c10::Half::from_bits()));
}

// Values per task of the decode kernels' at::parallel_for: a 128-row window (dim 512) is four tasks of 32 rows, over
// the intra-op threads. Waking the pool costs about 1 us; a window read some 30 us a layer in a decode step, its ring
// cold (stop 57, a 2-core Xeon VM at 12 GB/s a core: at 65,536, one task, a v4.1-mini step 0.65 ms slower at 4K
// and 0.73 ms at 1M).
constexpr int64_t kFp8DecodeGrainValues = 16384;

// 32 E4M3 bytes -> 32 floats, (fp8_half(code) * 256) * s; vcvtph2ps converts fp16 exactly, as c10::Half does
inline void decode_fp8_block(const uint8_t* codes, float s, float* out) {
#if defined(__AVX512F__)
  const __m512 k256 = _mm512_set1_ps(256.0f), scale = _mm512_set1_ps(s);
  const __m256i clear14 = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  for (int h = 0; h < 32; h += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + h));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), clear14);
    _mm512_storeu_ps(out + h, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(half), k256), scale));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 k256 = _mm256_set1_ps(256.0f), scale = _mm256_set1_ps(s);
  const __m128i clear14 = _mm_set1_epi16(static_cast<int16_t>(0xBFFF));
  for (int h = 0; h < 32; h += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + h));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), clear14);
    _mm256_storeu_ps(out + h, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(half), k256), scale));
  }
#else
  for (int i = 0; i < 32; ++i) out[i] = fp8_half(codes[i]) * 256.0f * s;
#endif
}

// one entry (dim E4M3 bytes, then dim/32 scale bytes) -> dim floats; false when a scale byte is outside lo..hi
inline bool decode_fp8_entry(const uint8_t* entry, int64_t dim, int64_t lo, int64_t hi, float* out) {
  bool ok = true;
  for (int64_t b = 0; b < dim / 32; ++b) {
    const uint32_t byte = entry[dim + b];
    ok &= byte >= lo && byte <= hi;
    decode_fp8_block(entry + b * 32, float_of((byte & 0xFF) << 23), out + b * 32);
  }
  return ok;
}

int64_t encode_fp8_rows(const float* x, int64_t n, int64_t dim, uint8_t* out) {
  const int64_t nb = dim / 32, width = dim + nb;
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      uint8_t* o = out + r * width;
      for (int64_t b = 0; b < nb; ++b) {
        uint32_t m = 0;
        for (int i = 0; i < 32; ++i) m = std::max(m, bits_of(xr[b * 32 + i]) & 0x7FFFFFFFu);
        if (m >= 0x7F800000u) {  // +-inf or NaN
          note_row(bad, r);
          break;
        }
        const float y = std::max(float_of(m), 1e-4f) / 448.0f;
        const uint32_t biased = std::min<uint32_t>((bits_of(y) + 0x7FFFFFu) >> 23, kFp8MaxBiased);
        const float s = float_of(biased << 23);
        o[dim + b] = static_cast<uint8_t>(biased);
        for (int i = 0; i < 32; ++i) {
          const float q = std::min(std::max(xr[b * 32 + i] / s, -448.0f), 448.0f);
          o[b * 32 + i] = c10::Float8_e4m3fn(q).x;
        }
      }
    }
  });
  return first_noted(bad);
}

}  // namespace

// x float32 [n, dim] contiguous -> out uint8 [n, dim + dim/32] contiguous; -1 or the first non-finite row
int64_t encode_fp8(at::Tensor x, at::Tensor out) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.dim() == 2 && out.dim() == 2 &&
                  x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "fp8 encode: layout");
  return encode_fp8_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<uint8_t>());
}

// packed uint8 [n, width] (unit element stride) -> out float32 [n, dim] contiguous; -1 or the first row holding
// a scale byte outside lo..hi
int64_t decode_fp8(at::Tensor packed, int64_t lo, int64_t hi, at::Tensor out) {
  TORCH_CHECK(packed.dim() == 2 && (packed.size(1) <= 1 || packed.stride(1) == 1) && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "fp8 decode: layout");
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const int64_t n = packed.size(0), stride = packed.stride(0), dim = out.size(1);
  float* o = out.data_ptr<float>();
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, kFp8DecodeGrainValues / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (!decode_fp8_entry(p + r * stride, dim, lo, hi, o + r * dim)) note_row(bad, r);
    }
  });
  return first_noted(bad);
}

// rings: B uint8 [W_b, dim + dim/32] (unit element stride); slots int64 [B, n] and held bool [B, n] (or None),
// contiguous; kv float32 [B, dim] contiguous; out float32 [B, n + 1, dim] and fresh uint8 [B, dim + dim/32],
// contiguous. False: input it does not take, see the top of this file.
bool read_fp8_window(const std::vector<at::Tensor>& rings, const at::Tensor& slots,
                     const std::optional<at::Tensor>& held, const at::Tensor& kv, int64_t lo, int64_t hi,
                     at::Tensor out, at::Tensor fresh) {
  const int64_t b = kv.dim() == 2 ? kv.size(0) : -1, dim = kv.dim() == 2 ? kv.size(1) : 0;
  const int64_t n = slots.dim() == 2 ? slots.size(1) : -1, width = dim + dim / 32;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == b &&
                  out.size(1) == n + 1 && out.size(2) == dim && fresh.is_contiguous() &&
                  fresh.scalar_type() == at::kByte && fresh.dim() == 2 && fresh.size(0) == b &&
                  fresh.size(1) == width,
              "fp8 window read: out / fresh layout");
  if (b < 0 || dim <= 0 || dim % 32 || !kv.device().is_cpu() || !kv.is_contiguous() || kv.scalar_type() != at::kFloat ||
      static_cast<int64_t>(rings.size()) != b || slots.scalar_type() != at::kLong || !slots.is_contiguous() ||
      slots.size(0) != b)
    return false;
  if (held && (held->scalar_type() != at::kBool || !held->is_contiguous() || held->sizes() != slots.sizes()))
    return false;
  std::vector<const uint8_t*> ring_rows(b);
  std::vector<int64_t> ring_stride(b);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const at::Tensor& ring = rings[i];
    if (ring.device() != kv.device() || ring.scalar_type() != at::kByte || ring.dim() != 2 ||
        ring.size(1) != width || ring.stride(1) != 1)
      return false;
    for (int64_t j = 0; j < n; ++j) {
      if (slot[i * n + j] < 0 || slot[i * n + j] >= ring.size(0)) return false;
    }
    ring_rows[i] = ring.data_ptr<uint8_t>();
    ring_stride[i] = ring.stride(0);
  }
  const bool* keep = held ? held->data_ptr<bool>() : nullptr;
  float* o = out.data_ptr<float>();
  uint8_t* f = fresh.data_ptr<uint8_t>();
  // the new entries: encode, decode into the last key, encode that (what the torch path stores)
  if (encode_fp8_rows(kv.data_ptr<float>(), b, dim, f) >= 0) return false;
  for (int64_t i = 0; i < b; ++i) {
    float* last = o + (i * (n + 1) + n) * dim;
    if (!decode_fp8_entry(f + i * width, dim, lo, hi, last) || encode_fp8_rows(last, 1, dim, f + i * width) >= 0)
      return false;
  }
  std::atomic<bool> ok{true};
  at::parallel_for(0, b * n, std::max<int64_t>(1, kFp8DecodeGrainValues / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / n, j = r % n;
      float* key = o + (i * (n + 1) + j) * dim;
      if (keep && !keep[r]) {
        std::memcpy(key, o + (i * (n + 1) + n) * dim, dim * sizeof(float));
      } else if (!decode_fp8_entry(ring_rows[i] + slot[r] * ring_stride[i], dim, lo, hi, key)) {
        ok = false;
      }
    }
  });
  return ok;
}

// The threads at::parallel_for spreads n one-item tasks over: torch's intra-op threads (torch.set_num_threads).
// The kernels are built with OpenMP (-fopenmp); without it at::parallel_for runs every kernel on one thread.
int64_t parallel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    seen |= uint64_t{1} << std::min<int64_t>(at::get_thread_num(), 63);
  });
  return __builtin_popcountll(seen.load());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_fp4", &encode_fp4, py::call_guard<py::gil_scoped_release>());
  m.def("decode_fp4", &decode_fp4, py::call_guard<py::gil_scoped_release>());
  m.def("gather_fp4", &gather_fp4, py::call_guard<py::gil_scoped_release>());
  m.def("index_scores", &index_scores, py::call_guard<py::gil_scoped_release>());
  m.def("index_integer_path", &index_integer_path);
  m.def("index_integer_groups", &index_integer_groups);
  m.def("index_amx_path", &index_amx_path);
  m.def("index_amx_groups", &index_amx_groups);
  m.def("select_topk", &select_topk, py::call_guard<py::gil_scoped_release>());
  m.def("block_max", &block_max, py::call_guard<py::gil_scoped_release>());
  m.def("row_products", &row_products, py::call_guard<py::gil_scoped_release>());
  m.def("row_products_each", &row_products_each, py::call_guard<py::gil_scoped_release>());
  m.def("expert_rows", &expert_rows, py::call_guard<py::gil_scoped_release>());
  m.def("expert_groups", &expert_groups, py::call_guard<py::gil_scoped_release>());
  m.def("route_rows", &route_rows, py::call_guard<py::gil_scoped_release>());
  m.def("route_scores_agree", &route_scores_agree, py::call_guard<py::gil_scoped_release>());
  m.def("encode_fp8", &encode_fp8, py::call_guard<py::gil_scoped_release>());
  m.def("decode_fp8", &decode_fp8, py::call_guard<py::gil_scoped_release>());
  m.def("read_fp8_window", &read_fp8_window, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("any_rows") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("engram_rows", &engram_rows, py::call_guard<py::gil_scoped_release>());
  m.def("engram_hashes", &engram_hashes, py::call_guard<py::gil_scoped_release>());
  m.def("engram_gate", &engram_gate, py::call_guard<py::gil_scoped_release>());
  m.def("hc_enter", &hc_enter, py::arg("h"), py::arg("fn_t"), py::arg("scale"), py::arg("base"),
        py::arg("collapse_pre"), py::arg("norm_weight"), py::arg("norm_eps"), py::arg("rms_eps"), py::arg("hc_eps"),
        py::arg("iters"), py::arg("mix"), py::arg("any_rows") = false, py::arg("mix_block") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("chain_mm", &chain_mm, py::arg("a"), py::arg("w"), py::arg("block"), py::call_guard<py::gil_scoped_release>());
  m.def("chain_bmm", &chain_bmm, py::arg("a"), py::arg("w"), py::arg("settle_zero") = false,
        py::arg("start_negative") = false, py::call_guard<py::gil_scoped_release>());
  m.def("hc_expand_rows", &hc_expand_rows, py::arg("x"), py::arg("residual"), py::arg("post"), py::arg("comb"),
        py::arg("any_rows") = false, py::arg("chain") = false, py::arg("settle_zero") = false,
        py::arg("start_negative") = false, py::call_guard<py::gil_scoped_release>());
  m.def("rope_rotate", &rope_rotate, py::arg("x"), py::arg("cis"), py::arg("rope_dim"), py::arg("any_rows") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("project_rows", &project_rows, py::call_guard<py::gil_scoped_release>());
  m.def("project_out_rows", &project_out_rows, py::call_guard<py::gil_scoped_release>());
  m.def("index_query_rows", &index_query_rows, py::call_guard<py::gil_scoped_release>());
  m.def("attend_rows", &attend_rows, py::call_guard<py::gil_scoped_release>());
  m.def("softmax_rows", &softmax_rows, py::call_guard<py::gil_scoped_release>());
  m.def("softmax_wide", &softmax_wide, py::call_guard<py::gil_scoped_release>());
  m.def("softmax_wide_agrees", &softmax_wide_agrees, py::call_guard<py::gil_scoped_release>());
  m.def("parallel_threads", &parallel_threads, py::call_guard<py::gil_scoped_release>());
  m.def("reads_hold", &reads_hold);  // these two hold the GIL: they read Python objects
  m.def("stamps_hold", &stamps_hold);
  py::class_<EntryWeights>(m, "EntryWeights")
      .def(py::init([](at::Tensor fn_t, at::Tensor scale, at::Tensor base, at::Tensor norm_weight, double norm_eps,
                       double rms_eps, double hc_eps, int64_t iters, std::tuple<int64_t, int64_t, int64_t> mix,
                       int64_t exit_one, int64_t exit_more, int64_t entry_one, int64_t entry_more) {
        return EntryWeights{fn_t,      scale,      base,       norm_weight,           norm_eps,
                            rms_eps,   hc_eps,     iters,      mix,                   exit_one,
                            exit_more, entry_one,  entry_more, at::get_num_threads(), matmul_precision()};
      }));
  py::class_<FfnWeights>(m, "FfnWeights")
      .def(py::init<EntryWeights, at::Tensor, at::Tensor, int64_t, bool, double, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>>());
  m.def("ffn_rows", &ffn_rows, py::call_guard<py::gil_scoped_release>());
  py::class_<AttnWeights>(m, "AttnWeights")
      .def(py::init<EntryWeights, at::Tensor, at::Tensor, double, at::Tensor, int64_t, int64_t, at::Tensor,
                    at::Tensor, double, int64_t, at::Tensor, double, at::Tensor, int64_t, at::Tensor>());
  m.def("attn_head", &attn_head, py::arg("h"), py::arg("collapse_pre"), py::arg("attn"), py::arg("cis"),
        py::arg("rings") = py::none(), py::arg("slots") = py::none(), py::arg("held") = py::none(),
        py::arg("lo") = 0, py::arg("hi") = 0, py::arg("keys") = py::none(), py::arg("entries") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("attn_tail", &attn_tail, py::arg("q"), py::arg("win"), py::arg("win_mask"), py::arg("comp").none(true),
        py::arg("comp_mask").none(true), py::arg("h"), py::arg("post"), py::arg("comb"), py::arg("attn_pre"),
        py::arg("cis_inverse"), py::arg("attn"), py::arg("ffn").none(true), py::call_guard<py::gil_scoped_release>());
}
