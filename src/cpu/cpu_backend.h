// CPU backend (OpenMP). Entry points called by the API layer after validation.
#pragma once

#include "src/api/problem.h"

namespace sparse_mla::cpu {

Status sparse_decode(const SparseDecodeArgs& args, const SparseDecodeProblem& p);
Status dense_decode(const DenseDecodeArgs& args, const DenseDecodeProblem& p);
Status merge_attention(const MergeArgs& args, const MergeProblem& p);
Status quantize_store(const QuantizeStoreArgs& args);
Status dequantize(const DequantizeArgs& args);
Status repack_pages(const RepackArgs& args);

}  // namespace sparse_mla::cpu
