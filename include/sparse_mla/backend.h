// Backend selection. kAuto picks the fastest backend that supports the request on the
// device the tensors live on; SPARSE_MLA_BACKEND=auto|sm90|cuda|cpu overrides kAuto.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "sparse_mla/status.h"

namespace sparse_mla {

enum class Backend { kAuto, kCPU, kCUDA, kSM90 };

const char* backend_name(Backend backend);  // "auto", "cpu", "cuda", "sm90"
Status parse_backend(std::string_view name, Backend* backend);

// Backends compiled into this build and usable on this machine (kCPU always).
std::vector<Backend> available_backends();

// Per-call options. The stream is a cudaStream_t (nullptr = default stream); the CPU ignores it.
struct Options {
  Backend backend = Backend::kAuto;
  void* stream = nullptr;
};

}  // namespace sparse_mla
