// Bit-exact format math shared by the CPU and CUDA backends (host and device code):
// e4m3 and bf16 conversions, the UE8M0 scale recipe, and byte offsets inside pages.
#pragma once

#include <cstdint>
#include <cstring>

#include "sparse_mla/kv_cache.h"

#if defined(__CUDACC__)
#define SPARSE_MLA_HD __host__ __device__ __forceinline__
#else
#define SPARSE_MLA_HD inline
#endif

namespace sparse_mla::fmt {

SPARSE_MLA_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

SPARSE_MLA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// 2^e for e in [-126, 127], exact.
SPARSE_MLA_HD float exp2i(int e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }

// ---- bf16 ----
SPARSE_MLA_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN.
SPARSE_MLA_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- fp16 (dense caches) ----
SPARSE_MLA_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float v = static_cast<float>(man) * exp2i(-24);
    return bits_float(float_bits(v) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// ---- e4m3 (fn variant: no inf, NaN = S.1111.111, max 448) ----
SPARSE_MLA_HD float e4m3_to_float(uint8_t c) {
  uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  uint32_t exp = (c >> 3) & 0xfu;
  uint32_t man = c & 0x7u;
  if (exp == 15 && man == 7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) {  // subnormal: man * 2^-9
    float v = static_cast<float>(man) * exp2i(-9);
    return bits_float(float_bits(v) | sign);
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Round to nearest even, saturating to +-448; NaN -> NaN.
SPARSE_MLA_HD uint8_t float_to_e4m3(float f) {
  uint32_t u = float_bits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448
  if (a < 0x3c800000u) {  // below 2^-6: subnormal grid of 2^-9, values 0..8 (8 = smallest normal)
    float scaled = bits_float(a) * 512.0f;  // exact
    uint32_t m = static_cast<uint32_t>(scaled);
    float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return static_cast<uint8_t>(sign | m);
  }
  uint32_t exp = (a >> 23) - 120u;  // biased e4m3 exponent, 1..15
  uint32_t code = (exp << 3) | ((a >> 20) & 0x7u);
  uint32_t rest = a & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<uint8_t>(sign | code);
}

// ---- scale recipe: s = max(amax / 448, 1e-4); scale = 2^ceil(log2 s) ----
// Returns log2(scale). A NaN amax gives the smallest exponent (-13), an infinite one the largest
// (127): the row is then garbage, but nothing overflows.
SPARSE_MLA_HD int scale_exponent(float amax) {
  float s = amax / 448.0f;
  if (!(s >= 1e-4f)) s = 1e-4f;  // also catches NaN
  uint32_t u = float_bits(s);
  if (u >= 0x7f800000u) return 127;
  int e = static_cast<int>(u >> 23) - 127;  // s is normal: s >= 1e-4
  if ((u & 0x7fffffu) != 0) ++e;
  return e > 127 ? 127 : e;
}

// UE8M0 byte <-> scale.
// Written as selects, not branches: the GPU kernels call it once per token and lane.
SPARSE_MLA_HD float ue8m0_to_float(uint8_t b) {
  const uint32_t bits = b == 0xffu ? 0x7fc00000u                        // NaN
                        : b == 0   ? 0x00400000u                        // 2^-127 (subnormal)
                                   : static_cast<uint32_t>(b) << 23;
  return bits_float(bits);
}

// ---- Page layout ----
// MODEL1: token t of a page at base: row at base + t*576 (448 e4m3 then 64 bf16),
// scales at base + page_size*576 + t*8.
SPARSE_MLA_HD int64_t model1_row_offset(int64_t t) { return t * kModel1RowBytes; }
SPARSE_MLA_HD int64_t model1_scale_offset(int64_t page_size, int64_t t) {
  return page_size * kModel1RowBytes + t * kModel1ScaleBytes;
}
// V32: token-major rows of 656 bytes: 512 e4m3, 4 fp32 scales at 512, 64 bf16 rope at 528.
inline constexpr int kV32ScaleOffset = 512;
inline constexpr int kV32RopeOffset = 528;

}  // namespace sparse_mla::fmt
