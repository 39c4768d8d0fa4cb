// Host side of the portable decode: picking a tile configuration for the device, sizing the plan
// and scratch buffers, and launching planner, attention and combine kernels on a stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sparse_mla/status.h"
#include "src/cuda/smxx/decode/config.h"
#include "src/cuda/smxx/decode/params.h"

namespace sparse_mla::cuda::smxx::decode {

// One compiled attention kernel (instantiations/).
struct KernelEntry {
  const void* fn = nullptr;
  int threads = 0;
  int smem_bytes = 0;
  int tile_tokens = 0;
  int rows_per_cta = 0;
};
KernelEntry kernel_entry(Fmt fmt, TileCfg cfg);
KernelEntry kernel_entry_model1(TileCfg cfg);
KernelEntry kernel_entry_v32(TileCfg cfg);
KernelEntry kernel_entry_bf16(TileCfg cfg);
KernelEntry kernel_entry_fp16(TileCfg cfg);

// "MODEL1", "V32", "BF16", "FP16" (error messages).
const char* fmt_name(Fmt fmt);

// What the kernel pick needs of a device (make_decode_shape asks the driver; tests pass their
// own, e.g. less shared memory than the GPU they run on has).
struct DeviceLimits {
  int sm_count = 0;
  int max_smem_optin = 0;  // bytes of shared memory a block may opt in to
  int cc_major = 0;
};

// The attention kernel of a decode: a portable tile configuration, or the Hopper kernel.
struct KernelPick {
  KernelEntry kernel;
  TileCfg cfg = TileCfg::kH16T16;  // portable kernels only
  bool sm90 = false;
};

// Picks the kernel for these shapes (arguments as in make_decode_shape) on a device with these
// limits: the portable tile configuration of fewest padded rows that fits its shared memory,
// and with sm90 the Hopper kernel where it applies (below) and fits; one that does not fit
// leaves the portable pick in place. Unsupported when no configuration fits.
Status pick_decode_kernel(Fmt fmt, int64_t rows_per_group, int64_t groups, int64_t num_pairs,
                          int64_t max_len, bool sm90, int64_t causal_hpk,
                          const DeviceLimits& dev, KernelPick* pick);

// Everything a decode call derives from shapes and the device: the same inputs always give the
// same shape, so plan() and run() agree without storing anything.
struct DecodeShape {
  Fmt fmt = Fmt::kModel1;
  TileCfg cfg = TileCfg::kH64T32;  // portable kernels only
  bool sm90 = false;                // the Hopper kernel instead
  KernelEntry kernel;
  int rows_per_group = 0;    // query rows sharing a token list
  int blocks_per_group = 0;  // CTAs (row blocks) per group
  int groups = 1;            // dense: h_kv
  int num_pairs = 0;
  int rows_per_pair = 0;
  int num_parts = 0;  // grid.x
  int64_t busy_parts = 0;  // parts that can get work: num_parts, fewer for short token lists
  int overhead_tiles = 0;  // planner cost line, in tiles of the kernel (kOverheadTokens or
                           // kSm90OverheadTiles)
  int min_tiles_per_part = 0;  // (kMinTokensPerPart)
  int busy_min_tiles = 0;      // (kSm90BusyMinTiles; 0: none)
  int snap_slack_tiles = 0;    // (kSnapSlackTiles)
  bool dependent_launch = false;  // combine as a programmatic dependent launch (sm_90+)
  int max_slots = 0;
  PlanLayout plan;
  int64_t part_lse_offset = 0;  // in scratch, after the fp32 partial outputs
  int64_t part_exp_offset = 0;  // in scratch, after the partial lse
  bool part16 = false;  // fp16 partials with exponents (sm90_fp16_partials)
  size_t plan_bytes = 0;
  size_t scratch_bytes = 0;
};

// rows_per_group / groups / num_pairs / rows_per_pair as in DecodeParams; max_len bounds the
// tokens of a pair from the shapes alone (0: unknown). sm90: use the Hopper wgmma kernel
// (src/cuda/sm90/) where it applies: 16-bit pages at any row count, FP8 pages except small
// batches (64-row CTAs above 16 rows a token list, its narrow 16-row form at or below).
// causal_hpk: for a causal dense call with s_q > 1 the query rows of one query token (h_q /
// h_kv), else 0; where a Hopper CTA's rows span query tokens, its kernel cleans the causal tail
// (sm90::kernel_entry).
Status make_decode_shape(Fmt fmt, int64_t rows_per_group, int64_t groups, int64_t num_pairs,
                         int64_t rows_per_pair, int64_t max_len, bool sm90, int64_t causal_hpk,
                         int device, DecodeShape* shape);

// Token lists a call (sparse: b * s_q, dense: b): the planner and the kernels walk them with
// 32-bit counters that step by a CTA of threads, so the count stays well below 2^31.
inline constexpr int64_t kMaxTokenLists = int64_t{1} << 30;

// Cost-line constants of the planner: a pair's fixed cost (Q load, pipeline fill, epilogue) and
// the smallest part worth a CTA (a split writes a 2 KB fp32 partial row per query row, so cutting
// below a few tiles costs more traffic than it saves). The Hopper kernel's fixed cost is two of
// its tiles (H200 sweep, sm90_notes.md variant 32: one tile left MODEL1 C3/C4 b=128 2.6-4%
// slower, four or five slowed C1 b=128 by 8%).
inline constexpr int kOverheadTokens = 64;
inline constexpr int kSm90OverheadTiles = 2;
inline constexpr int kMinTokensPerPart = 64;
// The Hopper kernel's smallest part where one-tile parts would keep at least half of its CTAs
// busy: their 64-row partials (128 KB a CTA against 28 KB of MODEL1 rows a tile), all written at
// once, then cost more than a second tile a part. H200, variant 103: MODEL1 C4 s_q 2 b=2 22.2 ->
// 20.6 us; the same minimum everywhere made dense b=1 s_k 1024 5-11% slower, and a larger one on
// the portable kernel every portable b=2 row 5-55% slower.
inline constexpr int kSm90BusyMinTiles = 2;
// Dense batches with fewer (request, KV head) token lists than this stay on the portable tiles
// rather than the Hopper kernel's narrow form (make_decode_shape).
inline constexpr int kNarrowMinDenseLists = 16;
// What the combine of split pairs costs, in tiles of a part: the planner moves part starts to
// pair ends (no pair split, nothing to combine) where that lengthens the longest part by at most
// this much. H200: the combine takes 9-14 us of a call with split pairs at b >= 64
// (sm90_notes.md, probe 94), 4-6 tiles of a Hopper CTA at h_q 128.
inline constexpr int kSnapSlackTiles = 4;

// The portable attention kernel's grid: a part a CTA along x, the row blocks of every group
// along y (the Hopper kernel's grid is the transpose: sm90_grid in sm90/kernels.cu).
inline dim3 decode_grid(const DecodeShape& shape) {
  return dim3(static_cast<unsigned>(shape.num_parts),
              static_cast<unsigned>(shape.blocks_per_group * shape.groups));
}

Status launch_plan(const PlanParams& params, cudaStream_t stream);
Status launch_decode(const DecodeShape& shape, const DecodeParams& params, cudaStream_t stream);
// Merges the partials of split pairs into out / lse (no-op CTAs for unsplit pairs).
Status launch_combine(const DecodeShape& shape, const DecodeParams& params, bool fp16_out,
                      cudaStream_t stream);

}  // namespace sparse_mla::cuda::smxx::decode
