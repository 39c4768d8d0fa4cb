// Public operations: validate arguments, pick a backend, dispatch.
#include "sparse_mla/ops.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "src/api/problem.h"
#include "src/api/validate.h"
#include "src/cpu/cpu_backend.h"

#if SPARSE_MLA_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/cuda_backend.h"
#endif

namespace sparse_mla {

namespace {

using validate::check_kv_cache;
using validate::check_kv_format;
using validate::check_same_device;
using validate::check_tensor;
using validate::kAny;
using validate::TensorSpec;

constexpr DType kBF16 = DType::kBFloat16;
constexpr DType kF32 = DType::kFloat32;
constexpr DType kI32 = DType::kInt32;

std::string str(int64_t v) { return std::to_string(v); }

// ---- backend selection ----

Status requested_backend(const Options& options, Backend* requested) {
  const int value = static_cast<int>(options.backend);
  if (value < static_cast<int>(Backend::kAuto) || value > static_cast<int>(Backend::kSM90)) {
    return Status::InvalidArgument("options.backend: value " + str(value) +
                                   ", expected auto, cpu, cuda or sm90");
  }
  *requested = options.backend;
  if (options.backend != Backend::kAuto) return Status::Ok();
  const char* env = std::getenv("SPARSE_MLA_BACKEND");
  if (env == nullptr || *env == '\0') return Status::Ok();
  Status s = parse_backend(env, requested);
  if (!s.ok()) return Status::InvalidArgument("environment variable SPARSE_MLA_BACKEND: " + s.message());
  return Status::Ok();
}

// Picks the backend for tensors on `device`. `op` names the operation for messages.
Status select_backend(const Options& options, Device device, const char* op, Backend* chosen) {
  if (device.type != DeviceType::kCPU && device.type != DeviceType::kCUDA) {
    return Status::InvalidArgument(std::string(op) + ": device type " +
                                   std::to_string(static_cast<int>(device.type)) +
                                   ", expected cpu or cuda");
  }
  Backend requested = Backend::kAuto;
  SPARSE_MLA_RETURN_IF_ERROR(requested_backend(options, &requested));
  if (device.type == DeviceType::kCPU) {
    if (requested == Backend::kAuto || requested == Backend::kCPU) {
      *chosen = Backend::kCPU;
      return Status::Ok();
    }
    return Status::InvalidArgument(std::string(op) + ": backend '" + backend_name(requested) +
                                   "' runs on CUDA tensors, but the tensors are on cpu");
  }
  if (requested == Backend::kCPU) {
    return Status::InvalidArgument(std::string(op) + ": backend 'cpu' runs on host tensors, but "
                                   "the tensors are on " + device_name(device));
  }
#if SPARSE_MLA_WITH_CUDA
  std::string why_not;
  if (!cuda::device_usable(device.index, &why_not)) {
    return Status::Unsupported(std::string(op) + ": " + why_not);
  }
  // auto: the Hopper path where it can run. Operations without a Hopper kernel of their own run
  // the portable kernels under either name.
  const bool sm90 = cuda::sm90_usable(device.index, &why_not);
  if (requested == Backend::kSM90 && !sm90) {
    return Status::Unsupported(std::string(op) + ": backend 'sm90': " + why_not);
  }
  *chosen = requested == Backend::kCUDA || !sm90 ? Backend::kCUDA : Backend::kSM90;
  return Status::Ok();
#else
  return Status::Unsupported(std::string(op) + ": tensors are on " + device_name(device) +
                             " but this build has no CUDA backend (built without nvcc)");
#endif
}

#if SPARSE_MLA_WITH_CUDA
// Makes the tensors' device current for the call and restores the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      if (cudaSetDevice(device) == cudaSuccess) switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};
#endif

Status check_scale(const std::optional<float>& scale, int d_qk, float* resolved) {
  if (!scale) {
    *resolved = 1.0f / std::sqrt(static_cast<float>(d_qk));
    return Status::Ok();
  }
  // The kernels work in base 2: scale * log2(e) must be finite too (2.35e38 * 1.4427 < FLT_MAX).
  constexpr float kMaxScale = 2.35e38f;
  if (!std::isfinite(*scale) || *scale <= 0.f || *scale > kMaxScale) {
    return Status::InvalidArgument("softmax_scale: " + std::to_string(*scale) +
                                   ", expected a finite value > 0 and at most 2.35e38");
  }
  *resolved = *scale;
  return Status::Ok();
}

Status check_length_tensor(const std::optional<TensorView>& t, const char* name, int64_t b,
                           Device device) {
  if (!t) return Status::Ok();
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(*t, {name, {kI32}, {b}, "[b]"}));
  return check_same_device(*t, name, device, "q");
}

// Query rows b * s_q * h_q: the backends count rows and token lists in 32-bit integers. Only
// tensors with zero strides come near the limit (q alone would take terabytes).
Status check_query_rows(const char* name, int64_t b, int64_t s_q, int64_t h_q) {
  constexpr int64_t kMaxRows = INT32_MAX;
  if (b > 0 && s_q > 0 && (s_q > kMaxRows / b || h_q > kMaxRows / (b * s_q))) {
    return Status::InvalidArgument(std::string(name) + ": b * s_q * h_q = " + str(b) + " * " +
                                   str(s_q) + " * " + str(h_q) + " query rows, expected at most " +
                                   str(kMaxRows));
  }
  return Status::Ok();
}

// ---- per-operation validation ----

Status validate_sparse(const SparseDecodeArgs& a, SparseDecodeProblem* p) {
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.q, {"q", {kBF16}, {kAny, kAny, kAny, kAny}, "[b, s_q, h_q, d_qk]", true, 16}));
  const Device dev = a.q.device;
  p->b = a.q.shape[0];
  p->s_q = a.q.shape[1];
  p->h_q = a.q.shape[2];
  if (p->s_q < 1) return Status::InvalidArgument("q: s_q (dim 1) is " + str(p->s_q) + ", expected >= 1");
  if (p->h_q < 1) return Status::InvalidArgument("q: h_q (dim 2) is " + str(p->h_q) + ", expected >= 1");
  SPARSE_MLA_RETURN_IF_ERROR(check_query_rows("q", p->b, p->s_q, p->h_q));
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_format(a.kv, "k_cache"));
  if (!kv_format_is_fp8(a.kv.format)) {
    return Status::InvalidArgument(std::string("k_cache: format ") + kv_format_name(a.kv.format) +
                                   ", expected MODEL1 or V32 (FP8 pages) for sparse decode");
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.kv, "k_cache"));
  if (a.kv.device != dev) {
    return Status::InvalidArgument("k_cache: on " + device_name(a.kv.device) + ", expected " +
                                   device_name(dev) + " (the device of q)");
  }
  p->d_qk = kv_format_d_qk(a.kv.format);
  if (a.q.shape[3] != p->d_qk) {
    return Status::InvalidArgument("q: last dim " + str(a.q.shape[3]) + ", expected " +
                                   str(p->d_qk) + " (d_qk of the " + kv_format_name(a.kv.format) +
                                   " cache)");
  }
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.indices, {"indices", {kI32}, {p->b, p->s_q, kAny}, "[b, s_q, topk]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.indices, "indices", dev, "q"));
  p->topk = a.indices.shape[2];
  if (p->topk < 1) return Status::InvalidArgument("indices: topk (dim 2) is 0, expected >= 1");
  SPARSE_MLA_RETURN_IF_ERROR(check_length_tensor(a.topk_length, "topk_length", p->b, dev));

  p->has_extra = a.extra_kv.has_value();
  if (!p->has_extra) {
    if (a.extra_indices) return Status::InvalidArgument("extra_indices: given without extra_k_cache");
    if (a.extra_topk_length) {
      return Status::InvalidArgument("extra_topk_length: given without extra_k_cache");
    }
  } else {
    SPARSE_MLA_RETURN_IF_ERROR(check_kv_format(*a.extra_kv, "extra_k_cache"));
    if (a.extra_kv->format != a.kv.format) {
      return Status::InvalidArgument(std::string("extra_k_cache: format ") +
                                     kv_format_name(a.extra_kv->format) + ", expected " +
                                     kv_format_name(a.kv.format) + " (the format of k_cache)");
    }
    SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(*a.extra_kv, "extra_k_cache"));
    if (a.extra_kv->device != dev) {
      return Status::InvalidArgument("extra_k_cache: on " + device_name(a.extra_kv->device) +
                                     ", expected " + device_name(dev) + " (the device of q)");
    }
    if (!a.extra_indices) {
      return Status::InvalidArgument("extra_indices: missing, expected [b, s_q, extra_topk] int32 "
                                     "with extra_k_cache");
    }
    SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
        *a.extra_indices, {"extra_indices", {kI32}, {p->b, p->s_q, kAny}, "[b, s_q, extra_topk]"}));
    SPARSE_MLA_RETURN_IF_ERROR(check_same_device(*a.extra_indices, "extra_indices", dev, "q"));
    p->extra_topk = a.extra_indices->shape[2];
    if (p->extra_topk < 1) {
      return Status::InvalidArgument("extra_indices: extra_topk (dim 2) is 0, expected >= 1");
    }
    SPARSE_MLA_RETURN_IF_ERROR(
        check_length_tensor(a.extra_topk_length, "extra_topk_length", p->b, dev));
  }
  if (a.attn_sink) {
    SPARSE_MLA_RETURN_IF_ERROR(check_tensor(*a.attn_sink, {"attn_sink", {kF32}, {p->h_q}, "[h_q]"}));
    SPARSE_MLA_RETURN_IF_ERROR(check_same_device(*a.attn_sink, "attn_sink", dev, "q"));
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_scale(a.softmax_scale, p->d_qk, &p->softmax_scale));
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.out, {"out", {kBF16}, {p->b, p->s_q, p->h_q, kDV}, "[b, s_q, h_q, 512]", true, 16}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.out, "out", dev, "q"));
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.lse, {"lse", {kF32}, {p->b, p->h_q, p->s_q}, "[b, h_q, s_q]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.lse, "lse", dev, "q"));
  return Status::Ok();
}

