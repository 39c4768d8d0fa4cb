// Host side of the Hopper (sm_90a) decode path: its kernels plug into the portable decode's
// plan, launch and combine (src/cuda/smxx/decode/launch.h) as one more tile configuration.
#pragma once

#include <string>

#include "src/cuda/smxx/decode/config.h"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda::sm90 {

// The wgmma decode kernel for one KV format (64 query rows, 64-token tiles).
smxx::decode::KernelEntry kernel_entry(smxx::decode::Fmt fmt);

// Uncached check behind cuda::sm90_usable (cuda_backend.h).
bool query_usable(int device, std::string* why_not);

}  // namespace sparse_mla::cuda::sm90
