// KV-cache tools through the public API on the CPU backend: quantize_store against hand-computed
// bytes and the spec's recipe, dequantize error bounds, exhaustive e4m3 round trips through pages,
// and byte-exact page repacks that leave everything they were not asked to write untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparse_mla/sparse_mla.h"
#include "src/cpu/kv_convert.h"
#include "src/kv/format.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla {
namespace {

constexpr uint8_t kSentinel = 0xA5;
const Options kCPU{Backend::kCPU, nullptr};

using test_support::test_seed;

// A page pool with a 16-byte-aligned start, as the API requires.
struct HostCache {
  std::vector<uint8_t> storage;
  KVCache kv;

  HostCache(KVFormat format, int64_t num_pages, int64_t page_size, int64_t page_stride,
            int64_t num_heads = 1, uint8_t fill = kSentinel)
      : storage(static_cast<size_t>(num_pages * page_stride + 16), fill) {
    kv.format = format;
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_stride = page_stride;
    kv.num_heads = num_heads;
    const uintptr_t p = reinterpret_cast<uintptr_t>(storage.data());
    kv.data = storage.data() + ((16 - p % 16) % 16);
  }
  uint8_t* bytes() const { return static_cast<uint8_t*>(kv.data); }
  int64_t size() const { return kv.num_pages * kv.page_stride; }
  std::vector<uint8_t> image() const { return {bytes(), bytes() + size()}; }
};

// The page stride engines use for MODEL1: pages padded to a multiple of 576 bytes.
int64_t engine_stride(int64_t page_size) {
  return (page_size * kModel1BytesPerToken + 575) / 576 * 576;
}

// Byte ranges (offset from the pool start, length) holding one token, written out from the
// spec rather than taken from format.h.
std::vector<std::pair<int64_t, int64_t>> token_spans(const KVCache& kv, int64_t page, int64_t t) {
  const int64_t base = page * kv.page_stride;
  if (kv.format == KVFormat::kModel1) {
    return {{base + t * 576, 576}, {base + kv.page_size * 576 + t * 8, 8}};
  }
  const int64_t bpt = kv.format == KVFormat::kV32 ? 656 : kv.num_heads * 576 * 2;
  return {{base + t * bpt, bpt}};
}

TensorView i32_view(std::vector<int32_t>& v) {
  return TensorView::contiguous(v.data(), DType::kInt32, Device{},
                                {static_cast<int64_t>(v.size())});
}

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

float read_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Every byte outside `written` (sorted, disjoint spans) must still hold the sentinel.
void expect_untouched_except(const HostCache& c, std::vector<std::pair<int64_t, int64_t>> written) {
  std::sort(written.begin(), written.end());
  int64_t pos = 0, bad = 0, first_bad = -1;
  auto check_until = [&](int64_t end) {
    for (; pos < end; ++pos) {
      if (c.bytes()[pos] != kSentinel) {
        if (first_bad < 0) first_bad = pos;
        ++bad;
      }
    }
  };
  for (const auto& [off, len] : written) {
    check_until(off);
    pos = off + len;
  }
  check_until(c.size());
  EXPECT_EQ(bad, 0) << "bytes written outside the expected spans, first at offset " << first_bad;
}

// ---------------------------------------------------------------------------------------------
// quantize_store against hand-computed bytes

TEST(KvQuantizeStore, Model1RowMatchesHandComputedBytes) {
  // 53-token pages with the engine stride 31104 (54 * 576); slot 2*53+7 is page 2, token 7:
  // its row starts at 2*31104 + 7*576 = 66240, its scales at 2*31104 + 53*576 + 7*8 = 92792.
  HostCache c(KVFormat::kModel1, 4, 53, 31104);
  std::vector<float> x(512, 0.f);
  float* tile = x.data();
  // Tile 0: amax 896 = 448*2 exactly -> scale 2 (byte 128).
  tile[0] = 896.f, tile[1] = 1.f, tile[2] = -3.f;
  for (int j = 3; j < 64; ++j) tile[j] = 0.5f;
  // Tile 1: all zero -> clamp 1e-4 -> 2^-13 (byte 114).
  // Tile 2: amax just above 448 -> scale 2 (byte 128); 448.00003/2 rounds to 224.
  x[128] = next_up(448.f);
  // Tile 3: amax 14 = 448*2^-5 -> byte 122; 1.5*2^-14 / 2^-5 = 1.5*2^-9, a subnormal tie -> 2.
  x[192] = 14.f, x[193] = std::ldexp(1.5f, -14);
  // Tile 4: tiny values -> clamp, 2^-13; 1e-6 * 2^13 = 0.008192 = 4.19 subnormal steps -> 4.
  for (int j = 256; j < 320; ++j) x[j] = 1e-6f;
  // Tile 5: the amax is negative: -1792 = -448*4 -> byte 129.
  x[320] = -1792.f, x[321] = 1.f;
  // Tile 6: scale 1 (byte 127); e4m3 ties 1.0625 -> 1.0 and 1.1875 -> 1.25; -0 stays -0.
  x[384] = 448.f, x[385] = 1.0625f, x[386] = 1.1875f;
  for (int j = 387; j < 448; ++j) x[j] = -0.f;
  // Rope (bf16, RNE from fp32): 1 + 2^-8 ties to 1.0.
  x[448] = 1.f + std::ldexp(1.f, -8), x[449] = -2.f, x[450] = 3.f;
  for (int j = 451; j < 512; ++j) x[j] = 0.25f;

  std::vector<int32_t> slots{2 * 53 + 7};
  QuantizeStoreArgs args{TensorView::contiguous(x.data(), DType::kFloat32, Device{}, {1, 512}),
                         i32_view(slots), c.kv};
  ASSERT_TRUE(quantize_store(args, kCPU).ok());

  const uint8_t* row = c.bytes() + 66240;
  const uint8_t* sc = c.bytes() + 92792;
  const uint8_t expect_scales[8] = {128, 114, 128, 122, 114, 129, 127, 0};
  for (int j = 0; j < 8; ++j) EXPECT_EQ(sc[j], expect_scales[j]) << "scale byte " << j;
  EXPECT_EQ(row[0], 0x7E);
  EXPECT_EQ(row[1], 0x30);                                    // 1/2 = 0.5
  EXPECT_EQ(row[2], 0xBC);                                    // -3/2 = -1.5
  for (int j = 3; j < 64; ++j) EXPECT_EQ(row[j], 0x28) << j;  // 0.25
  for (int j = 64; j < 128; ++j) EXPECT_EQ(row[j], 0x00) << j;
  EXPECT_EQ(row[128], 0x76);  // 224
  for (int j = 129; j < 192; ++j) EXPECT_EQ(row[j], 0x00) << j;
  EXPECT_EQ(row[192], 0x7E);
  EXPECT_EQ(row[193], 0x02);
  for (int j = 256; j < 320; ++j) EXPECT_EQ(row[j], 0x04) << j;
  EXPECT_EQ(row[320], 0xFE);
  EXPECT_EQ(row[321], 0x28);  // 1/4
  EXPECT_EQ(row[384], 0x7E);
  EXPECT_EQ(row[385], 0x38);
  EXPECT_EQ(row[386], 0x3A);
  for (int j = 387; j < 448; ++j) EXPECT_EQ(row[j], 0x80) << j;
  EXPECT_EQ(read_u16(row + 448), 0x3F80);
  EXPECT_EQ(read_u16(row + 450), 0xC000);
  EXPECT_EQ(read_u16(row + 452), 0x4040);
  for (int j = 3; j < 64; ++j) EXPECT_EQ(read_u16(row + 448 + 2 * j), 0x3E80) << j;
  expect_untouched_except(c, {{66240, 576}, {92792, 8}});
}

TEST(KvQuantizeStore, V32RowMatchesHandComputedBytes) {
  // 61-token pages padded by 32 bytes: stride 61*656 + 32 = 40048; slot 61+60 starts at
  // 40048 + 60*656 = 79408.
  HostCache c(KVFormat::kV32, 2, 61, 40048);
  std::vector<uint16_t> x(576, fmt::float_to_bf16(0.f));
  x[0] = fmt::float_to_bf16(896.f);  // tile 0: scale 2
  for (int j = 1; j < 128; ++j) x[j] = fmt::float_to_bf16(-0.5f);
  // Tile 1 zero, tile 2 tiny: both clamp to 2^-13.
  for (int j = 256; j < 384; ++j) x[j] = fmt::float_to_bf16(1e-6f);
  // Tile 3: amax 448*2^-20 is below the clamp: scale 2^-13, stored value 448*2^-7 = 3.5.
  x[384] = fmt::float_to_bf16(std::ldexp(448.f, -20));
  for (int j = 0; j < 64; ++j) x[512 + j] = static_cast<uint16_t>(0x1234 + 17 * j);  // any bits

  std::vector<int32_t> slots{61 + 60};
  QuantizeStoreArgs args{TensorView::contiguous(x.data(), DType::kBFloat16, Device{}, {1, 576}),
                         i32_view(slots), c.kv};
  ASSERT_TRUE(quantize_store(args, kCPU).ok());

  const uint8_t* row = c.bytes() + 79408;
  EXPECT_EQ(row[0], 0x7E);
  for (int j = 1; j < 128; ++j) EXPECT_EQ(row[j], 0xA8) << j;  // -0.25
  for (int j = 128; j < 256; ++j) EXPECT_EQ(row[j], 0x00) << j;
  // bf16(1e-6) = 9.98e-7; * 2^13 = 0.00818 = 4.19 steps of 2^-9 -> 4.
  for (int j = 256; j < 384; ++j) EXPECT_EQ(row[j], 0x04) << j;
  EXPECT_EQ(row[384], 0x46);
  EXPECT_EQ(read_f32(row + 512), 2.f);
  EXPECT_EQ(read_f32(row + 516), std::ldexp(1.f, -13));
  EXPECT_EQ(read_f32(row + 520), std::ldexp(1.f, -13));
  EXPECT_EQ(read_f32(row + 524), std::ldexp(1.f, -13));
  for (int j = 0; j < 64; ++j) EXPECT_EQ(read_u16(row + 528 + 2 * j), 0x1234 + 17 * j) << j;
  expect_untouched_except(c, {{79408, 656}});
}

TEST(KvQuantizeStore, SkipsMinusOneAndOutOfRangeSlots) {
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32}) {
    const int64_t ps = 69;
    const int64_t stride = format == KVFormat::kModel1 ? engine_stride(ps) : ps * 656 + 16;
    HostCache c(format, 3, ps, stride);
    const int d = kv_format_d_qk(format);
    std::vector<int32_t> slots{
        -1, static_cast<int32_t>(3 * ps), 1 << 30, -5, std::numeric_limits<int32_t>::min(), 70, -1};
    std::vector<float> x(slots.size() * d);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 0.3f);
    for (float& v : x) v = nd(rng);
    QuantizeStoreArgs args{TensorView::contiguous(x.data(), DType::kFloat32, Device{},
                                                  {static_cast<int64_t>(slots.size()), d}),
                           i32_view(slots), c.kv};
    ASSERT_TRUE(quantize_store(args, kCPU).ok());
    expect_untouched_except(c, token_spans(c.kv, 1, 1));  // slot 70 = page 1, token 1
  }
}

