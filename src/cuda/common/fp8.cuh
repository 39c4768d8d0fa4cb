// FP8 (e4m3) -> bf16 dequantization for tiles in shared memory. Bit-identical to
// fmt::e4m3_to_float(x) * scale rounded by fmt::float_to_bf16: e4m3 -> f16 is exact (hardware cvt
// from sm_89, emulated by cuda_fp8.h before), f16 -> f32 is exact, and a UE8M0 scale is a power
// of two, so the product needs no rounding; with a V32 fp32 scale it rounds once, to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "src/cuda/common/ptx.cuh"
#include "src/kv/format.h"

namespace sparse_mla::cuda {

__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes, float scale) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return ptx::pack2<false>(f.x * scale, f.y * scale);
}

// 16 e4m3 values (memory order) -> 16 bf16 values in two 16-byte vectors.
__device__ __forceinline__ void e4m3x16_to_bf16(const uint4& in, float scale, uint4& lo,
                                                uint4& hi) {
  lo.x = e4m3x2_to_bf16x2(in.x & 0xffffu, scale);
  lo.y = e4m3x2_to_bf16x2(in.x >> 16, scale);
  lo.z = e4m3x2_to_bf16x2(in.y & 0xffffu, scale);
  lo.w = e4m3x2_to_bf16x2(in.y >> 16, scale);
  hi.x = e4m3x2_to_bf16x2(in.z & 0xffffu, scale);
  hi.y = e4m3x2_to_bf16x2(in.z >> 16, scale);
  hi.z = e4m3x2_to_bf16x2(in.w & 0xffffu, scale);
  hi.w = e4m3x2_to_bf16x2(in.w >> 16, scale);
}

}  // namespace sparse_mla::cuda