Status validate_dense(const DenseDecodeArgs& a, DenseDecodeProblem* p) {
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.q, {"q", {kBF16, DType::kFloat16}, {kAny, kAny, kAny, kAny}, "[b, s_q, h_q, d_qk]", true, 16}));
  const Device dev = a.q.device;
  p->b = a.q.shape[0];
  p->s_q = a.q.shape[1];
  p->h_q = a.q.shape[2];
  if (p->s_q < 1) return Status::InvalidArgument("q: s_q (dim 1) is " + str(p->s_q) + ", expected >= 1");
  if (p->h_q < 1) return Status::InvalidArgument("q: h_q (dim 2) is " + str(p->h_q) + ", expected >= 1");
  SPARSE_MLA_RETURN_IF_ERROR(check_query_rows("q", p->b, p->s_q, p->h_q));
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.kv, "k_cache"));
  if (a.kv.device != dev) {
    return Status::InvalidArgument("k_cache: on " + device_name(a.kv.device) + ", expected " +
                                   device_name(dev) + " (the device of q)");
  }
  const DType want_q = a.kv.format == KVFormat::kFP16 ? DType::kFloat16 : kBF16;
  if (a.q.dtype != want_q) {
    return Status::InvalidArgument(std::string("q: dtype ") + dtype_name(a.q.dtype) +
                                   ", expected " + dtype_name(want_q) + " with a " +
                                   kv_format_name(a.kv.format) + " cache");
  }
  p->d_qk = kv_format_d_qk(a.kv.format);
  if (a.q.shape[3] != p->d_qk) {
    return Status::InvalidArgument("q: last dim " + str(a.q.shape[3]) + ", expected " +
                                   str(p->d_qk) + " (d_qk of the " + kv_format_name(a.kv.format) +
                                   " cache)");
  }
  p->h_kv = a.kv.num_heads;
  if (p->h_q % p->h_kv != 0) {
    return Status::InvalidArgument("q: h_q " + str(p->h_q) + " is not a multiple of h_kv " +
                                   str(p->h_kv) + " (k_cache dim 2)");
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.block_table, {"block_table", {kI32}, {p->b, kAny}, "[b, max_pages]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.block_table, "block_table", dev, "q"));
  p->max_pages = a.block_table.shape[1];
  if (p->max_pages > 0 && p->max_pages > validate::kMaxExtent / a.kv.page_size) {
    return Status::InvalidArgument("block_table: max_pages * page_size = " + str(p->max_pages) +
                                   " * " + str(a.kv.page_size) + " exceeds " +
                                   str(validate::kMaxExtent) + " tokens");
  }
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.cache_seqlens, {"cache_seqlens", {kI32}, {p->b}, "[b]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.cache_seqlens, "cache_seqlens", dev, "q"));
  p->causal = a.causal;
  SPARSE_MLA_RETURN_IF_ERROR(check_scale(a.softmax_scale, p->d_qk, &p->softmax_scale));
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.out, {"out", {a.q.dtype}, {p->b, p->s_q, p->h_q, kDV}, "[b, s_q, h_q, 512]", true, 16}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.out, "out", dev, "q"));
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.lse, {"lse", {kF32}, {p->b, p->h_q, p->s_q}, "[b, h_q, s_q]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.lse, "lse", dev, "q"));
  return Status::Ok();
}

Status validate_merge(const MergeArgs& a, MergeProblem* p) {
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(a.out_parts, {"out_parts", {kF32, kBF16},
                                                        {kAny, kAny, kAny, kAny, kAny},
                                                        "[n, b, s_q, h_q, d_v]", true}));
  const Device dev = a.out_parts.device;
  p->n = a.out_parts.shape[0];
  p->b = a.out_parts.shape[1];
  p->s_q = a.out_parts.shape[2];
  p->h_q = a.out_parts.shape[3];
  const int64_t d_v = a.out_parts.shape[4];
  if (p->n < 1) return Status::InvalidArgument("out_parts: n (dim 0) is 0, expected >= 1");
  SPARSE_MLA_RETURN_IF_ERROR(check_query_rows("out_parts", p->b, p->s_q, p->h_q));
  if (d_v < 1 || d_v > 4096) {
    return Status::InvalidArgument("out_parts: d_v (dim 4) is " + str(d_v) + ", expected 1..4096");
  }
  p->d_v = static_cast<int>(d_v);
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.lse_parts, {"lse_parts", {kF32}, {p->n, p->b, p->s_q, p->h_q}, "[n, b, s_q, h_q]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.lse_parts, "lse_parts", dev, "out_parts"));
  if (a.attn_sink) {
    SPARSE_MLA_RETURN_IF_ERROR(check_tensor(*a.attn_sink, {"attn_sink", {kF32}, {p->h_q}, "[h_q]"}));
    SPARSE_MLA_RETURN_IF_ERROR(check_same_device(*a.attn_sink, "attn_sink", dev, "out_parts"));
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.out, {"out", {kBF16, kF32}, {p->b, p->s_q, p->h_q, d_v}, "[b, s_q, h_q, d_v]", true}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.out, "out", dev, "out_parts"));
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.lse, {"lse", {kF32}, {p->b, p->h_q, p->s_q}, "[b, h_q, s_q]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.lse, "lse", dev, "out_parts"));
  return Status::Ok();
}

Status validate_quantize_store(const QuantizeStoreArgs& a) {
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_format(a.kv, "kv"));
  if (!kv_format_is_fp8(a.kv.format)) {
    return Status::InvalidArgument(std::string("kv: format ") + kv_format_name(a.kv.format) +
                                   ", expected MODEL1 or V32 (quantize_store writes FP8 pages)");
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.kv, "kv"));
  const int64_t d = kv_format_d_qk(a.kv.format);
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.src, {"src", {kBF16, kF32}, {kAny, d}, "[n, d_qk]", true}));
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(a.slots, {"slots", {kI32}, {a.src.shape[0]}, "[n]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.slots, "slots", a.src.device, "src"));
  if (a.kv.device != a.src.device) {
    return Status::InvalidArgument("kv: on " + device_name(a.kv.device) + ", expected " +
                                   device_name(a.src.device) + " (the device of src)");
  }
  return Status::Ok();
}

Status validate_dequantize(const DequantizeArgs& a) {
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.kv, "kv"));
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(a.slots, {"slots", {kI32}, {kAny}, "[n]"}));
  const int64_t d = kv_format_d_qk(a.kv.format);
  SPARSE_MLA_RETURN_IF_ERROR(
      check_tensor(a.out, {"out", {kBF16, kF32}, {a.slots.shape[0], d}, "[n, d_qk]", true}));
  SPARSE_MLA_RETURN_IF_ERROR(check_same_device(a.slots, "slots", a.kv.device, "kv"));
  return check_same_device(a.out, "out", a.kv.device, "kv");
}

