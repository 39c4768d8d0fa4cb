// CPU dense decode through the public API against the fp64 reference (spec sections 4 and 7):
// BF16/FP16/MODEL1/V32 pages, h_kv 1 and > 1, causal on and off, awkward page sizes and batches,
// empty and over-long requests, block-table entries outside the cache, NaN in every slot the
// block tables do not name, strided tensors, the split-KV path and determinism.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/dense_cases.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla {
namespace {

const Options kCPU{Backend::kCPU, nullptr};
constexpr double kInf = std::numeric_limits<double>::infinity();

using test_support::test_seed;

ref::CompareResult run_and_compare(ref::DenseCase& c) {
  c.poison_outputs();
  const Status st = dense_decode(c.args(), Workspace{}, kCPU);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const ref::RefOutput r = ref::dense_decode_reference(c.args());
  return ref::compare_outputs(c.out.view(), c.lse.view(), r,
                              ref::Tolerance::dense(c.config.value_scale_log2));
}

ref::DenseCaseConfig base(KVFormat format, int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv,
                          int64_t page_size, int64_t mean_seqlen, bool causal) {
  ref::DenseCaseConfig c;
  c.format = format;
  c.b = b;
  c.s_q = s_q;
  c.h_q = h_q;
  c.h_kv = h_kv;
  c.page_size = page_size;
  c.mean_seqlen = mean_seqlen;
  c.causal = causal;
  return c;
}

struct DenseParam {
  const char* name;
  ref::DenseCaseConfig config;
};

std::vector<DenseParam> dense_params() {
  const KVFormat BF16 = KVFormat::kBF16, FP16 = KVFormat::kFP16, M1 = KVFormat::kModel1,
                 V32 = KVFormat::kV32;
  std::vector<DenseParam> v;
  v.push_back({"bf16_b1_sq1_h16_hkv1_page64", base(BF16, 1, 1, 16, 1, 64, 200, false)});
  v.push_back({"bf16_b3_sq2_h8_hkv2_page53_causal", base(BF16, 3, 2, 8, 2, 53, 150, true)});
  v.push_back({"fp16_b3_sq3_h12_hkv4_page61_causal", base(FP16, 3, 3, 12, 4, 61, 150, true)});
  v.push_back({"fp16_b3_sq2_h8_hkv1_page69", base(FP16, 3, 2, 8, 1, 69, 150, false)});
  v.push_back({"model1_b3_sq2_h16_page69_causal", base(M1, 3, 2, 16, 1, 69, 150, true)});
  v.push_back({"model1_b3_sq1_h1_page1", base(M1, 3, 1, 1, 1, 1, 60, false)});
  v.push_back({"v32_b3_sq1_h8_page2", base(V32, 3, 1, 8, 1, 2, 100, false)});
  v.push_back({"v32_b3_sq3_h16_page256_causal", base(V32, 3, 3, 16, 1, 256, 200, true)});
  v.push_back({"bf16_b74_sq1_h8_hkv1_page64", base(BF16, 74, 1, 8, 1, 64, 40, false)});
  v.push_back({"model1_b74_sq2_h16_page2_causal", base(M1, 74, 2, 16, 1, 2, 30, true)});
  v.push_back({"bf16_b2_sq4_h128_hkv1_page256_causal", base(BF16, 2, 4, 128, 1, 256, 80, true)});
  v.push_back({"bf16_b2_sq1_h64_hkv64_page2", base(BF16, 2, 1, 64, 64, 2, 20, false)});
  {
    auto c = base(FP16, 3, 2, 16, 2, 53, 120, true);
    c.q_layout = ref::Layout::kTransposed;
    c.out_layout = ref::Layout::kPadded;
    c.page_stride = ref::default_page_stride(FP16, 53, 2) + 32;
    v.push_back({"fp16_hkv2_strided_q_out_padded_pages", c});
    c.format = M1;
    c.page_stride = ref::default_page_stride(M1, 53) + 16;
    v.push_back({"model1_strided_q_out_padded_pages", c});
  }
  {
    // Long single requests take the split-KV path (chunks merged in order).
    auto c = base(M1, 1, 2, 4, 1, 64, 0, true);
    c.seqlens = {5000};
    v.push_back({"model1_b1_split_kv_causal", c});
    c = base(BF16, 2, 1, 6, 1, 61, 0, false);
    c.seqlens = {4500, 0};
    v.push_back({"bf16_b2_split_kv_with_empty_request", c});
    // Values 2^40 times larger or smaller, the scores as usual.
    c.seqlens = {4500, 300};
    using ref::with_values_scaled;
    v.push_back({"bf16_b2_split_kv_values_times_2pow40", with_values_scaled(c, 40)});
    v.push_back({"bf16_b2_split_kv_values_times_2pow_minus40", with_values_scaled(c, -40)});
  }
  return v;
}

void PrintTo(const DenseParam& p, std::ostream* os) { *os << p.name; }

class CpuDenseDecode : public ::testing::TestWithParam<DenseParam> {};

TEST_P(CpuDenseDecode, MatchesReference) {
  ref::DenseCaseConfig cfg = GetParam().config;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::DenseCase c = ref::make_dense_case(cfg);
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuDenseDecode, ::testing::ValuesIn(dense_params()),
                         [](const auto& info) { return std::string(info.param.name); });

// The bench checks windows of query heads against the reference: a window must keep each head on
// the KV head of its place in the whole call. h_q 12, h_kv 3 (groups of 4): heads 3..8 read KV
// heads 0, 1 and 2, where a plain 6-head slice would put them in groups of 2.
TEST(DenseReference, HeadWindowKeepsEachHeadOnItsKVHead) {
  ref::DenseCaseConfig cfg = base(KVFormat::kBF16, 2, 2, 12, 3, 37, 90, true);
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  const ref::DenseCase c = ref::make_dense_case(cfg);
  const ref::RefOutput all = ref::dense_decode_reference(c.args());
  const int64_t first = 3, count = 6;
  DenseDecodeArgs a = c.args();
  a.q.data = static_cast<char*>(a.q.data) + first * a.q.strides[2] * dtype_size(a.q.dtype);
  a.q.shape[2] = count;
  const ref::RefOutput window = ref::dense_decode_reference(a, ref::HeadWindow{first, 12});
  ASSERT_EQ(window.h_q, count);
  for (int64_t i = 0; i < cfg.b; ++i) {
    for (int64_t s = 0; s < cfg.s_q; ++s) {
      for (int64_t h = 0; h < count; ++h) {
        ASSERT_EQ(window.lse_at(i, s, h), all.lse_at(i, s, first + h)) << i << " " << s << " " << h;
        for (int64_t d = 0; d < window.d_v; ++d) {
          ASSERT_EQ(window.out_at(i, s, h, d), all.out_at(i, s, first + h, d)) << i << " " << h;
        }
      }
    }
  }
}

// A window that does not fit the call is an error, not a silently empty reference.
TEST(DenseReference, HeadWindowOutsideTheCallThrows) {
  const ref::DenseCase c = ref::make_dense_case(base(KVFormat::kBF16, 1, 1, 12, 3, 16, 20, false));
  DenseDecodeArgs a = c.args();
  a.q.shape[2] = 6;
  EXPECT_THROW(ref::dense_decode_reference(a, ref::HeadWindow{7, 12}), std::invalid_argument);
  EXPECT_THROW(ref::dense_decode_reference(a, ref::HeadWindow{-1, 12}), std::invalid_argument);
  EXPECT_THROW(ref::dense_decode_reference(a, ref::HeadWindow{0, 10}), std::invalid_argument);
  EXPECT_NO_THROW(ref::dense_decode_reference(a, ref::HeadWindow{6, 12}));
}

// Value scales that a format cannot hold exactly are an error, not a silently different case.
TEST(DenseReference, ValueScaleOutsideTheFormatThrows) {
  const auto scaled = [](KVFormat format, int k) {
    return ref::with_values_scaled(base(format, 1, 1, 8, 1, 16, 20, false), k);
  };
  EXPECT_THROW(ref::make_dense_case(scaled(KVFormat::kModel1, -1)), std::invalid_argument);
  EXPECT_THROW(ref::make_dense_case(scaled(KVFormat::kFP16, 16)), std::invalid_argument);
  EXPECT_THROW(ref::make_dense_case(scaled(KVFormat::kBF16, 61)), std::invalid_argument);
  EXPECT_NO_THROW(ref::make_dense_case(scaled(KVFormat::kFP16, 15)));
  EXPECT_NO_THROW(ref::make_dense_case(scaled(KVFormat::kModel1, 60)));
}

// Requests of length 0, shorter than s_q (causal rows that see nothing), negative, and longer
// than the block table holds (clamped to max_pages * page_size).
TEST(CpuDenseDecodeCorners, EmptyShortAndOverlongRequests) {
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kModel1}) {
    for (bool causal : {false, true}) {
      ref::DenseCaseConfig cfg = base(format, 5, 3, 8, 1, 53, 0, causal);
      cfg.seqlens = {0, 1, 100000, -3, 2};
      cfg.max_pages = 4;
      cfg.seed = test_seed();
      SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
      ref::DenseCase c = ref::make_dense_case(cfg);
      const ref::CompareResult res = run_and_compare(c);
      EXPECT_TRUE(res.ok) << res.summary();
      for (int64_t i : {0, 3}) {
        for (int64_t s = 0; s < 3; ++s) {
          for (int64_t h = 0; h < 8; ++h) {
            EXPECT_EQ(c.lse.get({i, h, s}), kInf);
            EXPECT_EQ(c.out.get({i, s, h, 7}), 0.0);
          }
        }
      }
      // Causal, one token: query token s sees t <= 1 - 3 + s, so only the last one sees it.
      EXPECT_EQ(c.lse.get({1, 0, 0}) == kInf, causal);
      EXPECT_EQ(c.lse.get({1, 0, 1}) == kInf, causal);
      EXPECT_NE(c.lse.get({1, 0, 2}), kInf);
    }
  }
}

