// FP8 (e4m3) -> bf16 dequantization for tiles in shared memory. Bit-identical to
// fmt::e4m3_to_float(x) * scale rounded by fmt::float_to_bf16: e4m3 -> f16 is exact (hardware cvt
// from sm_89, emulated by cuda_fp8.h before), f16 -> f32 is exact, and with a V32 fp32 scale the
// product rounds once, to nearest even. A UE8M0 scale is a power of two, representable in bf16
// (2^-127 as a subnormal), so MODEL1 rounds the unscaled value to bf16 (exact: 4 significant bits)
// and scales in bf16: one bf16x2 multiply a pair instead of two fp32 ones, rounding the exact
// product once as the fp32 path does (also for results that overflow or become subnormal).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "src/cuda/common/ptx.cuh"
#include "src/kv/format.h"

namespace sparse_mla::cuda {

// Two e4m3 values (the low 16 bits) as floats, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return __half22float2(__half2(h));
}

__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes, float scale) {
  const float2 f = e4m3x2_to_float2(two_bytes);
  return ptx::pack2<false>(f.x * scale, f.y * scale);
}

// Two e4m3 values under a UE8M0 scale given as a bf16 pair (ue8m0_to_bf16x2).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes, __nv_bfloat162 scale) {
  const float2 f = e4m3x2_to_float2(two_bytes);
  const __nv_bfloat162 scaled = __hmul2(__floats2bfloat162_rn(f.x, f.y), scale);
  return *reinterpret_cast<const uint32_t*>(&scaled);
}

// The UE8M0 byte's scale (fmt::ue8m0_to_float) in both halves of a bf16 pair: its float has no
// bits below the bf16 ones, so the top half of its bits is exact.
__device__ __forceinline__ __nv_bfloat162 ue8m0_to_bf16x2(uint8_t b) {
  __nv_bfloat16_raw r;
  r.x = static_cast<unsigned short>(fmt::float_bits(fmt::ue8m0_to_float(b)) >> 16);
  return __bfloat162bfloat162(__nv_bfloat16(r));
}

// 16 e4m3 values (memory order) -> 16 bf16 values in two 16-byte vectors; Scale is float (V32)
// or ue8m0_to_bf16x2's pair (MODEL1).
template <typename Scale>
__device__ __forceinline__ void e4m3x16_to_bf16(const uint4& in, Scale scale, uint4& lo,
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
