// The sm_90a decode kernels, one per KV format, and whether this build and device can run them.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "src/cuda/sm90/decode_kernel.cuh"
#include "src/cuda/cuda_backend.h"
#include "src/cuda/sm90/sm90.h"

namespace sparse_mla::cuda::sm90 {
namespace {

template <Fmt F>
smxx::decode::KernelEntry entry() {
  using Cfg = Sm90Config<F>;
  return smxx::decode::KernelEntry{reinterpret_cast<const void*>(&sm90_decode_kernel<F>),
                                   Cfg::kThreads, Cfg::kSmemBytes, Cfg::kT, Cfg::kRows};
}

}  // namespace

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
  err = cudaFuncGetAttributes(&attr, sm90_decode_kernel<Fmt::kModel1>);
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

smxx::decode::KernelEntry kernel_entry(Fmt fmt) {
  switch (fmt) {
    case Fmt::kModel1: return entry<Fmt::kModel1>();
    case Fmt::kV32: return entry<Fmt::kV32>();
    case Fmt::kBF16: return entry<Fmt::kBF16>();
    case Fmt::kFP16: return entry<Fmt::kFP16>();
  }
  return smxx::decode::KernelEntry{};
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