// Checks a case of `cfg` changed by `feed`: against the reference, then by `expect`.
void check_fed_case(ref::DenseCaseConfig cfg, void (*feed)(ref::DenseCase&),
                    void (*expect)(const ref::DenseCase&)) {
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::DenseCase c = ref::make_dense_case(cfg);
  feed(c);
  const ref::CompareResult res = run_and_compare(c);
  EXPECT_TRUE(res.ok) << res.summary();
  expect(c);
}

// NaN in tokens past some query tokens' causal horizon reaches only the query tokens that see
// them: the tile they share with visible tokens used to carry them into the others as 0 * NaN.
TEST(CpuDenseDecodeCorners, NanPastTheCausalHorizonStaysHidden) {
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kFP16, KVFormat::kModel1, KVFormat::kV32}) {
    check_fed_case(dense_cases::nan_past_horizon_config(format, 8, 53),
                   dense_cases::feed_nan_past_horizon, dense_cases::expect_nan_only_past_horizon);
  }
}

// A request whose logits are all -inf: lse +inf and out 0 as with no valid token, but NaN where V
// holds the -inf (0 * -inf); every format, its 5000 tokens in three KV chunks whose merge keeps
// that NaN (robustness.md finding 19).
TEST(CpuDenseDecodeCorners, RequestOfMinusInfLogitsReadsAsEmptyButForInfV) {
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kFP16, KVFormat::kModel1, KVFormat::kV32}) {
    ref::DenseCaseConfig cfg = base(format, 2, 2, 8, 1, 64, 0, false);
    cfg.seqlens = {300, 5000};
    check_fed_case(cfg, dense_cases::feed_minus_inf_logits, dense_cases::expect_minus_inf_rows);
  }
}

