// Micro-kernels of the CPU attention ops: a portable set, an AVX2+FMA set and an AVX-512F set
// compiled with function-level target attributes, chosen at run time (no global -march flag).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "src/cpu/attention_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define SPARSE_MLA_CPU_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace sparse_mla::cpu::detail {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- Row dequantization, portable ----
void dequant_model1(const uint8_t* page, int64_t page_size, int64_t, int64_t t, int64_t,
                    float* dst) {
  const uint8_t* row = page + fmt::model1_row_offset(t);
  const uint8_t* scales = page + fmt::model1_scale_offset(page_size, t);
  for (int j = 0; j < kModel1NopeDims / kModel1ScaleTile; ++j) {
    const float scale = fmt::ue8m0_to_float(scales[j]);
    for (int i = j * kModel1ScaleTile; i < (j + 1) * kModel1ScaleTile; ++i) {
      dst[i] = fmt::e4m3_to_float(row[i]) * scale;
    }
  }
  for (int i = 0; i < kRopeDims; ++i) {
    uint16_t h;
    std::memcpy(&h, row + kModel1NopeDims + 2 * i, 2);
    dst[kModel1NopeDims + i] = fmt::bf16_to_float(h);
  }
}

void dequant_v32(const uint8_t* page, int64_t, int64_t, int64_t t, int64_t, float* dst) {
  const uint8_t* row = page + t * kV32BytesPerToken;
  float scales[kV32NopeDims / kV32ScaleTile];
  std::memcpy(scales, row + fmt::kV32ScaleOffset, sizeof scales);
  for (int i = 0; i < kV32NopeDims; ++i) {
    dst[i] = fmt::e4m3_to_float(row[i]) * scales[i / kV32ScaleTile];
  }
  for (int i = 0; i < kRopeDims; ++i) {
    uint16_t h;
    std::memcpy(&h, row + fmt::kV32RopeOffset + 2 * i, 2);
    dst[kV32NopeDims + i] = fmt::bf16_to_float(h);
  }
}

template <bool kFp16>
void dequant_dense(const uint8_t* page, int64_t, int64_t num_heads, int64_t t, int64_t head,
                   float* dst) {
  const uint8_t* row = page + (t * num_heads + head) * kDenseHeadDim * 2;
  for (int i = 0; i < kDenseHeadDim; ++i) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    dst[i] = kFp16 ? fmt::fp16_to_float(h) : fmt::bf16_to_float(h);
  }
}

// ---- GEMM-like kernels, portable ----
void qk_generic(const float* q, int64_t ldq, int M, const float* k, int64_t ldk, int T, int d,
                float* s, int64_t lds) {
  for (int m = 0; m < M; ++m) {
    for (int t = 0; t < T; ++t) {
      float acc = 0.f;
      for (int x = 0; x < d; ++x) acc += q[m * ldq + x] * k[t * ldk + x];
      s[m * lds + t] = acc;
    }
  }
}

void pv_generic(const float* p, int64_t ldp, int M, const float* v, int64_t ldv, int T, int d_v,
                float* o, int64_t ldo) {
  for (int m = 0; m < M; ++m) {
    float* orow = o + m * ldo;
    for (int t = 0; t < T; ++t) {
      const float pm = p[m * ldp + t];
      const float* vrow = v + t * ldv;
      for (int n = 0; n < d_v; ++n) orow[n] += pm * vrow[n];
    }
  }
}

void exp2_generic(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = x[i] < -126.f ? 0.f : std::exp2(x[i]);
}

void load_row_generic(const uint16_t* src, DType dtype, float scale, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = load_half(src + i, dtype) * scale;
}

void store_row_generic(const float* src, float scale, DType dtype, uint16_t* dst, int n) {
  for (int i = 0; i < n; ++i) store_half(dst + i, dtype, src[i] * scale);
}

