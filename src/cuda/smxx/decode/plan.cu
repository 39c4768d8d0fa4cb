// The planner: one CTA reads the length tensors on the device (no host sync, capturable in a CUDA
// graph) and writes the plan of params.h: per place on the cost line the pair there, its clamped
// lengths and cost position, per part its first tile, per split pair its partial slots.
#include <cuda_runtime.h>

#include <cstdint>

#include "src/cuda/common/block_scan.cuh"
#include "src/cuda/common/check.h"
#include "src/cuda/smxx/decode/launch.h"
#include "src/cuda/smxx/decode/params.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

constexpr int kPlanThreads = 1024;
// Parts the planner may snap to pair ends (its shared arrays); more parts keep the cut starts.
constexpr int kMaxSnapParts = 1024;
// Pairs the planner may reorder (sort keys in shared memory: cost above, pair index below).
constexpr int kOrderIdBits = 11;
constexpr int kMaxOrderPairs = 1 << kOrderIdBits;
static_assert(kMaxSnapParts <= kPlanThreads && kMaxOrderPairs % kPlanThreads == 0);

// Largest v over the CTA. Every thread must call.
__device__ int64_t block_max(int64_t v) {
  __shared__ int64_t warp_max[kPlanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  int64_t m = warp_max[0];
  for (int w = 1; w < kPlanThreads / 32; ++w) m = max(m, warp_max[w]);
  __syncthreads();  // warp_max is reused by the next call
  return m;
}

// Whole pairs into G parts, balanced in another order: pairs sorted by cost (largest first, then
// by index) go to the parts in rounds, forward and backward in turn (part 0 to G-1, then G-1 to
// 0, ...), and each part's pairs are laid out together. Used when no part then costs more than
// `limit`: writes pairs[] in the new order, parts[], and starts[0..G] (cost positions of the part
// starts); returns false and writes nothing otherwise. Every thread must call; N <= kMaxOrderPairs,
// G <= kMaxSnapParts; the pairs' costs were written to pairs[] by this CTA.
__device__ bool order_pairs_by_cost(const PlanParams& p, int G, int64_t limit, int64_t* starts) {
  __shared__ uint32_t key[kMaxOrderPairs];
  const int tid = threadIdx.x, N = p.num_pairs;
  const int64_t ovh = p.overhead_tiles;
  constexpr int64_t kMaxKeyCost = int64_t{1} << (32 - kOrderIdBits);
  int n2 = 1;
  while (n2 < N) n2 <<= 1;
  int64_t worst = 0;
  for (int k = tid; k < n2; k += kPlanThreads) {
    uint32_t v = 0;  // padding sorts last: every pair costs at least 1
    if (k < N) {
      const int64_t c = ovh + pair_tiles(p.pairs[k].len, p.tile_tokens);
      worst = max(worst, c);
      if (c < kMaxKeyCost) {
        v = static_cast<uint32_t>(c) << kOrderIdBits |
            static_cast<uint32_t>(kMaxOrderPairs - 1 - k);
      }
    }
    key[k] = v;
  }
  // A pair longer than the limit fits no part whole: no need to sort.
  const int64_t longest_pair = block_max(worst);
  if (longest_pair >= kMaxKeyCost || longest_pair > limit) return false;
  // Bitonic sort, descending.
  for (int k = 2; k <= n2; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int a = tid; a < n2; a += kPlanThreads) {
        const int b = a ^ j;
        if (b <= a) continue;
        const uint32_t x = key[a], y = key[b];
        if ((a & k) == 0 ? x < y : x > y) {
          key[a] = y;
          key[b] = x;
        }
      }
      __syncthreads();
    }
  }
  auto cost_at = [&](int r) { return static_cast<int64_t>(key[r] >> kOrderIdBits); };
  auto pair_at = [&](int r) {
    return kMaxOrderPairs - 1 - static_cast<int>(key[r] & (kMaxOrderPairs - 1));
  };
  // Round rd visits the parts forward when even, backward when odd; the last round is partial.
  const int R = N / G, rem = N % G;
  auto rank_of = [&](int g, int rd) { return rd * G + ((rd & 1) ? G - 1 - g : g); };
  auto part_of_rank = [&](int r) {  // inverse of rank_of, for the part
    const int rd = r / G, k = r - rd * G;
    return (rd & 1) ? G - 1 - k : k;
  };
  auto count_of = [&](int g) { return R + ((R & 1) ? g >= G - rem : g < rem); };
  auto first_place = [&](int g) { return g * R + ((R & 1) ? max(0, g - (G - rem)) : min(g, rem)); };
  int64_t load = 0;
  if (tid < G) {
    for (int rd = 0; rd < count_of(tid); ++rd) load += cost_at(rank_of(tid, rd));
  }
  if (block_max(load) > limit) return false;
  int64_t total;
  const int64_t before = block_exclusive_scan<kPlanThreads>(load, &total);
  if (tid < G) starts[tid] = before;
  if (tid == 0) starts[G] = total;
  __syncthreads();
  constexpr int kPer = kMaxOrderPairs / kPlanThreads;
  PairInfo moved[kPer];
  int place[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int r = tid + u * kPlanThreads;
    place[u] = -1;
    if (r >= N) continue;
    const int rd = r / G, g = part_of_rank(r);
    moved[u] = p.pairs[pair_at(r)];
    moved[u].cost_begin = starts[g];
    for (int e = 0; e < rd; ++e) moved[u].cost_begin += cost_at(rank_of(g, e));
    place[u] = first_place(g) + rd;
  }
  __syncthreads();  // every entry is read before any is overwritten
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    if (place[u] >= 0) p.pairs[place[u]] = moved[u];
  }
  __syncthreads();
  for (int g = tid; g <= G; g += kPlanThreads) {
    const int at = g < G ? first_place(g) : N;
    const PairInfo& m = p.pairs[at < N ? at : 0];
    p.parts[g] =
        at < N ? PartStart{at, 0, m.n_main, m.len, m.id, {}} : PartStart{N, 0, 0, 0, N, {}};
  }
  return true;
}

