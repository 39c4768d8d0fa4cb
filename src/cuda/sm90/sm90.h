// Host side of the Hopper (sm_90a) decode path: its kernels plug into the portable decode's
// plan, launch and combine (src/cuda/smxx/decode/launch.h) as one more tile configuration.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparse_mla/status.h"

#include "src/cuda/smxx/decode/config.h"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda::sm90 {

// The wgmma decode kernel for one KV format (64 query rows, 64-token tiles; MODEL1 48); with
// causal_tail, its form that cleans the causal tail (hidden_tail; pick_decode_kernel says where).
smxx::decode::KernelEntry kernel_entry(smxx::decode::Fmt fmt, bool causal_tail);
// Its narrow form for FP8 formats (16 query rows, 64-token tiles: S^T = K Q^T); fn == nullptr for
// the 16-bit formats.
smxx::decode::KernelEntry narrow_kernel_entry(smxx::decode::Fmt fmt, bool causal_tail);

// Launches the kernel of shape.kernel (from kernel_entry) on the plan in params.
Status launch_decode(const smxx::decode::DecodeShape& shape,
                     const smxx::decode::DecodeParams& params, cudaStream_t stream);

// Uncached check behind cuda::sm90_usable (cuda_backend.h).
bool query_usable(int device, std::string* why_not);

}  // namespace sparse_mla::cuda::sm90
