// The decode's kernel pick (pick_decode_kernel, src/cuda/smxx/decode/launch.h) on devices with
// made-up limits: whatever shared memory a device grants, the pick fits it, falls back from the
// Hopper kernel to a portable configuration where the Hopper kernel does not fit, and says so
// when nothing fits. Host code only: these tests need no GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "src/cuda/sm90/sm90.h"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

constexpr Fmt kFmts[] = {Fmt::kModel1, Fmt::kV32, Fmt::kBF16, Fmt::kFP16};

DeviceLimits hopper_limits(int max_smem_optin) {
  DeviceLimits d;
  d.sm_count = 132;
  d.max_smem_optin = max_smem_optin;
  d.cc_major = 9;
  return d;
}

// The Hopper kernel for `rows` query rows a token list: the narrow 16-row form on FP8 pages at 16
// rows or fewer, else the 64-row kernel.
KernelEntry hopper_entry(Fmt fmt, int64_t rows) {
  const bool narrow = rows <= 16 && (fmt == Fmt::kModel1 || fmt == Fmt::kV32);
  return narrow ? sm90::narrow_kernel_entry(fmt, false) : sm90::kernel_entry(fmt, false);
}

// A batch large enough that no small-batch rule applies: 128 token lists of 2048 tokens.
KernelPick pick_big_batch(Fmt fmt, int64_t rows, bool sm90, const DeviceLimits& dev) {
  KernelPick pick;
  const Status st = pick_decode_kernel(fmt, rows, 1, 128, 2048, sm90, 0, dev, &pick);
  EXPECT_TRUE(st.ok()) << fmt_name(fmt) << " rows " << rows << ": " << st.to_string();
  return pick;
}

class DecodeKernelPick : public ::testing::Test {
 protected:
  void SetUp() override {
    // The test hook forces one portable configuration whatever the device.
    if (std::getenv("SPARSE_MLA_DECODE_TILES") != nullptr) {
      GTEST_SKIP() << "SPARSE_MLA_DECODE_TILES forces the pick";
    }
  }
};

// With the shared memory of an H100/H200 the Hopper kernel is picked (64-row CTAs above 16 rows
// a token list and on 16-bit pages, the narrow 16-row form on FP8 pages at 16 rows or fewer).
TEST_F(DecodeKernelPick, HopperKernelWhereItFits) {
  for (Fmt fmt : kFmts) {
    for (int64_t rows : {64, 128, 16}) {
      const KernelEntry hopper = hopper_entry(fmt, rows);
      ASSERT_NE(hopper.fn, nullptr);
      const KernelPick pick = pick_big_batch(fmt, rows, true, hopper_limits(232448));
      EXPECT_TRUE(pick.sm90) << fmt_name(fmt) << " rows " << rows;
      EXPECT_EQ(pick.kernel.fn, hopper.fn) << fmt_name(fmt) << " rows " << rows;
    }
  }
}

// One byte less shared memory than the Hopper kernel needs: the pick falls back to the portable
// configuration it would take without the Hopper kernel, which fits.
TEST_F(DecodeKernelPick, HopperKernelThatDoesNotFitFallsBack) {
  for (Fmt fmt : kFmts) {
    for (int64_t rows : {64, 128, 16}) {
      const KernelEntry hopper = hopper_entry(fmt, rows);
      const DeviceLimits dev = hopper_limits(hopper.smem_bytes - 1);
      const KernelPick pick = pick_big_batch(fmt, rows, true, dev);
      const KernelPick portable = pick_big_batch(fmt, rows, false, dev);
      EXPECT_FALSE(pick.sm90) << fmt_name(fmt) << " rows " << rows;
      EXPECT_NE(pick.kernel.fn, hopper.fn) << fmt_name(fmt) << " rows " << rows;
      EXPECT_EQ(pick.kernel.fn, portable.kernel.fn) << fmt_name(fmt) << " rows " << rows;
      EXPECT_EQ(pick.cfg, portable.cfg) << fmt_name(fmt) << " rows " << rows;
      EXPECT_EQ(pick.kernel.fn, kernel_entry(fmt, pick.cfg).fn);
      EXPECT_LE(pick.kernel.smem_bytes, dev.max_smem_optin) << fmt_name(fmt) << " rows " << rows;
    }
  }
}

