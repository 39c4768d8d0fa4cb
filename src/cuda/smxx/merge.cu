// Merge of partial attention results (out_k, lse_k) over disjoint key sets (sm_80+):
//   lse = ln(sum_k exp(lse_k)),  out = sum_k exp(lse_k - lse) * out_k,
// skipping empty parts (lse_k = +-inf, whose out_k is never read), then the sink once:
//   out *= 1 / (1 + exp(sink[h] - lse)). All parts empty: out = 0, lse = +inf.
// A NaN lse_k is not empty: it makes the merged row NaN, so a broken input stays visible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "src/cuda/common/check.h"
#include "src/cuda/cuda_backend.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kWarp;
constexpr int kColsPerLane = 8;  // one tile is 256 columns: 8 per lane, 16- or 32-byte vectors
constexpr int kTileCols = kWarp * kColsPerLane;

struct MergeParams {
  const void* parts;       // [n, b, s_q, h_q, d_v], last dim contiguous
  int64_t part_s[4];       // strides of n, b, s_q, h_q (elements)
  const float* lse_parts;  // [n, b, s_q, h_q]
  int64_t lse_part_s[4];
  const float* sink;  // [h_q] or nullptr
  int64_t sink_s;
  void* out;  // [b, s_q, h_q, d_v], last dim contiguous
  int64_t out_s[3];
  float* lse;  // [b, h_q, s_q]
  int64_t lse_s[3];
  int64_t n, b, s_q, h_q;
  int d_v;
};

template <DType kDType>
using Storage = std::conditional_t<kDType == DType::kFloat32, float, uint16_t>;

template <DType kDType>
__device__ __forceinline__ float to_float(Storage<kDType> v) {
  if constexpr (kDType == DType::kFloat32) {
    return v;
  } else {
    return fmt::bf16_to_float(v);
  }
}

template <DType kDType>
__device__ __forceinline__ Storage<kDType> from_float(float v) {
  if constexpr (kDType == DType::kFloat32) {
    return v;
  } else {
    return fmt::float_to_bf16(v);
  }
}

// Loads columns [c, c + 8) of a row; kVec: the 8 values are one or two aligned 16-byte vectors.
// Columns past d_v read as 0 in the scalar path (kVec implies d_v % 8 == 0).
template <DType kDType, bool kVec>
__device__ __forceinline__ void load8(const Storage<kDType>* row, int c, int d_v, float (&x)[8]) {
  using T = Storage<kDType>;
  if constexpr (kVec) {
    T v[8];
    const uint4* p = reinterpret_cast<const uint4*>(row + c);
    uint4 tmp[sizeof(v) / 16];
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(v) / 16); ++i) tmp[i] = __ldg(p + i);
    memcpy(v, tmp, sizeof(v));
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float<kDType>(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = c + i < d_v ? to_float<kDType>(row[c + i]) : 0.f;
  }
}

template <DType kDType, bool kVec>
__device__ __forceinline__ void store8(Storage<kDType>* row, int c, int d_v, const float (&x)[8]) {
  using T = Storage<kDType>;
  T v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = from_float<kDType>(x[i]);
  if constexpr (kVec) {
    uint4 tmp[sizeof(v) / 16];
    memcpy(tmp, v, sizeof(v));
    uint4* p = reinterpret_cast<uint4*>(row + c);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(v) / 16); ++i) p[i] = tmp[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c + i < d_v) row[c + i] = v[i];
    }
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ bool any_lane(bool v) { return __any_sync(kFullMask, v); }

