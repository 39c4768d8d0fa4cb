// Kernel parameter blocks of the portable decode (planner, attention kernel, combine) and the
// layout of the plan inside the caller's workspace. Plain structs, every pointer with its shape.
//
// Work model: a "pair" is one sequence of tokens attended by a set of query rows: (request, query
// token) for sparse decode (b * s_q pairs, each with its own index list), one request for dense
// decode (b pairs; all query tokens and heads see the same pages). A pair's tokens are cut into
// tiles of kT; its cost is kOverhead + max(1, tiles). The planner lays all pairs end to end on one
// cost line and cuts it into num_parts equal parts; CTA (part, row block) walks the tiles of its
// part, so long pairs are split over several CTAs and short ones are packed into one. A pair
// touched by several parts writes fp32 partials that the combine kernel merges (sink applied
// there). The line holds the pairs in index order, or, where whole pairs balance the parts and that
// order does not, in an order of the planner's (pairs[] is then indexed by place on the line, and
// each entry names its pair).
#pragma once

#include <cstdint>

#include "src/cuda/common/divider.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda::smxx::decode {

// Tiles of a pair of `len` tokens: an empty pair still takes one (its CTA writes the empty row).
template <typename I>
SPARSE_MLA_HD I pair_tiles(I len, I tile) {
  return len > 0 ? (len + tile - 1) / tile : 1;
}

// Start of a part on the cost line: the first tile it owns (place of its pair on the line, tile
// within the pair), with that pair's lengths and index (PairInfo n_main, len, id), so that a CTA
// can load its first indices without reading pairs[] first.
struct alignas(16) PartStart {
  int32_t pair;
  int32_t tile;
  int32_t n_main;
  int32_t len;
  int32_t id;
  int32_t pad[3];
};

struct alignas(16) PairInfo {
  int32_t n_main;      // sparse: valid prefix of the main index list (clamped topk_length)
  int32_t len;         // tokens of the pair (sparse: n_main + n_extra; dense: clamped seqlen)
  int32_t first_part;  // part owning the pair's first tile
  int32_t nsplit;      // parts touching the pair; 1 = the kernel writes the final output
  int32_t slot;        // first partial slot of the pair when nsplit > 1
  int32_t id;          // the pair (request and query token) at this place of the cost line
  int64_t cost_begin;  // start of the pair on the cost line
};

// Plan layout in the workspace: parts[num_parts + 1] then pairs[num_pairs] (by place on the cost
// line).
struct PlanLayout {
  int64_t parts_offset = 0;
  int64_t pairs_offset = 0;
  int64_t bytes = 0;
};

inline PlanLayout plan_layout(int64_t num_parts, int64_t num_pairs) {
  PlanLayout l;
  l.parts_offset = 0;
  l.pairs_offset = ((num_parts + 1) * static_cast<int64_t>(sizeof(PartStart)) + 15) / 16 * 16;
  l.bytes = l.pairs_offset + num_pairs * static_cast<int64_t>(sizeof(PairInfo));
  return l;
}

struct CacheRef {
  const uint8_t* base;  // page 0; may be null when num_pages == 0
  int64_t page_stride;  // bytes
  int64_t num_slots;    // num_pages * page_size
  int32_t page_size;
  int32_t num_pages;
  SlotDivider page_div;  // by page_size
};

struct PlanParams {
  int32_t dense;
  int32_t s_q;
  int32_t num_pairs;  // sparse: b * s_q; dense: b
  int32_t num_parts;
  int32_t tile_tokens;
  int32_t overhead_tiles;
  int32_t min_tiles_per_part;
  int32_t busy_min_tiles;    // a larger smallest part where one-tile parts fill half the CTAs
  int32_t snap_slack_tiles;  // part starts move to pair ends if that lengthens no part by more
  // sparse
  const int32_t* topk_length;  // [b] or nullptr
  int64_t topk_length_stride;
  int32_t topk;
  const int32_t* extra_topk_length;  // [b] or nullptr
  int64_t extra_topk_length_stride;
  int32_t extra_topk;  // 0 without an extra cache
  // dense
  const int32_t* seqlens;  // [b]
  int64_t seqlens_stride;
  int64_t max_tokens;  // max_pages * page_size
  PartStart* parts;    // [num_parts + 1]
  PairInfo* pairs;     // [num_pairs]
};

struct DecodeParams {
  int32_t dense;
  int32_t causal;
  int32_t b, s_q, h_q, h_kv, hpk;  // hpk = h_q / h_kv (dense); sparse: h_kv = 1, hpk = h_q
  int32_t rows_per_group;          // query rows sharing one token list: sparse h_q, dense s_q*hpk
  int32_t blocks_per_group;        // ceil(rows_per_group / kHB)
  int32_t rows_per_pair;           // rows of a pair in the partial buffers: sparse h_q, dense s_q*h_q
  int32_t num_pairs;
  int32_t num_parts;
  float scale_log2;  // softmax_scale * log2(e)

  const uint16_t* q;  // [b, s_q, h_q, d_qk] bf16/fp16, last dim contiguous, 16-byte aligned rows
  int64_t q_stride[3];
  uint16_t* out;  // [b, s_q, h_q, 512], same dtype as q
  int64_t out_stride[3];
  float* lse;  // [b, h_q, s_q]
  int64_t lse_stride[3];
  const float* sink;  // [h_q] or nullptr
  int64_t sink_stride;

  CacheRef kv;
  CacheRef extra;  // sparse only; num_slots 0 without an extra cache

  const int32_t* indices;  // sparse: [b, s_q, topk]
  int64_t indices_stride[3];
  const int32_t* extra_indices;  // sparse: [b, s_q, extra_topk] or nullptr
  int64_t extra_indices_stride[3];

  const int32_t* block_table;  // dense: [b, max_pages]
  int64_t block_table_stride[2];

  const PartStart* parts;  // plan
  const PairInfo* pairs;
  float* part_out;  // [max_slots, rows_per_pair, 512] fp32 partial outputs (normalized)
  // The same buffer as fp16 partials (the Hopper kernel's 64-row CTAs on FP8 pages), with
  // part_exp [max_slots, rows_per_pair, 8]: value v of dim d was stored as v 2^-k, k the int8 at
  // 4 (d >= 128) + (d / 2) % 4 (one exponent per row, consumer and lane of a quad).
  uint16_t* part_out16;
  int8_t* part_exp;
  float* part_lse;  // [max_slots, rows_per_pair] base-2 partial lse, -inf when empty
  int32_t max_slots;
  // This call's bounds on a pair's lengths (sparse: topk, extra_topk; dense: 0, max_pages *
  // page_size). The kernels hold the plan's values to them and to num_pairs: a plan made for
  // other shapes, which the host cannot see, gives wrong values, never an access outside.
  int32_t max_main, max_extra;
};

}  // namespace sparse_mla::cuda::smxx::decode