const Kernels kGeneric = {
    "generic",
    qk_generic,
    pv_generic,
    exp2_generic,
    load_row_generic,
    store_row_generic,
    {dequant_model1, dequant_v32, dequant_dense<false>, dequant_dense<true>},
};

#if SPARSE_MLA_CPU_X86
// ---- AVX2 + FMA (+ F16C for fp16 pages) ----
#define SPARSE_MLA_AVX2 __attribute__((target("avx2,fma,f16c")))

SPARSE_MLA_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MR query rows x TR tokens of S: 12 accumulators, 3 key vectors and 1 query vector fill the
// 16 ymm registers at MR = 4, TR = 3.
template <int MR, int TR>
SPARSE_MLA_AVX2 void qk_block(const float* q, int64_t ldq, const float* k, int64_t ldk, int d,
                              float* s, int64_t lds) {
  __m256 acc[MR][TR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 3
    for (int t = 0; t < TR; ++t) acc[m][t] = _mm256_setzero_ps();
  }
  for (int x = 0; x < d; x += 8) {
    __m256 kv[TR];
#pragma GCC unroll 3
    for (int t = 0; t < TR; ++t) kv[t] = _mm256_loadu_ps(k + t * ldk + x);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 qv = _mm256_loadu_ps(q + m * ldq + x);
#pragma GCC unroll 3
      for (int t = 0; t < TR; ++t) acc[m][t] = _mm256_fmadd_ps(qv, kv[t], acc[m][t]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < TR; ++t) s[m * lds + t] = hsum(acc[m][t]);
  }
}

using QkBlock = void (*)(const float*, int64_t, const float*, int64_t, int, float*, int64_t);
constexpr QkBlock kQkBlocks[4][3] = {
    {qk_block<1, 1>, qk_block<1, 2>, qk_block<1, 3>},
    {qk_block<2, 1>, qk_block<2, 2>, qk_block<2, 3>},
    {qk_block<3, 1>, qk_block<3, 2>, qk_block<3, 3>},
    {qk_block<4, 1>, qk_block<4, 2>, qk_block<4, 3>},
};

SPARSE_MLA_AVX2 void qk_avx2(const float* q, int64_t ldq, int M, const float* k, int64_t ldk, int T,
                             int d, float* s, int64_t lds) {
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int mr = std::min(4, M - m0);
    for (int t0 = 0; t0 < T; t0 += 3) {
      const int tr = std::min(3, T - t0);
      kQkBlocks[mr - 1][tr - 1](q + m0 * ldq, ldq, k + t0 * ldk, ldk, d, s + m0 * lds + t0, lds);
    }
  }
}

