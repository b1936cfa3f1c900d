// Engram's pieces for a few rows (kvdiet/model/engram.py and engram_hash.py), one call each, with the bits of the
// torch formulas there. Compiled after rmsnorm_kernels.cpp into the same module (its square and any_nan are in
// scope; fp8_kernels.cpp holds the bindings). Built at first use by kvdiet.formats.native.
//
// engram_rows(codes, scales, ids): Fp8Embedding.forward on a table held in memory: codes uint8 [R, D] (E4M3 bytes)
//   and scales uint8 [R, D/32] (UE8M0 bytes), both contiguous, ids int64 [...] (contiguous) -> float32 [..., D]:
//   value = float(code) * 2^(byte - 127), one IEEE product of two exact conversions (torch's e4m3 -> float, NaN
//   codes 0x7F and 0xFF included, and ue8m0 -> float, 2^-127 included). std::nullopt for an id outside 0..R-1, a
//   scale byte 255 (the torch path raises their errors) and any other layout.
// engram_hashes(ids, mult, primes, offsets): EngramHasher.row_ids: ids int64 [rows, h + T] (the history, then T
//   compressed ids; contiguous), mult int64 [h + 1], primes and offsets int64 [h, heads] (contiguous) -> int64
//   [rows, T, h·heads]: mix = ids[h + t]·mult[0], then for s = 1..h: mix ^= ids[h - s + t]·mult[s] (int64
//   products wrapping, as torch's), column (s - 1)·heads + j = (mix mod primes[s-1][j], the divisor's sign, as
//   torch's %) + offsets[s-1][j]. std::nullopt for another layout or a divisor that is not positive.
// engram_gate(h, kv, q_weight, k_weight, eps): Engram.forward after wkv: streams h float32 [T, hc, hidden]
//   (contiguous), kv float32 [T, (hc+1)·hidden] (contiguous), q_weight and k_weight float32 [hc, hidden]
//   (contiguous) -> float32 [T, hc, hidden], or std::nullopt for other input or a NaN in the output. Each step is
//   the formula's: the squares, products and sums one IEEE op each in its order ((h·w)·key with w = q_weight ·
//   k_weight); the means torch's own at::mean and the dot's sum torch's own at::sum, each over a contiguous tensor
//   of the shape the formula reduces; rsqrt, sqrt and the sigmoid torch's own at::rsqrt, at::sqrt and at::sigmoid
//   (from 32 values on, torch's vector rsqrt is not 1/sqrt rounded once); eps, hidden^-1/2 and 1e-6 as float
//   scalars (wrapped numbers do not promote); sign as (0 < x) - (x < 0); |x| and the clamp exact; then
//   h + gate·value.
//   Why: in torch the gate is some 15 ops of 3-10 µs dispatch each on a few thousand floats, the table lookup 8
//   more (two index calls of ~20 µs) and the hash 10: ~0.3 ms of a v4.1-mini decode step per Engram layer.

#include <cmath>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kEngramRowsMax = 16;  // a decode step's rows (one per request)

bool engram_float_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_neg();
}

bool int64_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous();
}

}  // namespace

std::optional<at::Tensor> engram_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids) {
  if (!codes.device().is_cpu() || codes.scalar_type() != at::kByte || codes.dim() != 2 || !codes.is_contiguous())
    return {};
  const int64_t table = codes.size(0), dim = codes.size(1);
  if (dim % 32 != 0 || !scales.device().is_cpu() || scales.scalar_type() != at::kByte || scales.dim() != 2 ||
      !scales.is_contiguous() || scales.size(0) != table || scales.size(1) != dim / 32 || !int64_cpu(ids))
    return {};
  const int64_t n = ids.numel();
  const int64_t* ip = ids.const_data_ptr<int64_t>();
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  const uint8_t* sp = scales.const_data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (ip[i] < 0 || ip[i] >= table) return {};
    for (int64_t b = 0; b < dim / 32; ++b)
      if (sp[ip[i] * (dim / 32) + b] == 255) return {};
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(dim);
  at::Tensor out = at::empty(shape, codes.options().dtype(at::kFloat));
  float* op = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = cp + ip[i] * dim;
    for (int64_t b = 0; b < dim / 32; ++b) {
      const float s = std::ldexp(1.0f, static_cast<int>(sp[ip[i] * (dim / 32) + b]) - 127);
      for (int64_t j = 32 * b; j < 32 * b + 32; ++j) {
        op[i * dim + j] = static_cast<float>(c10::Float8_e4m3fn(row[j], c10::Float8_e4m3fn::from_bits())) * s;
      }
    }
  }
  return out;
}

