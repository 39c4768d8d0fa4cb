// Tile-configuration choice, workspace sizing and the attention-kernel launch.
#include "src/cuda/smxx/decode/launch.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "src/cuda/common/check.h"
#include "src/cuda/sm90/sm90.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

// Runs f with `device` current, restoring the caller's device.
template <typename F>
Status on_device(int device, F&& f) {
  int old = 0;
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&old));
  if (old != device) SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  Status st = f();
  if (old != device) {
    const cudaError_t err = cudaSetDevice(old);
    if (st.ok() && err != cudaSuccess) return cuda_status(err, "cudaSetDevice (restore)");
  }
  return st;
}

Status device_limits(int device, DeviceLimits* info) {
  static std::mutex mu;
  static std::map<int, DeviceLimits> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) {
    *info = it->second;
    return Status::Ok();
  }
  DeviceLimits d;
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&d.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  cache[device] = d;
  *info = d;
  return Status::Ok();
}

// Raises the kernel's dynamic shared-memory limit on `device` and returns its CTAs per SM. Cached:
// the attribute and the occupancy never change for a (device, kernel).
Status prepare_kernel(const KernelEntry& k, int device, int* ctas_per_sm) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(device, k.fn);
  auto it = cache.find(key);
  if (it != cache.end()) {
    *ctas_per_sm = it->second;
    return Status::Ok();
  }
  int n = 0;
  SPARSE_MLA_RETURN_IF_ERROR(on_device(device, [&]() -> Status {
    SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes));
    SPARSE_MLA_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.fn, k.threads, k.smem_bytes));
    return Status::Ok();
  }));
  n = std::max(n, 1);
  cache[key] = n;
  *ctas_per_sm = n;
  return Status::Ok();
}

}  // namespace

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::kModel1: return "MODEL1";
    case Fmt::kV32: return "V32";
    case Fmt::kBF16: return "BF16";
    case Fmt::kFP16: return "FP16";
  }
  return "?";
}

KernelEntry kernel_entry(Fmt fmt, TileCfg cfg) {
  switch (fmt) {
    case Fmt::kModel1: return kernel_entry_model1(cfg);
    case Fmt::kV32: return kernel_entry_v32(cfg);
    case Fmt::kBF16: return kernel_entry_bf16(cfg);
    case Fmt::kFP16: return kernel_entry_fp16(cfg);
  }
  return KernelEntry{};
}

