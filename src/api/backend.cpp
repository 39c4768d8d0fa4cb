#include "sparse_mla/backend.h"

#include <string>

#if SPARSE_MLA_WITH_CUDA
#include "src/cuda/cuda_backend.h"
#endif

namespace sparse_mla {

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kCPU: return "cpu";
    case Backend::kCUDA: return "cuda";
    case Backend::kSM90: return "sm90";
  }
  return "unknown";
}

Status parse_backend(std::string_view name, Backend* backend) {
  for (Backend b : {Backend::kAuto, Backend::kCPU, Backend::kCUDA, Backend::kSM90}) {
    if (name == backend_name(b)) {
      *backend = b;
      return Status::Ok();
    }
  }
  return Status::InvalidArgument("backend: '" + std::string(name) +
                                 "', expected one of auto, cpu, cuda, sm90");
}

std::vector<Backend> available_backends() {
  std::vector<Backend> backends;
#if SPARSE_MLA_WITH_CUDA
  std::string why_not;
  if (cuda::device_usable(0, &why_not)) {
    if (cuda::sm90_usable(0, &why_not)) backends.push_back(Backend::kSM90);
    backends.push_back(Backend::kCUDA);
  }
#endif
  backends.push_back(Backend::kCPU);
  return backends;
}

}  // namespace sparse_mla
