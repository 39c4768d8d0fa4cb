// The CUDA decode plan (src/cuda/smxx/decode/params.h) read back from a workspace, and the checks
// that it covers the cost line, for the GPU tests of the planner and of decode under its plans.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "src/cuda/smxx/decode/params.h"
#include "tests/cpp/cuda/gpu_util.h"

namespace sparse_mla::plan_test {

using cuda::smxx::decode::PairInfo;
using cuda::smxx::decode::PartStart;

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

inline PlanTables read_plan(const gpu_test::DeviceBuffer& plan, int64_t n) {
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

inline bool before_or_at(const PartStart& s, int64_t pair, int64_t tile) {
  return std::tie(s.pair, s.tile) <= std::tie(pair, tile);
}

// Checks the cover; returns whether the pairs are in an order of the planner's.
inline bool expect_valid_plan(const PlanTables& t) {
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

}  // namespace sparse_mla::plan_test
