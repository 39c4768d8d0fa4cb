// cuda:: entry points of sparse and dense decode (src/cuda/cuda_backend.h): map the validated
// problem onto the portable decode kernels (launch.h), the plan and scratch onto the caller's
// workspace. Only enqueues work: no allocation, no synchronization.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "src/cuda/cuda_backend.h"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda {
namespace {

using smxx::decode::CacheRef;
using smxx::decode::DecodeParams;
using smxx::decode::DecodeShape;
using smxx::decode::Fmt;
using smxx::decode::PairInfo;
using smxx::decode::PartStart;
using smxx::decode::PlanParams;

constexpr float kLog2e = 1.4426950408889634f;
// Token positions are int32 on the device, with a tile of headroom.
constexpr int64_t kMaxTokens = INT32_MAX - 64;

Fmt fmt_of(KVFormat f) {
  switch (f) {
    case KVFormat::kModel1: return Fmt::kModel1;
    case KVFormat::kV32: return Fmt::kV32;
    case KVFormat::kBF16: return Fmt::kBF16;
    case KVFormat::kFP16: return Fmt::kFP16;
  }
  return Fmt::kModel1;
}

CacheRef cache_ref(const KVCache& kv) {
  CacheRef c{};
  c.base = static_cast<const uint8_t*>(kv.data);
  c.page_stride = kv.page_stride;
  c.num_slots = kv.num_pages * kv.page_size;
  c.page_size = static_cast<int32_t>(kv.page_size);
  c.num_pages = static_cast<int32_t>(kv.num_pages);
  c.page_div = SlotDivider::make(kv.page_size);
  return c;
}

void copy_strides(const TensorView& t, int64_t* dst, int n) {
  for (int d = 0; d < n; ++d) dst[d] = t.strides[d];
}

Status sparse_shape(const SparseDecodeProblem& p, int device, DecodeShape* s) {
  if (p.topk + p.extra_topk > kMaxTokens) {
    return Status::Unsupported("cuda sparse decode: topk + extra_topk = " +
                               std::to_string(p.topk + p.extra_topk) + ", at most " +
                               std::to_string(kMaxTokens) + " supported");
  }
  const Fmt fmt = p.d_qk == kModel1NopeDims + kRopeDims ? Fmt::kModel1 : Fmt::kV32;
  return smxx::decode::make_decode_shape(fmt, p.h_q, 1, p.b * p.s_q, p.h_q,
                                         p.topk + p.extra_topk, p.sm90, 0, device, s);
}

// Dense token positions (max_pages * page_size) must fit the kernels' 32-bit token counts.
Status check_dense_tokens(const DenseDecodeProblem& p, int64_t page_size) {
  const int64_t max_tokens = p.max_pages * page_size;
  if (max_tokens > kMaxTokens) {
    return Status::Unsupported("cuda dense decode: max_pages * page_size = " +
                               std::to_string(max_tokens) + ", at most " +
                               std::to_string(kMaxTokens) + " supported");
  }
  return Status::Ok();
}

Status dense_shape(const DenseDecodeProblem& p, Fmt fmt, int device, DecodeShape* s) {
  const int64_t hpk = p.h_q / p.h_kv;
  // The page size is not part of the problem (the workspace query has only shapes), so the
  // longest request is unknown here: no small-batch tile switch for dense decode.
  return smxx::decode::make_decode_shape(fmt, p.s_q * hpk, p.h_kv, p.b, p.s_q * p.h_q, 0, p.sm90,
                                         p.causal && p.s_q > 1 ? hpk : 0, device, s);
}

PlanParams plan_params(const DecodeShape& s, const Workspace& ws) {
  PlanParams pp{};
  pp.num_pairs = s.num_pairs;
  pp.num_parts = s.num_parts;
  pp.tile_tokens = s.kernel.tile_tokens;
  pp.overhead_tiles = s.overhead_tiles;
  pp.min_tiles_per_part = s.min_tiles_per_part;
  pp.busy_min_tiles = s.busy_min_tiles;
  pp.snap_slack_tiles = s.snap_slack_tiles;
  auto* base = static_cast<uint8_t*>(ws.plan);
  pp.parts = reinterpret_cast<PartStart*>(base + s.plan.parts_offset);
  pp.pairs = reinterpret_cast<PairInfo*>(base + s.plan.pairs_offset);
  return pp;
}

// The fields shared by sparse and dense decode.
DecodeParams decode_params(const DecodeShape& s, const Workspace& ws, const TensorView& q,
                           const TensorView& out, const TensorView& lse, float softmax_scale) {
  DecodeParams dp{};
  dp.rows_per_group = s.rows_per_group;
  dp.blocks_per_group = s.blocks_per_group;
  dp.rows_per_pair = s.rows_per_pair;
  dp.num_pairs = s.num_pairs;
  dp.num_parts = s.num_parts;
  dp.scale_log2 = softmax_scale * kLog2e;
  dp.q = static_cast<const uint16_t*>(q.data);
  copy_strides(q, dp.q_stride, 3);
  dp.out = static_cast<uint16_t*>(out.data);
  copy_strides(out, dp.out_stride, 3);
  dp.lse = static_cast<float*>(lse.data);
  copy_strides(lse, dp.lse_stride, 3);
  const auto* plan = static_cast<const uint8_t*>(ws.plan);
  dp.parts = reinterpret_cast<const PartStart*>(plan + s.plan.parts_offset);
  dp.pairs = reinterpret_cast<const PairInfo*>(plan + s.plan.pairs_offset);
  auto* scratch = static_cast<uint8_t*>(ws.scratch);
  dp.part_out = reinterpret_cast<float*>(scratch);
  dp.part_out16 = reinterpret_cast<uint16_t*>(scratch);
  dp.part_exp = reinterpret_cast<int8_t*>(scratch + s.part_exp_offset);
  dp.part_lse = reinterpret_cast<float*>(scratch + s.part_lse_offset);
  dp.max_slots = s.max_slots;
  return dp;
}

Status check_workspace_fits(const DecodeShape& s, const Workspace& ws) {
  if (ws.plan_bytes < s.plan_bytes || ws.scratch_bytes < s.scratch_bytes ||
      (s.plan_bytes > 0 && ws.plan == nullptr) || (s.scratch_bytes > 0 && ws.scratch == nullptr)) {
    return Status::InvalidArgument("workspace: plan " + std::to_string(ws.plan_bytes) +
                                   " / scratch " + std::to_string(ws.scratch_bytes) +
                                   " bytes, expected at least " + std::to_string(s.plan_bytes) +
                                   " / " + std::to_string(s.scratch_bytes));
  }
  // The kernels write partials into scratch while other CTAs read the plan.
  const auto plan = reinterpret_cast<uintptr_t>(ws.plan);
  const auto scratch = reinterpret_cast<uintptr_t>(ws.scratch);
  if (s.plan_bytes > 0 && s.scratch_bytes > 0 && plan < scratch + s.scratch_bytes &&
      scratch < plan + s.plan_bytes) {
    return Status::InvalidArgument("workspace: plan and scratch overlap (the plan's " +
                                   std::to_string(s.plan_bytes) + " bytes and the scratch's " +
                                   std::to_string(s.scratch_bytes) +
                                   " bytes must be separate memory)");
  }
  return Status::Ok();
}

Status run_decode(const DecodeShape& s, const DecodeParams& dp, bool fp16_out, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  SPARSE_MLA_RETURN_IF_ERROR(smxx::decode::launch_decode(s, dp, st));
  // With a single part no pair can be split.
  if (s.num_parts > 1) SPARSE_MLA_RETURN_IF_ERROR(smxx::decode::launch_combine(s, dp, fp16_out, st));
  return Status::Ok();
}

}  // namespace

