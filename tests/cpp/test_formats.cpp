// Format math and byte layouts against hand-computed values (spec section 2): e4m3, bf16, the
// UE8M0 scale recipe, MODEL1 footer and V32 row offsets, and kv_cache_from_tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "sparse_mla/kv_cache.h"
#include "sparse_mla/sparse_mla.h"
#include "src/cuda/common/divider.h"
#include "src/kv/format.h"

namespace sparse_mla {
namespace {

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

// The e4m3fn value of a code from its definition, independent of format.h.
double e4m3_by_definition(int code) {
  const int sign = code >> 7, exp = (code >> 3) & 15, man = code & 7;
  const double mag =
      exp == 0 ? man / 8.0 * std::ldexp(1.0, -6) : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}

TEST(FormatE4M3, DecodesHandPickedCodes) {
  EXPECT_EQ(fmt::e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(fmt::e4m3_to_float(0x80)));
  EXPECT_EQ(fmt::e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fmt::e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(fmt::e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fmt::e4m3_to_float(0x30), 0.5f);
  EXPECT_EQ(fmt::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fmt::e4m3_to_float(0x77), 240.0f);
  EXPECT_EQ(fmt::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fmt::e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(fmt::e4m3_to_float(0xB8), -1.0f);
  EXPECT_TRUE(std::isnan(fmt::e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fmt::e4m3_to_float(0xFF)));
}

TEST(FormatE4M3, AllCodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const float v = fmt::e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(fmt::float_to_e4m3(v) & 0x7F, 0x7F) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), e4m3_by_definition(c)) << "code " << c;
    EXPECT_EQ(fmt::float_to_e4m3(v), c) << "code " << c;
  }
}

TEST(FormatE4M3, RoundsToNearestEven) {
  EXPECT_EQ(fmt::float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(fmt::float_to_e4m3(1.0625f), 0x38);           // tie between 1 and 1.125 -> even
  EXPECT_EQ(fmt::float_to_e4m3(next_up(1.0625f)), 0x39);  // just above the tie
  EXPECT_EQ(fmt::float_to_e4m3(1.1875f), 0x3A);           // tie between 1.125 and 1.25 -> even
  EXPECT_EQ(fmt::float_to_e4m3(-1.1875f), 0xBA);
  EXPECT_EQ(fmt::float_to_e4m3(0.1f), 0x1D);   // 0.1 = 1.6*2^-4 -> 1.625*2^-4
  EXPECT_EQ(fmt::float_to_e4m3(15.5f), 0x58);  // tie 15 (0x57) / 16 (0x58) -> even
  EXPECT_EQ(fmt::float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(fmt::float_to_e4m3(-0.0f), 0x80);
}

TEST(FormatE4M3, RoundsSubnormalsToNearestEven) {
  const float u = std::ldexp(1.0f, -9);  // subnormal step
  EXPECT_EQ(fmt::float_to_e4m3(u), 0x01);
  EXPECT_EQ(fmt::float_to_e4m3(0.5f * u), 0x00);  // tie 0 / 1 -> 0
  EXPECT_EQ(fmt::float_to_e4m3(0.51f * u), 0x01);
  EXPECT_EQ(fmt::float_to_e4m3(1.5f * u), 0x02);   // tie 1 / 2 -> 2
  EXPECT_EQ(fmt::float_to_e4m3(2.5f * u), 0x02);   // tie 2 / 3 -> 2
  EXPECT_EQ(fmt::float_to_e4m3(3.5f * u), 0x04);   // tie 3 / 4 -> 4
  EXPECT_EQ(fmt::float_to_e4m3(7.5f * u), 0x08);   // tie 7 / 8 -> 8, the smallest normal
  EXPECT_EQ(fmt::float_to_e4m3(-6.5f * u), 0x86);  // tie 6 / 7 -> 6
  EXPECT_EQ(fmt::float_to_e4m3(std::ldexp(1.0f, -20)), 0x00);
  EXPECT_EQ(fmt::float_to_e4m3(std::ldexp(1.0f, -130)), 0x00);  // fp32 subnormal input
}

TEST(FormatE4M3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(fmt::float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(fmt::float_to_e4m3(460.0f), 0x7E);  // would round to 480, which e4m3fn lacks
  EXPECT_EQ(fmt::float_to_e4m3(464.0f), 0x7E);
  EXPECT_EQ(fmt::float_to_e4m3(1e6f), 0x7E);
  EXPECT_EQ(fmt::float_to_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(fmt::float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fmt::float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(fmt::float_to_e4m3(432.0f), 0x7E);  // tie 416 (0x7D) / 448 (0x7E) -> even 0x7E
  EXPECT_EQ(fmt::float_to_e4m3(420.0f), 0x7D);
  EXPECT_EQ(fmt::float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(fmt::float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
}

TEST(FormatBF16, RoundsToNearestEven) {
  EXPECT_EQ(fmt::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(fmt::float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie -> even
  EXPECT_EQ(fmt::float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie -> even
  EXPECT_EQ(fmt::float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_EQ(fmt::float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(fmt::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(fmt::float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  const uint16_t nan = fmt::float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7F80, 0x7F80);
  EXPECT_NE(nan & 0x007F, 0);
  // A NaN whose payload lives only in the low 16 bits must stay NaN, not become inf.
  uint32_t low_nan_bits = 0x7F800001u;
  float low_nan;
  std::memcpy(&low_nan, &low_nan_bits, 4);
  EXPECT_NE(fmt::float_to_bf16(low_nan) & 0x007F, 0);
  EXPECT_EQ(fmt::bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(fmt::bf16_to_float(0xC040), -3.0f);
}

TEST(FormatFP16, DecodesHandPickedValues) {
  EXPECT_EQ(fmt::fp16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(fmt::fp16_to_float(0xC000), -2.0f);
  EXPECT_EQ(fmt::fp16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(fmt::fp16_to_float(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(fmt::fp16_to_float(0x7C00)));
  EXPECT_TRUE(std::isnan(fmt::fp16_to_float(0x7E00)));
}

TEST(FormatScale, RoundsUpToPowerOfTwo) {
  for (int k = -10; k <= 20; ++k) {
    const float exact = std::ldexp(448.0f, k);
    EXPECT_EQ(fmt::scale_exponent(exact), k) << "amax 448*2^" << k;
    EXPECT_EQ(fmt::scale_exponent(next_up(exact)), k + 1) << "amax just above 448*2^" << k;
    EXPECT_EQ(fmt::scale_exponent(std::ldexp(300.0f, k)), k) << "amax 300*2^" << k;
  }
  EXPECT_EQ(fmt::scale_exponent(1.0f), -8);  // 1/448 = 2^-8.8 -> 2^-8
  EXPECT_EQ(fmt::scale_exponent(448.0f * 3), 2);
}

TEST(FormatScale, ClampsAtOneTenThousandth) {
  // log2(1e-4) = -13.29: the clamp gives 2^-13 for every small or empty tile.
  EXPECT_EQ(fmt::scale_exponent(0.0f), -13);
  EXPECT_EQ(fmt::scale_exponent(1e-30f), -13);
  EXPECT_EQ(fmt::scale_exponent(0.0448f), -13);  // s = 1e-4 exactly at the clamp
  EXPECT_EQ(fmt::scale_exponent(448.0f * std::ldexp(1.0f, -13)), -13);
  EXPECT_EQ(fmt::scale_exponent(next_up(448.0f * std::ldexp(1.0f, -13))), -12);
  EXPECT_EQ(fmt::scale_exponent(std::numeric_limits<float>::quiet_NaN()), -13);
  EXPECT_EQ(fmt::scale_exponent(std::numeric_limits<float>::infinity()), 127);
}

TEST(FormatScale, UE8M0Bytes) {
  EXPECT_EQ(fmt::ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(fmt::ue8m0_to_float(114), std::ldexp(1.0f, -13));
  EXPECT_EQ(fmt::ue8m0_to_float(130), 8.0f);
  EXPECT_EQ(fmt::ue8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(fmt::ue8m0_to_float(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(fmt::ue8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(fmt::ue8m0_to_float(255)));
}

// The page of a slot (GPU kernels) by multiply and shift: the same as integer division for every
// page size and every int32 slot, including divisors past 2^31 (clamped: page 0).
TEST(SlotDivider, MatchesIntegerDivision) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (int64_t d : {4093LL, 65536LL, 65537LL, 1000003LL, (1LL << 30) - 1, 1LL << 30,
                    (1LL << 31) - 1, 1LL << 31, 1LL << 40}) {
    divisors.push_back(d);
  }
  uint64_t state = 12345;
  for (int64_t d : divisors) {
    const cuda::SlotDivider div = cuda::SlotDivider::make(d);
    std::vector<uint32_t> ns = {0, 1, 0x7fffffffu, 0x7ffffffeu};
    for (int64_t k : {1LL, 2LL, 1000LL, 0x7fffffffLL / d}) {
      for (int64_t off : {-1LL, 0LL, 1LL}) {
        const int64_t n = k * d + off;
        if (n >= 0 && n <= 0x7fffffff) ns.push_back(static_cast<uint32_t>(n));
      }
    }
    for (int r = 0; r < 200; ++r) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      ns.push_back(static_cast<uint32_t>(state >> 33));  // [0, 2^31)
    }
    for (uint32_t n : ns) {
      const int64_t want = static_cast<int64_t>(n) / d;
      const uint32_t q = div.quotient(n);
      ASSERT_EQ(q, want) << "n=" << n << " d=" << d;
      ASSERT_EQ(div.remainder(n, q),
                static_cast<int64_t>(n) - want * std::min<int64_t>(d, 1LL << 31))
          << "n=" << n << " d=" << d;
    }
  }
}

TEST(FormatLayout, Model1FooterOffsets) {
  struct Case {
    int64_t page_size, t, row, scale;
  };
  // row = t*576, scales = page_size*576 + t*8, computed by hand.
  const Case cases[] = {
      {1, 0, 0, 576},
      {2, 0, 0, 1152},
      {2, 1, 576, 1160},
      {64, 0, 0, 36864},
      {64, 63, 36288, 37368},
      {256, 0, 0, 147456},
      {256, 255, 146880, 149496},
      {53, 52, 29952, 30944},
      {61, 30, 17280, 35376},
      {69, 68, 39168, 40288},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(fmt::model1_row_offset(c.t), c.row) << c.page_size << "/" << c.t;
    EXPECT_EQ(fmt::model1_scale_offset(c.page_size, c.t), c.scale) << c.page_size << "/" << c.t;
    // The footer of the last token ends inside the 584-byte-per-token budget.
    EXPECT_LE(fmt::model1_scale_offset(c.page_size, c.page_size - 1) + 8,
              c.page_size * kModel1BytesPerToken);
  }
}

TEST(FormatLayout, V32RowOffsets) {
  EXPECT_EQ(fmt::kV32ScaleOffset, 512);
  EXPECT_EQ(fmt::kV32RopeOffset, 528);
  EXPECT_EQ(fmt::kV32RopeOffset + 2 * kRopeDims, kV32BytesPerToken);
  EXPECT_EQ(kv_format_bytes_per_token(KVFormat::kV32), 656);
  EXPECT_EQ(kv_format_bytes_per_token(KVFormat::kModel1), 584);
  EXPECT_EQ(kv_format_bytes_per_token(KVFormat::kBF16, 2), 2304);
  EXPECT_EQ(kv_format_d_qk(KVFormat::kModel1), 512);
  EXPECT_EQ(kv_format_d_qk(KVFormat::kV32), 576);
  EXPECT_EQ(kv_format_d_qk(KVFormat::kBF16), 576);
}

TEST(FormatKVCacheFromTensor, Model1EnginePaddedPages) {
  // Engines pad pages to a multiple of 576 bytes: 37440 for 64-token pages.
  std::vector<uint8_t> buf(10 * 37440);
  TensorView t = TensorView::strided(buf.data(), DType::kUInt8, Device{}, {10, 64, 1, 584},
                                     {37440, 584, 584, 1});
  KVCache c;
  ASSERT_TRUE(kv_cache_from_tensor(t, "k_cache", &c).ok());
  EXPECT_EQ(c.format, KVFormat::kModel1);
  EXPECT_EQ(c.num_pages, 10);
  EXPECT_EQ(c.page_size, 64);
  EXPECT_EQ(c.page_stride, 37440);
  EXPECT_EQ(c.num_heads, 1);
  EXPECT_EQ(c.data, buf.data());
  EXPECT_EQ(c.num_slots(), 640);

  t.dtype = DType::kFloat8E4M3;
  ASSERT_TRUE(kv_cache_from_tensor(t, "k_cache", &c).ok());
  EXPECT_EQ(c.format, KVFormat::kModel1);
}

TEST(FormatKVCacheFromTensor, V32AndDense) {
  std::vector<uint8_t> buf(3 * 53 * 656);
  KVCache c;
  TensorView v32 = TensorView::contiguous(buf.data(), DType::kUInt8, Device{}, {3, 53, 1, 656});
  ASSERT_TRUE(kv_cache_from_tensor(v32, "k_cache", &c).ok());
  EXPECT_EQ(c.format, KVFormat::kV32);
  EXPECT_EQ(c.page_stride, 53 * 656);

  // bf16 [4, 16, 2, 576] with 64 elements of padding per page: stride in bytes = 2 * elements.
  std::vector<uint16_t> dense(4 * (16 * 2 * 576 + 64));
  TensorView bf = TensorView::strided(dense.data(), DType::kBFloat16, Device{}, {4, 16, 2, 576},
                                      {16 * 2 * 576 + 64, 1152, 576, 1});
  ASSERT_TRUE(kv_cache_from_tensor(bf, "k_cache", &c).ok());
  EXPECT_EQ(c.format, KVFormat::kBF16);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.page_stride, (16 * 2 * 576 + 64) * 2);
  EXPECT_EQ(c.bytes_per_token(), 2304);

  bf.dtype = DType::kFloat16;
  ASSERT_TRUE(kv_cache_from_tensor(bf, "k_cache", &c).ok());
  EXPECT_EQ(c.format, KVFormat::kFP16);

  // One page: the stride of dim 0 is meaningless (here a padded pool's); the page's own bytes,
  // rounded up to a multiple of 16, so that an odd page size with one page is usable too.
  TensorView one = TensorView::strided(buf.data(), DType::kUInt8, Device{}, {1, 7, 1, 584},
                                       {31104, 584, 584, 1});
  ASSERT_TRUE(kv_cache_from_tensor(one, "k_cache", &c).ok());
  EXPECT_EQ(c.page_stride, 4096);  // 7 * 584 = 4088
  std::vector<int32_t> slots = {0, 3, 6};
  std::vector<float> deq(3 * 512);
  DequantizeArgs a;
  a.kv = c;
  a.slots = TensorView::contiguous(slots.data(), DType::kInt32, Device{}, {3});
  a.out = TensorView::contiguous(deq.data(), DType::kFloat32, Device{}, {3, 512});
  const Status st = dequantize(a, Options{Backend::kCPU, nullptr});
  EXPECT_TRUE(st.ok()) << st.to_string();

  // Dims of extent 1 may have any stride, negative too (numpy's a[::-1]): it is never used.
  one.strides[0] = -31104;
  one.strides[2] = -584;
  ASSERT_TRUE(kv_cache_from_tensor(one, "k_cache", &c).ok());
  EXPECT_EQ(c.page_stride, 4096);
}

TEST(FormatKVCacheFromTensor, RejectsBadTensorsNamingTheArgument) {
  std::vector<uint8_t> buf(4 * 64 * 656);
  KVCache c;
  auto expect_error = [&](const TensorView& t, const char* must_contain) {
    Status s = kv_cache_from_tensor(t, "extra_k_cache", &c);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("extra_k_cache"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(must_contain), std::string::npos) << s.message();
  };
  expect_error(TensorView::contiguous(buf.data(), DType::kUInt8, Device{}, {4, 64, 1, 580}), "580");
  expect_error(TensorView::contiguous(buf.data(), DType::kUInt8, Device{}, {4, 32, 2, 584}),
               "h_kv");
  expect_error(TensorView::contiguous(buf.data(), DType::kFloat32, Device{}, {4, 64, 1, 584}),
               "float32");
  expect_error(TensorView::contiguous(buf.data(), DType::kUInt8, Device{}, {64, 1, 584}), "rank 3");
  expect_error(TensorView::contiguous(buf.data(), DType::kBFloat16, Device{}, {4, 64, 1, 512}),
               "512");
  // Tokens not packed inside a page.
  expect_error(TensorView::strided(buf.data(), DType::kUInt8, Device{}, {4, 32, 1, 584},
                                   {32 * 600, 600, 600, 1}),
               "strides");
  // A negative stride where it steps (two pages).
  expect_error(TensorView::strided(buf.data() + 64 * 656, DType::kUInt8, Device{},
                                   {2, 64, 1, 584}, {-64 * 656, 584, 584, 1}),
               "stride 0 is -41984, expected 0..2^48");
}

}  // namespace
}  // namespace sparse_mla