Status validate_repack(const RepackArgs& a) {
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.src, "src"));
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_cache(a.dst, "dst"));
  if (a.src.format != a.dst.format || a.src.num_heads != a.dst.num_heads) {
    return Status::InvalidArgument(std::string("dst: format ") + kv_format_name(a.dst.format) +
                                   " with " + str(a.dst.num_heads) + " heads, expected " +
                                   kv_format_name(a.src.format) + " with " +
                                   str(a.src.num_heads) + " heads (the format of src)");
  }
  if (a.dst.device != a.src.device) {
    return Status::InvalidArgument("dst: on " + device_name(a.dst.device) + ", expected " +
                                   device_name(a.src.device) + " (the device of src)");
  }
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(a.seqlens, {"seqlens", {kI32}, {kAny}, "[b]"}));
  const int64_t b = a.seqlens.shape[0];
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.src_block_table, {"src_block_table", {kI32}, {b, kAny}, "[b, max_src_pages]"}));
  SPARSE_MLA_RETURN_IF_ERROR(check_tensor(
      a.dst_block_table, {"dst_block_table", {kI32}, {b, kAny}, "[b, max_dst_pages]"}));
  for (const auto& [t, name] : {std::pair{&a.seqlens, "seqlens"},
                                std::pair{&a.src_block_table, "src_block_table"},
                                std::pair{&a.dst_block_table, "dst_block_table"}}) {
    SPARSE_MLA_RETURN_IF_ERROR(check_same_device(*t, name, a.src.device, "src"));
  }
  return Status::Ok();
}