// ---- Sparse decode ----

Status sparse_decode_workspace_size(const SparseDecodeProblem& p, int device_index,
                                    WorkspaceSizes* sizes) {
  *sizes = WorkspaceSizes{};
  if (p.b == 0) return Status::Ok();
  DecodeShape s;
  SPARSE_MLA_RETURN_IF_ERROR(sparse_shape(p, device_index, &s));
  *sizes = WorkspaceSizes{s.plan_bytes, s.scratch_bytes};
  return Status::Ok();
}

Status sparse_decode_plan(const SparseDecodeArgs& args, const SparseDecodeProblem& p,
                          const Workspace& ws, void* stream) {
  if (p.b == 0) return Status::Ok();
  DecodeShape s;
  SPARSE_MLA_RETURN_IF_ERROR(sparse_shape(p, args.q.device.index, &s));
  SPARSE_MLA_RETURN_IF_ERROR(check_workspace_fits(s, ws));
  PlanParams pp = plan_params(s, ws);
  pp.dense = 0;
  pp.s_q = static_cast<int32_t>(p.s_q);
  pp.topk = static_cast<int32_t>(p.topk);
  if (args.topk_length) {
    pp.topk_length = static_cast<const int32_t*>(args.topk_length->data);
    pp.topk_length_stride = args.topk_length->strides[0];
  }
  pp.extra_topk = static_cast<int32_t>(p.has_extra ? p.extra_topk : 0);
  if (p.has_extra && args.extra_topk_length) {
    pp.extra_topk_length = static_cast<const int32_t*>(args.extra_topk_length->data);
    pp.extra_topk_length_stride = args.extra_topk_length->strides[0];
  }
  return smxx::decode::launch_plan(pp, static_cast<cudaStream_t>(stream));
}

