// The sm_90a decode kernels, one per KV format, and whether this build and device can run them.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "src/cuda/sm90/decode_kernel.cuh"
#include "src/cuda/common/check.h"
#include "src/cuda/cuda_backend.h"
#include "src/cuda/sm90/sm90.h"

namespace sparse_mla::cuda::sm90 {
namespace {

template <Fmt F, int kRows>
smxx::decode::KernelEntry entry(bool causal_tail) {
  using Cfg = Sm90Config<F, kRows>;
  const void* fn = reinterpret_cast<const void*>(&sm90_decode_kernel<F, kRows, false>);
  if (causal_tail) fn = reinterpret_cast<const void*>(&sm90_decode_kernel<F, kRows, true>);
  return smxx::decode::KernelEntry{fn, Cfg::kThreads, Cfg::kSmemBytes, Cfg::kT, Cfg::kRows};
}

// The driver's tensor-map encoder, looked up once through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                             cudaEnableDefault, &found);
    // A failed lookup is not sticky; clear it so that the launch check does not report it. The
    // kernel then copies rows with cp.async.
    if (err != cudaSuccess) cudaGetLastError();
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Sm90Cta::kv_map for 16-bit dense pages: the cache as a (dim, KV head, token, page) tensor
// read in boxes of 64 dims x 8 tokens with the 128-byte swizzle of the tile. False where TMA
// cannot describe the cache (a page size that is not a multiple of 8 tokens, no pages); the
// kernel then copies every row with cp.async. The 16-byte alignment of base and page stride
// and the stride's lower bound that TMA needs are checked by the API's validation.
bool encode_kv_map(Fmt fmt, const DecodeParams& p, CUtensorMap* map) {
  constexpr int kTokensPerBox = Sm90Config<Fmt::kBF16>::kTokensPerWarp;
  const smxx::decode::CacheRef& c = p.kv;
  if (!p.dense || (fmt != Fmt::kBF16 && fmt != Fmt::kFP16)) return false;
  if (c.base == nullptr || c.num_pages <= 0 || c.page_size % kTokensPerBox != 0) return false;
  const uint64_t row_bytes = kDenseHeadDim * 2;
  const uint64_t token_bytes = row_bytes * static_cast<uint64_t>(p.h_kv);
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(kDenseHeadDim),
                              static_cast<cuuint64_t>(p.h_kv),
                              static_cast<cuuint64_t>(c.page_size),
                              static_cast<cuuint64_t>(c.num_pages)};
  const cuuint64_t strides[3] = {row_bytes, token_bytes, static_cast<cuuint64_t>(c.page_stride)};
  const cuuint32_t box[4] = {64, 1, kTokensPerBox, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<uint8_t*>(c.base), dims,
                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The row blocks of a part along x, parts along y: the CTAs that walk the same tiles start next
// to each other, so they share more of their L2 traffic (dense bf16 h_q 128: 24% fewer L2 fabric
// sectors and 0.5-2% faster than parts along x, sm90_notes.md variant 126).
dim3 sm90_grid(const smxx::decode::DecodeShape& shape) {
  return dim3(static_cast<unsigned>(shape.blocks_per_group * shape.groups),
              static_cast<unsigned>(shape.num_parts));
}

}  // namespace

Status launch_decode(const smxx::decode::DecodeShape& shape, const DecodeParams& params,
                     cudaStream_t stream) {
  CUtensorMap map{};
  int kv_tma = encode_kv_map(shape.fmt, params, &map) ? 1 : 0;
  // Test hook: SPARSE_MLA_SM90_TMA=0 keeps every row on the cp.async path.
  if (const char* env = std::getenv("SPARSE_MLA_SM90_TMA")) {
    if (std::string(env) == "0") kv_tma = 0;
  }
  void* args[] = {const_cast<DecodeParams*>(&params), &map, &kv_tma};
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaLaunchKernel(shape.kernel.fn, sm90_grid(shape),
                       dim3(shape.kernel.threads), args,
                       static_cast<size_t>(shape.kernel.smem_bytes), stream));
  return check_launch("sparse_mla sm90 decode kernel");
}

bool query_usable(int device, std::string* why_not) {
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    *why_not = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
    return false;
  }
  if (prop.major != 9 || prop.minor != 0) {
    *why_not = "the sm90 backend needs an sm_90 (Hopper) GPU, device " + std::to_string(device) +
               " (" + prop.name + ") is sm_" + std::to_string(prop.major * 10 + prop.minor);
    return false;
  }
  // A build without 90a in SPARSE_MLA_CUDA_ARCHS runs sm_80 code on Hopper, where this kernel
  // is empty.
  int old = 0;
  cudaGetDevice(&old);
  if (old != device) cudaSetDevice(device);
  cudaFuncAttributes attr{};
  err = cudaFuncGetAttributes(&attr, sm90_decode_kernel<Fmt::kModel1, 64, false>);
  if (old != device) cudaSetDevice(old);
  if (err != cudaSuccess) {
    *why_not = std::string("cudaFuncGetAttributes: ") + cudaGetErrorString(err);
    return false;
  }
  if (attr.binaryVersion != 90) {
    *why_not = "this build has no sm_90a code (SPARSE_MLA_CUDA_ARCHS must include 90a); the "
               "loaded kernel is sm_" + std::to_string(attr.binaryVersion);
    return false;
  }
  why_not->clear();
  return true;
}

smxx::decode::KernelEntry kernel_entry(Fmt fmt, bool causal_tail) {
  switch (fmt) {
    case Fmt::kModel1: return entry<Fmt::kModel1, 64>(causal_tail);
    case Fmt::kV32: return entry<Fmt::kV32, 64>(causal_tail);
    case Fmt::kBF16: return entry<Fmt::kBF16, 64>(causal_tail);
    case Fmt::kFP16: return entry<Fmt::kFP16, 64>(causal_tail);
  }
  return smxx::decode::KernelEntry{};
}

smxx::decode::KernelEntry narrow_kernel_entry(Fmt fmt, bool causal_tail) {
  switch (fmt) {
    case Fmt::kModel1:
      return entry<Fmt::kModel1, 16>(causal_tail);
    case Fmt::kV32:
      return entry<Fmt::kV32, 16>(causal_tail);
    default:
      return smxx::decode::KernelEntry{};
  }
}

}  // namespace sparse_mla::cuda::sm90

namespace sparse_mla::cuda {

bool sm90_usable(int device, std::string* why_not) {
  static std::mutex mu;
  static std::map<int, std::string> cache;  // device -> reason ("" = usable)
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it == cache.end()) {
    std::string reason;
    sm90::query_usable(device, &reason);
    it = cache.emplace(device, reason).first;
  }
  *why_not = it->second;
  return it->second.empty();
}

}  // namespace sparse_mla::cuda