// MR rows x 16 columns of O: 12 accumulators, 2 value vectors and 1 broadcast at MR = 6.
template <int MR>
SPARSE_MLA_AVX2 void pv_block(const float* p, int64_t ldp, const float* v, int64_t ldv, int T,
                              float* o, int64_t ldo) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = _mm256_loadu_ps(o + m * ldo);
    acc[m][1] = _mm256_loadu_ps(o + m * ldo + 8);
  }
  for (int t = 0; t < T; ++t) {
    const __m256 v0 = _mm256_loadu_ps(v + t * ldv);
    const __m256 v1 = _mm256_loadu_ps(v + t * ldv + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m256 pm = _mm256_broadcast_ss(p + m * ldp + t);
      acc[m][0] = _mm256_fmadd_ps(pm, v0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(pm, v1, acc[m][1]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(o + m * ldo, acc[m][0]);
    _mm256_storeu_ps(o + m * ldo + 8, acc[m][1]);
  }
}

using PvBlock = void (*)(const float*, int64_t, const float*, int64_t, int, float*, int64_t);
constexpr PvBlock kPvBlocks[6] = {pv_block<1>, pv_block<2>, pv_block<3>,
                                  pv_block<4>, pv_block<5>, pv_block<6>};

SPARSE_MLA_AVX2 void pv_avx2(const float* p, int64_t ldp, int M, const float* v, int64_t ldv, int T,
                             int d_v, float* o, int64_t ldo) {
  for (int n0 = 0; n0 < d_v; n0 += 16) {
    for (int m0 = 0; m0 < M; m0 += 6) {
      const int mr = std::min(6, M - m0);
      kPvBlocks[mr - 1](p + m0 * ldp, ldp, v + n0, ldv, T, o + m0 * ldo + n0, ldo);
    }
  }
}

// 2^x: x = n + f with f in [-0.5, 0.5]; degree-7 Taylor polynomial of 2^f (relative error
// ~5e-9 before rounding), times 2^n built in the exponent field.
SPARSE_MLA_AVX2 inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);  // NaN stays in x
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

SPARSE_MLA_AVX2 void exp2_avx2(float* x, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp2_ps(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float buf[8] = {};
    std::memcpy(buf, x + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(buf, exp2_ps(_mm256_loadu_ps(buf)));
    std::memcpy(x + i, buf, (n - i) * sizeof(float));
  }
}

// Half-precision rows to fp32 and back, 8 at a time; tails go through the portable code.
SPARSE_MLA_AVX2 void load_row_avx2(const uint16_t* src, DType dtype, float scale, float* dst,
                                   int n) {
  const __m256 sc = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256 x = dtype == DType::kFloat16
                         ? _mm256_cvtph_ps(h)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, sc));
  }
  load_row_generic(src + i, dtype, scale, dst + i, n - i);
}

// fp32 to bf16, round to nearest even; NaN keeps its sign and stays NaN (quiet bit set).
SPARSE_MLA_AVX2 inline __m128i bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // Values fit 16 bits: pack within lanes, then put the two halves in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

SPARSE_MLA_AVX2 void store_row_avx2(const float* src, float scale, DType dtype, uint16_t* dst,
                                    int n) {
  const __m256 sc = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + i), sc);
    const __m128i h =
        dtype == DType::kFloat16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) : bf16x8(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  store_row_generic(src + i, scale, dtype, dst + i, n - i);
}

// 8 e4m3 bytes to fp32, exactly. Normals come from moving the exponent/mantissa bits into place
// and rebiasing; subnormals (exponent 0) are 2^-6 * 0.mmm = 2 * (2^-7 * 1.mmm) - 2^-6, which avoids
// fp32 denormal arithmetic; S.1111.111 is NaN.
SPARSE_MLA_AVX2 inline __m256 e4m3x8(const uint8_t* src) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  __m256 f = _mm256_castsi256_ps(_mm256_add_epi32(mag, _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_fmsub_ps(f, _mm256_set1_ps(2.f), _mm256_set1_ps(0x1p-6f));
  const __m256i is_sub =
      _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  f = _mm256_blendv_ps(f, sub, _mm256_castsi256_ps(is_sub));
  const __m256i is_nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f << 20));
  f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                       _mm256_castsi256_ps(is_nan));
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

SPARSE_MLA_AVX2 inline void bf16x64(const uint8_t* src, float* dst) {
  for (int i = 0; i < kRopeDims; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}

SPARSE_MLA_AVX2 void dequant_model1_avx2(const uint8_t* page, int64_t page_size, int64_t, int64_t t,
                                         int64_t, float* dst) {
  const uint8_t* row = page + fmt::model1_row_offset(t);
  const uint8_t* scales = page + fmt::model1_scale_offset(page_size, t);
  for (int j = 0; j < kModel1NopeDims / kModel1ScaleTile; ++j) {
    const __m256 scale = _mm256_set1_ps(fmt::ue8m0_to_float(scales[j]));
    for (int i = j * kModel1ScaleTile; i < (j + 1) * kModel1ScaleTile; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(e4m3x8(row + i), scale));
    }
  }
  bf16x64(row + kModel1NopeDims, dst + kModel1NopeDims);
}