#if SPARSE_MLA_WITH_CUDA
Status check_decode_workspace(const Workspace& ws, const WorkspaceSizes& need) {
  SPARSE_MLA_RETURN_IF_ERROR(
      validate::check_workspace(ws.plan, ws.plan_bytes, need.plan_bytes, "workspace.plan"));
  return validate::check_workspace(ws.scratch, ws.scratch_bytes, need.scratch_bytes,
                                   "workspace.scratch");
}
#endif

// What differs between sparse and dense decode at this layer; the Decode* templates below do
// the rest (validation, backend choice, workspace checks, dispatch) once for both.
struct SparseOp {
  using Args = SparseDecodeArgs;
  using Problem = SparseDecodeProblem;
  static constexpr const char* kName = "sparse_decode";
  static Status validate(const Args& a, Problem* p) { return validate_sparse(a, p); }
  static Status run_cpu(const Args& a, const Problem& p) { return cpu::sparse_decode(a, p); }
#if SPARSE_MLA_WITH_CUDA
  static Status sizes(const Args& a, const Problem& p, WorkspaceSizes* sizes) {
    return cuda::sparse_decode_workspace_size(p, a.q.device.index, sizes);
  }
  static Status plan(const Args& a, const Problem& p, const Workspace& ws, void* stream) {
    return cuda::sparse_decode_plan(a, p, ws, stream);
  }
  static Status run(const Args& a, const Problem& p, const Workspace& ws, void* stream) {
    return cuda::sparse_decode(a, p, ws, stream);
  }
#endif
};