std::optional<at::Tensor> engram_hashes(const at::Tensor& ids, const at::Tensor& mult, const at::Tensor& primes,
                                        const at::Tensor& offsets) {
  if (!int64_cpu(ids) || !int64_cpu(mult) || !int64_cpu(primes) || !int64_cpu(offsets) || ids.dim() != 2 ||
      mult.dim() != 1 || primes.dim() != 2 || offsets.sizes() != primes.sizes())
    return {};
  const int64_t h = primes.size(0), heads = primes.size(1), rows = ids.size(0), t_len = ids.size(1) - h;
  if (h < 1 || mult.size(0) != h + 1 || t_len < 0) return {};
  const int64_t* pp = primes.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < h * heads; ++i)
    if (pp[i] <= 0) return {};
  const int64_t* ip = ids.const_data_ptr<int64_t>();
  const int64_t* mp = mult.const_data_ptr<int64_t>();
  const int64_t* fp = offsets.const_data_ptr<int64_t>();
  at::Tensor out = at::empty({rows, t_len, h * heads}, ids.options());
  int64_t* op = out.mutable_data_ptr<int64_t>();
  const auto times = [](int64_t a, int64_t b) {  // int64 product, wrapping (no signed overflow)
    return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* row = ip + r * (h + t_len);
    for (int64_t t = 0; t < t_len; ++t) {
      int64_t mix = times(row[h + t], mp[0]);
      int64_t* o = op + (r * t_len + t) * h * heads;
      for (int64_t s = 1; s <= h; ++s) {
        mix ^= times(row[h - s + t], mp[s]);
        for (int64_t j = 0; j < heads; ++j) {
          const int64_t p = pp[(s - 1) * heads + j];
          int64_t m = mix % p;
          m += m < 0 ? p : 0;  // the divisor's sign (p > 0)
          o[(s - 1) * heads + j] = static_cast<int64_t>(static_cast<uint64_t>(m) +
                                                        static_cast<uint64_t>(fp[(s - 1) * heads + j]));
        }
      }
    }
  }
  return out;
}

std::optional<at::Tensor> engram_gate(const at::Tensor& h, const at::Tensor& kv, const at::Tensor& q_weight,
                                      const at::Tensor& k_weight, double eps) {
  if (!engram_float_cpu(h) || !engram_float_cpu(kv) || !engram_float_cpu(q_weight) || !engram_float_cpu(k_weight))
    return {};
  if (h.dim() != 3 || kv.dim() != 2 || q_weight.dim() != 2) return {};
  const int64_t rows = h.size(0), hc = h.size(1), hidden = h.size(2);
  if (rows < 1 || rows > kEngramRowsMax || kv.size(0) != rows || kv.size(1) != (hc + 1) * hidden ||
      q_weight.size(0) != hc || q_weight.size(1) != hidden || k_weight.sizes() != q_weight.sizes())
    return {};
  const float* hp = h.const_data_ptr<float>();
  const float* kp = kv.const_data_ptr<float>();
  const float* qw = q_weight.const_data_ptr<float>();
  const float* kw = k_weight.const_data_ptr<float>();
  const int64_t width = (hc + 1) * hidden, cells = rows * hc;
  at::Tensor h_sq = at::empty({rows, hc, hidden}, h.options()), k_sq = at::empty_like(h_sq);
  at::Tensor prod = at::empty_like(h_sq);
  square(hp, h_sq.mutable_data_ptr<float>(), cells * hidden);
  float* ks = k_sq.mutable_data_ptr<float>();
  float* pr = prod.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < hc; ++i) {
      const float* key = kp + r * width + i * hidden;  // kv's first hc·hidden values: the keys
      const float* hr = hp + (r * hc + i) * hidden;
      const int64_t c = (r * hc + i) * hidden;
      for (int64_t d = 0; d < hidden; ++d) {
        ks[c + d] = key[d] * key[d];
        pr[c + d] = (hr[d] * (qw[i * hidden + d] * kw[i * hidden + d])) * key[d];
      }
    }
  }
  at::Tensor h_mean = at::mean(h_sq, {-1}), k_mean = at::mean(k_sq, {-1});
  const at::Tensor sums = at::sum(prod, {-1});
  float* hm = h_mean.mutable_data_ptr<float>();
  float* km = k_mean.mutable_data_ptr<float>();
  const float e = static_cast<float>(eps), scale = static_cast<float>(std::pow(static_cast<double>(hidden), -0.5));
  for (int64_t c = 0; c < cells; ++c) hm[c] += e, km[c] += e;
  // torch's rsqrt and sqrt: over 32 values and more its vector path (MKL's) is not 1/sqrt rounded once
  const at::Tensor h_rsqrt = at::rsqrt(h_mean), k_rsqrt = at::rsqrt(k_mean);
  const float* hr = h_rsqrt.const_data_ptr<float>();
  const float* kr = k_rsqrt.const_data_ptr<float>();
  const float* sm = sums.const_data_ptr<float>();
  at::Tensor magnitude = at::empty({rows, hc}, h.options());
  std::vector<float> sign(cells);
  float* mg = magnitude.mutable_data_ptr<float>();
  for (int64_t c = 0; c < cells; ++c) {
    const float dot = (sm[c] * (hr[c] * kr[c])) * scale;
    sign[c] = static_cast<float>(static_cast<int>(0.0f < dot) - static_cast<int>(dot < 0.0f));
    mg[c] = std::max(std::fabs(dot), 1e-6f);
  }
  at::Tensor signed_root = at::sqrt(magnitude);
  float* z = signed_root.mutable_data_ptr<float>();
  for (int64_t c = 0; c < cells; ++c) z[c] = sign[c] * z[c];
  const at::Tensor gate = at::sigmoid(signed_root);
  const float* gp = gate.const_data_ptr<float>();
  at::Tensor out = at::empty_like(h_sq);
  float* op = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* value = kp + r * width + hc * hidden;
    for (int64_t i = 0; i < hc; ++i) {
      const int64_t c = (r * hc + i) * hidden;
      for (int64_t d = 0; d < hidden; ++d) op[c + d] = hp[c + d] + gp[r * hc + i] * value[d];
    }
  }
  if (any_nan(op, cells * hidden)) return {};
  return out;
}