// Over the shared memory of real GPUs and a range of made-up ones, the picked kernel always fits;
// the portable pick is the first of its order that fits (64 query rows a token list: 64, 32 and
// 16 rows a CTA with 32-token tiles, then 16-token tiles).
TEST_F(DecodeKernelPick, PickFitsTheDevice) {
  const int limits[] = {232448, 166912, 101376, 65536, 49152};  // H100, A100, sm_86/89/120, ...
  const TileCfg order[] = {TileCfg::kH64T32, TileCfg::kH32T32, TileCfg::kH16T32,
                           TileCfg::kH16T16};
  for (Fmt fmt : kFmts) {
    for (int limit : limits) {
      for (bool sm90 : {true, false}) {
        const DeviceLimits dev = hopper_limits(limit);
        KernelPick pick;
        const Status st = pick_decode_kernel(fmt, 64, 1, 128, 2048, sm90, 0, dev, &pick);
        const std::string where = std::string(fmt_name(fmt)) + " limit " + std::to_string(limit) +
                                  (sm90 ? " sm90" : " portable");
        int first_fit = -1;
        for (int c = 0; c < 4 && first_fit < 0; ++c) {
          if (kernel_entry(fmt, order[c]).smem_bytes <= limit) first_fit = c;
        }
        if (first_fit < 0 && !(sm90 && sm90::kernel_entry(fmt, false).smem_bytes <= limit)) {
          EXPECT_EQ(st.code(), StatusCode::kUnsupported) << where;
          continue;
        }
        ASSERT_TRUE(st.ok()) << where << ": " << st.to_string();
        EXPECT_LE(pick.kernel.smem_bytes, limit) << where;
        if (!pick.sm90) EXPECT_EQ(pick.cfg, order[first_fit]) << where;
      }
    }
  }
}

// A causal dense call with s_q > 1 whose Hopper CTAs hold rows of several query tokens (causal_hpk
// rows a token, not a multiple of a CTA's rows) gets the kernel's form that cleans the causal
// tail; every other call the form without that code (its own kernel, same shape and resources).
TEST_F(DecodeKernelPick, CausalTailFormOnlyWhereAsked) {
  for (Fmt fmt : kFmts) {
    for (int64_t rows : {64, 16}) {
      for (int64_t causal_hpk : {0, 4, 16, 64, 100, 128}) {
        KernelPick pick;
        ASSERT_TRUE(pick_decode_kernel(fmt, rows, 1, 128, 2048, true, causal_hpk,
                                       hopper_limits(232448), &pick)
                        .ok());
        const KernelEntry plain = hopper_entry(fmt, rows);
        const bool tail = causal_hpk > 0 && causal_hpk % plain.rows_per_cta != 0;
        EXPECT_EQ(pick.kernel.fn == plain.fn, !tail)
            << fmt_name(fmt) << " rows " << rows << " causal_hpk " << causal_hpk;
        EXPECT_EQ(pick.kernel.smem_bytes, plain.smem_bytes);
        EXPECT_EQ(pick.kernel.rows_per_cta, plain.rows_per_cta);
      }
    }
  }
}

// A device whose shared memory fits no configuration gets an Unsupported error that names the
// format and the bytes the device grants.
TEST_F(DecodeKernelPick, NothingFitsIsAnError) {
  for (Fmt fmt : kFmts) {
    KernelPick pick;
    const Status st =
        pick_decode_kernel(fmt, 64, 1, 128, 2048, true, 0, hopper_limits(4096), &pick);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << std::string(fmt_name(fmt));
    EXPECT_NE(st.message().find(std::string(fmt_name(fmt))), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("4096 bytes"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace sparse_mla::cuda::smxx::decode
