// gather_fp4: a decode step's read of its selected FP4 entries through the block tables (fp4.gather_main_kv):
//   request b's entry j, for j < counts[b], is pool row table[b, e / per_block] * per_block + e % per_block of
//   `rows`, e = idx[b, j]; out[b, j] = decode_fp4(that row) (fp4_kernels.cpp's decode, the same bits), and
//   out[b, j] = +0 for j >= counts[b]. out is float32 or bfloat16: an FP4 value times its scale has at most six
//   significant bits (E2M1's two, E4M3's four, or a power of two: UE8M0), at least 2^-10 or a UE8M0 power of two
//   times 0.5..6, so bf16 holds it exactly, as the upper half of its fp32 bits. The bf16 copy is half the bytes
//   for the layers that attend it to re-read (v4.1-mini: 512 KB instead of 1 MB, read by several layers, mostly
//   from beyond the core's L2). Returns false (nothing promised about out) for input it does not take: a layout,
//   dtype or width other than below, an entry id whose block lies outside its table, a pool row outside `rows`, a
//   read entry with a scale byte outside lo..hi; the caller then runs the torch path, which raises (or defers) the
//   error. Why: that torch path is the slots' four ops, an index_select copy of the rows and the decode, some
//   100-200 us per layer and step at 1M tokens of context, of which the torch ops' own cost is about a third.

namespace {

// O: float, or uint16_t for bf16 bits (fp4_kernels.cpp's to_bf16)
template <int Block, typename O>
bool gather_rows(const uint8_t* p, int64_t stride, const std::vector<int64_t>& slot, int64_t dim, int lo, int hi,
                 O* out) {
  const int64_t n = static_cast<int64_t>(slot.size()), width = dim / 2 + dim / Block;
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> c(dim);
    std::vector<float> s(dim / Block), v(std::is_same_v<O, float> ? 0 : dim);
    std::vector<uint8_t> copy((end - begin) * width);
    // the rows copied first, in a loop of loads only: their cache and TLB misses overlap (a decode between
    // them would hold them apart); then each decoded from the copy
    for (int64_t r = begin; r < end; ++r) {
      if (slot[r] >= 0) std::memcpy(copy.data() + (r - begin) * width, p + slot[r] * stride, width);
    }
    for (int64_t r = begin; r < end; ++r) {
      O* o = out + r * dim;
      if (slot[r] < 0) {
        std::fill(o, o + dim, O{0});  // +0 in either
        continue;
      }
      float* vo = std::is_same_v<O, float> ? reinterpret_cast<float*>(o) : v.data();
      if (!decode_entry<Block>(copy.data() + (r - begin) * width, dim, lo, hi, c.data(), s.data(), vo)) ok = false;
      if constexpr (!std::is_same_v<O, float>) to_bf16(vo, dim, o);
    }
  });
  return ok;
}

}  // namespace

// rows uint8 [N, dim/2 + dim/block] (unit element stride); table int64 [B, T] and idx int64 [B, K], contiguous;
// counts: B ints (at most K are read); out float32 or bfloat16 [B, K, dim] contiguous. False: see the top of this
// file.
bool gather_fp4(const at::Tensor& rows, const at::Tensor& table, const at::Tensor& idx,
                const std::vector<int64_t>& counts, int64_t per_block, int64_t recipe, int64_t lo, int64_t hi,
                at::Tensor out) {
  const int64_t b = idx.dim() == 2 ? idx.size(0) : -1, k = idx.dim() == 2 ? idx.size(1) : 0;
  const bool wide = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.is_contiguous() && (wide || out.scalar_type() == at::kBFloat16) && out.dim() == 3 &&
                  out.size(0) == b && out.size(1) == k,
              "fp4 gather: out layout");
  const int64_t dim = out.size(2), block = recipe == kE4M3 ? 16 : 32;
  if (b < 0 || dim <= 0 || dim % block || !rows.device().is_cpu() || rows.scalar_type() != at::kByte ||
      rows.dim() != 2 || rows.size(1) != dim / 2 + dim / block || rows.stride(1) != 1 || !idx.is_cpu() ||
      idx.scalar_type() != at::kLong || !idx.is_contiguous() || !table.is_cpu() || table.dim() != 2 ||
      table.scalar_type() != at::kLong || !table.is_contiguous() || table.size(0) != b ||
      static_cast<int64_t>(counts.size()) != b || per_block <= 0)
    return false;
  const int64_t* e = idx.data_ptr<int64_t>();
  const int64_t* t = table.data_ptr<int64_t>();
  const int64_t blocks = table.size(1), held = rows.size(0);
  std::vector<int64_t> slot(b * k, -1);  // -1: past the request's count, read as zeros
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < std::min(counts[i], k); ++j) {
      const int64_t entry = e[i * k + j];
      if (entry < 0 || entry / per_block >= blocks) return false;
      const int64_t row = t[i * blocks + entry / per_block] * per_block + entry % per_block;
      if (row < 0 || row >= held) return false;
      slot[i * k + j] = row;
    }
  }
  const uint8_t* p = rows.data_ptr<uint8_t>();
  const int64_t st = rows.stride(0);
  const auto gather = [&](auto* o) {
    return recipe == kE4M3 ? gather_rows<16>(p, st, slot, dim, lo, hi, o) : gather_rows<32>(p, st, slot, dim, lo, hi, o);
  };
  return wide ? gather(out.data_ptr<float>()) : gather(static_cast<uint16_t*>(out.data_ptr()));
}