// Block-table entries outside [0, num_pages) contribute nothing and are never dereferenced.
TEST(CpuDenseDecodeCorners, BlockTableEntriesOutOfRange) {
  for (KVFormat format : {KVFormat::kFP16, KVFormat::kV32}) {
    ref::DenseCaseConfig cfg = base(format, 3, 2, 8, 1, 61, 150, true);
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::DenseCase c = ref::make_dense_case(cfg);
    const int64_t num_pages = c.kv.config().num_pages;
    const double bad[4] = {-1.0, static_cast<double>(num_pages), 2147483647.0, -2147483648.0};
    const int64_t max_pages = c.block_table.shape()[1];
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t p = 0; p < max_pages; p += 2) c.block_table.set({i, p}, bad[(i + p) % 4]);
    }
    ref::Rng rng(cfg.seed + 1);
    c.refresh_cache(rng);
    const ref::CompareResult res = run_and_compare(c);
    EXPECT_TRUE(res.ok) << res.summary();
  }
}

// Same inputs give bitwise the same outputs with 1, 2 or 7 threads (head / row groups split
// differently), split-KV path included.
TEST(CpuDenseDecodeDeterminism, BitwiseAcrossRunsAndThreadCounts) {
  for (int64_t seqlen : {300, 6000}) {
    ref::DenseCaseConfig cfg = base(KVFormat::kModel1, 1, 2, 16, 1, 64, 0, true);
    cfg.seqlens = {static_cast<int32_t>(seqlen)};
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::DenseCase c = ref::make_dense_case(cfg);
    const int saved = omp_get_max_threads();
    std::vector<std::vector<uint8_t>> outs;
    for (int threads : {1, 2, 7, 2}) {
      omp_set_num_threads(threads);
      c.poison_outputs();
      ASSERT_TRUE(dense_decode(c.args(), Workspace{}, kCPU).ok());
      outs.push_back(ref::output_bytes(c.out, c.lse));
    }
    omp_set_num_threads(saved);
    for (size_t k = 1; k < outs.size(); ++k) EXPECT_EQ(outs[k], outs[0]) << "run " << k;
    const ref::CompareResult res = ref::compare_outputs(
        c.out.view(), c.lse.view(), ref::dense_decode_reference(c.args()), ref::Tolerance::dense());
    EXPECT_TRUE(res.ok) << res.summary();
  }
}

}  // namespace
}  // namespace sparse_mla
