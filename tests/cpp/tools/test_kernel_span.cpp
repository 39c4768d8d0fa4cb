// The kernel-span timing's bookkeeping (tools/kernel_span.cpp): a batch's trace records are split
// into runs at the L2-flush memsets, and each run's span is its first kernel's start to its last
// kernel's end. Host only; the traced runs themselves run in `sparse-mla bench` on a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "tools/kernel_span.h"

namespace sparse_mla::tools {
namespace {

TracedActivity memset_at(uint64_t start) { return {true, start, start + 40000}; }
TracedActivity kernel(uint64_t start, uint64_t end) { return {false, start, end}; }

// The split of `log` into `runs` runs when each must hold `kernels` kernels (0: not yet known).
Status split(const std::vector<TracedActivity>& log, int runs, int kernels = 0) {
  std::vector<double> us;
  return append_run_spans(log, runs, &us, &kernels);
}

TEST(KernelSpan, SplitsRunsAtTheFlushesInTimeOrder) {
  // Two runs of an attention kernel and a combine that starts early (programmatic launch) and
  // ends last; records arrive out of order, and one kernel before the first flush is left out.
  std::vector<TracedActivity> log = {
      kernel(150000, 160000), memset_at(100000),    kernel(141000, 155500), kernel(500, 900),
      memset_at(1000),        kernel(42000, 52000), kernel(43000, 57250)};
  std::vector<double> us = {1.0};  // appended to
  int kernels = 0;
  ASSERT_TRUE(append_run_spans(log, 2, &us, &kernels).ok());
  ASSERT_EQ(us.size(), 3u);
  EXPECT_DOUBLE_EQ(us[1], 15.25);  // 42000 -> 57250 ns
  EXPECT_DOUBLE_EQ(us[2], 19.0);   // 141000 -> 160000 ns
  EXPECT_EQ(kernels, 2);
}

TEST(KernelSpan, EveryRunMustRecordTheSameKernels) {
  const Status st = split(
      {memset_at(0), kernel(100, 200), kernel(150, 300), memset_at(1000), kernel(1100, 1200)}, 2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("recorded 1 kernels, expected 2"), std::string::npos) << st.message();
}

TEST(KernelSpan, KernelsKnownFromAnEarlierBatchAreChecked) {
  const Status st = split({memset_at(0), kernel(100, 200)}, 1, 2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("recorded 1 kernels, expected 2"), std::string::npos) << st.message();
}

TEST(KernelSpan, ARunWithoutKernelsIsAnError) {
  const Status st = split({memset_at(0), memset_at(1000), kernel(1100, 1200)}, 2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("recorded 0 kernels"), std::string::npos) << st.message();
}

TEST(KernelSpan, TheFlushesMustMatchTheRuns) {
  const Status st = split({memset_at(0), kernel(100, 200)}, 2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("1 L2 flushes recorded for 2 runs"), std::string::npos)
      << st.message();
}

}  // namespace
}  // namespace sparse_mla::tools
