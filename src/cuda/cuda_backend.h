// Portable CUDA backend (sm_80+). Entry points called by the API layer after validation. All of
// them only enqueue work on `stream`: no allocation, no host synchronization.
#pragma once

#include "src/api/problem.h"

namespace sparse_mla::cuda {

// Whether the CUDA runtime sees a device this build has code for ("" when yes, else why not).
bool device_usable(int device_index, std::string* why_not);
// Whether `device_index` is an sm_90 GPU and this build carries the sm_90a kernels (the `sm90`
// backend); otherwise *why_not says why. Cached per device.
bool sm90_usable(int device_index, std::string* why_not);

// The workspace a decode needs, or why the CUDA kernels cannot run it (the error its run gives).
Status sparse_decode_workspace_size(const SparseDecodeProblem& p, int device_index,
                                    WorkspaceSizes* sizes);
Status sparse_decode_plan(const SparseDecodeArgs& args, const SparseDecodeProblem& p,
                          const Workspace& ws, void* stream);
Status sparse_decode(const SparseDecodeArgs& args, const SparseDecodeProblem& p,
                     const Workspace& ws, void* stream);

// The sizes cover every format of the cache's d_qk (one workspace serves them all); the status
// is that of the cache itself (its format and page size).
Status dense_decode_workspace_size(const DenseDecodeProblem& p, const KVCache& kv,
                                   int device_index, WorkspaceSizes* sizes);
Status dense_decode_plan(const DenseDecodeArgs& args, const DenseDecodeProblem& p,
                         const Workspace& ws, void* stream);
Status dense_decode(const DenseDecodeArgs& args, const DenseDecodeProblem& p,
                    const Workspace& ws, void* stream);

Status merge_attention(const MergeArgs& args, const MergeProblem& p, void* stream);
Status quantize_store(const QuantizeStoreArgs& args, void* stream);
Status dequantize(const DequantizeArgs& args, void* stream);
Status repack_pages(const RepackArgs& args, void* stream);

}  // namespace sparse_mla::cuda