struct DenseOp {
  using Args = DenseDecodeArgs;
  using Problem = DenseDecodeProblem;
  static constexpr const char* kName = "dense_decode";
  static Status validate(const Args& a, Problem* p) { return validate_dense(a, p); }
  static Status run_cpu(const Args& a, const Problem& p) { return cpu::dense_decode(a, p); }
#if SPARSE_MLA_WITH_CUDA
  static Status sizes(const Args& a, const Problem& p, WorkspaceSizes* sizes) {
    return cuda::dense_decode_workspace_size(p, a.kv, a.q.device.index, sizes);
  }
  static Status plan(const Args& a, const Problem& p, const Workspace& ws, void* stream) {
    return cuda::dense_decode_plan(a, p, ws, stream);
  }
  static Status run(const Args& a, const Problem& p, const Workspace& ws, void* stream) {
    return cuda::dense_decode(a, p, ws, stream);
  }
#endif
};

// Validates, picks the backend and records it in the problem.
template <typename Op>
Status prepare_decode(const typename Op::Args& args, const Options& options,
                      typename Op::Problem* p, Backend* backend) {
  SPARSE_MLA_RETURN_IF_ERROR(Op::validate(args, p));
  SPARSE_MLA_RETURN_IF_ERROR(select_backend(options, args.q.device, Op::kName, backend));
  p->sm90 = *backend == Backend::kSM90;
  return Status::Ok();
}

