// Fused FP8 window codec (mxfp8: E4M3 values + one UE8M0 scale per 32), bit-identical to the pure-torch path in
// fp8.py. Compiled after fp4_kernels.cpp, topk_kernels.cpp and gemv_kernels.cpp into the same module (their
// helpers are in scope), and holds the module's bindings. Built at first use by kvdiet.formats.native.
//
// encode: rows x float32 [n, dim] (contiguous) -> entries uint8 [n, dim + dim/32]: per block,
//   amax = max(max|x| (on the bits), 1e-4), s = 2^min(ceil(log2(amax / 448)), 119) (ceil on the fp32 bits),
//   code = e4m3_rne(clamp(x / s, +-448)) as torch's float8_e4m3fn cast; then the scale bytes.
//   Returns -1, or the first row holding a non-finite value (nothing is promised about `out` then).
// decode: entries uint8 [n, width] (any row stride, unit element stride) -> float32 [n, dim]: value =
//   e4m3(code) * s, where code 0x7F / 0xFF reads +-480 as fp8.py's fp16 bit trick does.
//   Returns -1, or the first row holding a scale byte outside lo..hi.

namespace {

constexpr uint32_t kFp8MaxBiased = 119 + 127;  // the largest scale exponent the recipe writes, biased

// E4M3 byte -> float32 by fp8.py's bits: the byte sign-extended to int16, shifted left 7, bit 14 cleared, is an
// fp16 equal to the E4M3 value * 2^-8 (0x7F: 1.875 * 2^-8, so 480 and not NaN)
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const uint16_t half = static_cast<uint16_t>((static_cast<int16_t>(static_cast<int8_t>(b)) << 7) & 0xBFFF);
      v[b] = static_cast<float>(c10::Half(half, c10::Half::from_bits())) * 256.0f;
    }
  }
};
const Fp8Table kFp8;

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
  const int64_t n = packed.size(0), stride = packed.stride(0), dim = out.size(1), nb = dim / 32;
  float* o = out.data_ptr<float>();
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* pr = p + r * stride;
      float* orow = o + r * dim;
      for (int64_t b = 0; b < nb; ++b) {
        const uint32_t byte = pr[dim + b];
        if (byte < lo || byte > hi) note_row(bad, r);
        const float s = float_of((byte & 0xFF) << 23);
        for (int i = 0; i < 32; ++i) orow[b * 32 + i] = kFp8.v[pr[b * 32 + i]] * s;
      }
    }
  });
  return first_noted(bad);
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
  m.def("index_scores", &index_scores, py::call_guard<py::gil_scoped_release>());
  m.def("select_topk", &select_topk, py::call_guard<py::gil_scoped_release>());
  m.def("block_max", &block_max, py::call_guard<py::gil_scoped_release>());
  m.def("row_products", &row_products, py::call_guard<py::gil_scoped_release>());
  m.def("row_products_each", &row_products_each, py::call_guard<py::gil_scoped_release>());
  m.def("expert_rows", &expert_rows, py::call_guard<py::gil_scoped_release>());
  m.def("encode_fp8", &encode_fp8, py::call_guard<py::gil_scoped_release>());
  m.def("decode_fp8", &decode_fp8, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope_rotate", &rope_rotate, py::call_guard<py::gil_scoped_release>());
  m.def("attend_rows", &attend_rows, py::call_guard<py::gil_scoped_release>());
  m.def("parallel_threads", &parallel_threads, py::call_guard<py::gil_scoped_release>());
}
