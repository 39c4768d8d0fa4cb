// The planner: one CTA reads the length tensors on the device (no host sync, capturable in a CUDA
// graph) and writes the plan of params.h: per pair its clamped lengths and place on the cost line,
// per part its first tile, per split pair its partial slots.
#include <cuda_runtime.h>

#include <cstdint>

#include "src/cuda/common/check.h"
#include "src/cuda/smxx/decode/launch.h"
#include "src/cuda/smxx/decode/params.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

constexpr int kPlanThreads = 1024;
// Parts the planner may snap to pair ends (its shared arrays); more parts keep the cut starts.
constexpr int kMaxSnapParts = 1024;

// Exclusive prefix sum over the CTA; *total gets the sum of all values. Every thread must call.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[kPlanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int64_t before = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[kPlanThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + x - v;
}

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
    const int64_t before = block_exclusive_scan(cost, &total);
    if (pr < p.num_pairs) {
      info.cost_begin = carry + before;
      p.pairs[pr] = info;
    }
    carry += total;
  }
  const int64_t C = carry;
  const int64_t G = p.num_parts;
  int64_t q = (C + G - 1) / G;
  if (q < p.min_tiles_per_part) q = p.min_tiles_per_part;
  if (q < 1) q = 1;
  __syncthreads();  // pairs[] written above is read by other threads below

  // 2. Part starts. Cut: the first tile at cost >= g * q, which splits the pair it falls in.
  // Snapped: that pair's start or end instead, whichever is nearer, so that no pair splits. The
  // snapped starts are taken when their longest part is at most snap_slack_tiles longer than the
  // cut's (the combine that the splits need costs about that much), and G fits the arrays.
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
      p.parts[g] = pr[0] < p.num_pairs
                       ? PartStart{pr[0], tile[0], p.pairs[pr[0]].n_main, p.pairs[pr[0]].len}
                       : PartStart{p.num_pairs, 0, 0, 0};
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
    const bool snap = block_max(longest[1]) <= block_max(longest[0]) + p.snap_slack_tiles;
    const int v = snap ? 1 : 0;
    for (int g = tid; g <= G; g += kPlanThreads) {
      const int pr = start_pair[v][g];
      p.parts[g] = pr < p.num_pairs
                       ? PartStart{pr, start_tile[v][g], p.pairs[pr].n_main, p.pairs[pr].len}
                       : PartStart{p.num_pairs, 0, 0, 0};
      if (v == 1) pos[0][g] = pos[1][g];  // step 3 reads the chosen starts from pos[0]
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
    const int64_t before = block_exclusive_scan(need, &total);
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