// ---------------------------------------------------------------------------------------------
// quantize -> dequantize

// The spec's recipe in double precision, as an independent check of the stored exponent.
int recipe_exponent(double amax) {
  const double s = std::max(amax / 448.0, 1e-4);
  return static_cast<int>(std::ceil(std::log2(s)));
}

// Half an e4m3 ulp at |y| (y = x / scale, |y| <= 448).
double half_ulp_e4m3(double y) {
  y = std::fabs(y);
  if (y < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(y))) - 4);
}

struct RoundTripCase {
  KVFormat format;
  int64_t page_size;
  int64_t page_pad;  // bytes of padding per page (beyond the engine stride for MODEL1)
  DType src_dtype;
};

class KvQuantizeRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(KvQuantizeRoundTrip, DequantizedValuesWithinHalfUlpTimesScale) {
  const RoundTripCase pc = GetParam();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const bool m1 = pc.format == KVFormat::kModel1;
  const int d = kv_format_d_qk(pc.format);
  const int nope = m1 ? 448 : 512;
  const int tile = m1 ? 64 : 128;
  const int64_t stride =
      (m1 ? engine_stride(pc.page_size) : pc.page_size * 656 + 15) / 16 * 16 + pc.page_pad;
  const int64_t num_pages = 5;
  HostCache c(pc.format, num_pages, pc.page_size, stride, 1, 0xFF);  // 0xFF: NaN codes
  const int64_t num_slots = num_pages * pc.page_size;
  const int64_t n = std::min<int64_t>(num_slots, 300);

