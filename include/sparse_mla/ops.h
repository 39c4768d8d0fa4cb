// Operations. Each validates its arguments, picks a backend (Options::backend) and runs on the
// caller's stream. Decode ops follow a plan/run split: query the workspace sizes, plan once per
// decode step (plan depends only on shapes and on the length tensors), run every layer with it.
// Nothing here allocates or synchronizes with the host on the decode path.
#pragma once

#include <cstddef>
#include <optional>

#include "sparse_mla/backend.h"
#include "sparse_mla/kv_cache.h"
#include "sparse_mla/status.h"
#include "sparse_mla/tensor.h"

namespace sparse_mla {

// Caller-owned memory on the tensors' device. Sizes come from *_workspace_size().
struct Workspace {
  void* plan = nullptr;
  size_t plan_bytes = 0;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

struct WorkspaceSizes {
  size_t plan_bytes = 0;
  size_t scratch_bytes = 0;
};

// ---- Sparse decode (spec section 3) ----
struct SparseDecodeArgs {
  TensorView q;                                 // [b, s_q, h_q, d_qk] bf16, last dim contiguous
  KVCache kv;                                   // MODEL1 or V32
  TensorView indices;                           // [b, s_q, topk] int32 slots, -1 = no token
  std::optional<TensorView> topk_length;        // [b] int32: only the first topk_length[i] count
  std::optional<KVCache> extra_kv;              // same format as kv, own page size / stride
  std::optional<TensorView> extra_indices;      // [b, s_q, extra_topk] int32, with extra_kv
  std::optional<TensorView> extra_topk_length;  // [b] int32, with extra_kv
  std::optional<TensorView> attn_sink;          // [h_q] float32
  std::optional<float> softmax_scale;           // default d_qk^-0.5
  TensorView out;                               // [b, s_q, h_q, 512] bf16
  TensorView lse;                               // [b, h_q, s_q] float32, natural log, sink excluded
};

Status sparse_decode_workspace_size(const SparseDecodeArgs& args, const Options& options,
                                    WorkspaceSizes* sizes);
// Fills workspace.plan from shapes and topk_length / extra_topk_length (on the device, graph-safe).
// A plan belongs to the backend and device it was made for (the sm90 and cuda kernels cut tokens
// into tiles of different sizes): query, plan and run with the same Options::backend.
Status sparse_decode_plan(const SparseDecodeArgs& args, const Workspace& workspace,
                          const Options& options);
Status sparse_decode(const SparseDecodeArgs& args, const Workspace& workspace,
                     const Options& options);

// ---- Dense decode (spec section 4) ----
struct DenseDecodeArgs {
  TensorView q;                        // [b, s_q, h_q, d_qk] bf16 (fp16 with an fp16 cache)
  KVCache kv;                          // any format; h_q % kv.num_heads == 0
  TensorView block_table;              // [b, max_pages] int32
  TensorView cache_seqlens;            // [b] int32
  bool causal = false;                 // with s_q > 1: token s sees t <= seqlen - s_q + s
  std::optional<float> softmax_scale;  // default d_qk^-0.5
  TensorView out;                      // [b, s_q, h_q, 512], q's dtype
  TensorView lse;                      // [b, h_q, s_q] float32
};

Status dense_decode_workspace_size(const DenseDecodeArgs& args, const Options& options,
                                   WorkspaceSizes* sizes);
Status dense_decode_plan(const DenseDecodeArgs& args, const Workspace& workspace,
                         const Options& options);
Status dense_decode(const DenseDecodeArgs& args, const Workspace& workspace,
                    const Options& options);

// ---- Merge of partial attention results (e.g. from several GPUs) ----
// A part whose lse is +inf or -inf is empty and contributes nothing. The sink, if given, is applied
// once to the merged result (so the parts must come from decode calls without attn_sink); the
// returned lse excludes it.
struct MergeArgs {
  TensorView out_parts;                 // [n, b, s_q, h_q, d_v] float32 or bf16
  TensorView lse_parts;                 // [n, b, s_q, h_q] float32, natural log
  std::optional<TensorView> attn_sink;  // [h_q] float32
  TensorView out;                       // [b, s_q, h_q, d_v] bf16 or float32
  TensorView lse;                       // [b, h_q, s_q] float32
};

Status merge_attention(const MergeArgs& args, const Options& options);

// ---- KV-cache tools ----
// Quantizes token vectors with the recipe of docs/formats.md and stores them into slots
// (slot = page * page_size + offset; -1 skips the row).
struct QuantizeStoreArgs {
  TensorView src;    // [n, d_qk] bf16 or float32 (512 for MODEL1, 576 for V32)
  TensorView slots;  // [n] int32
  KVCache kv;        // MODEL1 or V32, written
};
Status quantize_store(const QuantizeStoreArgs& args, const Options& options);

// Reads slots back as rows of d_qk values (FP8 dequantized exactly; head 0 for dense formats).
// Slot -1 gives a row of zeros.
struct DequantizeArgs {
  KVCache kv;
  TensorView slots;  // [n] int32
  TensorView out;    // [n, d_qk] bf16 or float32
};
Status dequantize(const DequantizeArgs& args, const Options& options);

// Copies each request's first seqlens[i] tokens from src pages to dst pages (same format, any
// page sizes and strides). Only the pages the tables name are read or written; tokens past
// seqlens[i] in the last dst page are left untouched. src and dst may be one pool when no page is
// both read and written by the call (docs/errors.md).
struct RepackArgs {
  KVCache src;
  KVCache dst;
  TensorView src_block_table;  // [b, max_src_pages] int32
  TensorView dst_block_table;  // [b, max_dst_pages] int32
  TensorView seqlens;          // [b] int32
};
Status repack_pages(const RepackArgs& args, const Options& options);

// ---- Capability queries ----
// OK when the request is valid and some backend can run it; *chosen names that backend.
Status sparse_decode_supported(const SparseDecodeArgs& args, const Options& options,
                               Backend* chosen);
Status dense_decode_supported(const DenseDecodeArgs& args, const Options& options,
                              Backend* chosen);

}  // namespace sparse_mla
