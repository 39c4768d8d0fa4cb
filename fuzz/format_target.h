// Fuzz target "format": src/kv/format.h (e4m3, bf16, fp16, UE8M0, the scale recipe and MODEL1 page
// offsets) against the slow model of fuzz/format_model.h, on values taken from the input.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "fuzz/format_model.h"
#include "fuzz/harness.h"
#include "src/kv/format.h"

namespace sparse_mla::fuzz {

namespace format_detail {

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Floats that the raw bits of a fuzz input rarely produce on their own: rounding boundaries
// of e4m3 (midpoints between codes), the saturation edge, the subnormal edge, the recipe's
// 1e-4 floor.
inline float interesting_float(Input& in) {
  const int kind = in.u8() % 8;
  const uint8_t code = in.u8() & 0x7f;
  const float sign = in.coin() ? -1.f : 1.f;
  switch (kind) {
    case 0: {  // an exact e4m3 value, or the midpoint to the next code, nudged by +-k ulps
      double v = model::e4m3_value(code == 0x7f ? 0x7e : code);
      if (in.coin()) v = (v + model::e4m3_value(code >= 0x7e ? 0x7e : code + 1)) / 2;
      float f = static_cast<float>(v);
      const int nudge = static_cast<int>(in.u8() % 5) - 2;
      uint32_t u = model::bits(f) + nudge;
      if (f == 0.f && nudge < 0) u = 0;
      return sign * model::as_float(u);
    }
    case 1:
      return sign * static_cast<float>(448.0 + in.range(-64, 64) * 0.5);
    case 2:
      return sign * std::ldexp(static_cast<float>(in.range(0, 64)), -15);
    case 3:
      return sign * 448.0f * 1e-4f * (1.0f + static_cast<float>(in.range(-8, 8)) * 1e-7f);
    case 4:
      return sign * std::ldexp(1.0f, static_cast<int>(in.range(-149, 127)));
    default:
      return in.f32();
  }
}

}  // namespace format_detail

inline std::string fuzz_format(const uint8_t* data, size_t size) {
  using namespace format_detail;
  Input in(data, size);
  Findings f;
  // Decoders: every code of each 8-bit format, and the 16-bit codes the input names.
  for (int c = 0; c < 256 && !f.any(); ++c) {
    const uint8_t b = static_cast<uint8_t>(c);
    if (!model::same_value(fmt::e4m3_to_float(b), model::e4m3_value(b))) {
      f.fail("e4m3_to_float(" + hex(c) + ") disagrees with the model");
    }
    if (!model::same_value(fmt::ue8m0_to_float(b), model::ue8m0_value(b))) {
      f.fail("ue8m0_to_float(" + hex(c) + ") disagrees with the model");
    }
    if (c != 0x7f && c != 0xff && fmt::float_to_e4m3(fmt::e4m3_to_float(b)) != b) {
      f.fail("e4m3 round trip of " + hex(c) + " gives " +
             hex(fmt::float_to_e4m3(fmt::e4m3_to_float(b))));
    }
  }
  while (in.remaining() > 0 && !f.any()) {
    const float x = in.coin() ? in.f32() : interesting_float(in);
    const uint32_t xb = model::bits(x);
    const uint8_t e = fmt::float_to_e4m3(x);
    if (e != model::e4m3_encode(x)) {
      f.fail("float_to_e4m3(" + hex(xb) + ") = " + hex(e) + ", model says " +
             hex(model::e4m3_encode(x)));
    }
    const uint16_t h = fmt::float_to_bf16(x);
    if (!model::bf16_encode_ok(x, h)) f.fail("float_to_bf16(" + hex(xb) + ") = " + hex(h));
    const uint16_t code16 = in.u16();
    if (!model::same_value(fmt::bf16_to_float(code16), model::bf16_value(code16))) {
      f.fail("bf16_to_float(" + hex(code16) + ") disagrees with the model");
    }
    if (!model::same_value(fmt::fp16_to_float(code16), model::fp16_value(code16))) {
      f.fail("fp16_to_float(" + hex(code16) + ") disagrees with the model");
    }
    // The recipe: the exponent matches, and for a finite tile every value fits without
    // saturating while the scale is as small as the 1e-4 floor allows.
    const float amax = std::fabs(x);
    const int se = fmt::scale_exponent(amax);
    if (std::isnan(amax)) {
      // The contract leaves a NaN amax open (callers take amax with fmax, which skips NaN);
      // any exponent the recipe can produce is acceptable.
      if (se < -13 || se > 127) f.fail("scale_exponent(NaN) = " + num(se));
    } else if (se != model::scale_exponent(amax)) {
      f.fail("scale_exponent(" + hex(model::bits(amax)) + ") = " + num(se) + ", model says " +
             num(model::scale_exponent(amax)));
    } else if (std::isfinite(amax) && se < 127) {
      const double scaled = amax / std::ldexp(1.0, se);
      if (scaled > 448.0) f.fail("scale_exponent(" + hex(model::bits(amax)) + ") saturates");
      if (se > -13 && scaled <= 224.0 && amax / 448.0f > 1e-4f) {
        f.fail("scale_exponent(" + hex(model::bits(amax)) + ") is not the smallest scale");
      }
    }
    const int ei = static_cast<int>(in.range(-126, 127));
    if (static_cast<double>(fmt::exp2i(ei)) != std::ldexp(1.0, ei)) {
      f.fail("exp2i(" + num(ei) + ") is not 2^" + num(ei));
    }
    // MODEL1 page layout: token rows and footer scales of a page tile the first page_size*584
    // bytes without overlap.
    const int64_t page_size = in.range(1, 1 << 20);
    const int64_t t = in.range(0, static_cast<int64_t>(page_size - 1));
    const int64_t row = fmt::model1_row_offset(t), scale = fmt::model1_scale_offset(page_size, t);
    if (row != t * 576 || scale != page_size * 576 + t * 8 || scale + 8 > page_size * 584) {
      f.fail("MODEL1 offsets of token " + num(t) + " in a page of " + num(page_size));
    }
  }
  return f.first;
}

}  // namespace sparse_mla::fuzz