Status pick_decode_kernel(Fmt fmt, int64_t rows_per_group, int64_t groups, int64_t num_pairs,
                          int64_t max_len, bool sm90, int64_t causal_hpk,
                          const DeviceLimits& dev, KernelPick* pick) {
  // Fewest padded rows first (a CTA's K tile is dequantized once for all its rows), then the
  // largest tiles that fit the device's shared memory.
  const TileCfg big[] = {TileCfg::kH64T32, TileCfg::kH32T32, TileCfg::kH16T32, TileCfg::kH16T16};
  const TileCfg mid[] = {TileCfg::kH32T32, TileCfg::kH16T32, TileCfg::kH16T16};
  const TileCfg small[] = {TileCfg::kH16T32, TileCfg::kH16T16};
  const TileCfg* order = rows_per_group > 32 ? big : (rows_per_group > 16 ? mid : small);
  int n_order = rows_per_group > 32 ? 4 : (rows_per_group > 16 ? 3 : 2);
  // Small batches: when even the longest possible lists give fewer 64-row CTAs of two tiles than
  // the GPU has SMs, 32-row CTAs finish sooner (C1 s_q=2 b=2 on H200: 21.5 us against 25.4 us);
  // with enough work the 64-row tiles win (C1 s_q=1 b=256: 185 us against 275 us; s_q=2 b=64:
  // 92 us against 146 us), as each K tile is dequantized once for 64 heads.
  bool small_batch = false;
  if (rows_per_group > 16 && max_len > 0) {
    const int64_t tiles = pair_tiles<int64_t>(max_len, 32);
    const int64_t blocks64 = (rows_per_group + 63) / 64 * groups;
    if (num_pairs * tiles * blocks64 < 2 * static_cast<int64_t>(dev.sm_count)) {
      order = mid;
      n_order = 3;
      small_batch = true;
    }
  }
  // Test hook: SPARSE_MLA_DECODE_TILES=64x32|32x32|16x32|16x16 forces one portable configuration
  // (also under the sm90 backend), so that tests on a big GPU also run the tiles that only
  // small-shared-memory GPUs would pick.
  TileCfg forced[1];
  bool force = false;
  if (const char* env = std::getenv("SPARSE_MLA_DECODE_TILES")) {
    const std::string v(env);
    const char* names[] = {"64x32", "32x32", "16x32", "16x16"};
    for (int c = 0; c < kNumTileCfgs; ++c) {
      if (v == names[c]) {
        forced[0] = static_cast<TileCfg>(c);
        order = forced;
        n_order = 1;
        force = true;
      }
    }
  }
  KernelEntry k;
  TileCfg cfg = TileCfg::kH16T16;
  for (int c = 0; c < n_order; ++c) {
    const KernelEntry e = kernel_entry(fmt, order[c]);
    if (e.fn != nullptr && e.smem_bytes <= dev.max_smem_optin) {
      k = e;
      cfg = order[c];
      break;
    }
  }
  // The Hopper kernel computes 64 rows per CTA. With 17-32 rows it still beats the portable
  // 32-row tiles despite the padding (H200, b = 128, h_q 32: sparse MODEL1 C1 97 us against
  // 126 us, dense bf16 s_k 16384 708 us against 1157 us). With 16 rows or fewer FP8 pages take
  // its narrow form (S^T = K Q^T over 16 rows, no padding), which beats the portable 16-row tiles
  // (H200, h_q 16, b = 128: sparse MODEL1 C1 s_q 2 63.2 us against 70.3; dense s_k 16384 MODEL1
  // 527 against 729, V32 583 against 797); 16-bit pages, which the Hopper kernel loads by TMA,
  // take the 64-row CTAs at any row count (Hopper against portable, dense bf16 s_k 16384: h_q 16
  // 598 against 696 us, h_q 1 591 against 689). Small batches (above) finish sooner on 32-row
  // portable CTAs (H200, MODEL1 b = 2, kernel spans: 13.1-16.3 us against 14.7-19.0 us on the 6
  // rows this rule routes; the h_q 128 s_q 2 rows are not small by it and stay on the Hopper
  // kernel). Test hook: SPARSE_MLA_SM90_SMALL_BATCHES=1 keeps small batches on the Hopper kernel,
  // so that the small shapes of the GPU tests cover it.
  const char* sm90_small = std::getenv("SPARSE_MLA_SM90_SMALL_BATCHES");
  const bool keep_small = sm90_small != nullptr && std::string(sm90_small) == "1";
  const bool wide = rows_per_group > 16 || fmt == Fmt::kBF16 || fmt == Fmt::kFP16;
  // The narrow form holds one CTA an SM and starts slower than the portable 16-row tiles, so
  // small work stays on those: sparse lists of fewer 64-token tiles in all than two per SM, and
  // dense batches of few (request, KV head) lists, whose lengths are unknown here (H200, h_q 16:
  // sparse MODEL1 s_q 2 b = 2 14.4 us portable against 18.3 narrow; dense MODEL1 b = 1 s_k 1024
  // 14.3 against 19.6, b = 8 s_k 1024 18.9 against 21.8 and s_k 8192 38.3 against 37.1).
  if (!wide) {
    const int64_t sm_count = dev.sm_count;
    small_batch = max_len > 0 ? num_pairs * pair_tiles<int64_t>(max_len, 64) * groups < 2 * sm_count
                              : num_pairs * groups < kNarrowMinDenseLists;
  }
  // A Hopper kernel that needs more shared memory than the device grants leaves the portable
  // configuration picked above in place.
  bool use_sm90 = sm90 && !force && (!small_batch || keep_small);
  if (use_sm90) {
    // Causal calls whose CTAs hold rows of several query tokens (a token's causal_hpk rows not a
    // multiple of a CTA's) take the form that cleans the causal tail; a CTA whose rows are of one
    // query token never loads the tokens past its horizon (Sm90Cta::hidden_len).
    auto entry = [&](bool causal_tail) {
      return wide ? sm90::kernel_entry(fmt, causal_tail)
                  : sm90::narrow_kernel_entry(fmt, causal_tail);
    };
    KernelEntry hopper = entry(false);
    if (causal_hpk > 0 && causal_hpk % hopper.rows_per_cta != 0) hopper = entry(true);
    if (hopper.smem_bytes <= dev.max_smem_optin) {
      k = hopper;
    } else {
      use_sm90 = false;
    }
  }
  if (k.fn == nullptr) {
    return Status::Unsupported(std::string("cuda decode: no ") + fmt_name(fmt) +
                               " tile configuration fits the " +
                               std::to_string(dev.max_smem_optin) +
                               " bytes of shared memory per block");
  }
  pick->kernel = k;
  pick->cfg = cfg;
  pick->sm90 = use_sm90;
  return Status::Ok();
}