__device__ __forceinline__ int clamp_len(int64_t v, int64_t hi) {
  return static_cast<int>(v < 0 ? 0 : (v > hi ? hi : v));
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const __grid_constant__ PlanParams p) {
  const int tid = threadIdx.x;
  const int T = p.tile_tokens;
  const int64_t ovh = p.overhead_tiles;

  // 1. Lengths and the cost line.
  int64_t carry = 0;
  for (int base = 0; base < p.num_pairs; base += kPlanThreads) {
    const int pr = base + tid;
    PairInfo info{};
    int64_t cost = 0;
    if (pr < p.num_pairs) {
      if (p.dense) {
        info.len = clamp_len(p.seqlens[pr * p.seqlens_stride], p.max_tokens);
      } else {
        const int i = pr / p.s_q;
        info.n_main = p.topk_length == nullptr
                          ? p.topk
                          : clamp_len(p.topk_length[i * p.topk_length_stride], p.topk);
        int n_extra = p.extra_topk;
        if (p.extra_topk_length != nullptr) {
          n_extra = clamp_len(p.extra_topk_length[i * p.extra_topk_length_stride], p.extra_topk);
        }
        info.len = info.n_main + n_extra;
      }
      cost = ovh + pair_tiles(info.len, T);
    }
    int64_t total;
    const int64_t before = block_exclusive_scan<kPlanThreads>(cost, &total);
    if (pr < p.num_pairs) {
      info.cost_begin = carry + before;
      info.id = pr;
      p.pairs[pr] = info;
    }
    carry += total;
  }
  const int64_t C = carry;
  const int64_t G = p.num_parts;
  int64_t q = (C + G - 1) / G;
  if (q < p.min_tiles_per_part) q = p.min_tiles_per_part;
  // Where one-tile parts would keep at least half of the CTAs busy, their partial rows, written
  // by all of them at once, cost more than a longer part; with fewer busy CTAs the partials are
  // few and a part's own chain dominates (variant 103).
  if (q < p.busy_min_tiles && 2 * C >= G) q = p.busy_min_tiles;
  if (q < 1) q = 1;
  __syncthreads();  // pairs[] written above is read by other threads below

  // 2. Part starts. Cut: the first tile at cost >= g * q, which splits the pair it falls in.
  // Snapped: that pair's start or end instead, whichever is nearer, so that no pair splits. The
  // snapped starts are taken when their longest part is at most snap_slack_tiles longer than the
  // cut's (the combine that the splits need costs about that much), and G fits the arrays. Else
  // whole pairs in another order (order_pairs_by_cost), under the same rule.
  __shared__ int64_t
      pos[2][kMaxSnapParts + 1];  // cost position of each start: [0] cut, [1] snapped
  __shared__ int32_t start_pair[2][kMaxSnapParts + 1], start_tile[2][kMaxSnapParts + 1];
  const bool may_snap = G <= kMaxSnapParts && p.snap_slack_tiles >= 0;
  int64_t longest[2] = {0, 0};
  for (int g = tid; g <= G; g += kPlanThreads) {
    const int64_t target = g * q;
    int64_t at[2] = {C, C};
    int pr[2] = {p.num_pairs, p.num_pairs}, tile[2] = {0, 0};
    if (target < C) {
      // Smallest pair whose end on the cost line lies past target.
      int lo = 0, hi = p.num_pairs - 1;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const PairInfo& m = p.pairs[mid];
        if (m.cost_begin + ovh + pair_tiles(m.len, T) > target) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const PairInfo& m = p.pairs[lo];
      const int64_t k = target - m.cost_begin - ovh;
      const int64_t end = m.cost_begin + ovh + pair_tiles(m.len, T);
      pr[0] = pr[1] = lo;
      at[0] = at[1] = m.cost_begin;
      if (k > 0) {
        tile[0] = static_cast<int>(k);
        at[0] = m.cost_begin + ovh + k;
        if (end - target < target - m.cost_begin) {
          pr[1] = lo + 1;
          at[1] = end;
        }
      }
    }
    if (!may_snap) {
      p.parts[g] =
          pr[0] < p.num_pairs
              ? PartStart{pr[0], tile[0], p.pairs[pr[0]].n_main, p.pairs[pr[0]].len, pr[0], {}}
              : PartStart{p.num_pairs, 0, 0, 0, p.num_pairs, {}};
      continue;
    }
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      pos[v][g] = at[v];
      start_pair[v][g] = pr[v];
      start_tile[v][g] = tile[v];
    }
  }
  if (may_snap) {
    __syncthreads();
    for (int g = tid; g < G; g += kPlanThreads) {
#pragma unroll
      for (int v = 0; v < 2; ++v) longest[v] = max(longest[v], pos[v][g + 1] - pos[v][g]);
    }
    const int64_t limit = block_max(longest[0]) + p.snap_slack_tiles;
    const bool snap = block_max(longest[1]) <= limit;
    // Step 3 reads the chosen starts from pos[0].
    const bool ordered = !snap && p.num_pairs > 0 && p.num_pairs <= kMaxOrderPairs &&
                         order_pairs_by_cost(p, static_cast<int>(G), limit, pos[0]);
    if (!ordered) {
      const int v = snap ? 1 : 0;
      for (int g = tid; g <= G; g += kPlanThreads) {
        const int pr = start_pair[v][g];
        p.parts[g] =
            pr < p.num_pairs
                ? PartStart{pr, start_tile[v][g], p.pairs[pr].n_main, p.pairs[pr].len, pr, {}}
                : PartStart{p.num_pairs, 0, 0, 0, p.num_pairs, {}};
        if (v == 1) pos[0][g] = pos[1][g];
      }
    }
    __syncthreads();
  }

  // 3. Which parts touch each pair, and partial slots for the split ones. A tile at cost x
  // belongs to the last part whose start is at or before x (parts without tiles share their
  // start with the next one).
  auto part_of = [&](int64_t x) {
    if (!may_snap) return static_cast<int>(x / q);
    int lo = 0, hi = static_cast<int>(G) - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (pos[0][mid] <= x) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  };
  carry = 0;
  for (int base = 0; base < p.num_pairs; base += kPlanThreads) {
    const int pr = base + tid;
    int64_t need = 0;
    int first = 0, nsplit = 1;
    if (pr < p.num_pairs) {
      const PairInfo& info = p.pairs[pr];
      const int64_t c0 = info.cost_begin + ovh;
      first = part_of(c0);
      nsplit = part_of(c0 + pair_tiles(info.len, T) - 1) - first + 1;
      need = nsplit > 1 ? nsplit : 0;
    }
    int64_t total;
    const int64_t before = block_exclusive_scan<kPlanThreads>(need, &total);
    if (pr < p.num_pairs) {
      p.pairs[pr].first_part = first;
      p.pairs[pr].nsplit = nsplit;
      p.pairs[pr].slot = static_cast<int>(carry + before);
    }
    carry += total;
  }
}

}  // namespace

Status launch_plan(const PlanParams& params, cudaStream_t stream) {
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(params);
  return check_launch("sparse_mla decode planner");
}

}  // namespace sparse_mla::cuda::smxx::decode
