// Validated problem descriptions handed from the API layer to the backends. Everything here has
// been checked against the tensors (shapes, dtypes, strides, devices, alignment), so backends
// may trust it. Values inside device tensors (indices, lengths, block tables) are never trusted.
#pragma once

#include <cstdint>

#include "sparse_mla/ops.h"

namespace sparse_mla {

struct SparseDecodeProblem {
  int64_t b = 0, s_q = 0, h_q = 0;
  int64_t topk = 0;        // indices.shape[2]
  int64_t extra_topk = 0;  // 0 without an extra cache
  int d_qk = 0;            // 512 (MODEL1) or 576 (V32)
  int d_v = kDV;
  float softmax_scale = 0.f;
  bool has_extra = false;
  bool sm90 = false;  // backend sm90: the wgmma kernel where it applies
};

struct DenseDecodeProblem {
  int64_t b = 0, s_q = 0, h_q = 0, h_kv = 1;
  int64_t max_pages = 0;  // block_table.shape[1]
  int d_qk = 0;
  int d_v = kDV;
  float softmax_scale = 0.f;
  bool causal = false;
  bool sm90 = false;  // backend sm90: the wgmma kernel where it applies
};

struct MergeProblem {
  int64_t n = 0, b = 0, s_q = 0, h_q = 0;
  int d_v = 0;
};

// Value semantics the backends share (documented in docs/semantics.md):
// - topk_length / extra_topk_length are clamped to [0, topk]; cache_seqlens to
//   [0, max_pages * page_size].
// - A slot outside [0, num_slots) other than -1, or a block-table entry outside [0, num_pages),
//   contributes nothing and is never dereferenced.

}  // namespace sparse_mla
