// A slow, independent model of the number formats of docs/formats.md, written from the definitions
// (value = sign * mantissa * 2^exponent, evaluated in double) rather than from bit tricks, so that
// fuzzing src/kv/format.h against it compares two different derivations.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sparse_mla::fuzz::model {

inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// e4m3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6);
// S.1111.111 is NaN; no infinities.
inline double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (e == 15 && m == 7) return std::copysign(std::nan(""), sign);
  if (e == 0) return sign * std::ldexp(m / 8.0, -6);
  return sign * std::ldexp(1.0 + m / 8.0, e - 7);
}

// Nearest e4m3 among the 127 non-negative finite values (a table built from e4m3_value; codes
// 0..0x7e increase with their value), ties to the even code, magnitudes above 448 saturate; the
// sign bit is always kept (so -0 and tiny negatives give 0x80), NaN gives sign|0x7f.
inline uint8_t e4m3_encode(double f) {
  static const auto table = [] {
    std::array<double, 127> t{};
    for (int c = 0; c < 127; ++c) t[c] = e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  double a = std::fabs(f);
  if (a > 448.0) a = 448.0;
  const int hi = static_cast<int>(std::lower_bound(table.begin(), table.end(), a) - table.begin());
  int best = hi;
  if (hi > 0) {
    const double below = a - table[hi - 1], above = table[hi] - a;
    if (below < above || (below == above && ((hi - 1) & 1) == 0)) best = hi - 1;
  }
  return static_cast<uint8_t>(sign | best);
}

// bf16: the top 16 bits of a float.
inline double bf16_value(uint16_t h) { return as_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even between the two bf16 neighbours of |f| (the one above may be infinity,
// which counts as 2^128 for the distance, as IEEE rounding does). NaN: any NaN, with f's sign
// when `nan_sign` (arithmetic that produced f may not define the sign of its NaN).
inline bool bf16_encode_ok(float f, uint16_t got, bool nan_sign = true) {
  const uint32_t u = bits(f);
  if (std::isnan(f)) {
    return std::isnan(bf16_value(got)) &&
           (!nan_sign || ((got & 0x8000) != 0) == ((u & 0x80000000u) != 0));
  }
  const uint32_t sign = u & 0x80000000u;
  const uint32_t mag = u & 0x7fffffffu;
  const uint32_t lo = mag & 0xffff0000u;
  if (lo == mag) return got == static_cast<uint16_t>((sign | mag) >> 16);
  const uint32_t hi = lo + 0x10000u;
  const double a = as_float(mag);
  const double vlo = as_float(lo);
  const double vhi = hi >= 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(as_float(hi));
  uint32_t pick;
  if (a - vlo < vhi - a) {
    pick = lo;
  } else if (a - vlo > vhi - a) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1) ? hi : lo;
  }
  return got == static_cast<uint16_t>((sign | pick) >> 16);
}

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline double fp16_value(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? std::copysign(std::nan(""), sign) : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024.0 + m, e - 25);
}

// Nearest-even fp16 code of f (overflow to infinity, NaN to the quiet NaN 0x7e00).
inline uint16_t fp16_encode(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a <
      std::ldexp(1.0, -14)) {  // subnormal grid of 2^-24 (1024 rounds up to the smallest normal)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24))));
  }
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  double mant = std::nearbyint(std::ldexp(m, 11));
  if (mant == 2048) {
    mant = 1024;
    ++e;
  }
  const int biased = e - 1 + 15;
  if (biased >= 31) return sign | 0x7c00;
  return static_cast<uint16_t>(sign | (biased << 10) | (static_cast<int>(mant) - 1024));
}

// UE8M0: 2^(byte - 127); 0xff is NaN.
inline double ue8m0_value(uint8_t b) { return b == 0xff ? std::nan("") : std::ldexp(1.0, b - 127); }

// The scale recipe on a tile's amax: s = max(amax / 448, 1e-4) in float32, returns ceil(log2 s)
// capped at 127 (NaN or infinite amax: 127).
inline int scale_exponent(float amax) {
  if (std::isnan(amax) || std::isinf(amax)) return 127;
  float s = amax / 448.0f;
  if (!(s >= 1e-4f)) s = 1e-4f;
  if (std::isinf(s)) return 127;
  int k;
  const double m = std::frexp(static_cast<double>(s), &k);  // s = m * 2^k, m in [0.5, 1)
  const int e = (m == 0.5) ? k - 1 : k;
  return e > 127 ? 127 : e;
}

// Two floats that hold the same value, or both NaN.
inline bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b;
}

}  // namespace sparse_mla::fuzz::model
