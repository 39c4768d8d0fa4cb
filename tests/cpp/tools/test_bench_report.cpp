// The benchmark's FlashMLA ratio (tools/bench_report.cpp): it compares our time taken the way
// targets.md took FlashMLA's, kernel span or CUDA events, and says which.
#include <gtest/gtest.h>

#include <string>

#include "tools/bench_cases.h"
#include "tools/bench_report.h"

namespace sparse_mla::tools::bench {
namespace {

Case only_case(const std::string& name) {
  const std::vector<Case> cases = select_cases(all_cases(), name, false);
  EXPECT_EQ(cases.size(), 1u) << name;
  return cases.empty() ? Case{} : cases[0];
}

Result gpu_result(double event_us, std::optional<double> span_us) {
  Result res;
  res.backend = "sm90";
  res.status = "ok";
  res.on_gpu = true;
  res.time = summarize({event_us, event_us + 1, event_us - 1});
  if (span_us) res.span_time = summarize({*span_us});
  return res;
}

// targets.md: the s_q = 2 table (and the peak and dense tables, under its general method) is the
// span of FlashMLA's kernels; the s_q = 1 and imbalanced tables are CUDA events around the call.
TEST(BenchReport, FlashMlaTimingFollowsTargetsMd) {
  for (const Case& c : all_cases()) {
    if (!c.flashmla_us) continue;
    SCOPED_TRACE(c.name);
    const bool events = (c.suite == "model1" && c.s_q == 1) || c.suite == "dense_imb";
    EXPECT_EQ(c.flashmla_timed_by_events, events);
  }
}

TEST(BenchReport, SpeedupUsesTheSpanWhereFlashMlaWasTimedByItsKernels) {
  Record r{only_case("sparse/C1/sq2/b2"), {}, 0, "", {}};
  ASSERT_TRUE(r.c.flashmla_us);
  const Metrics m = metrics(r, gpu_result(20.0, 12.5));
  EXPECT_DOUBLE_EQ(m.us, 20.0);  // the table's time stays the event-timed median
  EXPECT_DOUBLE_EQ(m.speedup_vs_flashmla, *r.c.flashmla_us / 12.5);
  EXPECT_STREQ(m.speedup_basis, "kernel span");
}

TEST(BenchReport, SpeedupUsesEventsWhereFlashMlaWasTimedByEvents) {
  Record r{only_case("sparse/C1/sq1/b2"), {}, 0, "", {}};
  ASSERT_TRUE(r.c.flashmla_us);
  const Metrics m = metrics(r, gpu_result(20.0, 12.5));
  EXPECT_DOUBLE_EQ(m.speedup_vs_flashmla, *r.c.flashmla_us / 20.0);
  EXPECT_STREQ(m.speedup_basis, "events");
}

TEST(BenchReport, SpeedupFallsBackToEventsWithoutASpan) {
  Record r{only_case("sparse/C1/sq2/b2"), {}, 0, "", {}};
  const Metrics m = metrics(r, gpu_result(20.0, std::nullopt));
  EXPECT_DOUBLE_EQ(m.speedup_vs_flashmla, *r.c.flashmla_us / 20.0);
  EXPECT_STREQ(m.speedup_basis, "events");
}

TEST(BenchReport, JsonAndCsvCarryTheSpanAndTheBasis) {
  Record r{only_case("sparse/C1/sq2/b2"), {}, 0, "", {gpu_result(20.0, 12.5)}};
  r.results[0].span_kernels = 2;
  RunInfo info;
  const std::string json = to_json(info, {r});
  EXPECT_NE(json.find("\"flashmla_timing\": \"kernel span\""), std::string::npos);
  EXPECT_NE(json.find("\"span_median_us\": 12.5"), std::string::npos);
  EXPECT_NE(json.find("\"span_kernels\": 2"), std::string::npos);
  EXPECT_NE(json.find("\"speedup_basis\": \"kernel span\""), std::string::npos);
  const std::string csv = to_csv(info, {r});
  EXPECT_NE(csv.find(",span_median_us,"), std::string::npos);
  EXPECT_NE(csv.find(",12.5,"), std::string::npos);
  EXPECT_NE(csv.find(",kernel span,"), std::string::npos);
}

}  // namespace
}  // namespace sparse_mla::tools::bench
