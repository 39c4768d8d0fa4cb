// CPU merge of partial attention results through the public API against the fp64 reference:
// 1..5 parts, fp32/bf16 parts and outputs, odd value widths, empty parts (lse +-inf with NaN
// values that must not be read), rows where every part is empty, sinks, NaN lse, and a merge of
// two sparse-decode halves that must equal decoding the whole.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "reference/compare.h"
#include "reference/reference.h"
#include "reference/testdata.h"
#include "sparse_mla/sparse_mla.h"
#include "tests/cpp/test_seed.h"

namespace sparse_mla {
namespace {

const Options kCPU{Backend::kCPU, nullptr};
constexpr double kInf = std::numeric_limits<double>::infinity();

using test_support::test_seed;

ref::CompareResult run_and_compare(ref::MergeCase& c) {
  c.poison_outputs();
  const Status st = merge_attention(c.args(), kCPU);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const ref::RefOutput r = ref::merge_reference(c.args());
  return ref::compare_outputs(c.out.view(), c.lse.view(), r, ref::Tolerance::sparse());
}

struct MergeParam {
  const char* name;
  ref::MergeCaseConfig config;
};

ref::MergeCaseConfig cfg(int64_t n, int64_t b, int64_t s_q, int64_t h_q, int64_t d_v, DType parts,
                         DType out, double empty, bool sink) {
  ref::MergeCaseConfig c;
  c.n = n;
  c.b = b;
  c.s_q = s_q;
  c.h_q = h_q;
  c.d_v = d_v;
  c.parts_dtype = parts;
  c.out_dtype = out;
  c.empty_fraction = empty;
  c.use_sink = sink;
  return c;
}

std::vector<MergeParam> merge_params() {
  const DType F32 = DType::kFloat32, BF16 = DType::kBFloat16;
  return {
      {"n1_f32_to_bf16", cfg(1, 3, 2, 8, 512, F32, BF16, 0.0, false)},
      {"n2_f32_to_bf16_sink", cfg(2, 3, 2, 16, 512, F32, BF16, 0.0, true)},
      {"n3_bf16_to_f32_empty_parts", cfg(3, 3, 1, 8, 512, BF16, F32, 0.3, false)},
      {"n4_f32_to_f32_mostly_empty_sink", cfg(4, 2, 3, 5, 100, F32, F32, 0.7, true)},
      {"n5_bf16_to_bf16_dv7", cfg(5, 74, 1, 3, 7, BF16, BF16, 0.2, true)},
      {"n2_f32_h128_dv576", cfg(2, 1, 2, 128, 576, F32, BF16, 0.1, false)},
  };
}

void PrintTo(const MergeParam& p, std::ostream* os) { *os << p.name; }

class CpuMerge : public ::testing::TestWithParam<MergeParam> {};

TEST_P(CpuMerge, MatchesReference) {
  ref::MergeCaseConfig c = GetParam().config;
  c.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(c.seed));
  ref::MergeCase m = ref::make_merge_case(c);
  const ref::CompareResult res = run_and_compare(m);
  EXPECT_TRUE(res.ok) << res.summary();
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuMerge, ::testing::ValuesIn(merge_params()),
                         [](const auto& info) { return std::string(info.param.name); });

// Rows whose parts are all empty give out 0 and lse +inf (sink or not); a NaN lse propagates;
// sinks of +inf zero the row and -inf leave it alone.
TEST(CpuMergeCorners, AllEmptyNanLseAndInfiniteSinks) {
  ref::MergeCaseConfig c = cfg(3, 2, 1, 4, 64, DType::kFloat32, DType::kFloat32, 0.0, true);
  c.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(c.seed));
  ref::MergeCase m = ref::make_merge_case(c);
  const double nan = std::nan("");
  for (int64_t p = 0; p < 3; ++p) {
    m.lse_parts.set({p, 0, 0, 0}, p == 1 ? -kInf : kInf);  // row (0, 0, 0): all empty
    for (int64_t d = 0; d < 64; ++d) m.out_parts.set({p, 0, 0, 0, d}, nan);
  }
  m.lse_parts.set({1, 1, 0, 3}, nan);  // row (1, 0, 3): NaN lse
  m.attn_sink.set({0}, kInf);
  m.attn_sink.set({1}, kInf);
  m.attn_sink.set({2}, -kInf);
  const ref::CompareResult res = run_and_compare(m);
  EXPECT_TRUE(res.ok) << res.summary();
  EXPECT_EQ(m.lse.get({0, 0, 0}), kInf);
  EXPECT_EQ(m.out.get({0, 0, 0, 5}), 0.0);
  EXPECT_TRUE(std::isnan(m.lse.get({1, 3, 0})));
  EXPECT_TRUE(std::isnan(m.out.get({1, 0, 3, 0})));
  EXPECT_EQ(m.out.get({1, 0, 1, 9}), 0.0);  // +inf sink on a non-empty row
  EXPECT_TRUE(std::isfinite(m.lse.get({1, 1, 0})));
}

