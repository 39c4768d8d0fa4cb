// The CUDA decode planner (src/cuda/smxx/decode/plan.cu) through the public plan calls: over many
// sparse and dense shapes, the plan it leaves in the workspace must be a valid cover of the cost
// line (params.h), whichever of its three layouts it picks (cut, snapped to pair ends, pairs in
// an order of its own), and the same for the same inputs.
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/cpp/cuda/decode_util.h"
#include "tests/cpp/cuda/plan_util.h"
#include "tests/cpp/sparse_cases.h"

namespace sparse_mla {
namespace {

using decode_test::test_seed;
using gpu_test::Stream;
using plan_test::expect_valid_plan;
using plan_test::kPoison;
using plan_test::read_plan;

// Plans twice into fresh workspaces; both plans must be valid and equal byte for byte.
template <typename Args, typename SizeFn, typename PlanFn>
bool plan_and_check(const Args& args, int64_t n, SizeFn size_fn, PlanFn plan_fn) {
  Stream stream;
  const Options o = stream.options();
  WorkspaceSizes sizes;
  const Status st = size_fn(args, o, &sizes);
  EXPECT_TRUE(st.ok()) << st.to_string();
  if (!st.ok()) return false;
  std::vector<std::vector<uint8_t>> plans;
  bool reordered = false;
  for (int run = 0; run < 2; ++run) {
    decode_test::DeviceWorkspace ws(sizes);
    ws.plan.fill(kPoison);
    const Status ps = plan_fn(args, ws.ws, o);
    EXPECT_TRUE(ps.ok()) << ps.to_string();
    EXPECT_TRUE(stream.sync());
    if (!ps.ok()) return false;
    reordered = expect_valid_plan(read_plan(ws.plan, n));
    plans.push_back(ws.plan.to_vector<uint8_t>());
  }
  EXPECT_TRUE(plans[0] == plans[1]) << "two plans of the same inputs differ";
  return reordered;
}

std::string shape_name(int64_t b, int64_t s_q, int64_t h_q) {
  return "b " + std::to_string(b) + " s_q " + std::to_string(s_q) + " h_q " + std::to_string(h_q);
}

// Token lists of varied lengths, from fewer than the parts to several a part: each of the
// planner's layouts must come out valid. On the H200 some of these shapes take the planner's own
// order on each backend; the test fails if none does.
TEST(CudaPlan, SparseCoversOverShapes) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(seed));
  int reordered = 0;
  for (auto [b, s_q, h_q, topk_lengths] : {std::tuple{3, 2, 64, true},
                                           {40, 1, 24, false},
                                           {130, 2, 64, true},
                                           {200, 2, 24, false},
                                           {300, 1, 64, true},
                                           {517, 2, 16, true},
                                           {1100, 1, 24, false}}) {
    ref::SparseCaseConfig cfg = sparse_cases::with_extra(
        sparse_cases::base(KVFormat::kModel1, b, s_q, h_q, 64, 64), 320, 2);
    cfg.use_topk_length = topk_lengths;
    cfg.use_extra_topk_length = true;
    cfg.seed = seed + static_cast<uint64_t>(b);
    SCOPED_TRACE(shape_name(b, s_q, h_q));
    const ref::SparseCase c = ref::make_sparse_case(cfg);
    const decode_test::DeviceSparse d(c);
    reordered += plan_and_check(d.args, b * s_q, sparse_decode_workspace_size, sparse_decode_plan);
  }
  EXPECT_GE(reordered, 1) << "no shape took the planner's own order";
}

TEST(CudaPlan, DenseCoversOverShapes) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = test_seed();
  SCOPED_TRACE("SPARSE_MLA_TEST_SEED=" + std::to_string(seed));
  int reordered = 0;
  for (auto [b, s_q, h_q, mean] :
       {std::tuple{4, 1, 16, 3000}, {90, 2, 16, 300}, {300, 1, 16, 256}, {700, 1, 8, 100}}) {
    ref::DenseCaseConfig cfg;
    cfg.b = b;
    cfg.s_q = s_q;
    cfg.h_q = h_q;
    cfg.mean_seqlen = mean;
    cfg.seed = seed + static_cast<uint64_t>(b);
    SCOPED_TRACE(shape_name(b, s_q, h_q));
    const ref::DenseCase c = ref::make_dense_case(cfg);
    const decode_test::DeviceDense d(c);
    reordered += plan_and_check(d.args, b, dense_decode_workspace_size, dense_decode_plan);
  }
  std::cout << "dense shapes in the planner's own order: " << reordered << " of 4\n";
}

}  // namespace
}  // namespace sparse_mla
