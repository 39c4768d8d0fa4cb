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

  // 2. First tile of every part (and the end sentinel): the first tile at cost >= g * q.
  for (int g = tid; g <= p.num_parts; g += kPlanThreads) {
    const int64_t target = g * q;
    PartStart ps{p.num_pairs, 0, 0, 0};
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
      const int64_t k = target - p.pairs[lo].cost_begin - ovh;
      ps = PartStart{lo, static_cast<int>(k > 0 ? k : 0), p.pairs[lo].n_main, p.pairs[lo].len};
    }
    p.parts[g] = ps;
  }

  // 3. Which parts touch each pair, and partial slots for the split ones.
  carry = 0;
  for (int base = 0; base < p.num_pairs; base += kPlanThreads) {
    const int pr = base + tid;
    int64_t need = 0;
    int first = 0, nsplit = 1;
    if (pr < p.num_pairs) {
      const PairInfo& info = p.pairs[pr];
      const int64_t c0 = info.cost_begin + ovh;
      first = static_cast<int>(c0 / q);
      nsplit = static_cast<int>((c0 + pair_tiles(info.len, T) - 1) / q) - first + 1;
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