Status make_decode_shape(Fmt fmt, int64_t rows_per_group, int64_t groups, int64_t num_pairs,
                         int64_t rows_per_pair, int64_t max_len, bool sm90, int64_t causal_hpk,
                         int device, DecodeShape* shape) {
  if (num_pairs > kMaxTokenLists) {
    return Status::Unsupported("cuda decode: " + std::to_string(num_pairs) +
                               " token lists (sparse: b * s_q, dense: b), at most " +
                               std::to_string(kMaxTokenLists) + " supported");
  }
  DeviceLimits dev;
  SPARSE_MLA_RETURN_IF_ERROR(device_limits(device, &dev));
  KernelPick pick;
  Status picked = pick_decode_kernel(fmt, rows_per_group, groups, num_pairs, max_len, sm90,
                                     causal_hpk, dev, &pick);
  if (!picked.ok()) {
    return Status(picked.code(), picked.message() + " of device " + std::to_string(device));
  }
  const KernelEntry& k = pick.kernel;
  const bool use_sm90 = pick.sm90;
  int ctas_per_sm = 1;
  SPARSE_MLA_RETURN_IF_ERROR(prepare_kernel(k, device, &ctas_per_sm));

  DecodeShape s;
  s.fmt = fmt;
  s.cfg = pick.cfg;
  s.sm90 = use_sm90;
  s.kernel = k;
  s.rows_per_group = static_cast<int>(rows_per_group);
  s.blocks_per_group = static_cast<int>((rows_per_group + k.rows_per_cta - 1) / k.rows_per_cta);
  s.groups = static_cast<int>(groups);
  s.num_pairs = static_cast<int>(num_pairs);
  s.rows_per_pair = static_cast<int>(rows_per_pair);
  const int64_t row_blocks = static_cast<int64_t>(s.blocks_per_group) * groups;
  if (row_blocks > 65535) {
    return Status::Unsupported("cuda decode: " + std::to_string(row_blocks) +
                               " row blocks of " + std::to_string(k.rows_per_cta) +
                               " query rows per token list, at most 65535 supported");
  }
  // One wave of CTAs over all row blocks.
  const int64_t slots = static_cast<int64_t>(dev.sm_count) * ctas_per_sm;
  s.num_parts = static_cast<int>(std::max<int64_t>(1, slots / row_blocks));
  s.overhead_tiles =
      use_sm90 ? kSm90OverheadTiles : std::max(1, kOverheadTokens / k.tile_tokens);
  s.min_tiles_per_part = std::max(1, kMinTokensPerPart / k.tile_tokens);
  s.busy_min_tiles = use_sm90 ? kSm90BusyMinTiles : 0;
  s.snap_slack_tiles = kSnapSlackTiles;
  s.busy_parts = s.num_parts;
  if (max_len > 0) {
    const int64_t cost = num_pairs * (s.overhead_tiles +
                                       pair_tiles<int64_t>(max_len, k.tile_tokens));
    s.busy_parts = std::min<int64_t>(s.busy_parts, (cost + s.min_tiles_per_part - 1) /
                                                       s.min_tiles_per_part);
  }
  s.dependent_launch = dev.cc_major >= 9;
  s.max_slots = static_cast<int>(
      std::min<int64_t>(2 * static_cast<int64_t>(s.num_parts), num_pairs + s.num_parts));
  s.plan = plan_layout(s.num_parts, num_pairs);
  s.plan_bytes = static_cast<size_t>(s.plan.bytes);
  const int64_t part_rows = static_cast<int64_t>(s.max_slots) * rows_per_pair;
  s.part_lse_offset = part_rows * kDV * static_cast<int64_t>(sizeof(float));
  s.part_exp_offset = (s.part_lse_offset + part_rows * static_cast<int64_t>(sizeof(float)) + 15) /
                      16 * 16;
  s.scratch_bytes = static_cast<size_t>(s.part_exp_offset + part_rows * 8);
  s.part16 = use_sm90 && sm90_fp16_partials(fmt, k.rows_per_cta);
  *shape = s;
  return Status::Ok();
}

Status launch_decode(const DecodeShape& shape, const DecodeParams& params, cudaStream_t stream) {
  if (shape.sm90) return sm90::launch_decode(shape, params, stream);
  void* args[] = {const_cast<DecodeParams*>(&params)};
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(shape.kernel.fn, decode_grid(shape),
                                                   dim3(shape.kernel.threads), args,
                                                   static_cast<size_t>(shape.kernel.smem_bytes),
                                                   stream));
  return check_launch("sparse_mla decode kernel");
}

}  // namespace sparse_mla::cuda::smxx::decode