Status sparse_decode(const SparseDecodeArgs& args, const SparseDecodeProblem& p,
                     const Workspace& ws, void* stream) {
  if (p.b == 0) return Status::Ok();
  DecodeShape s;
  SPARSE_MLA_RETURN_IF_ERROR(sparse_shape(p, args.q.device.index, &s));
  SPARSE_MLA_RETURN_IF_ERROR(check_workspace_fits(s, ws));
  DecodeParams dp = decode_params(s, ws, args.q, args.out, args.lse, p.softmax_scale);
  dp.dense = 0;
  dp.causal = 0;
  dp.b = static_cast<int32_t>(p.b);
  dp.s_q = static_cast<int32_t>(p.s_q);
  dp.h_q = static_cast<int32_t>(p.h_q);
  dp.h_kv = 1;
  dp.hpk = static_cast<int32_t>(p.h_q);
  if (args.attn_sink) {
    dp.sink = static_cast<const float*>(args.attn_sink->data);
    dp.sink_stride = args.attn_sink->strides[0];
  }
  dp.kv = cache_ref(args.kv);
  dp.indices = static_cast<const int32_t*>(args.indices.data);
  copy_strides(args.indices, dp.indices_stride, 3);
  dp.max_main = static_cast<int32_t>(p.topk);
  dp.max_extra = static_cast<int32_t>(p.has_extra ? p.extra_topk : 0);
  if (p.has_extra) {
    dp.extra = cache_ref(*args.extra_kv);
    dp.extra_indices = static_cast<const int32_t*>(args.extra_indices->data);
    copy_strides(*args.extra_indices, dp.extra_indices_stride, 3);
  }
  return run_decode(s, dp, false, stream);
}

// ---- Dense decode ----

// The problem does not name the cache format; d_qk 576 may be V32, BF16 or FP16 pages, whose
// kernels may pick different tiles. The workspace covers the largest of them.
Status dense_decode_workspace_size(const DenseDecodeProblem& p, const KVCache& kv,
                                   int device_index, WorkspaceSizes* sizes) {
  *sizes = WorkspaceSizes{};
  if (p.b == 0) return Status::Ok();
  DecodeShape own;
  SPARSE_MLA_RETURN_IF_ERROR(dense_shape(p, fmt_of(kv.format), device_index, &own));
  SPARSE_MLA_RETURN_IF_ERROR(check_dense_tokens(p, kv.page_size));
  const Fmt m1[] = {Fmt::kModel1};
  const Fmt wide[] = {Fmt::kV32, Fmt::kBF16, Fmt::kFP16};
  const bool is_m1 = p.d_qk == kModel1NopeDims + kRopeDims;
  const Fmt* fmts = is_m1 ? m1 : wide;
  for (int k = 0; k < (is_m1 ? 1 : 3); ++k) {
    DecodeShape s;
    if (!dense_shape(p, fmts[k], device_index, &s).ok()) continue;
    sizes->plan_bytes = std::max(sizes->plan_bytes, s.plan_bytes);
    sizes->scratch_bytes = std::max(sizes->scratch_bytes, s.scratch_bytes);
  }
  return Status::Ok();
}

Status dense_decode_plan(const DenseDecodeArgs& args, const DenseDecodeProblem& p,
                         const Workspace& ws, void* stream) {
  if (p.b == 0) return Status::Ok();
  DecodeShape s;
  SPARSE_MLA_RETURN_IF_ERROR(dense_shape(p, fmt_of(args.kv.format), args.q.device.index, &s));
  SPARSE_MLA_RETURN_IF_ERROR(check_workspace_fits(s, ws));
  SPARSE_MLA_RETURN_IF_ERROR(check_dense_tokens(p, args.kv.page_size));
  PlanParams pp = plan_params(s, ws);
  pp.dense = 1;
  pp.s_q = static_cast<int32_t>(p.s_q);
  pp.seqlens = static_cast<const int32_t*>(args.cache_seqlens.data);
  pp.seqlens_stride = args.cache_seqlens.strides[0];
  pp.max_tokens = p.max_pages * args.kv.page_size;
  return smxx::decode::launch_plan(pp, static_cast<cudaStream_t>(stream));
}

Status dense_decode(const DenseDecodeArgs& args, const DenseDecodeProblem& p, const Workspace& ws,
                    void* stream) {
  if (p.b == 0) return Status::Ok();
  DecodeShape s;
  SPARSE_MLA_RETURN_IF_ERROR(dense_shape(p, fmt_of(args.kv.format), args.q.device.index, &s));
  SPARSE_MLA_RETURN_IF_ERROR(check_workspace_fits(s, ws));
  SPARSE_MLA_RETURN_IF_ERROR(check_dense_tokens(p, args.kv.page_size));
  DecodeParams dp = decode_params(s, ws, args.q, args.out, args.lse, p.softmax_scale);
  dp.dense = 1;
  dp.causal = p.causal && p.s_q > 1 ? 1 : 0;
  dp.b = static_cast<int32_t>(p.b);
  dp.s_q = static_cast<int32_t>(p.s_q);
  dp.h_q = static_cast<int32_t>(p.h_q);
  dp.h_kv = static_cast<int32_t>(p.h_kv);
  dp.hpk = static_cast<int32_t>(p.h_q / p.h_kv);
  dp.kv = cache_ref(args.kv);
  dp.block_table = static_cast<const int32_t*>(args.block_table.data);
  copy_strides(args.block_table, dp.block_table_stride, 2);
  dp.max_main = 0;
  dp.max_extra = static_cast<int32_t>(p.max_pages * args.kv.page_size);  // fits: check_dense_tokens
  return run_decode(s, dp, args.kv.format == KVFormat::kFP16, stream);
}

}  // namespace sparse_mla::cuda