SPARSE_MLA_AVX2 void dequant_v32_avx2(const uint8_t* page, int64_t, int64_t, int64_t t, int64_t,
                                      float* dst) {
  const uint8_t* row = page + t * kV32BytesPerToken;
  for (int j = 0; j < kV32NopeDims / kV32ScaleTile; ++j) {
    float s;
    std::memcpy(&s, row + fmt::kV32ScaleOffset + 4 * j, 4);
    const __m256 scale = _mm256_set1_ps(s);
    for (int i = j * kV32ScaleTile; i < (j + 1) * kV32ScaleTile; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(e4m3x8(row + i), scale));
    }
  }
  bf16x64(row + fmt::kV32RopeOffset, dst + kV32NopeDims);
}

template <bool kFp16>
SPARSE_MLA_AVX2 void dequant_dense_avx2(const uint8_t* page, int64_t, int64_t num_heads, int64_t t,
                                        int64_t head, float* dst) {
  const uint8_t* row = page + (t * num_heads + head) * kDenseHeadDim * 2;
  for (int i = 0; i < kDenseHeadDim; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
    if constexpr (kFp16) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    } else {
      _mm256_storeu_ps(dst + i,
                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
}

const Kernels kAvx2 = {
    "avx2",
    qk_avx2,
    pv_avx2,
    exp2_avx2,
    load_row_avx2,
    store_row_avx2,
    {dequant_model1_avx2, dequant_v32_avx2, dequant_dense_avx2<false>, dequant_dense_avx2<true>},
};

// ---- AVX-512F: the same blocking with 32 zmm registers (qk and pv; the rest is AVX2) ----
#define SPARSE_MLA_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// MR rows x TR tokens: 24 accumulators, 6 key vectors and 1 query vector at MR = 4, TR = 6.
template <int MR, int TR>
SPARSE_MLA_AVX512 void qk_block512(const float* q, int64_t ldq, const float* k, int64_t ldk, int d,
                                   float* s, int64_t lds) {
  __m512 acc[MR][TR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 6
    for (int t = 0; t < TR; ++t) acc[m][t] = _mm512_setzero_ps();
  }
  for (int x = 0; x < d; x += 16) {
    __m512 kv[TR];
#pragma GCC unroll 6
    for (int t = 0; t < TR; ++t) kv[t] = _mm512_loadu_ps(k + t * ldk + x);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512 qv = _mm512_loadu_ps(q + m * ldq + x);
#pragma GCC unroll 6
      for (int t = 0; t < TR; ++t) acc[m][t] = _mm512_fmadd_ps(qv, kv[t], acc[m][t]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < TR; ++t) {
      // Fixed reduction order: the two halves added, then the AVX2 horizontal sum.
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[m][t]);
      s[m * lds + t] = hsum(_mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8)));
    }
  }
}

template <int MR, int... TR>
constexpr std::array<QkBlock, sizeof...(TR)> qk512_row(std::integer_sequence<int, TR...>) {
  return {qk_block512<MR, TR + 1>...};
}
constexpr std::array<std::array<QkBlock, 6>, 4> kQk512Blocks = {
    qk512_row<1>(std::make_integer_sequence<int, 6>{}),
    qk512_row<2>(std::make_integer_sequence<int, 6>{}),
    qk512_row<3>(std::make_integer_sequence<int, 6>{}),
    qk512_row<4>(std::make_integer_sequence<int, 6>{}),
};

SPARSE_MLA_AVX512 void qk_avx512(const float* q, int64_t ldq, int M, const float* k, int64_t ldk,
                                 int T, int d, float* s, int64_t lds) {
  if (d % 16 != 0) return qk_avx2(q, ldq, M, k, ldk, T, d, s, lds);
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int mr = std::min(4, M - m0);
    for (int t0 = 0; t0 < T; t0 += 6) {
      const int tr = std::min(6, T - t0);
      kQk512Blocks[mr - 1][tr - 1](q + m0 * ldq, ldq, k + t0 * ldk, ldk, d, s + m0 * lds + t0, lds);
    }
  }
}