  // Distinct random slots; row i gets its own magnitude so tiles span many scales.
  std::vector<int32_t> slots(num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_int_distribution<int> mag(-24, 12);
  std::vector<float> xf(n * d);
  for (int64_t i = 0; i < n; ++i) {
    const int row_mag = mag(rng);
    for (int j = 0; j < d; ++j) {
      // Each tile has its own magnitude around the row's; one tile in five is tiny.
      const int tile_mag = row_mag + (j / tile) % 3 - ((j / tile) % 5 == 4 ? 16 : 0);
      xf[i * d + j] = static_cast<float>(std::ldexp(nd(rng), tile_mag));
    }
  }
  // bf16 sources hold the bf16-rounded values; the check compares against those.
  std::vector<uint16_t> xb(n * d);
  for (int64_t k = 0; k < n * d; ++k) {
    xb[k] = fmt::float_to_bf16(xf[k]);
    if (pc.src_dtype == DType::kBFloat16) xf[k] = fmt::bf16_to_float(xb[k]);
  }
  void* src_data = pc.src_dtype == DType::kBFloat16 ? static_cast<void*>(xb.data())
                                                    : static_cast<void*>(xf.data());
  QuantizeStoreArgs qa{TensorView::contiguous(src_data, pc.src_dtype, Device{}, {n, d}),
                       i32_view(slots), c.kv};
  ASSERT_TRUE(quantize_store(qa, kCPU).ok());

  // Read back every stored slot plus -1 and out-of-range slots (which give zero rows).
  std::vector<int32_t> read = slots;
  read.push_back(-1);
  read.push_back(static_cast<int32_t>(num_slots));
  read.push_back(std::numeric_limits<int32_t>::max());
  const int64_t m = static_cast<int64_t>(read.size());
  std::vector<float> out(m * d, std::numeric_limits<float>::quiet_NaN());
  DequantizeArgs da{c.kv, i32_view(read),
                    TensorView::contiguous(out.data(), DType::kFloat32, Device{}, {m, d})};
  ASSERT_TRUE(dequantize(da, kCPU).ok());
  std::vector<uint16_t> out_bf(m * d, 0x7FC1);
  DequantizeArgs db{c.kv, i32_view(read),
                    TensorView::contiguous(out_bf.data(), DType::kBFloat16, Device{}, {m, d})};
  ASSERT_TRUE(dequantize(db, kCPU).ok());

  int64_t failures = 0;
  for (int64_t i = 0; i < n && failures < 10; ++i) {
    const int64_t slot = slots[i];
    const uint8_t* base = c.bytes() + (slot / pc.page_size) * stride;
    const int64_t t = slot % pc.page_size;
    for (int tl = 0; tl < nope / tile; ++tl) {
      double amax = 0;
      for (int j = 0; j < tile; ++j)
        amax = std::max(amax, std::fabs(double(xf[i * d + tl * tile + j])));
      const int e = recipe_exponent(amax);
      if (m1) {
        EXPECT_EQ(base[pc.page_size * 576 + t * 8 + tl], e + 127) << "row " << i << " tile " << tl;
      } else {
        EXPECT_EQ(read_f32(base + t * 656 + 512 + 4 * tl), std::ldexp(1.f, e))
            << "row " << i << " tile " << tl;
      }
      const double scale = std::ldexp(1.0, e);
      for (int j = tl * tile; j < (tl + 1) * tile; ++j) {
        const double x = xf[i * d + j];
        const double got = out[i * d + j];
        const double bound = half_ulp_e4m3(x / scale) * scale;
        if (!(std::fabs(got - x) <= bound)) {
          ADD_FAILURE() << "row " << i << " dim " << j << ": " << got << " vs " << x << ", bound "
                        << bound;
          ++failures;
        }
      }
    }
    if (m1) EXPECT_EQ(base[pc.page_size * 576 + t * 8 + 7], 0) << "unused footer byte";
    for (int j = nope; j < d; ++j) {
      EXPECT_EQ(out[i * d + j], fmt::bf16_to_float(xb[i * d + j])) << "rope, row " << i;
    }
  }
  EXPECT_EQ(failures, 0);
  for (int64_t k = 0; k < n * d; ++k) {
    // e4m3 * 2^e has 4 significant bits: exact in bf16.
    ASSERT_EQ(fmt::bf16_to_float(out_bf[k]), out[k]) << "bf16 output, element " << k;
  }
  for (int64_t i = n; i < m; ++i) {
    for (int j = 0; j < d; ++j) {
      ASSERT_EQ(out[i * d + j], 0.f) << "slot " << read[i] << " must read as zeros";
      ASSERT_EQ(out_bf[i * d + j], 0) << "slot " << read[i] << " must read as zeros";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, KvQuantizeRoundTrip,
    ::testing::Values(RoundTripCase{KVFormat::kModel1, 256, 0, DType::kFloat32},
                      RoundTripCase{KVFormat::kModel1, 64, 0, DType::kBFloat16},
                      RoundTripCase{KVFormat::kModel1, 2, 16, DType::kFloat32},
                      RoundTripCase{KVFormat::kModel1, 53, 48, DType::kBFloat16},
                      RoundTripCase{KVFormat::kV32, 64, 0, DType::kBFloat16},
                      RoundTripCase{KVFormat::kV32, 61, 32, DType::kFloat32},
                      RoundTripCase{KVFormat::kV32, 1, 0, DType::kFloat32}),
    [](const ::testing::TestParamInfo<RoundTripCase>& info) {
      const RoundTripCase& c = info.param;
      return std::string(kv_format_name(c.format)) + "_page" + std::to_string(c.page_size) +
             "_pad" + std::to_string(c.page_pad) + "_" + dtype_name(c.src_dtype);
    });

// Stores every finite e4m3 code under several scales, reads the pages back and stores the result
// again: the second store must reproduce the first byte for byte.
TEST(KvQuantizeStore, AllE4M3CodesSurviveDequantizeAndRequantize) {
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32}) {
    SCOPED_TRACE(kv_format_name(format));
    const bool m1 = format == KVFormat::kModel1;
    const int nope = m1 ? 448 : 512, tile = m1 ? 64 : 128, d = m1 ? 512 : 576;
    const int exps[7] = {-13, -5, 0, 3, 10, -1, 7};
    const int64_t ps = 3, stride = m1 ? engine_stride(ps) : ps * 656 + 16;
    HostCache a(format, 2, ps, stride), b(format, 2, ps, stride);
    // Codes 0..255 without the two NaNs, spread over two tokens; each tile starts with +-448 so
    // its scale is recovered exactly.
    std::vector<int> codes;
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) != 0x7F) codes.push_back(code);
    }
    std::vector<int32_t> slots{4, 2};
    size_t next = 0;
    for (int32_t slot : slots) {
      uint8_t* base = a.bytes() + (slot / ps) * stride;
      const int64_t t = slot % ps;
      uint8_t* row = base + (m1 ? t * 576 : t * 656);
      for (int j = 0; j < nope; ++j) {
        row[j] = j % tile == 0 ? ((j / tile) % 2 ? 0xFE : 0x7E)
                               : static_cast<uint8_t>(codes[next++ % codes.size()]);
      }
      for (int tl = 0; tl < nope / tile; ++tl) {
        const int e = exps[(tl + slot) % 7];
        if (m1) {
          base[ps * 576 + t * 8 + tl] = static_cast<uint8_t>(e + 127);
        } else {
          const float s = std::ldexp(1.f, e);
          std::memcpy(row + 512 + 4 * tl, &s, 4);
        }
      }
      if (m1) base[ps * 576 + t * 8 + 7] = 0;
      for (int j = 0; j < 64; ++j) {
        const uint16_t bits = fmt::float_to_bf16(0.01f * (j - 20) * (slot + 1));
        std::memcpy(row + (m1 ? 448 : 528) + 2 * j, &bits, 2);
      }
    }
    ASSERT_GE(next, codes.size()) << "every code must be stored";
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      std::vector<uint8_t> vals(slots.size() * d * 4);
      DequantizeArgs da{a.kv, i32_view(slots),
                        TensorView::contiguous(vals.data(), dt, Device{}, {2, d})};
      ASSERT_TRUE(dequantize(da, kCPU).ok());
      QuantizeStoreArgs qa{TensorView::contiguous(vals.data(), dt, Device{}, {2, d}),
                           i32_view(slots), b.kv};
      ASSERT_TRUE(quantize_store(qa, kCPU).ok());
      std::vector<std::pair<int64_t, int64_t>> spans;
      for (int32_t slot : slots) {
        for (auto sp : token_spans(a.kv, slot / ps, slot % ps)) {
          spans.push_back(sp);
          for (int64_t k = sp.first; k < sp.first + sp.second; ++k) {
            ASSERT_EQ(b.bytes()[k], a.bytes()[k]) << "slot " << slot << " byte " << k;
          }
        }
      }
      expect_untouched_except(b, spans);
    }
  }
}

