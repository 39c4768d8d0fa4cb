// Device discovery for the CUDA backends.
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <string>

#include "src/cuda/cuda_backend.h"

namespace sparse_mla::cuda {

namespace {

bool query_device_usable(int device_index, std::string* why_not) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    *why_not = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    return false;
  }
  if (device_index < 0 || device_index >= count) {
    *why_not = "CUDA device " + std::to_string(device_index) + " does not exist (" +
               std::to_string(count) + " visible)";
    return false;
  }
  cudaDeviceProp prop{};
  err = cudaGetDeviceProperties(&prop, device_index);
  if (err != cudaSuccess) {
    *why_not = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
    return false;
  }
  if (prop.major < 8) {
    *why_not = "the cuda backend needs sm_80 or newer, device " + std::to_string(device_index) +
               " (" + prop.name + ") is sm_" + std::to_string(prop.major * 10 + prop.minor);
    return false;
  }
  why_not->clear();
  return true;
}

}  // namespace

// Every decode call asks this; cudaGetDeviceProperties costs microseconds, and the answer for a
// device that exists cannot change while the process runs, so positive answers are cached.
bool device_usable(int device_index, std::string* why_not) {
  static std::mutex mu;
  static std::set<int> usable;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (usable.count(device_index)) {
      why_not->clear();
      return true;
    }
  }
  if (!query_device_usable(device_index, why_not)) return false;
  std::lock_guard<std::mutex> lock(mu);
  usable.insert(device_index);
  return true;
}

}  // namespace sparse_mla::cuda
