// The CUDA decode planner (src/cuda/smxx/decode/plan.cu) through the public plan calls: over many
// sparse and dense shapes, the plan it leaves in the workspace must be a valid cover of the cost
// line (params.h), whichever of its three layouts it picks (cut, snapped to pair ends, pairs in
// an order of its own), and the same for the same inputs.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "src/cuda/smxx/decode/params.h"
#include "tests/cpp/cuda/decode_util.h"
#include "tests/cpp/sparse_cases.h"

namespace sparse_mla {
namespace {

using cuda::smxx::decode::PairInfo;
using cuda::smxx::decode::PartStart;
using decode_test::test_seed;
using gpu_test::Stream;

// The workspace's plan buffer is filled with this before planning: the planner writes every byte
// of its tables, and a workspace may be larger than the plan (dense: the query covers every
// 576-dim page format).
constexpr uint8_t kPoison = 0xab;

// The plan's tables, read back from the workspace: parts[G + 1] at its start, pairs[n] at the end
// of what the planner wrote.
struct PlanTables {
  std::vector<PartStart> parts;
  std::vector<PairInfo> pairs;
};

PlanTables read_plan(const gpu_test::DeviceBuffer& plan, int64_t n) {
  const std::vector<uint8_t> bytes = plan.to_vector<uint8_t>();
  size_t end = bytes.size() / sizeof(PairInfo) * sizeof(PairInfo);
  auto poisoned = [&](size_t at) {
    for (size_t i = at; i < at + sizeof(PairInfo); ++i) {
      if (bytes[i] != kPoison) return false;
    }
    return true;
  };
  while (end >= sizeof(PairInfo) && poisoned(end - sizeof(PairInfo))) end -= sizeof(PairInfo);
  PlanTables t;
  const size_t pairs_bytes = static_cast<size_t>(n) * sizeof(PairInfo);
  EXPECT_GE(end, pairs_bytes + 2 * sizeof(PartStart));
  if (end < pairs_bytes + 2 * sizeof(PartStart)) return t;
  t.parts.resize((end - pairs_bytes) / sizeof(PartStart));
  std::memcpy(t.parts.data(), bytes.data(), t.parts.size() * sizeof(PartStart));
  t.pairs.resize(n);
  std::memcpy(t.pairs.data(), bytes.data() + end - pairs_bytes, pairs_bytes);
  return t;
}

bool before_or_at(const PartStart& s, int64_t pair, int64_t tile) {
  return std::tie(s.pair, s.tile) <= std::tie(pair, tile);
}

// Checks the cover; returns whether the pairs are in an order of the planner's.
bool expect_valid_plan(const PlanTables& t) {
  if (t.parts.empty()) return false;
  const int64_t n = static_cast<int64_t>(t.pairs.size());
  const int64_t G = static_cast<int64_t>(t.parts.size()) - 1;
  std::vector<int> seen(n, 0);
  bool reordered = false;
  for (int64_t k = 0; k < n; ++k) {
    const PairInfo& p = t.pairs[k];
    EXPECT_TRUE(p.id >= 0 && p.id < n) << "place " << k << " names pair " << p.id;
    if (p.id < 0 || p.id >= n) return false;
    ++seen[p.id];
    reordered |= p.id != k;
    if (k > 0) EXPECT_GT(p.cost_begin, t.pairs[k - 1].cost_begin) << "place " << k;
  }
  for (int64_t id = 0; id < n; ++id) EXPECT_EQ(seen[id], 1) << "pair " << id;

  EXPECT_EQ(t.parts[0].pair, 0);
  EXPECT_EQ(t.parts[0].tile, 0);
  EXPECT_EQ(t.parts[G].pair, n);
  for (int64_t g = 0; g < G; ++g) {
    const PartStart& s = t.parts[g];
    EXPECT_TRUE(before_or_at(s, t.parts[g + 1].pair, t.parts[g + 1].tile)) << "part " << g;
    if (s.pair >= n) continue;
    const PairInfo& p = t.pairs[s.pair];
    EXPECT_TRUE(s.n_main == p.n_main && s.len == p.len && s.id == p.id) << "part " << g;
  }

  // The parts that touch pair k: the last one starting at or before its first tile, then one per
  // start inside it; the split pairs' partial slots follow one another in place order.
  int64_t next_slot = 0;
  for (int64_t k = 0; k < n; ++k) {
    int64_t first = 0, inside = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (before_or_at(t.parts[g], k, 0)) first = g;
      if (t.parts[g].pair == k && t.parts[g].tile > 0) ++inside;
    }
    const PairInfo& p = t.pairs[k];
    EXPECT_EQ(p.first_part, first) << "place " << k;
    EXPECT_EQ(p.nsplit, 1 + inside) << "place " << k;
    if (reordered) EXPECT_EQ(p.nsplit, 1) << "place " << k << ": a reordered plan splits no pair";
    if (p.nsplit > 1) {
      EXPECT_EQ(p.slot, next_slot) << "place " << k;
      next_slot += p.nsplit;
    }
  }
  return reordered;
}

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
