// Combine: merges the fp32 partials of every split pair in a fixed order (deterministic),
// converts the base-2 lse to natural log and applies the sink once. One warp per query row; the
// grid covers every pair because which pairs are split is only known on the device.
#include <cuda_runtime.h>

#include <cstdint>

#include "src/cuda/common/check.h"
#include "src/cuda/common/ptx.cuh"
#include "src/cuda/smxx/decode/launch.h"
#include "src/cuda/smxx/decode/params.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

constexpr int kCombineThreads = 256;
constexpr int kRowsPerCta = kCombineThreads / 32;
constexpr int kDimsPerLane = kDV / 32;  // 16

template <bool kFP16>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ DecodeParams p) {
  const PairInfo info = p.pairs[blockIdx.x];
  if (info.nsplit <= 1) return;
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.y * kRowsPerCta + (threadIdx.x >> 5);
  if (row >= p.rows_per_pair) return;
  const int n = info.nsplit;
  if (info.slot < 0 || info.slot + n > p.max_slots) return;

  const int pr = blockIdx.x;
  int i, s, head;
  if (p.dense) {
    i = pr;
    const int g = row / p.rows_per_group, lr = row % p.rows_per_group;
    s = lr / p.hpk;
    head = g * p.hpk + lr % p.hpk;
  } else {
    i = pr / p.s_q;
    s = pr % p.s_q;
    head = row;
  }
  const int64_t stride = p.rows_per_pair;
  const float* lse_k = p.part_lse + static_cast<int64_t>(info.slot) * stride + row;
  const float* out_k = p.part_out + (static_cast<int64_t>(info.slot) * stride + row) * kDV;

  // Max over the parts; NaN is remembered so that a NaN part makes the row NaN.
  float mx = -INFINITY;
  bool nan = false;
  for (int k = lane; k < n; k += 32) {
    const float v = lse_k[k * stride];
    mx = fmaxf(mx, v);
    nan |= v != v;
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  nan = __any_sync(0xffffffffu, nan);

  float acc[kDimsPerLane];
#pragma unroll
  for (int e = 0; e < kDimsPerLane; ++e) acc[e] = 0.f;
  float lse = INFINITY;  // empty row: out 0, lse +inf
  if (nan) {
    lse = NAN;
#pragma unroll
    for (int e = 0; e < kDimsPerLane; ++e) acc[e] = NAN;
  } else if (mx != -INFINITY) {
    // Weights of 32 parts at a time live in the lanes; the loads of 4 parts are issued together
    // (the loop is latency-bound otherwise). Parts are added in index order: deterministic.
    float w_sum = 0.f;
    for (int k = lane; k < n; k += 32) w_sum += ptx::exp2_approx(lse_k[k * stride] - mx);
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, d);
    const float inv = 1.f / w_sum;
    for (int k0 = 0; k0 < n; k0 += 32) {
      const int cnt = min(32, n - k0);
      const float w_lane =
          lane < cnt ? ptx::exp2_approx(lse_k[(k0 + lane) * stride] - mx) * inv : 0.f;
      const float4* src = reinterpret_cast<const float4*>(out_k + k0 * stride * kDV) + lane * 4;
      const int64_t part_step = stride * kDV / 4;  // float4s between consecutive parts
      int kk = 0;
      for (; kk + 4 <= cnt; kk += 4) {
        float4 x[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
          for (int v = 0; v < 4; ++v) x[u][v] = src[(kk + u) * part_step + v];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float w = __shfl_sync(0xffffffffu, w_lane, kk + u);
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            acc[4 * v + 0] += w * x[u][v].x;
            acc[4 * v + 1] += w * x[u][v].y;
            acc[4 * v + 2] += w * x[u][v].z;
            acc[4 * v + 3] += w * x[u][v].w;
          }
        }
      }
      for (; kk < cnt; ++kk) {
        const float w = __shfl_sync(0xffffffffu, w_lane, kk);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float4 x = src[kk * part_step + v];
          acc[4 * v + 0] += w * x.x;
          acc[4 * v + 1] += w * x.y;
          acc[4 * v + 2] += w * x.z;
          acc[4 * v + 3] += w * x.w;
        }
      }
    }
    lse = (mx + log2f(w_sum)) * 0.693147180559945309f;
    if (p.sink != nullptr) {
      const float f = 1.f / (1.f + expf(p.sink[head * p.sink_stride] - lse));
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) acc[e] *= f;
    }
  }

  uint16_t* dst = p.out + i * p.out_stride[0] + s * p.out_stride[1] + head * p.out_stride[2] +
                  lane * kDimsPerLane;
  uint4 v0, v1;
  v0.x = ptx::pack2<kFP16>(acc[0], acc[1]);
  v0.y = ptx::pack2<kFP16>(acc[2], acc[3]);
  v0.z = ptx::pack2<kFP16>(acc[4], acc[5]);
  v0.w = ptx::pack2<kFP16>(acc[6], acc[7]);
  v1.x = ptx::pack2<kFP16>(acc[8], acc[9]);
  v1.y = ptx::pack2<kFP16>(acc[10], acc[11]);
  v1.z = ptx::pack2<kFP16>(acc[12], acc[13]);
  v1.w = ptx::pack2<kFP16>(acc[14], acc[15]);
  reinterpret_cast<uint4*>(dst)[0] = v0;
  reinterpret_cast<uint4*>(dst)[1] = v1;
  if (lane == 0) p.lse[i * p.lse_stride[0] + head * p.lse_stride[1] + s * p.lse_stride[2]] = lse;
}

}  // namespace

Status launch_combine(const DecodeShape& shape, const DecodeParams& params, bool fp16_out,
                      cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(shape.num_pairs),
                  static_cast<unsigned>((shape.rows_per_pair + kRowsPerCta - 1) / kRowsPerCta));
  if (fp16_out) {
    combine_kernel<true><<<grid, kCombineThreads, 0, stream>>>(params);
  } else {
    combine_kernel<false><<<grid, kCombineThreads, 0, stream>>>(params);
  }
  return check_launch("sparse_mla decode combine");
}

}  // namespace sparse_mla::cuda::smxx::decode
