// The benchmark's input generator (tools/bench_data.cpp): properties that its suites promise.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>

#include "tools/bench_cases.h"
#include "tools/bench_data.h"

namespace sparse_mla::tools::bench {
namespace {

// Of the first `len` indices of query token 1, how many are among token 0's first `len`.
int64_t shared_prefix(const ref::HostTensor& idx, int64_t i, int64_t len) {
  std::set<int64_t> first;
  for (int64_t j = 0; j < len; ++j) first.insert(static_cast<int64_t>(idx.get({i, 0, j})));
  int64_t n = 0;
  for (int64_t j = 0; j < len; ++j) n += first.count(static_cast<int64_t>(idx.get({i, 1, j})));
  return n;
}

// model1_mtp promises 90% of the second token's indices shared with the first's, in each cache;
// under extra_topk_length (C3, C4) that must hold for the attended prefix, not only for the whole
// list. Prefixes of 100 entries or more: at 90% in expectation, the draw stays above 80%.
TEST(BenchData, MtpTokensShareNinetyPercentOfEveryAttendedPrefix) {
  for (const char* name : {"mtp/C3/sq2/b2", "mtp/C4/sq2/b2"}) {
    SCOPED_TRACE(name);
    const std::vector<Case> cases = select_cases(all_cases(), name, false);
    ASSERT_EQ(cases.size(), 1u);
    const Case& c = cases[0];
    ASSERT_EQ(c.s_q, 2);
    Inputs in;
    ASSERT_TRUE(build_inputs(c, &in, [](double) {}).ok());
    ASSERT_TRUE(in.extra_topk_length.numel() > 0);
    int64_t checked = 0;
    for (int64_t i = 0; i < c.b; ++i) {
      const auto attended = static_cast<int64_t>(in.extra_topk_length.get({i}));
      for (int64_t len : {attended, c.extra_topk}) {
        if (len < 100) continue;
        EXPECT_GE(shared_prefix(in.extra_indices, i, len), len * 8 / 10)
            << "request " << i << ", extra prefix " << len;
        ++checked;
      }
      EXPECT_GE(shared_prefix(in.indices, i, c.topk), c.topk * 8 / 10) << "request " << i;
    }
    EXPECT_GT(checked, 0);
  }
}

// The other suites draw each query token's indices anew: where the cache holds more slots than
// a list takes (C1: 512 extra entries of ~4096, 128 main ones of ~16384), the lists overlap by
// chance only.
TEST(BenchData, Model1TokensDrawTheirIndicesIndependently) {
  const std::vector<Case> cases = select_cases(all_cases(), "sparse/C1/sq2/b2", false);
  ASSERT_EQ(cases.size(), 1u);
  const Case& c = cases[0];
  Inputs in;
  ASSERT_TRUE(build_inputs(c, &in, [](double) {}).ok());
  for (int64_t i = 0; i < c.b; ++i) {
    EXPECT_LT(shared_prefix(in.extra_indices, i, c.extra_topk), c.extra_topk / 4);
    EXPECT_LT(shared_prefix(in.indices, i, c.topk), c.topk / 4);
  }
}

}  // namespace
}  // namespace sparse_mla::tools::bench
