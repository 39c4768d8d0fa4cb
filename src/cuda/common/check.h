// CUDA error handling: every runtime error becomes a Status, never an exit.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparse_mla/status.h"

namespace sparse_mla::cuda {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::DeviceError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

// After a launch: catches bad configurations without synchronizing.
inline Status check_launch(const char* kernel) {
  return cuda_status(cudaPeekAtLastError() == cudaSuccess ? cudaSuccess : cudaGetLastError(),
                     kernel);
}

}  // namespace sparse_mla::cuda

#define SPARSE_MLA_CUDA_RETURN_IF_ERROR(call) \
  SPARSE_MLA_RETURN_IF_ERROR(::sparse_mla::cuda::cuda_status((call), #call))