TEST(KvQuantizeStore, StridedSourceRows) {
  // Rows 8 elements apart: the store must follow the row stride.
  const int64_t n = 3, d = 512, ld = d + 8;
  std::vector<float> x(n * ld, std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < d; ++j) x[i * ld + j] = 0.01f * static_cast<float>((i + 1) * (j % 37) - 11);
  }
  HostCache strided(KVFormat::kModel1, 1, 4, engine_stride(4));
  HostCache packed(KVFormat::kModel1, 1, 4, engine_stride(4));
  std::vector<int32_t> slots{3, 0, 1};
  QuantizeStoreArgs sa{TensorView::strided(x.data(), DType::kFloat32, Device{}, {n, d}, {ld, 1}),
                       i32_view(slots), strided.kv};
  ASSERT_TRUE(quantize_store(sa, kCPU).ok());
  std::vector<float> xp(n * d);
  for (int64_t i = 0; i < n; ++i) std::copy_n(&x[i * ld], d, &xp[i * d]);
  QuantizeStoreArgs pa{TensorView::contiguous(xp.data(), DType::kFloat32, Device{}, {n, d}),
                       i32_view(slots), packed.kv};
  ASSERT_TRUE(quantize_store(pa, kCPU).ok());
  EXPECT_EQ(strided.image(), packed.image());
  EXPECT_NE(packed.image()[0], kSentinel);
}