// Decoding the main cache and the extra cache separately and merging equals one sparse decode
// over both (the context-parallel use of merge).
TEST(CpuMergeCorners, TwoSparseHalvesEqualTheWhole) {
  ref::SparseCaseConfig sc;
  sc.b = 3;
  sc.s_q = 2;
  sc.h_q = 16;
  sc.topk = 90;
  sc.page_size = 61;
  sc.use_extra = true;
  sc.extra_topk = 50;
  sc.extra_page_size = 2;
  sc.use_sink = true;
  sc.seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(sc.seed));
  ref::SparseCase whole = ref::make_sparse_case(sc);
  whole.indices.set({0, 0, 0}, -1);
  for (int64_t k = 0; k < 50; ++k) whole.extra_indices.set({1, 1, k}, -1);  // an empty half

  // Parts [2, b, s_q, h_q, 512] fp32 out and [2, b, s_q, h_q] lse; each half without the sink.
  ref::HostTensor parts = ref::make_tensor(DType::kFloat32, {2, 3, 2, 16, kDV});
  ref::HostTensor lses = ref::make_tensor(DType::kFloat32, {2, 3, 2, 16});
  for (int half = 0; half < 2; ++half) {
    SparseDecodeArgs a = whole.args();
    a.attn_sink.reset();
    if (half == 1) {
      a.kv = *a.extra_kv;
      a.indices = *a.extra_indices;
    }
    a.extra_kv.reset();
    a.extra_indices.reset();
    a.extra_topk_length.reset();
    ref::HostTensor out = ref::make_out(DType::kBFloat16, 3, 2, 16);
    ref::HostTensor lse = ref::make_lse(3, 16, 2);
    a.out = out.view();
    a.lse = lse.view();
    ASSERT_TRUE(sparse_decode(a, Workspace{}, kCPU).ok());
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        for (int64_t h = 0; h < 16; ++h) {
          lses.set({half, i, s, h}, lse.get({i, h, s}));
          for (int64_t d = 0; d < kDV; ++d) parts.set({half, i, s, h, d}, out.get({i, s, h, d}));
        }
      }
    }
  }
  MergeArgs m;
  m.out_parts = parts.view();
  m.lse_parts = lses.view();
  m.attn_sink = whole.attn_sink.view();
  ref::HostTensor out = ref::make_out(DType::kBFloat16, 3, 2, 16);
  ref::HostTensor lse = ref::make_lse(3, 16, 2);
  m.out = out.view();
  m.lse = lse.view();
  ASSERT_TRUE(merge_attention(m, kCPU).ok());
  // The halves were rounded to bf16 before merging: twice the rounding of one decode.
  ref::Tolerance tol = ref::Tolerance::sparse();
  tol.cos_diff = 2e-5;
  const ref::RefOutput r = ref::sparse_decode_reference(whole.args());
  const ref::CompareResult res = ref::compare_outputs(out.view(), lse.view(), r, tol);
  EXPECT_TRUE(res.ok) << res.summary();
}

}  // namespace
}  // namespace sparse_mla