// MR rows x 64 columns of O: 24 accumulators, 4 value vectors and 1 broadcast at MR = 6.
template <int MR>
SPARSE_MLA_AVX512 void pv_block512(const float* p, int64_t ldp, const float* v, int64_t ldv, int T,
                                   float* o, int64_t ldo) {
  __m512 acc[MR][4];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_loadu_ps(o + m * ldo + 16 * j);
  }
  for (int t = 0; t < T; ++t) {
    __m512 vv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(v + t * ldv + 16 * j);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m512 pm = _mm512_set1_ps(p[m * ldp + t]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(pm, vv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + m * ldo + 16 * j, acc[m][j]);
  }
}

constexpr PvBlock kPv512Blocks[6] = {pv_block512<1>, pv_block512<2>, pv_block512<3>,
                                     pv_block512<4>, pv_block512<5>, pv_block512<6>};

SPARSE_MLA_AVX512 void pv_avx512(const float* p, int64_t ldp, int M, const float* v, int64_t ldv,
                                 int T, int d_v, float* o, int64_t ldo) {
  if (d_v % 64 != 0) return pv_avx2(p, ldp, M, v, ldv, T, d_v, o, ldo);
  for (int n0 = 0; n0 < d_v; n0 += 64) {
    for (int m0 = 0; m0 < M; m0 += 6) {
      const int mr = std::min(6, M - m0);
      kPv512Blocks[mr - 1](p + m0 * ldp, ldp, v + n0, ldv, T, o + m0 * ldo + n0, ldo);
    }
  }
}

const Kernels kAvx512 = {
    "avx512",
    qk_avx512,
    pv_avx512,
    exp2_avx2,
    load_row_avx2,
    store_row_avx2,
    {dequant_model1_avx2, dequant_v32_avx2, dequant_dense_avx2<false>, dequant_dense_avx2<true>},
};

bool cpu_has_avx2() {
  __builtin_cpu_init();
  // F16C from CPUID: clang before 16 does not accept "f16c" in __builtin_cpu_supports.
  unsigned eax, ebx, ecx, edx;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}

bool cpu_has_avx512() { return cpu_has_avx2() && __builtin_cpu_supports("avx512f"); }
#endif  // SPARSE_MLA_CPU_X86

const Kernels& pick_kernels() {
  const char* isa = std::getenv("SPARSE_MLA_CPU_ISA");
  if (isa != nullptr && *isa != '\0') {
    const Kernels* named = kernels_named(isa);
    if (named != nullptr) return *named;
  }
  for (const char* name : {"avx512", "avx2"}) {
    if (const Kernels* k = kernels_named(name)) return *k;
  }
  return kGeneric;
}

}  // namespace

const Kernels* kernels_named(const char* name) {
  if (std::strcmp(name, "generic") == 0) return &kGeneric;
#if SPARSE_MLA_CPU_X86
  if (std::strcmp(name, "avx2") == 0 && cpu_has_avx2()) return &kAvx2;
  if (std::strcmp(name, "avx512") == 0 && cpu_has_avx512()) return &kAvx512;
#endif
  return nullptr;
}

const Kernels& kernels() {
  static const Kernels& chosen = pick_kernels();
  return chosen;
}

// ---- Online softmax ----
// The larger of a and b, NaN if either is: a NaN logit makes its row NaN (spec section 7: NaN
// positions as in the reference), where std::max would drop it and a row of NaN logits alone
// would read as empty.
static float max_keeping_nan(float a, float b) { return b > a || b != b ? b : a; }

