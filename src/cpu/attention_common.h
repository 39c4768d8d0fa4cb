// Shared machinery of the CPU attention ops: micro-kernels picked at run time (AVX2+FMA or
// portable), row dequantization, and the per-work-unit online-softmax state.
//
// Every work unit (a request's query token, or a request's KV head for dense decode) gathers the
// rows it attends to into fp32 tiles of kTileTokens tokens, dequantized once for all its heads, and
// runs S = Q K^T (a small GEMM), an online softmax in base 2 and O += P V over each tile. Each
// output row only depends on its own Q row and the tile sequence, whatever rows share a kernel
// call, so results are bitwise the same however units are split across threads.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "sparse_mla/kv_cache.h"
#include "sparse_mla/tensor.h"
#include "src/kv/format.h"

namespace sparse_mla::cpu::detail {

inline constexpr int kTileTokens = 64;
// Query rows one work unit attends for at most: bounds a thread's state (a Q and an O row, ~4.3 KB
// a row together) whatever the shape; more rows are split into more units (results unchanged).
inline constexpr int64_t kMaxRowsPerUnit = 256;
// Floats between dequantized rows: d_qk plus one cache line, so the column walk of O += P V does
// not map every row onto the same L1 sets.
inline constexpr int kRowPitch = kDenseHeadDim + 16;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr double kLn2 = 0.6931471805599453;

// Dequantizes token t (head `head`) of the page at `page` into d_qk floats.
using DequantFn = void (*)(const uint8_t* page, int64_t page_size, int64_t num_heads, int64_t t,
                           int64_t head, float* dst);

struct Kernels {
  const char* name;
  // s[m*lds + t] = sum_{x < d} q[m*ldq + x] * k[t*ldk + x]; d a multiple of 8.
  void (*qk)(const float* q, int64_t ldq, int M, const float* k, int64_t ldk, int T, int d,
             float* s, int64_t lds);
  // o[m*ldo + n] += sum_{t < T} p[m*ldp + t] * v[t*ldv + n] for n < d_v (a multiple of 16).
  void (*pv)(const float* p, int64_t ldp, int M, const float* v, int64_t ldv, int T, int d_v,
             float* o, int64_t ldo);
  // x[i] = 2^x[i] in place; -inf (and anything below -126) gives 0.
  void (*exp2)(float* x, int n);
  // dst[i] = src[i] (bf16 or fp16) * scale.
  void (*load_row)(const uint16_t* src, DType dtype, float scale, float* dst, int n);
  // dst[i] = src[i] * scale rounded to bf16 or fp16 (nearest even).
  void (*store_row)(const float* src, float scale, DType dtype, uint16_t* dst, int n);
  DequantFn dequant[4];  // indexed by KVFormat
};

// The fastest kernel set this CPU runs, decided once; SPARSE_MLA_CPU_ISA=generic|avx2|avx512
// picks one (when the CPU has it).
const Kernels& kernels();
// A named set ("generic", "avx2", "avx512") or nullptr when this CPU or build lacks it.
const Kernels* kernels_named(const char* name);

// Float to fp16 bits, round to nearest even (NaN stays NaN, overflow gives inf).
inline uint16_t float_to_fp16(float f) {
  const uint32_t u = fmt::float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                    // below 2^-14: subnormal grid of 2^-24
    const float scaled = fmt::bits_float(a) * 16777216.0f;  // exact
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t code = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu);
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (code & 1u))) ++code;
  return static_cast<uint16_t>(sign | code);
}

// Element pointer of a host tensor (strides in elements).
template <typename T>
inline T* element(const TensorView& t, int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0,
                  int64_t i4 = 0) {
  const int64_t off = i0 * t.strides[0] + (t.ndim > 1 ? i1 * t.strides[1] : 0) +
                      (t.ndim > 2 ? i2 * t.strides[2] : 0) + (t.ndim > 3 ? i3 * t.strides[3] : 0) +
                      (t.ndim > 4 ? i4 * t.strides[4] : 0);
  return static_cast<T*>(t.data) + off;
}

inline float load_half(const uint16_t* p, DType dtype) {
  return dtype == DType::kFloat16 ? fmt::fp16_to_float(*p) : fmt::bf16_to_float(*p);
}

inline void store_half(uint16_t* p, DType dtype, float v) {
  *p = dtype == DType::kFloat16 ? float_to_fp16(v) : fmt::float_to_bf16(v);
}

// Online softmax over tiles for M query rows of one work unit. Scratch is reused across units.
class SoftmaxState {
 public:
  // Sizes the scratch for M rows and resets them; then fill q_row(m) with
  // q * softmax_scale * log2(e).
  void begin(int M, int d_qk, int d_v);
  float* q_row(int m) { return q_.data() + static_cast<int64_t>(m) * d_qk_; }
  // Attends to the T (<= kTileTokens) rows of a dequantized tile (pitch kRowPitch; V is the first
  // d_v of each row). With `visible_until`, row m sees tile token t only when
  // pos[t] <= visible_until[m] (pos ascending).
  void tile(const Kernels& k, const float* rows, int T, const int64_t* pos = nullptr,
            const int64_t* visible_until = nullptr);
  int rows() const { return M_; }
  // Unnormalized accumulator, running max (base 2) and sum of row m.
  const float* o_row(int m) const { return o_.data() + static_cast<int64_t>(m) * d_v_; }
  float* o_row(int m) { return o_.data() + static_cast<int64_t>(m) * d_v_; }
  float& max(int m) { return m_[m]; }
  float& sum(int m) { return l_[m]; }

 private:
  int M_ = 0, d_qk_ = 0, d_v_ = 0;
  std::vector<float> q_, s_, o_, m_, l_;
};

// Writes row results: out = o / l * sink factor, lse = natural log (sink excluded); an empty row
// (l == 0) gives zeros and +inf. `sink` may be null.
void finish_row(const Kernels& k, const float* o, float max2, float sum, int d_v, const float* sink,
                uint16_t* out, int64_t out_stride, DType out_dtype, float* lse);

// A tile of dequantized rows being filled.
struct RowTile {
  std::vector<float> rows = std::vector<float>(static_cast<size_t>(kTileTokens) * kRowPitch);
  int64_t pos[kTileTokens];
  int count = 0;
  float* next() { return rows.data() + static_cast<int64_t>(count) * kRowPitch; }
};

}  // namespace sparse_mla::cpu::detail
