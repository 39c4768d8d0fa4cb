// Branch-free exact conversions for the CPU KV tools. Each returns the same bits as its
// src/kv/format.h counterpart for every input (NaN payloads, infinities, subnormals, ties), but is
// written as integer arithmetic and selects, so that loops over rows of them vectorize.
// tests/cpp/test_kv_ops.cpp checks them against format.h exhaustively over bf16 and on random
// fp32 bit patterns.
#pragma once

#include <cstdint>

#include "src/kv/format.h"

// Forced inlining lets the ISA-specific row loops of kv_ops.cpp compile these with their own
// target (a plain inline function may stay an out-of-line baseline-ISA call).
#define SPARSE_MLA_KV_INLINE inline __attribute__((always_inline))

namespace sparse_mla::cpu::kv {

// cond ? a : b as bit masks. A plain ?: over a float result lets GCC sink the float arithmetic
// into a branch it then cannot if-convert (the operation might trap), which stops vectorization.
SPARSE_MLA_KV_INLINE uint32_t select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// fmt::float_to_e4m3: nearest even, saturating to +-448, NaN -> S.1111.111.
SPARSE_MLA_KV_INLINE uint8_t e4m3_from_float(float f) {
  const uint32_t u = fmt::float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal e4m3 range (a >= 2^-6): round the fp32 bits to 3 mantissa bits (a carry moves into the
  // exponent), then rebias the exponent from 127 to 7.
  uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  normal = normal < 0x7eu ? normal : 0x7eu;
  // Subnormal range (a < 2^-6): adding 2^14 leaves a mantissa ulp of 2^-9, the e4m3 subnormal
  // step, so the fp32 addition rounds to the nearest even multiple of it (8 = the smallest
  // normal, code 0x08).
  const uint32_t sub = fmt::float_bits(fmt::bits_float(a) + 16384.0f) - 0x46800000u;
  uint32_t code = select(a < 0x3c800000u, sub, normal);
  code = select(a >= 0x43e00000u, 0x7eu, code);  // >= 448 and +-inf saturate
  code = select(a > 0x7f800000u, 0x7fu, code);
  return static_cast<uint8_t>(sign | code);
}

// fmt::float_to_bf16: nearest even, NaN stays NaN (quiet bit set).
SPARSE_MLA_KV_INLINE uint16_t bf16_from_float(float f) {
  const uint32_t u = fmt::float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(select((u & 0x7fffffffu) > 0x7f800000u, nan, rounded));
}

// fmt::e4m3_to_float. Subnormals (exponent 0) are 2 * (2^-7 * 1.mmm) - 2^-6 = mmm * 2^-9, both
// steps exact.
SPARSE_MLA_KV_INLINE float e4m3_to_float(uint8_t c) {
  const uint32_t mag = static_cast<uint32_t>(c & 0x7fu);
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const float normal = fmt::bits_float((mag << 20) + (120u << 23));
  const float sub = normal * 2.0f - 0x1p-6f;
  uint32_t bits = select((mag & 0x78u) == 0, fmt::float_bits(sub), fmt::float_bits(normal));
  bits = select(mag == 0x7fu, 0x7fc00000u, bits);
  return fmt::bits_float(bits | sign);
}

// fmt::fp16_to_float.
SPARSE_MLA_KV_INLINE float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  const uint32_t normal = (mag << 13) + (112u << 23);
  const uint32_t special = normal + (112u << 23);  // exponent 31 -> 255: inf and NaN payloads
  const uint32_t sub = fmt::float_bits(static_cast<float>(mag) * 0x1p-24f);
  uint32_t bits = select(mag < 0x400u, sub, normal);
  bits = select(mag >= 0x7c00u, special, bits);
  return fmt::bits_float(bits | sign);
}

}  // namespace sparse_mla::cpu::kv