// ---------------------------------------------------------------------------------------------
// dequantize of dense caches

TEST(KvDequantize, DenseCachesGiveHeadZero) {
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kFP16}) {
    SCOPED_TRACE(kv_format_name(format));
    const int64_t ps = 5, heads = 2, pages = 3, stride = ps * heads * 576 * 2 + 32;
    HostCache c(format, pages, ps, stride, heads);
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> bits(0, 0xFFFF);
    for (int64_t p = 0; p < pages; ++p) {
      for (int64_t k = 0; k < ps * heads * 576; ++k) {
        // Finite values only; the exponent field is kept away from all-ones.
        uint16_t v = static_cast<uint16_t>(bits(rng));
        if (format == KVFormat::kBF16)
          v &= 0xBFFF;
        else
          v &= 0xBBFF;
        std::memcpy(c.bytes() + p * stride + 2 * k, &v, 2);
      }
    }
    std::vector<int32_t> slots{14, 0, -1, 7, 15, 9};
    const int64_t n = static_cast<int64_t>(slots.size());
    std::vector<float> out(n * 576, std::numeric_limits<float>::quiet_NaN());
    DequantizeArgs da{c.kv, i32_view(slots),
                      TensorView::contiguous(out.data(), DType::kFloat32, Device{}, {n, 576})};
    ASSERT_TRUE(dequantize(da, kCPU).ok());
    std::vector<uint16_t> out_bf(n * 576, 0x7FC1);
    DequantizeArgs db{c.kv, i32_view(slots),
                      TensorView::contiguous(out_bf.data(), DType::kBFloat16, Device{}, {n, 576})};
    ASSERT_TRUE(dequantize(db, kCPU).ok());
    for (int64_t i = 0; i < n; ++i) {
      const int32_t slot = slots[i];
      const bool valid = slot >= 0 && slot < pages * ps;
      for (int j = 0; j < 576; ++j) {
        float want = 0.f;
        if (valid) {
          const uint16_t h =
              read_u16(c.bytes() + (slot / ps) * stride + (slot % ps) * heads * 576 * 2 + 2 * j);
          want = format == KVFormat::kBF16 ? fmt::bf16_to_float(h) : fmt::fp16_to_float(h);
        }
        ASSERT_EQ(out[i * 576 + j], want) << "slot " << slot << " dim " << j;
        ASSERT_EQ(out_bf[i * 576 + j], fmt::float_to_bf16(want)) << "slot " << slot << " dim " << j;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// repack

struct RepackCase {
  KVFormat format;
  int64_t num_heads;
  int64_t src_page, dst_page;
  int64_t src_pad, dst_pad;  // extra bytes per page beyond the minimum 16-byte-aligned stride
};

int64_t min_stride(KVFormat format, int64_t page_size, int64_t heads) {
  if (format == KVFormat::kModel1) return engine_stride(page_size);
  return (page_size * kv_format_bytes_per_token(format, heads) + 15) / 16 * 16;
}

// A block table giving each request fresh pages of a pool in random order; columns past a
// request's last page hold garbage that must never be followed.
std::vector<int32_t> make_table(const std::vector<int32_t>& lens, int64_t page_size,
                                int64_t max_pages, int64_t pool_pages, std::mt19937_64& rng) {
  std::vector<int32_t> pool(pool_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> table(lens.size() * max_pages);
  size_t next = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t used = (std::max(lens[i], 0) + page_size - 1) / page_size;
    for (int64_t p = 0; p < max_pages; ++p) {
      table[i * max_pages + p] = p < used ? pool.at(next++) : (p % 2 ? -1 : 1 << 29);
    }
  }
  return table;
}

// What dst must look like after copying each request's tokens: its old bytes, with the tokens
// overwritten. Computed token by token, independently of the run-based copy in the library.
std::vector<uint8_t> expected_image(const HostCache& src, const std::vector<int32_t>& src_table,
                                    int64_t max_src, const HostCache& dst,
                                    const std::vector<int32_t>& dst_table, int64_t max_dst,
                                    const std::vector<int32_t>& lens) {
  std::vector<uint8_t> img = dst.image();
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = std::clamp<int64_t>(
        lens[i], 0, std::min(max_src * src.kv.page_size, max_dst * dst.kv.page_size));
    for (int64_t t = 0; t < len; ++t) {
      const int64_t sp = src_table[i * max_src + t / src.kv.page_size];
      const int64_t dp = dst_table[i * max_dst + t / dst.kv.page_size];
      if (sp < 0 || sp >= src.kv.num_pages || dp < 0 || dp >= dst.kv.num_pages) continue;
      const auto s = token_spans(src.kv, sp, t % src.kv.page_size);
      const auto d = token_spans(dst.kv, dp, t % dst.kv.page_size);
      for (size_t k = 0; k < s.size(); ++k) {
        std::memcpy(img.data() + d[k].first, src.bytes() + s[k].first,
                    static_cast<size_t>(s[k].second));
      }
    }
  }
  return img;
}

// Index of the first differing byte, or -1.
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  auto it = std::mismatch(a.begin(), a.end(), b.begin());
  return it.first == a.end() ? -1 : it.first - a.begin();
}

Status run_repack(const HostCache& src, std::vector<int32_t>& src_table, int64_t max_src,
                  const HostCache& dst, std::vector<int32_t>& dst_table, int64_t max_dst,
                  std::vector<int32_t>& lens) {
  const int64_t b = static_cast<int64_t>(lens.size());
  RepackArgs args{src.kv, dst.kv,
                  TensorView::contiguous(src_table.data(), DType::kInt32, Device{}, {b, max_src}),
                  TensorView::contiguous(dst_table.data(), DType::kInt32, Device{}, {b, max_dst}),
                  i32_view(lens)};
  return repack_pages(args, kCPU);
}

class KvRepack : public ::testing::TestWithParam<RepackCase> {};

TEST_P(KvRepack, RoundTripIsByteExactAndTouchesOnlyNamedTokens) {
  const RepackCase pc = GetParam();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> len_dist(1, static_cast<int>(4 * pc.src_page + 37));
  std::vector<int32_t> lens{len_dist(rng), 1, len_dist(rng), 0, len_dist(rng)};
  lens[2] = static_cast<int32_t>(3 * pc.dst_page);  // ends exactly on a dst page boundary
  const int32_t max_len = *std::max_element(lens.begin(), lens.end());

  auto pages_for = [&](int64_t ps) {
    int64_t total = 0;
    for (int32_t l : lens) total += (l + ps - 1) / ps;
    return total;
  };
  const int64_t max_src = (max_len + pc.src_page - 1) / pc.src_page + 1;
  const int64_t max_dst = (max_len + pc.dst_page - 1) / pc.dst_page + 2;
  const int64_t src_pool = pages_for(pc.src_page) + 3, dst_pool = pages_for(pc.dst_page) + 4;
  const int64_t src_stride = min_stride(pc.format, pc.src_page, pc.num_heads) + pc.src_pad;
  const int64_t dst_stride = min_stride(pc.format, pc.dst_page, pc.num_heads) + pc.dst_pad;

  // The source is random bytes everywhere (padding included), NaN patterns and all.
  HostCache src(pc.format, src_pool, pc.src_page, src_stride, pc.num_heads);
  for (int64_t k = 0; k < src.size(); ++k) src.bytes()[k] = static_cast<uint8_t>(rng());
  HostCache mid(pc.format, dst_pool, pc.dst_page, dst_stride, pc.num_heads);
  HostCache back(pc.format, src_pool, pc.src_page, src_stride, pc.num_heads);
  std::vector<int32_t> src_table = make_table(lens, pc.src_page, max_src, src_pool, rng);
  std::vector<int32_t> dst_table = make_table(lens, pc.dst_page, max_dst, dst_pool, rng);

  std::vector<uint8_t> want_mid =
      expected_image(src, src_table, max_src, mid, dst_table, max_dst, lens);
  ASSERT_TRUE(run_repack(src, src_table, max_src, mid, dst_table, max_dst, lens).ok());
  EXPECT_EQ(first_difference(mid.image(), want_mid), -1);

  std::vector<uint8_t> want_back =
      expected_image(mid, dst_table, max_dst, back, src_table, max_src, lens);
  ASSERT_TRUE(run_repack(mid, dst_table, max_dst, back, src_table, max_src, lens).ok());
  EXPECT_EQ(first_difference(back.image(), want_back), -1);

  // And the round trip reproduces every token of the source exactly.
  for (size_t i = 0; i < lens.size(); ++i) {
    for (int64_t t = 0; t < lens[i]; ++t) {
      const int64_t page = src_table[i * max_src + t / pc.src_page];
      for (auto [off, len] : token_spans(src.kv, page, t % pc.src_page)) {
        ASSERT_EQ(std::memcmp(back.bytes() + off, src.bytes() + off, len), 0)
            << "request " << i << " token " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, KvRepack,
                         ::testing::Values(RepackCase{KVFormat::kModel1, 1, 256, 64, 0, 0},
                                           RepackCase{KVFormat::kModel1, 1, 64, 256, 32, 576},
                                           RepackCase{KVFormat::kModel1, 1, 53, 61, 16, 0},
                                           RepackCase{KVFormat::kModel1, 1, 2, 69, 0, 48},
                                           RepackCase{KVFormat::kModel1, 1, 1, 7, 0, 0},
                                           RepackCase{KVFormat::kV32, 1, 53, 61, 0, 16},
                                           RepackCase{KVFormat::kV32, 1, 64, 64, 16, 0},
                                           RepackCase{KVFormat::kBF16, 2, 17, 5, 0, 32},
                                           RepackCase{KVFormat::kFP16, 1, 3, 8, 16, 16}),
                         [](const ::testing::TestParamInfo<RepackCase>& info) {
                           const RepackCase& c = info.param;
                           return std::string(kv_format_name(c.format)) + "_" +
                                  std::to_string(c.src_page) + "_to_" + std::to_string(c.dst_page) +
                                  "_pad" + std::to_string(c.src_pad) + "_" +
                                  std::to_string(c.dst_pad);
                         });

TEST(KvRepackRange, SkipsOutOfRangeTableEntriesAndClampsLengths) {
  const int64_t sps = 53, dps = 61;
  HostCache src(KVFormat::kModel1, 6, sps, engine_stride(sps));
  std::mt19937_64 rng(3);
  for (int64_t k = 0; k < src.size(); ++k) src.bytes()[k] = static_cast<uint8_t>(rng());
  HostCache dst(KVFormat::kModel1, 5, dps, engine_stride(dps));
  // Request 0: a dst entry out of range (tokens 61..121 dropped), a src entry -1 (tokens
  // 53..105 dropped). Request 1: length beyond the table capacity (clamped to 2*53 = 106).
  // Request 2: negative length. Request 3: dst entry -7.
  const int64_t max_src = 2, max_dst = 3;
  std::vector<int32_t> src_table{0, -1, 2, 3, 4, 5, 1, 1};
  std::vector<int32_t> dst_table{0, 99, 1, 2, 3, 4, 4, 4, 4, -7, 0, 0};
  std::vector<int32_t> lens{106, 1 << 30, -3, 20};
  std::vector<uint8_t> want =
      expected_image(src, src_table, max_src, dst, dst_table, max_dst, lens);
  ASSERT_TRUE(run_repack(src, src_table, max_src, dst, dst_table, max_dst, lens).ok());
  EXPECT_EQ(first_difference(dst.image(), want), -1);
  // Request 0's first page got its tokens 0..52 only (53..60 came from the skipped src page).
  const uint8_t* page0 = dst.bytes();
  EXPECT_EQ(std::memcmp(page0, src.bytes(), 53 * 576), 0);
  EXPECT_EQ(page0[53 * 576], kSentinel);
  EXPECT_EQ(page0[61 * 576 + 53 * 8], kSentinel);
}

// Block tables far wider than the tokens to copy (zero-stride tables of 2^31-1 entries) cost only
// those tokens. A dst table wider than the src table's capacity used to walk every entry of every
// request, and two wide tables every (request, dst page) pair below the capacity, whatever the
// lengths: 2^47 work items here, which never finished.
TEST(KvRepackRange, WideTablesCostOnlyTheCopiableTokens) {
  HostCache src(KVFormat::kModel1, 1, 1, engine_stride(1));
  std::mt19937_64 rng(5);
  for (int64_t k = 0; k < src.size(); ++k) src.bytes()[k] = static_cast<uint8_t>(rng());
  const int64_t b = 1 << 16, wide = (int64_t{1} << 31) - 1;
  int32_t zero = 0;
  for (const int64_t src_width : {int64_t{1}, wide}) {
    SCOPED_TRACE("src table width " + std::to_string(src_width));
    HostCache dst(KVFormat::kModel1, 1, 1, engine_stride(1));
    std::vector<int32_t> lens(b, 0);
    // Narrow src table: clamped to its one token. Wide: three tokens of the last request, each
    // from src page 0 into dst page 0. The other requests are empty.
    if (src_width == 1) {
      lens[0] = 1 << 30;
    } else {
      lens[b - 1] = 3;
    }
    RepackArgs args{src.kv, dst.kv,
                    TensorView::strided(&zero, DType::kInt32, Device{}, {b, src_width}, {0, 0}),
                    TensorView::strided(&zero, DType::kInt32, Device{}, {b, wide}, {0, 0}),
                    i32_view(lens)};
    ASSERT_TRUE(repack_pages(args, kCPU).ok());
    EXPECT_EQ(std::memcmp(dst.bytes(), src.bytes(), 584), 0);  // token 0 and its page's scales
  }
}

// The branch-free conversions of the CPU KV tools against format.h: every bf16 pattern, each with
// random low bits (ties and sticky bits of the e4m3 rounding), the neighbours of every e4m3 tie,
// random fp32 patterns, and every e4m3 / fp16 code.
TEST(KvConvert, MatchesFormatBitForBit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int64_t mismatches = 0;
  auto check = [&](uint32_t u) {
    const float f = fmt::bits_float(u);
    if (cpu::kv::e4m3_from_float(f) != fmt::float_to_e4m3(f) ||
        cpu::kv::bf16_from_float(f) != fmt::float_to_bf16(f)) {
      if (++mismatches <= 10) ADD_FAILURE() << "fp32 bits 0x" << std::hex << u;
    }
  };
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    check(h << 16);
    check((h << 16) | 0x8000u);  // a bf16 tie
    for (int k = 0; k < 4; ++k) check((h << 16) | static_cast<uint32_t>(rng() & 0xffffu));
  }
  for (uint32_t top = 0; top < 0x1000u; ++top) {  // sign, exponent, 3 mantissa bits
    for (uint32_t low : {0x00000u, 0x7ffffu, 0x80000u, 0x80001u, 0xfffffu}) check((top << 20) | low);
  }
  // Subnormal e4m3 ties: odd multiples of 2^-10, and their fp32 neighbours.
  for (int m = 1; m < 16; m += 2) {
    const uint32_t u = fmt::float_bits(std::ldexp(static_cast<float>(m), -10));
    for (uint32_t s : {0u, 0x80000000u}) {
      check((u - 1) | s);
      check(u | s);
      check((u + 1) | s);
    }
  }
  for (int k = 0; k < (1 << 22); ++k) check(static_cast<uint32_t>(rng()));
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    EXPECT_EQ(fmt::float_bits(cpu::kv::e4m3_to_float(code)),
              fmt::float_bits(fmt::e4m3_to_float(code)))
        << "e4m3 code " << c;
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t code = static_cast<uint16_t>(h);
    if (fmt::float_bits(cpu::kv::fp16_to_float(code)) !=
        fmt::float_bits(fmt::fp16_to_float(code))) {
      if (++mismatches <= 10) ADD_FAILURE() << "fp16 code 0x" << std::hex << h;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// A signaling NaN is ignored by the tile's amax like any NaN (spec recipe; std::fmax returns NaN
// for one, which used to restart the running max): the infinity before it still sets the scale.
TEST(KvQuantizeStore, SignalingNanDoesNotResetTileAmax) {
  HostCache c(KVFormat::kModel1, 1, 4, engine_stride(4));
  std::vector<float> x(512, 0.25f);
  x[3] = std::numeric_limits<float>::infinity();
  x[5] = fmt::bits_float(0x7f800001u);  // signaling NaN
  std::vector<int32_t> slots{2};
  QuantizeStoreArgs args{TensorView::contiguous(x.data(), DType::kFloat32, Device{}, {1, 512}),
                         i32_view(slots), c.kv};
  ASSERT_TRUE(quantize_store(args, kCPU).ok());
  const uint8_t* row = c.bytes() + 2 * 576;
  const uint8_t* scales = c.bytes() + 4 * 576 + 2 * 8;
  EXPECT_EQ(scales[0], 127 + 127);  // amax inf: exponent 127
  EXPECT_EQ(row[3], 0x7E);          // inf / 2^127 saturates
  EXPECT_EQ(row[5], 0x7F);
  EXPECT_EQ(row[0], 0x00);  // 0.25 / 2^127 rounds to zero
  EXPECT_EQ(scales[1], 127 - 10);  // 0.25 / 448 = 2^-10.8 -> 2^-10
}

// Large calls split rows over threads; small ones run on the calling thread. Both give the same
// bytes: one call over many rows against one call per row, for both formats, bf16 and fp32
// sources with padded rows, and dequantize to both output types.
TEST(KvQuantizeStore, OneLargeCallEqualsRowByRowCalls) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (KVFormat format : {KVFormat::kModel1, KVFormat::kV32}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      SCOPED_TRACE(std::string(kv_format_name(format)) +
                   (dtype == DType::kFloat32 ? " fp32" : " bf16"));
      const int d = kv_format_d_qk(format);
      const int64_t page_size = 37, num_pages = 40, n = 1111;
      const int64_t stride = (page_size * (format == KVFormat::kModel1 ? 584 : 656) + 15) / 16 * 16 + 48;
      const int64_t row_stride = d + 8;
      std::vector<float> xf(n * row_stride);
      for (auto& v : xf) v = std::ldexp(nd(rng), static_cast<int>(rng() % 40) - 20);
      std::vector<uint16_t> xb(xf.size());
      for (size_t k = 0; k < xf.size(); ++k) xb[k] = fmt::float_to_bf16(xf[k]);
      void* src = dtype == DType::kFloat32 ? static_cast<void*>(xf.data()) : xb.data();
      const size_t elem = dtype == DType::kFloat32 ? 4 : 2;
      std::vector<int32_t> slots(page_size * num_pages);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(n);
      slots[7] = -1;
      HostCache whole(format, num_pages, page_size, stride);
      HostCache single(format, num_pages, page_size, stride);
      ASSERT_TRUE(quantize_store({TensorView::strided(src, dtype, Device{}, {n, d}, {row_stride, 1}),
                                  i32_view(slots), whole.kv},
                                 kCPU)
                      .ok());
      for (int64_t i = 0; i < n; ++i) {
        std::vector<int32_t> one{slots[i]};
        void* row = static_cast<uint8_t*>(src) + i * row_stride * elem;
        ASSERT_TRUE(quantize_store({TensorView::contiguous(row, dtype, Device{}, {1, d}),
                                    i32_view(one), single.kv},
                                   kCPU)
                        .ok());
      }
      ASSERT_TRUE(whole.image() == single.image());

      for (DType out_dtype : {DType::kFloat32, DType::kBFloat16}) {
        const size_t oe = out_dtype == DType::kFloat32 ? 4 : 2;
        std::vector<uint8_t> all(n * d * oe, kSentinel), each(n * d * oe, kSentinel);
        ASSERT_TRUE(dequantize({whole.kv, i32_view(slots),
                                TensorView::contiguous(all.data(), out_dtype, Device{}, {n, d})},
                               kCPU)
                        .ok());
        for (int64_t i = 0; i < n; ++i) {
          std::vector<int32_t> one{slots[i]};
          ASSERT_TRUE(dequantize({whole.kv, i32_view(one),
                                  TensorView::contiguous(each.data() + i * d * oe, out_dtype,
                                                         Device{}, {1, d})},
                                 kCPU)
                          .ok());
        }
        ASSERT_TRUE(all == each) << (out_dtype == DType::kFloat32 ? "fp32" : "bf16") << " out";
        for (int j = 0; j < d; ++j) ASSERT_EQ(all[7 * d * oe + j * oe], 0) << "slot -1 row";
      }
    }
  }
}

}  // namespace
}  // namespace sparse_mla