void SoftmaxState::begin(int M, int d_qk, int d_v) {
  M_ = M;
  d_qk_ = d_qk;
  d_v_ = d_v;
  q_.resize(static_cast<size_t>(M) * d_qk);
  s_.resize(static_cast<size_t>(M) * kTileTokens);
  o_.assign(static_cast<size_t>(M) * d_v, 0.f);
  m_.assign(M, kNegInf);
  l_.assign(M, 0.f);
}

void SoftmaxState::tile(const Kernels& k, const float* rows, int T, const int64_t* pos,
                        const int64_t* visible_until) {
  if (T <= 0) return;
  k.qk(q_.data(), d_qk_, M_, rows, kRowPitch, T, d_qk_, s_.data(), kTileTokens);
  for (int m = 0; m < M_; ++m) {
    float* s = s_.data() + static_cast<int64_t>(m) * kTileTokens;
    if (visible_until != nullptr) {
      for (int t = 0; t < T; ++t) {
        if (pos[t] > visible_until[m]) s[t] = kNegInf;
      }
    }
    float mx = kNegInf;
    for (int t = 0; t < T; ++t) mx = max_keeping_nan(mx, s[t]);
    const float m_new = max_keeping_nan(m_[m], mx);
    if (m_new == kNegInf) {  // nothing visible to this row yet
      std::fill(s, s + T, 0.f);
      continue;
    }
    const float alpha = std::exp2(m_[m] - m_new);  // 0 on the first visible tile
    for (int t = 0; t < T; ++t) s[t] -= m_new;
    k.exp2(s, T);
    float sum = 0.f;
    for (int t = 0; t < T; ++t) sum += s[t];
    l_[m] = l_[m] * alpha + sum;
    if (alpha != 1.f) {
      float* o = o_row(m);
      for (int n = 0; n < d_v_; ++n) o[n] *= alpha;
    }
    m_[m] = m_new;
  }
  if (visible_until == nullptr) {
    k.pv(s_.data(), kTileTokens, M_, rows, kRowPitch, T, d_v_, o_.data(), d_v_);
    return;
  }
  // Each run of rows with the same horizon takes P V over the tokens it sees only (a prefix of the
  // tile: pos ascends), so a hidden token's NaN or inf does not reach it through 0 * V.
  for (int m0 = 0; m0 < M_;) {
    int m1 = m0 + 1;
    while (m1 < M_ && visible_until[m1] == visible_until[m0]) ++m1;
    int seen = 0;
    while (seen < T && pos[seen] <= visible_until[m0]) ++seen;
    if (seen > 0) {
      k.pv(s_.data() + static_cast<int64_t>(m0) * kTileTokens, kTileTokens, m1 - m0, rows,
           kRowPitch, seen, d_v_, o_row(m0), d_v_);
    }
    m0 = m1;
  }
}

void finish_row(const Kernels& k, const float* o, float max2, float sum, int d_v, const float* sink,
                uint16_t* out, int64_t out_stride, DType out_dtype, float* lse) {
  if (sum == 0.f) {
    // No valid slot (o is 0), or only -inf logits, whose o holds 0 * V: 0, NaN where a V value
    // is infinite (docs/semantics.md). lse +inf either way.
    for (int n = 0; n < d_v; ++n) store_half(out + n * out_stride, out_dtype, o[n] * 0.f);
    *lse = std::numeric_limits<float>::infinity();
    return;
  }
  const double lse_nat = (static_cast<double>(max2) + std::log2(static_cast<double>(sum))) * kLn2;
  double factor = 1.0 / sum;
  if (sink != nullptr) factor /= 1.0 + std::exp(static_cast<double>(*sink) - lse_nat);
  const float f = static_cast<float>(factor);
  if (out_stride == 1) {
    k.store_row(o, f, out_dtype, out, d_v);
  } else {
    for (int n = 0; n < d_v; ++n) store_half(out + n * out_stride, out_dtype, o[n] * f);
  }
  *lse = static_cast<float>(lse_nat);
}

}  // namespace sparse_mla::cpu::detail