// Valid, and the chosen backend can run it (on CUDA: its kernels' limits, as the run checks).
template <typename Op>
Status decode_supported(const typename Op::Args& args, const Options& options, Backend* chosen) {
  typename Op::Problem p;
  SPARSE_MLA_RETURN_IF_ERROR(prepare_decode<Op>(args, options, &p, chosen));
#if SPARSE_MLA_WITH_CUDA
  WorkspaceSizes need;
  if (*chosen != Backend::kCPU) return Op::sizes(args, p, &need);
#endif
  return Status::Ok();
}

template <typename Op>
Status decode_workspace_size(const typename Op::Args& args, const Options& options,
                             WorkspaceSizes* sizes) {
  typename Op::Problem p;
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(prepare_decode<Op>(args, options, &p, &backend));
  *sizes = WorkspaceSizes{};  // the CPU backend needs no workspace
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) return Op::sizes(args, p, sizes);
#endif
  return Status::Ok();
}

// Plans (run == false) or runs one decode call.
template <typename Op>
Status decode_call(const typename Op::Args& args, const Workspace& workspace,
                   const Options& options, bool run) {
  typename Op::Problem p;
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(prepare_decode<Op>(args, options, &p, &backend));
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) {
    WorkspaceSizes need;
    SPARSE_MLA_RETURN_IF_ERROR(Op::sizes(args, p, &need));
    SPARSE_MLA_RETURN_IF_ERROR(check_decode_workspace(workspace, need));
    DeviceGuard guard(args.q.device.index);
    return run ? Op::run(args, p, workspace, options.stream)
               : Op::plan(args, p, workspace, options.stream);
  }
