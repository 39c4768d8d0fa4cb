// fp64 reference of the attention operations (spec sections 3-5), computed from the dequantized
// cache over host tensors read through their strides. Test and tool code only.
#pragma once

#include <cstdint>
#include <vector>

#include "sparse_mla/ops.h"

namespace sparse_mla::ref {

// Reference outputs: out laid out [b, s_q, h_q, d_v], lse [b, h_q, s_q] (the API's logical shapes),
// lse natural log and sink excluded; empty rows give out 0 and lse +inf.
struct RefOutput {
  int64_t b = 0, s_q = 0, h_q = 0, d_v = 0;
  std::vector<double> out;
  std::vector<double> lse;

  double& out_at(int64_t i, int64_t s, int64_t h, int64_t d) {
    return out[((i * s_q + s) * h_q + h) * d_v + d];
  }
  double out_at(int64_t i, int64_t s, int64_t h, int64_t d) const {
    return out[((i * s_q + s) * h_q + h) * d_v + d];
  }
  double& lse_at(int64_t i, int64_t s, int64_t h) { return lse[(i * h_q + h) * s_q + s]; }
  double lse_at(int64_t i, int64_t s, int64_t h) const { return lse[(i * h_q + h) * s_q + s]; }
};

// Sparse decode: one softmax over the valid slots of both caches (entries past the clamped
// lengths, -1 and out-of-range slots skipped), sink applied to out only.
RefOutput sparse_decode_reference(const SparseDecodeArgs& args);
// Which query heads args.q holds: heads [first, first + q's h_q) of a call with `total` heads
// (total 0: all of them). A window keeps each head on the KV head of its place in the whole call,
// (first + h) / (total / h_kv), which a plain slice of q would change when h_kv > 1. A window
// outside [0, total), or a total that h_kv does not divide, throws std::invalid_argument.
struct HeadWindow {
  int64_t first = 0;
  int64_t total = 0;
};
// Dense decode through the block table: lengths clamped, causal, h_kv grouping, block-table
// entries outside [0, num_pages) skipped.
RefOutput dense_decode_reference(const DenseDecodeArgs& args, HeadWindow window = {});
// Merge of (out, lse) parts: parts with lse +-inf contribute nothing; sink applied once.
RefOutput merge_reference(const MergeArgs& args);

}  // namespace sparse_mla::ref
