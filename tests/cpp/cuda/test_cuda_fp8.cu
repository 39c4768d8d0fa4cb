// The device FP8 -> bf16 conversion of the decode kernels against the host format math, bit for
// bit: every e4m3 code under arbitrary fp32 scales (V32), where the product rounds once, and under
// every UE8M0 scale byte through the bf16 multiply of MODEL1 (subnormal and overflowing products,
// the NaN scale 0xff).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "src/cuda/common/fp8.cuh"
#include "src/kv/format.h"
#include "tests/cpp/cuda/gpu_util.h"

namespace sparse_mla {
namespace {

// Thread t converts codes 16 (t % 16) .. + 15 under scales[t / 16].
__global__ void convert_all(const uint4* codes, const float* scales, uint4* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= 256 * 16) return;
  uint4 lo, hi;
  cuda::e4m3x16_to_bf16(codes[t % 16], scales[t / 16], lo, hi);
  out[2 * t] = lo;
  out[2 * t + 1] = hi;
}

// Thread t converts codes 16 (t % 16) .. + 15 under UE8M0 byte t / 16.
__global__ void convert_all_ue8m0(const uint4* codes, uint4* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= 256 * 16) return;
  uint4 lo, hi;
  cuda::e4m3x16_to_bf16(codes[t % 16], cuda::ue8m0_to_bf16x2(static_cast<uint8_t>(t / 16)), lo, hi);
  out[2 * t] = lo;
  out[2 * t + 1] = hi;
}

bool same_bf16(uint16_t got, uint16_t want) {
  const bool got_nan = (got & 0x7fffu) > 0x7f80u, want_nan = (want & 0x7fffu) > 0x7f80u;
  return got_nan || want_nan ? got_nan == want_nan : got == want;
}

// The 256 e4m3 codes on the device, as 16 chunks of 16.
gpu_test::DeviceBuffer all_codes() {
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  return gpu_test::to_device(codes);
}

// out[g * 256 + c] must be code c times scales[g], rounded once to bf16 (NaN for NaN).
void expect_exact(const std::vector<uint16_t>& out, const std::vector<float>& scales) {
  int bad = 0;
  for (int g = 0; g < 256; ++g) {
    for (int c = 0; c < 256; ++c) {
      const uint16_t want =
          fmt::float_to_bf16(fmt::e4m3_to_float(static_cast<uint8_t>(c)) * scales[g]);
      const uint16_t got = out[g * 256 + c];
      if (!same_bf16(got, want) && ++bad <= 10) {
        ADD_FAILURE() << "scale " << scales[g] << " (group " << g << "), code 0x" << std::hex << c
                      << ": got bf16 0x" << got << ", want 0x" << want << std::dec;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of 65536 conversions";
}

TEST(CudaFP8, EveryCodeUnderFp32ScalesRoundsOnce) {
  SKIP_WITHOUT_GPU();
  std::vector<float> scales(256);
  for (int g = 0; g < 256; ++g) {
    // powers of two across the range, then arbitrary fp32 scales (the product rounds to bf16)
    scales[g] = g < 128 ? fmt::ue8m0_to_float(static_cast<uint8_t>(g * 2))
                        : 1e-3f * static_cast<float>(g) / 7.f;
  }
  const gpu_test::DeviceBuffer d_codes = all_codes();
  const gpu_test::DeviceBuffer d_scales = gpu_test::to_device(scales);
  gpu_test::DeviceBuffer d_out(256 * 256 * 2);
  d_out.fill(0xff);  // poison
  convert_all<<<16, 256>>>(static_cast<const uint4*>(d_codes.data()),
                           static_cast<const float*>(d_scales.data()),
                           static_cast<uint4*>(d_out.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  expect_exact(d_out.to_vector<uint16_t>(), scales);
}

TEST(CudaFP8, EveryCodeUnderEveryUe8m0ScaleIsExact) {
  SKIP_WITHOUT_GPU();
  const gpu_test::DeviceBuffer d_codes = all_codes();
  gpu_test::DeviceBuffer d_out(256 * 256 * 2);
  d_out.fill(0xff);  // poison
  convert_all_ue8m0<<<16, 256>>>(static_cast<const uint4*>(d_codes.data()),
                                 static_cast<uint4*>(d_out.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> scales(256);
  for (int s = 0; s < 256; ++s) scales[s] = fmt::ue8m0_to_float(static_cast<uint8_t>(s));
  expect_exact(d_out.to_vector<uint16_t>(), scales);
}

}  // namespace
}  // namespace sparse_mla
