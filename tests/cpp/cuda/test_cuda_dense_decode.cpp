// CUDA dense decode (portable sm_80+ kernels) through the public API against the fp64 reference
// and the CPU backend (spec sections 4 and 7): bf16 / fp16 / MODEL1 / V32 pages, h_q / h_kv
// grouping, causal multi-token queries, page sizes 1..256, empty and clamped requests, block-table
// entries outside the cache, strided tensors, long requests split over CTAs, every tile
// configuration, determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tests/cpp/cuda/decode_util.h"

namespace sparse_mla {
namespace {

using decode_test::DeviceDense;
using decode_test::ScopedTiles;
using decode_test::test_seed;
using gpu_test::Stream;

constexpr double kInf = std::numeric_limits<double>::infinity();

ref::DenseCaseConfig base(KVFormat format, int64_t b, int64_t s_q, int64_t h_q, int64_t h_kv,
                          int64_t page_size, std::vector<int32_t> seqlens = {}) {
  ref::DenseCaseConfig c;
  c.format = format;
  c.b = b;
  c.s_q = s_q;
  c.h_q = h_q;
  c.h_kv = h_kv;
  c.page_size = page_size;
  c.seqlens = std::move(seqlens);
  return c;
}

void check_case(ref::DenseCase& c) {
  Stream stream;
  DeviceDense d(c);
  ASSERT_TRUE(decode_test::run_dense(d.args, stream));
  c.poison_outputs();
  d.download(c);
  const ref::RefOutput r = ref::dense_decode_reference(c.args());
  const ref::CompareResult res =
      ref::compare_outputs(c.out.view(), c.lse.view(), r, ref::Tolerance::dense());
  EXPECT_TRUE(res.ok) << "vs reference: " << res.summary();

  ref::DenseCase cpu = c;
  cpu.poison_outputs();
  const Status st = dense_decode(cpu.args(), Workspace{}, Options{Backend::kCPU, nullptr});
  ASSERT_TRUE(st.ok()) << st.to_string();
  ref::Tolerance tol = ref::Tolerance::dense();
  tol.lse_abs *= 2;
  tol.lse_rel *= 2;
  const ref::CompareResult res_cpu = ref::compare_outputs(
      c.out.view(), c.lse.view(), decode_test::as_ref(cpu.out, cpu.lse), tol);
  EXPECT_TRUE(res_cpu.ok) << "vs CPU backend: " << res_cpu.summary();
}

struct DenseParam {
  const char* name;
  ref::DenseCaseConfig config;
  const char* tiles = nullptr;
};

std::vector<DenseParam> dense_params() {
  const KVFormat BF = KVFormat::kBF16, FP = KVFormat::kFP16, M1 = KVFormat::kModel1,
                 V32 = KVFormat::kV32;
  std::vector<DenseParam> v;
  v.push_back({"bf16_b1_sq1_h16_page64", base(BF, 1, 1, 16, 1, 64)});
  v.push_back({"bf16_b2_sq1_h1_page1", base(BF, 2, 1, 1, 1, 1, {37, 5})});
  {
    auto c = base(BF, 3, 2, 16, 2, 53);
    c.causal = true;
    v.push_back({"bf16_b3_sq2_h16_hkv2_page53_causal", c});
  }
  {
    auto c = base(FP, 3, 3, 8, 4, 61);
    c.causal = true;
    v.push_back({"fp16_b3_sq3_h8_hkv4_page61_causal", c});
  }
  v.push_back({"fp16_b2_sq1_h24_hkv3_page2", base(FP, 2, 1, 24, 3, 2, {300, 41})});
  {
    auto c = base(M1, 3, 2, 64, 1, 256);
    c.causal = true;
    v.push_back({"model1_b3_sq2_h64_page256_causal", c});
    v.push_back({"model1_b3_sq2_h64_page256_causal_tiles16x16", c, "16x16"});
  }
  v.push_back({"v32_b2_sq1_h32_page69", base(V32, 2, 1, 32, 1, 69)});
  v.push_back({"v32_b3_sq2_h16_page2", base(V32, 3, 2, 16, 1, 2, {1, 2, 300})});
  {
    // An imbalanced batch (one long request split over many CTAs, short ones packed).
    auto c = base(BF, 4, 4, 16, 1, 64, {580, 5640, 216, 212});
    c.causal = true;
    v.push_back({"bf16_b4_sq4_h16_imbalanced_causal", c});
    c.s_q = 1;
    c.h_q = 128;
    v.push_back({"bf16_b4_sq1_h128_imbalanced", c});
    v.push_back({"bf16_b4_sq1_h128_imbalanced_tiles32x32", c, "32x32"});
    v.push_back({"bf16_b4_sq1_h128_imbalanced_tiles16x16", c, "16x16"});
  }
  {
    auto c = base(BF, 2, 4, 128, 1, 64, {700, 90});
    c.causal = true;
    v.push_back({"bf16_b2_sq4_h128_causal_8_row_blocks", c});
  }
  {
    // Empty requests, a request of s_q - 1 tokens (its first query rows see nothing under the
    // causal mask) and one clamped to max_pages * page_size.
    auto c = base(BF, 4, 3, 8, 1, 16, {0, 2, 100, 0});
    c.max_pages = 5;
    c.causal = true;
    v.push_back({"bf16_b4_sq3_h8_empty_short_clamped_causal", c});
  }
  {
    auto c = base(FP, 3, 2, 16, 2, 61);
    c.q_layout = ref::Layout::kTransposed;
    c.out_layout = ref::Layout::kPadded;
    c.page_stride = ref::default_page_stride(FP, 61, 2) + 96;
    v.push_back({"fp16_b3_sq2_h16_hkv2_strided_q_out_padded_pages", c});
    c.format = M1;
    c.h_kv = 1;
    c.page_stride = ref::default_page_stride(M1, 61) + 32;
    v.push_back({"model1_b3_sq2_h16_strided_q_out_padded_pages", c});
  }
  {
    auto c = base(M1, 2, 1, 64, 1, 64);
    c.softmax_scale = 1.0f / std::sqrt(512.0f);
    v.push_back({"model1_b2_sq1_h64_default_scale", c});
  }
  return v;
}

class CudaDenseDecode : public ::testing::TestWithParam<DenseParam> {};

TEST_P(CudaDenseDecode, MatchesReferenceAndCpu) {
  SKIP_WITHOUT_GPU();
  ref::DenseCaseConfig cfg = GetParam().config;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ScopedTiles tiles(GetParam().tiles);
  ref::DenseCase c = ref::make_dense_case(cfg);
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaDenseDecode, ::testing::ValuesIn(dense_params()),
                         [](const auto& info) { return std::string(info.param.name); });

// Block-table entries outside [0, num_pages) make their tokens absent and are never read;
// requests with no token left give out 0 and lse +inf.
TEST(CudaDenseDecodeCorners, OutOfRangeBlockTableEntries) {
  SKIP_WITHOUT_GPU();
  for (KVFormat format : {KVFormat::kBF16, KVFormat::kModel1}) {
    ref::DenseCaseConfig cfg = base(format, 3, 2, 16, 1, 32, {200, 64, 90});
    cfg.seed = test_seed();
    SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
    ref::DenseCase c = ref::make_dense_case(cfg);
    const int64_t num_pages = c.kv.config().num_pages;
    c.block_table.set({0, 1}, -1);
    c.block_table.set({0, 3}, static_cast<double>(num_pages));
    c.block_table.set({0, 4}, 2147483647.0);
    c.block_table.set({1, 0}, -2147483648.0);
    c.block_table.set({1, 1}, static_cast<double>(num_pages + 7));
    ref::Rng rng(cfg.seed + 1);
    c.refresh_cache(rng);
    check_case(c);
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t h = 0; h < 16; ++h) {
        EXPECT_EQ(c.lse.get({1, h, s}), kInf);
        EXPECT_EQ(c.out.get({1, s, h, 7}), 0.0);
      }
    }
  }
}

TEST(CudaDenseDecodeDeterminism, BitwiseAcrossRuns) {
  SKIP_WITHOUT_GPU();
  ref::DenseCaseConfig cfg = base(KVFormat::kBF16, 3, 2, 64, 1, 64, {3000, 17, 900});
  cfg.causal = true;
  cfg.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(cfg.seed));
  ref::DenseCase c = ref::make_dense_case(cfg);
  Stream stream;
  DeviceDense d(c);
  std::vector<std::vector<uint8_t>> outs;
  for (int run = 0; run < 3; ++run) {
    d.poison_outputs();
    ASSERT_TRUE(decode_test::run_dense(d.args, stream));
    d.download(c);
    std::vector<uint8_t> bytes = decode_test::host_bytes(c.out);
    const std::vector<uint8_t> lse = decode_test::host_bytes(c.lse);
    bytes.insert(bytes.end(), lse.begin(), lse.end());
    outs.push_back(std::move(bytes));
  }
  EXPECT_TRUE(outs[0] == outs[1]);
  EXPECT_TRUE(outs[0] == outs[2]);
}

}  // namespace
}  // namespace sparse_mla