// One warp per (b, s_q, h_q) row. The occupancy hint gives ptxas a 64-register budget: left to
// itself it stopped at 48 on sm_80 and spilled.
template <DType kPart, DType kOut, bool kVec>
__global__ void __launch_bounds__(kThreads, 4) merge_kernel(MergeParams p) {
  using PT = Storage<kPart>;
  using OT = Storage<kOut>;
  const int lane = threadIdx.x % kWarp;
  const int64_t rows = p.b * p.s_q * p.h_q;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       row < rows; row += warps) {
    const int64_t h = row % p.h_q;
    const int64_t s = (row / p.h_q) % p.s_q;
    const int64_t bi = row / (p.h_q * p.s_q);
    const float* lse_row =
        p.lse_parts + bi * p.lse_part_s[1] + s * p.lse_part_s[2] + h * p.lse_part_s[3];
    auto part_lse = [&](int64_t k) { return lse_row[k * p.lse_part_s[0]]; };

    // Largest finite lse, and whether any is NaN; lanes stride over the parts.
    float m = -INFINITY;
    bool has_nan = false;
    for (int64_t k = lane; k < p.n; k += kWarp) {
      const float l = part_lse(k);
      has_nan |= isnan(l);
      if (isfinite(l)) m = fmaxf(m, l);
    }
    m = warp_max(m);
    has_nan = any_lane(has_nan);

    OT* out = static_cast<OT*>(p.out) + bi * p.out_s[0] + s * p.out_s[1] + h * p.out_s[2];
    float* lse_out = p.lse + bi * p.lse_s[0] + h * p.lse_s[1] + s * p.lse_s[2];
    if (has_nan || m == -INFINITY) {
      const float fill = has_nan ? NAN : 0.f;
      const float v[8] = {fill, fill, fill, fill, fill, fill, fill, fill};
      for (int c = lane * kColsPerLane; c < p.d_v; c += kTileCols)
        store8<kOut, kVec>(out, c, p.d_v, v);
      if (lane == 0) *lse_out = has_nan ? NAN : INFINITY;
      continue;
    }

    float sum = 0.f;
    for (int64_t k = lane; k < p.n; k += kWarp) {
      const float l = part_lse(k);
      if (isfinite(l)) sum += expf(l - m);
    }
    sum = warp_sum(sum);
    const float lse = m + logf(sum);
    const float inv_sum = 1.f / sum;
    float factor = 1.f;
    if (p.sink != nullptr) factor = 1.f / (1.f + expf(p.sink[h * p.sink_s] - lse));

    const PT* part_row =
        static_cast<const PT*>(p.parts) + bi * p.part_s[1] + s * p.part_s[2] + h * p.part_s[3];
    for (int c = lane * kColsPerLane; c < p.d_v; c += kTileCols) {
      float acc[8] = {};
      for (int64_t k = 0; k < p.n; ++k) {
        const float l = part_lse(k);
        if (!isfinite(l)) continue;  // uniform over the warp: empty parts are never read
        const float w = expf(l - m) * inv_sum;
        float x[8];
        load8<kPart, kVec>(part_row + k * p.part_s[0], c, p.d_v, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, x[i], acc[i]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= factor;
      store8<kOut, kVec>(out, c, p.d_v, acc);
    }
    if (lane == 0) *lse_out = lse;
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Every row start of a view (outer strides given) is 16-byte aligned.
bool rows_aligned(const void* data, const int64_t* strides, const int64_t* shape, int outer,
                  size_t elem) {
  if (!aligned16(data)) return false;
  for (int d = 0; d < outer; ++d) {
    if (shape[d] > 1 && (strides[d] * static_cast<int64_t>(elem)) % 16 != 0) return false;
  }
  return true;
}

template <DType kPart, DType kOut>
void launch(const MergeParams& p, bool vec, unsigned grid, cudaStream_t stream) {
  if (vec) {
    merge_kernel<kPart, kOut, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    merge_kernel<kPart, kOut, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

}  // namespace

Status merge_attention(const MergeArgs& args, const MergeProblem& pr, void* stream) {
  const int64_t rows = pr.b * pr.s_q * pr.h_q;
  if (rows == 0) return Status::Ok();
  int dev = 0, major = 0;
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8) {
    return Status::DeviceError("merge_attention: the cuda backend needs sm_80 or newer, device " +
                               std::to_string(dev) + " is sm_" + std::to_string(major) + "x");
  }
  MergeParams p;
  p.parts = args.out_parts.data;
  for (int d = 0; d < 4; ++d) {
    p.part_s[d] = args.out_parts.strides[d];
    p.lse_part_s[d] = args.lse_parts.strides[d];
  }
  p.lse_parts = args.lse_parts.ptr<const float>();
  p.sink = args.attn_sink ? args.attn_sink->ptr<const float>() : nullptr;
  p.sink_s = args.attn_sink ? args.attn_sink->strides[0] : 0;
  p.out = args.out.data;
  p.lse = args.lse.ptr<float>();
  for (int d = 0; d < 3; ++d) {
    p.out_s[d] = args.out.strides[d];
    p.lse_s[d] = args.lse.strides[d];
  }
  p.n = pr.n;
  p.b = pr.b;
  p.s_q = pr.s_q;
  p.h_q = pr.h_q;
  p.d_v = pr.d_v;
  const bool vec =
      pr.d_v % kColsPerLane == 0 &&
      rows_aligned(args.out_parts.data, args.out_parts.strides, args.out_parts.shape, 4,
                   dtype_size(args.out_parts.dtype)) &&
      rows_aligned(args.out.data, args.out.strides, args.out.shape, 3, dtype_size(args.out.dtype));
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1 << 30));
  auto s = static_cast<cudaStream_t>(stream);
  const bool part_f32 = args.out_parts.dtype == DType::kFloat32;
  const bool out_f32 = args.out.dtype == DType::kFloat32;
  if (part_f32 && out_f32) {
    launch<DType::kFloat32, DType::kFloat32>(p, vec, grid, s);
  } else if (part_f32) {
    launch<DType::kFloat32, DType::kBFloat16>(p, vec, grid, s);
  } else if (out_f32) {
    launch<DType::kBFloat16, DType::kFloat32>(p, vec, grid, s);
  } else {
    launch<DType::kBFloat16, DType::kBFloat16>(p, vec, grid, s);
  }
  return check_launch("merge_kernel");
}

}  // namespace sparse_mla::cuda