#endif
  (void)workspace;
  if (!run || p.b == 0) return Status::Ok();  // the CPU backend needs no plan
  return Op::run_cpu(args, p);
}

}  // namespace

// ---- Sparse decode ----

Status sparse_decode_supported(const SparseDecodeArgs& args, const Options& options,
                               Backend* chosen) {
  return decode_supported<SparseOp>(args, options, chosen);
}

Status sparse_decode_workspace_size(const SparseDecodeArgs& args, const Options& options,
                                    WorkspaceSizes* sizes) {
  return decode_workspace_size<SparseOp>(args, options, sizes);
}

Status sparse_decode_plan(const SparseDecodeArgs& args, const Workspace& workspace,
                          const Options& options) {
  return decode_call<SparseOp>(args, workspace, options, false);
}

Status sparse_decode(const SparseDecodeArgs& args, const Workspace& workspace,
                     const Options& options) {
  return decode_call<SparseOp>(args, workspace, options, true);
}

// ---- Dense decode ----

Status dense_decode_supported(const DenseDecodeArgs& args, const Options& options,
                              Backend* chosen) {
  return decode_supported<DenseOp>(args, options, chosen);
}

Status dense_decode_workspace_size(const DenseDecodeArgs& args, const Options& options,
                                   WorkspaceSizes* sizes) {
  return decode_workspace_size<DenseOp>(args, options, sizes);
}

Status dense_decode_plan(const DenseDecodeArgs& args, const Workspace& workspace,
                         const Options& options) {
  return decode_call<DenseOp>(args, workspace, options, false);
}

Status dense_decode(const DenseDecodeArgs& args, const Workspace& workspace,
                    const Options& options) {
  return decode_call<DenseOp>(args, workspace, options, true);
}

// ---- Merge and KV tools ----

Status merge_attention(const MergeArgs& args, const Options& options) {
  MergeProblem p;
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(validate_merge(args, &p));
  SPARSE_MLA_RETURN_IF_ERROR(select_backend(options, args.out_parts.device, "merge_attention", &backend));
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) {
    DeviceGuard guard(args.out_parts.device.index);
    return cuda::merge_attention(args, p, options.stream);
  }
#endif
  if (p.b == 0 || p.s_q == 0 || p.h_q == 0) return Status::Ok();
  return cpu::merge_attention(args, p);
}

Status quantize_store(const QuantizeStoreArgs& args, const Options& options) {
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(validate_quantize_store(args));
  SPARSE_MLA_RETURN_IF_ERROR(select_backend(options, args.src.device, "quantize_store", &backend));
  if (args.src.shape[0] == 0) return Status::Ok();
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) {
    DeviceGuard guard(args.src.device.index);
    return cuda::quantize_store(args, options.stream);
  }
#endif
  return cpu::quantize_store(args);
}

Status dequantize(const DequantizeArgs& args, const Options& options) {
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(validate_dequantize(args));
  SPARSE_MLA_RETURN_IF_ERROR(select_backend(options, args.kv.device, "dequantize", &backend));
  if (args.slots.shape[0] == 0) return Status::Ok();
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) {
    DeviceGuard guard(args.kv.device.index);
    return cuda::dequantize(args, options.stream);
  }
#endif
  return cpu::dequantize(args);
}

Status repack_pages(const RepackArgs& args, const Options& options) {
  Backend backend;
  SPARSE_MLA_RETURN_IF_ERROR(validate_repack(args));
  SPARSE_MLA_RETURN_IF_ERROR(select_backend(options, args.src.device, "repack_pages", &backend));
  if (args.seqlens.shape[0] == 0) return Status::Ok();
#if SPARSE_MLA_WITH_CUDA
  if (backend != Backend::kCPU) {
    DeviceGuard guard(args.src.device.index);
    return cuda::repack_pages(args, options.stream);
  }
#endif
  return cpu::repack_pages(args);
}

}  // namespace sparse_mla
