// The Hopper (sm_90a) decode kernel: same work split, plan, parameters and combine as the portable
// kernel (src/cuda/smxx/decode/), with warpgroup MMAs fed from shared memory.
//
// One CTA owns 64 query rows and walks the tiles of its part (64 tokens, FP8 pages 48); four
// warpgroups:
//   producers (warps 0-7): gather each tile's rows, kT / 8 tokens a warp, and write them as a bf16
//             tile for all 64 rows. FP8 pages: raw rows land by bulk copy (one a token; MODEL1's
//             footer scales by cp.async) in raw stages (MODEL1 two, V32 one), ahead of their
//             use, and are dequantized from there (the gather latency stays off the producers'
//             path). bf16/fp16: straight into the tile, dense pages by TMA (a box of 8 tokens x 64
//             dims), rows TMA cannot take by cp.async. They also load Q at the start of
//             every pair. Where no other CTA reads the same rows (the token list's rows fit
//             one CTA), the row loads are evicted first from L2: a stream read once, which
//             should not push out what the rest of the program keeps there.
//   consumers (warps 8-15), two warpgroups; O stays in registers, V is the tile's first 512
//             dims read MN-major; S is a wgmma with both operands in shared memory.
//             Consumer 0 computes S for the whole tile (wgmma m64n64 / m64n48), the softmax
//             of all rows, and writes P (as wgmma A fragments) and the rows' rescale factors
//             into shared memory; consumer 0 accumulates O[:, 0, 128), consumer 1 O[:, 128,
//             512) while consumer 0 goes on to the next tile's S and softmax, both with P from
//             registers.
// Hand-offs: full/empty mbarriers per tile stage, q_full/q_empty for Q, a named barrier (P
// ready) and an mbarrier (P read) between the consumers per tile.
//
// Shared-memory operands use the 128-byte swizzle: a [rows x d] matrix is stored as d / 64
// blocks of [rows x 128 bytes]; 16-byte chunk c of row r sits at chunk c ^ (r % 8).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "src/cuda/common/fp8.cuh"
#include "src/cuda/common/ptx.cuh"
#include "src/cuda/sm90/wgmma.cuh"
#include "src/cuda/smxx/decode/config.h"
#include "src/cuda/smxx/decode/decode_kernel.cuh"
#include "src/cuda/smxx/decode/params.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda::sm90 {

using smxx::decode::all_tokens_visible;
using smxx::decode::DecodeParams;
using smxx::decode::finite_or_zero;
using smxx::decode::Fmt;
using smxx::decode::FormatTraits;
using smxx::decode::hidden_tail;
using smxx::decode::next_max;
using smxx::decode::PairInfo;
using smxx::decode::part_holds;
using smxx::decode::part_pair_end;
using smxx::decode::part_pair_info;
using smxx::decode::PartStart;
using smxx::decode::RowRef;
using smxx::decode::token_visible;

// kRowsArg: query rows per CTA. 64 is the wgmma M of S = Q K^T. Narrow CTAs (16 rows, FP8 pages
// with 16 query rows or fewer a token list) compute S^T = K Q^T instead, with the tile's 64 tokens
// as M and the rows as N, and O^T = V^T P^T, so that no padded rows are computed.
template <Fmt F, int kRowsArg = 64>
struct Sm90Config {
  using Traits = FormatTraits<F>;
  static constexpr int kRows = kRowsArg;  // query rows per CTA
  static constexpr bool kNarrow = kRows < 64;
  static_assert(kRows == 64 || (kRows == 16 && Traits::kFP8), "wide, or narrow FP8 CTAs");
  // FP8 pages stage their raw rows (kStaged): bulk copies land them in raw stages, and the
  // producers convert from there. 48-token tiles make room for the raw stages next to two bf16
  // stages and Q in the 227 KB of shared memory: two for MODEL1, one for V32's larger rows and
  // d_qk (a V32 warp copies its next tile's rows as soon as it has converted this one's; 32-token
  // tiles with three raw stages were 6% slower, variant 141). Narrow CTAs, whose Q is small,
  // take 64-token tiles (the M of S^T) with as many raw stages. V32 rows went through the
  // producers' registers until variants 141b and 142; staged they are 6-12% faster in the 64-row
  // CTAs and as fast in the narrow ones.
  static constexpr bool kStaged = Traits::kFP8;
  static constexpr int kT = kStaged && !kNarrow ? 48 : 64;  // tokens per tile
  static constexpr int kDqk = Traits::kDqk;
  static constexpr int kStages = 2;
  static constexpr int kRawStages = !kStaged ? 0 : (F == Fmt::kModel1 ? 2 : 1);
  static constexpr int kProducerWarps = 8;
  static constexpr int kProducerThreads = kProducerWarps * 32;
  static constexpr int kTokensPerWarp = kT / kProducerWarps;
  static constexpr int kThreads = kProducerThreads + 256;
  // The consumers split by role: consumer 0 computes S for the whole tile (narrow: S^T) and the
  // softmax, and accumulates output dims [0, kDimsS); consumer 1 the others, overlapping the
  // next tile's S and softmax (with 256 dims each, consumer 0 was the slower one: variant 109).
  // Producers that copy (56 registers) or convert from the raw stages (72: at 64 they wait
  // longer on their loads) leave room for consumer 1's 192 accumulators and the P fragments of
  // its wgmma in flight (232; at 224 ptxas serializes its wgmma). Narrow consumers' accumulators
  // are small, so narrow producers get 128 (variant 111: at 72 / 96 MODEL1 was 2-5% slower).
  static constexpr int kDimsS = 128;
  static constexpr int kProducerRegs = kNarrow ? 128 : (kStaged ? 72 : 56);
  // 2 * 128 kProducerRegs + 128 (kSRegs + kPVRegs) = 128 * 512 (launch)
  static constexpr int kPVRegs = kNarrow ? 256 - kProducerRegs : 232;
  static constexpr int kSRegs = 512 - 2 * kProducerRegs - kPVRegs;

  static constexpr int kBlockBytes = kT * 128;    // one 64-dim column block of a tile
  static constexpr int kQBlockBytes = kRows * 128;  // ... of Q
  static constexpr int kQBytes = kRows * kDqk * 2;
  static constexpr int kTileBytes = kT * kDqk * 2;
  static constexpr int kPBytes = kRows * 128;  // P (narrow: P^T) rows of 64 tokens (kT used)
  // A raw stage: the rows (MODEL1 576 bytes, V32 656 with their scales), MODEL1's 8 footer scale
  // bytes a token, then [8] uint8 valid bits.
  static constexpr int kRawRowBytes = F == Fmt::kModel1 ? kModel1RowBytes : Traits::kRowBytes;
  static constexpr int kRawScaleOff = kT * kRawRowBytes;
  static constexpr int kRawValidOff = kRawScaleOff + kT * Traits::kScaleBytes;
  static constexpr int kRawBytes = kRawValidOff + 16;

  static constexpr int kQOff = 0;
  static constexpr int kTileOff = kQOff + kQBytes;
  static constexpr int kPOff = kTileOff + kStages * kTileBytes;
  static constexpr int kRawOff = kPOff + kPBytes;
  // Per-row floats the consumers exchange: [2][kRows]; narrow CTAs [16][kRows] (Sm90Cta::exch).
  static constexpr int kExchFloats = (kNarrow ? 16 : 2) * kRows;
  static constexpr int kExchOff = kRawOff + kRawStages * kRawBytes;
  static constexpr int kMaskOff = kExchOff + kExchFloats * 4;  // [kStages][8] uint8 valid bits
  static constexpr int kBarOff = kMaskOff + kStages * 8;      // mbarriers
  // + one barrier a raw stage and producer warp (staged rows by bulk copy), + P free
  static constexpr int kNumBars = 2 * kStages + 2 + kRawStages * kProducerWarps + 1;
  static constexpr int kUsedBytes = kBarOff + kNumBars * 8;
  static constexpr int kSmemBytes = kUsedBytes + 1024;  // room to align the base to 1024

  static_assert(kQBytes % 1024 == 0 && kTileBytes % 1024 == 0 && kPBytes % 1024 == 0 &&
                    kT % 8 == 0,
                "swizzle atoms (8 rows, 1024 bytes) stay aligned");
  static_assert(kRawBytes % 16 == 0, "raw stages keep 16-byte alignment");
};

// Byte offset of 16-byte chunk `chunk` (of a d-wide row) of row `row` in a swizzled matrix of
// `rows` rows.
__device__ __forceinline__ uint32_t sw_off(int row, int chunk, int rows) {
  return (chunk >> 3) * (rows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

#if SPARSE_MLA_SM90_DEVICE

// Pair id's request i and query token sq (dense: the request, sq 0).
__device__ __forceinline__ void pair_coords(const DecodeParams& p, int id, int* i, int* sq) {
  *i = p.dense ? id : id / p.s_q;
  *sq = p.dense ? 0 : id - *i * p.s_q;
}

// Walks the tiles of one part in order, as the portable kernel does: pairs from the part's
// start to its end, and within a pair its tiles [k0, k1). Small on purpose: the producers keep
// three of them live.
template <int kT>
struct TileCursor {
  // A part start that no pair is the first of, so that every pair's lengths come from pairs[]
  // (INT_MAX: enter() only asks for pairs below num_pairs).
  static constexpr PartStart kPastBegin{INT_MAX, 0, 0, 0, 0, {}};

  int pr;   // place of the pair on the cost line; num_pairs when done
  int k;    // tile within the pair
  int k0;   // first tile of the pair in this part
  int k1;   // end tile of the pair in this part
  int seg;  // pairs entered before this one
  int n_main, len;  // of the pair (PairInfo)
  int id;           // the pair (pair_coords: its request and query token)

  __device__ bool valid(const DecodeParams& p) const { return pr < p.num_pairs; }
  __device__ bool first() const { return k == k0; }
  __device__ bool last() const { return k + 1 == k1; }
  __device__ PairInfo info() const {
    PairInfo i{};
    i.n_main = n_main;
    i.len = len;
    return i;
  }

  // Enters pair pr at tile kt, skipping pairs with no tile in this part; begin: the part's start,
  // whose first pair's lengths come with it (kPastBegin once the cursor has left that pair).
  __device__ void enter(const DecodeParams& p, PartStart end, int kt, PartStart begin) {
    while (pr < p.num_pairs && part_holds(end, pr, kt)) {
      const PairInfo info = part_pair_info(p, begin, pr);
      k1 = part_pair_end(end, pr, smxx::decode::pair_tiles(info.len, kT));
      if (kt < k1) {
        k = k0 = kt;
        n_main = info.n_main;
        len = info.len;
        id = info.id;
        return;
      }
      ++pr;
      kt = 0;
    }
    pr = p.num_pairs;
  }

  __device__ void init(const DecodeParams& p, int part, PartStart end) {
    const PartStart begin = part_begin(p, part);
    pr = begin.pair;
    // A part with no tile leaves the tile fields unset in enter(), but batches read them.
    k = k0 = k1 = seg = n_main = len = id = 0;
    enter(p, end, begin.tile, begin);
  }

  __device__ void advance(const DecodeParams& p, PartStart end) {
    if (pr >= p.num_pairs) return;
    if (k + 1 < k1) {
      ++k;
      return;
    }
    ++pr;
    ++seg;
    enter(p, end, 0, kPastBegin);
  }
};

// kCausalTail: the kernel for causal dense calls with s_q > 1 whose CTAs hold rows of query
// tokens with different horizons, which cleans the causal tail's V (clean_tail); the others go
// without that code, which cost them 1-2% where it only sat in the consumers' loops (H200,
// session 66).
template <Fmt F, int kRowsArg, bool kCausalTail>
struct Sm90Cta {
  using Cfg = Sm90Config<F, kRowsArg>;
  using Tr = FormatTraits<F>;
  static constexpr bool kHalf = Tr::kFP16;
  static constexpr bool kPart16 = sm90_fp16_partials(F, kRowsArg);
  static constexpr int kT = Cfg::kT, kRows = Cfg::kRows;
  static constexpr int kChunks = Cfg::kDqk / 8;  // 16-byte chunks of a 16-bit row
  static constexpr int kRopeSrc = F == Fmt::kModel1 ? 28 : 33;  // rope chunks in a stored FP8 row
  static constexpr int kRopeDst = F == Fmt::kModel1 ? 56 : 64;  // ... and in the bf16 row

  // Named barriers between the consumers (0 is __syncthreads).
  static constexpr int kPReadyBarrier = 1;    // P and the rescale factors written
  static constexpr int kEpilogueBarrier = 2;  // a pair's end: the output factors written
  static constexpr int kNarrowBarrier = 3;    // narrow: consumer 0's warps (column maxima, sums)
  static constexpr int kTailBarrier0 = 4;     // consumer 0's / 1's warps around clean_tail
  static constexpr int kTailBarrier1 = 5;
  static constexpr int kDV = smxx::decode::kDV;
  static constexpr int kDimsS = Cfg::kDimsS;  // output dims [0, kDimsS) are consumer 0's

  const DecodeParams& p;
  uint8_t* smem;
  int part, grp, row0, nrows;
  // Causal dense decode: the tokens at a list's end past the horizon of this CTA's last query
  // token, which none of its rows sees. The producers never load them (they count as absent),
  // so a CTA whose rows are all of one query token has no causal tail to clean.
  int hidden_len;
  // 16-bit dense pages as a TMA tensor (dim, KV head, token in page, page), boxes of 64 dims x
  // 8 tokens; nullptr where the host could not describe the cache that way (or
  // SPARSE_MLA_SM90_TMA=0).
  const CUtensorMap* kv_map;
  // L2 policy of the KV row loads (TMA boxes, bulk copies): evict first where
  // this CTA is their only reader. The cp.async paths keep the default: cp.async under this
  // policy, built by ptxas 13.0, stopped the portable kernel with an illegal instruction on the
  // H200 (sm90_notes.md, variant 84).
  uint64_t kv_policy;

  __device__ uint8_t* q_smem() const { return smem + Cfg::kQOff; }
  __device__ uint8_t* tile_smem(int st) const { return smem + Cfg::kTileOff + st * Cfg::kTileBytes; }
  __device__ uint8_t* p_smem() const { return smem + Cfg::kPOff; }
  // Per-row values the consumers hand each other: kAlpha the rows' O rescale factors (each
  // tile), kFactor the output factors (a pair's end).
  static constexpr int kAlpha = 0, kFactor = 1;
  __device__ float* exch(int k) const {
    return reinterpret_cast<float*>(smem + Cfg::kExchOff) + k * kRows;
  }
  __device__ uint8_t* mask_smem(int st) const { return smem + Cfg::kMaskOff + st * 8; }
  __device__ uint64_t* bar(int i) const { return reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff) + i; }
  __device__ uint64_t* full_bar(int st) const { return bar(st); }
  __device__ uint64_t* empty_bar(int st) const { return bar(Cfg::kStages + st); }
  __device__ uint64_t* q_full_bar() const { return bar(2 * Cfg::kStages); }
  __device__ uint64_t* q_empty_bar() const { return bar(2 * Cfg::kStages + 1); }
  // FP8 staged rows: warp pw's rows of raw stage rs landed (bulk copies).
  __device__ uint64_t* raw_bar(int rs, int pw) const {
    return bar(2 * Cfg::kStages + 2 + rs * Cfg::kProducerWarps + pw);
  }
  // Consumer 1 has read P, the rescale factors and the output factors, so consumer 0 may
  // write the next ones. An mbarrier rather than a named barrier: its arrive
  // orders consumer 1's earlier reads, which compute-sanitizer's racecheck can follow.
  __device__ uint64_t* p_free_bar() const {
    return bar(2 * Cfg::kStages + 2 + Cfg::kRawStages * Cfg::kProducerWarps);
  }

  // Query row `lr` of the CTA's group -> (query token, head).
  __device__ void row_coords(int lr, int sq, int* s, int* head) const {
    if (p.dense) {
      *s = lr / p.hpk;
      *head = grp * p.hpk + lr % p.hpk;
    } else {
      *s = sq;
      *head = lr;
    }
  }

  // ---------------------------------------------------------------- producers (warps 0-7)

  // Producers resolve their rows kBatchTiles tiles at a time: lane l < kBatchTiles kW holds token
  // l % kW (of the warp's kW) of tile l / kW of a batch. A lane's index load, page division and
  // row addresses are then issued by the warp once a batch instead of once a tile, and a batch's
  // indices are loaded a batch ahead of their use.
  static constexpr int kBatchTiles = 32 / Cfg::kTokensPerWarp;
  static_assert(kBatchTiles > 1, "a batch's indices are loaded and resolved in different tiles");
  struct PendingToken {
    int raw;  // >= 0 only below the pair's length (load_raw)
    int pos;  // the token's position in its pair; bit 31: an extra-cache token
  };

  // The lane's token of the batch that starts at `first`, up to its index load; `first` moves on
  // to the next batch.
  __device__ PendingToken load_batch(TileCursor<kT>& first, PartStart end, int lane,
                                     int tok) const {
    TileCursor<kT> mine = first;
#pragma unroll 1
    for (int u = 0; u < kBatchTiles; ++u) {
      if (u == lane / Cfg::kTokensPerWarp) mine = first;
      first.advance(p, end);
    }
    PendingToken t{-1, 0};
    if (lane < kBatchTiles * Cfg::kTokensPerWarp) {
      const int pos = mine.k * kT + tok;
      int i, sq;
      pair_coords(p, mine.id, &i, &sq);
      PairInfo info = mine.info();
      info.len = max(info.len - hidden_len, 0);
      if (mine.valid(p)) t.raw = smxx::decode::load_raw(p, info, i, sq, pos);
      t.pos = !p.dense && pos >= mine.n_main ? pos | INT_MIN : pos;
    }
    return t;
  }
  __device__ RowRef resolve_pending(const PendingToken& t) const {
    // raw >= 0 already says that the token is below the pair's length; the sign bit says which
    // cache it is in.
    PairInfo info{};
    info.n_main = t.pos < 0 ? 0 : INT_MAX;
    info.len = INT_MAX;
    return smxx::decode::resolve<F>(p, info, grp, t.pos & INT_MAX, t.raw);
  }

  // The data row that lane `j` of the warp resolved (every lane must call).
  __device__ static const uint8_t* row_of_lane(const RowRef& ref, int j) {
    return reinterpret_cast<const uint8_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(ref.row), j));
  }
  // Source address of zero-filling copies (0 bytes are read from it).
  __device__ const uint8_t* never_read() const { return reinterpret_cast<const uint8_t*>(p.q); }

  __device__ void load_q(const TileCursor<kT>& c, int tid) {
    static_assert(kChunks >= 64 && kChunks <= 96, "a lane copies two or three chunks of a row");
    int i, sq;
    pair_coords(p, c.id, &i, &sq);
    // Padding rows are zero-filled by the copy too (0 bytes read from q): every write to Q is a
    // cp.async, so that the thread's one arrival on q_full can be the copies' completion. The
    // loops are not unrolled: unrolled copies' addresses and predicates spilled in the
    // producers' registers.
    if constexpr (F != Fmt::kV32) {
      // A warp a row (rows w, w + kProducerWarps, ...): the row's source is worked out once and
      // lane l copies chunks l, l + 32 and l + 64, 4 column blocks apart in the swizzled layout.
      // Its copies go out ~1 us sooner than with a chunk a thread (variants 134, 135). V32
      // keeps a chunk a thread: the per-row form was 1-1.5% slower on V32 b=128 (variant 136,
      // measured when its rows still went through the producers' registers).
      const int lane = tid & 31;
#pragma unroll 1
      for (int r = tid >> 5; r < kRows; r += Cfg::kProducerWarps) {
        const bool live = r < nrows;
        const uint16_t* src = p.q + lane * 8;
        if (live) {
          int s, head;
          row_coords(row0 + r, sq, &s, &head);
          src += i * p.q_stride[0] + s * p.q_stride[1] + head * p.q_stride[2];
        }
        uint8_t* dst = q_smem() + (lane >> 3) * Cfg::kQBlockBytes + r * 128 +
                       (((lane & 7) ^ (r & 7)) << 4);
        ptx::cp_async_16_zfill(dst, src, live);
        ptx::cp_async_16_zfill(dst + 4 * Cfg::kQBlockBytes, src + 32 * 8, live);
        if (lane + 64 < kChunks) {
          ptx::cp_async_16_zfill(dst + 8 * Cfg::kQBlockBytes, src + 64 * 8, live);
        }
      }
    } else {
#pragma unroll 1
      for (int u = tid; u < kRows * kChunks; u += Cfg::kProducerThreads) {
        const int r = u / kChunks, ch = u % kChunks;
        const uint16_t* src = p.q;
        if (r < nrows) {
          int s, head;
          row_coords(row0 + r, sq, &s, &head);
          src = p.q + i * p.q_stride[0] + s * p.q_stride[1] + head * p.q_stride[2] + ch * 8;
        }
        ptx::cp_async_16_zfill(q_smem() + sw_off(r, ch, kRows), src, r < nrows);
      }
    }
    mbar_arrive_on_cp_async(q_full_bar());
  }

  // 16-bit pages: each warp copies its kW tokens' rows straight into the tile, dense pages as
  // TMA boxes where a warp's tokens are all present, other rows by cp.async.
  __device__ void producer() {
    static_assert(!Tr::kFP8, "FP8 pages are staged (producer_staged)");
    const int tid = threadIdx.x;
    const int lane = tid & 31, pw = tid >> 5;
    constexpr int kW = Cfg::kTokensPerWarp;
    const int tok = pw * kW + lane % kW;  // the lane's token of its tile of a batch
    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;
    cur.init(p, part, end);
    // The rows of the current batch, and their pages (raw values) for the TMA boxes. The next
    // batch's indices are loaded behind the batch's first tile and resolved at its last.
    TileCursor<kT> ahead = cur;
    PendingToken pending = load_batch(ahead, end, lane, tok);
    // The first pair's Q goes out right after the first index loads and before they are
    // resolved, so that the two overlap without Q's copies ahead of the indices (variant 131b).
    if (cur.valid(p)) load_q(cur, tid);
    int batch_raw = pending.raw;
    RowRef batch = resolve_pending(pending);
    RowRef next{nullptr, nullptr};
    int u = 0;  // cur's place in the batch: lanes [u kW, u kW + kW) hold its rows

    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      const uint32_t phase = (it / Cfg::kStages) & 1;
      const int base = u * kW;
      if (u + 1 == kBatchTiles) next = resolve_pending(pending);
      // Rows are not prefetched into L2: with L2 at 88% of its throughput on dense bf16 h_q 128,
      // the extra requests cost 1-3% (variant 26), and 15% on the memory-bound rows whose CTA is
      // their only reader (variant 137), also as one bulk prefetch a warp (variant 140).

      if (cur.first() && it > 0) {  // the first pair's Q went out before the loop
        mbar_wait(q_empty_bar(), (cur.seg & 1) ^ 1);
        load_q(cur, tid);
      }

      mbar_wait(empty_bar(st), phase ^ 1);
      uint8_t* tile = tile_smem(st);
      const uint32_t valid =
          (__ballot_sync(0xffffffffu, batch.row != nullptr) >> base) & ((1u << kW) - 1);
      if (lane == 0) mask_smem(st)[pw] = static_cast<uint8_t>(valid);
      // Dense pages: a warp whose kW tokens are all present (so in one page, whose size the host
      // checked to be a multiple of kW) takes them as one TMA box per 64-dim block.
      const bool by_tma = kv_map != nullptr && valid == (1u << kW) - 1;
      const int page = __shfl_sync(0xffffffffu, batch_raw, base);
      if (by_tma && lane == 0) {
        const int pos = cur.k * kT + pw * kW;
        const int off =
            static_cast<int>(p.kv.page_div.remainder(pos, p.kv.page_div.quotient(pos)));
        mbar_expect_tx(full_bar(st), kChunks / 8 * kW * 128);
#pragma unroll
        for (int b = 0; b < kChunks / 8; ++b) {
          tma_load_4d(tile + b * Cfg::kBlockBytes + pw * kW * 128, kv_map, full_bar(st), b * 64,
                      grp, off, page, kv_policy);
        }
      }
      if (!by_tma) {
#pragma unroll
        for (int j = 0; j < kW; ++j) {
          const int t = pw * kW + j;
          const auto row = row_of_lane(batch, base + j);
#pragma unroll
          for (int ch = lane; ch < kChunks; ch += 32) {
            uint8_t* dst = tile + sw_off(t, ch, kT);
            if (row != nullptr) {
              ptx::cp_async_16(dst, row + ch * 16);
            } else {
              *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            }
          }
        }
      }
      fence_proxy_async();
      // Two arrivals a thread: its stores (release) and its copies' completion.
      mbar_arrive_on_cp_async(full_bar(st));
      mbar_arrive(full_bar(st));
      // The next batch's indices go out behind this tile's TMA boxes, so that a part's first
      // boxes are not held up by them (variant 131b).
      if (u == 0) pending = load_batch(ahead, end, lane, tok);

      cur.advance(p, end);
      if (++u == kBatchTiles) {
        u = 0;
        batch = next;
        batch_raw = pending.raw;
      }
    }
    ptx::cp_async_wait<0>();
  }

  // Staged producers: the raw rows of the it-th tile land in raw stage it % kRawStages on the
  // warp's raw_bar (MODEL1's footer scales: one cp.async group per tile); each warp copies, and
  // later converts, its own kW tokens.
  __device__ uint8_t* raw_smem(int rs) const { return smem + Cfg::kRawOff + rs * Cfg::kRawBytes; }

  // u: the tile's place in its batch (load_batch), whose rows lanes [u kW, u kW + kW) hold.
  __device__ void issue_raw(int rs, const RowRef& ref, int u, int lane, int pw) {
    constexpr int kW = Cfg::kTokensPerWarp;
    constexpr int kRowChunks = Cfg::kRawRowBytes / 16;
    constexpr int kCopies = kW * kRowChunks;
    static_assert(Cfg::kRawRowBytes % 16 == 0, "bulk copies move whole 16-byte chunks");
    uint8_t* raw = raw_smem(rs);
    const int j = lane - u * kW;  // the lane's token of this tile, if in [0, kW)
    const bool mine = static_cast<unsigned>(j) < static_cast<unsigned>(kW);
    const uint32_t valid =
        (__ballot_sync(0xffffffffu, ref.row != nullptr) >> (u * kW)) & ((1u << kW) - 1);
    if (lane == 0) raw[Cfg::kRawValidOff + pw] = static_cast<uint8_t>(valid);
    // The warp's kW rows are contiguous in the stage. Missing rows are zero-filled (finite V).
    uint8_t* dst = raw + pw * kW * Cfg::kRawRowBytes;
    // Lane u kW + j copies token j's row in one bulk copy onto the warp's barrier of this stage
    // (the API demands 16-byte aligned pages and strides; rows are 576 or 656 bytes); lane 0's
    // arrival announces the bytes of all present rows. Absent rows are zeroed by the whole warp.
    if (lane == 0) mbar_arrive_expect_tx(raw_bar(rs, pw), __popc(valid) * Cfg::kRawRowBytes);
    if (mine && ref.row != nullptr) {
      bulk_copy(dst + j * Cfg::kRawRowBytes, ref.row, Cfg::kRawRowBytes, raw_bar(rs, pw),
                kv_policy);
    }
    if (valid != (1u << kW) - 1) {
#pragma unroll 1
      for (int c = lane; c < kCopies; c += 32) {
        if (!((valid >> (c / kRowChunks)) & 1)) {
          reinterpret_cast<uint4*>(dst)[c] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    if constexpr (F == Fmt::kModel1) {  // V32's scales come with its rows
      if (mine) {
        const bool ok = ref.row != nullptr;
        ptx::cp_async_8_zfill(raw + Cfg::kRawScaleOff + (pw * kW + j) * 8,
                              ok ? ref.scale : never_read(), ok);
      }
    }
  }

  __device__ void convert_raw(int rs, int st, int lane, int pw) {
    const uint8_t* raw = raw_smem(rs);
    uint8_t* tile = tile_smem(st);
    if (lane == 0) mask_smem(st)[pw] = raw[Cfg::kRawValidOff + pw];
    if constexpr (F == Fmt::kV32) {
      convert_raw_v32(raw, tile, lane, pw);
    } else {
      convert_raw_model1(raw, tile, lane, pw);
    }
    copy_raw_rope(raw, tile, lane, pw);
  }

  // V32: lane l converts chunk l (16 values) of each of the warp's tokens under the fp32 scale of
  // its 128-dim block, reading the raw row 16 contiguous bytes a lane. Its two bf16 chunks lie in
  // one 64-dim block; neighbouring blocks store them in alternate order, so that the 8 lanes of a
  // store phase hit 8 different bank groups (the two chunks differ in offset bit 4), and the
  // swapping lanes convert their chunk's halves in swapped order (4 selects on the input instead
  // of 8 on the output).
  __device__ void convert_raw_v32(const uint8_t* raw, uint8_t* tile, int lane, int pw) {
    constexpr int kW = Cfg::kTokensPerWarp;
    static_assert(Tr::kFP8Chunks == 32, "a chunk a lane");
    // Tokens loaded a batch ahead of their stores: 3 of the 64-row CTAs' 6, 4 of the narrow ones'
    // 8 (variant 145: batches of 2 were up to 3% slower; 6 and 8 spill).
    constexpr int kBatch = kW % 3 == 0 ? 3 : 4;
    static_assert(kW % kBatch == 0, "whole batches");
    const int swap = (lane >> 2) & 1;
#pragma unroll
    for (int j0 = 0; j0 < kW; j0 += kBatch) {
      uint4 in[kBatch];
      float scale[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint8_t* row = raw + (pw * kW + j0 + j) * Cfg::kRawRowBytes;
        in[j] = *reinterpret_cast<const uint4*>(row + lane * 16);
        scale[j] = reinterpret_cast<const float*>(row + fmt::kV32ScaleOffset)[lane >> 3];
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint4 d = in[j];
        uint4 first_half, second_half;
        e4m3x16_to_bf16(swap ? make_uint4(d.z, d.w, d.x, d.y) : d, scale[j], first_half,
                        second_half);
        const uint32_t first = sw_off(pw * kW + j0 + j, 2 * lane + swap, kT);
        *reinterpret_cast<uint4*>(tile + first) = first_half;
        *reinterpret_cast<uint4*>(tile + (first ^ 16u)) = second_half;
      }
    }
  }

  __device__ void convert_raw_model1(const uint8_t* raw, uint8_t* tile, int lane, int pw) {
    constexpr int kW = Cfg::kTokensPerWarp;
    // One branch around all kW tokens, not one per token, and the loads of a batch of tokens
    // before their stores (the compiler cannot move a load of the raw stage above a store to the
    // tile: both are shared memory), so that the tokens' shared-memory round trips overlap.
    // Batches of 2 keep the registers within the producers' budget next to a batch of row
    // pointers (resolve_pending); batches of 3 spilled.
    constexpr int kBatch = 2;
    static_assert(kW % kBatch == 0, "whole batches");
    // Lane l converts chunk l % 4 of 64-dim block `block`. The 8 lanes of a 16-byte access phase
    // take two blocks of equal parity (lanes 0-7: blocks 0 and 2; 8-15: 1 and 3; 16-23: 4 and 6;
    // 24-27: 5), the second four on token j ^ 1 while the first four are on token j. Token j ^ 1's
    // swizzle puts the stores of those four lanes in the other 4 bank groups, and its raw row,
    // 576 bytes (36 = 4 mod 8 16-byte units) away, does the same for their loads: both are
    // conflict-free with each chunk's halves stored in order (no selects).
    static_assert(kW % 2 == 0, "tokens j and j ^ 1 belong to the warp");
    const int odd = (lane >> 2) & 1;
    const int block = 4 * (lane >> 4) + ((lane >> 3) & 1) + 2 * odd;
    const int chunk = 4 * block + (lane & 3);
    const uint32_t tile_addr = ptx::smem_addr(tile);
    if (chunk < Tr::kFP8Chunks) {
#pragma unroll
      for (int j0 = 0; j0 < kW; j0 += kBatch) {
        uint4 in[kBatch];
        uint8_t sb[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int t = pw * kW + j0 + j + (((j0 + j) & 1) ? -odd : odd);  // token (j0 + j) ^ odd
          in[j] = *reinterpret_cast<const uint4*>(raw + t * Cfg::kRawRowBytes + chunk * 16);
          sb[j] = raw[Cfg::kRawScaleOff + t * 8 + block];
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int t = pw * kW + j0 + j + (((j0 + j) & 1) ? -odd : odd);
          uint4 lo, hi;
          e4m3x16_to_bf16(in[j], ue8m0_to_bf16x2(sb[j]), lo, hi);
          // tile_addr is 1024-byte aligned: ^ 16 flips bit 0 of the 16-byte chunk.
          const uint32_t first = tile_addr + sw_off(t, 2 * chunk, kT);
          ptx::st_shared_16(first, lo);
          ptx::st_shared_16(first ^ 16u, hi);
        }
      }
    }
  }

  // The rope (MODEL1 stored chunks 28-35 -> bf16 chunks 56-63, V32 33-40 -> 64-71), the warp's
  // kW x 8 chunks spread over all lanes after the conversion: copied by lanes 28-31 beside it, it
  // was a divergent path of 4 x kW loads and stores that the whole warp waited through.
  __device__ void copy_raw_rope(const uint8_t* raw, uint8_t* tile, int lane, int pw) {
    constexpr int kW = Cfg::kTokensPerWarp;
    constexpr int kRopeChunks = kW * 8;
    constexpr int kRounds = (kRopeChunks + 31) / 32;
    uint4 rope[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int u = 32 * r + lane;
      if (kRopeChunks % 32 == 0 || u < kRopeChunks) {
        rope[r] = *reinterpret_cast<const uint4*>(raw + (pw * kW + u / 8) * Cfg::kRawRowBytes +
                                                  (kRopeSrc + u % 8) * 16);
      }
    }
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const int u = 32 * r + lane;
      if (kRopeChunks % 32 == 0 || u < kRopeChunks) {
        *reinterpret_cast<uint4*>(tile + sw_off(pw * kW + u / 8, kRopeDst + u % 8, kT)) = rope[r];
      }
    }
  }

  __device__ void producer_staged() {
    constexpr int kW = Cfg::kTokensPerWarp;
    static_assert(Cfg::kRawStages < kBatchTiles, "the prologue's tiles are in the first batch");
    const int tid = threadIdx.x;
    const int lane = tid & 31, pw = tid >> 5;
    const int tok = pw * kW + lane % kW;
    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;  // the tile converted next
    cur.init(p, part, end);
    TileCursor<kT> ahead = cur;  // the first tile of the batch after the pending one
    PendingToken pending = load_batch(ahead, end, lane, tok);
    // The first pair's Q goes out right after the first index loads and before they are
    // resolved, so that the two overlap without Q's copies ahead of the indices (variant 131b).
    if (cur.valid(p)) load_q(cur, tid);
    RowRef ref = resolve_pending(pending);
#pragma unroll
    for (int u = 0; u < Cfg::kRawStages; ++u) {
      issue_raw(u, ref, u, lane, pw);
      ptx::cp_async_commit();
    }
    pending = load_batch(ahead, end, lane, tok);  // after the first copies: small parts wait less
    int u_next = Cfg::kRawStages;  // the batch's tile whose raw rows are issued next
    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      const int rs = it % Cfg::kRawStages;
      if (cur.first() && it > 0) {  // the first pair's Q went out before the loop
        mbar_wait(q_empty_bar(), (cur.seg & 1) ^ 1);
        load_q(cur, tid);
      }
      ptx::cp_async_wait<Cfg::kRawStages - 1>();  // this thread's copies of tile `it` landed
      __syncwarp();                                // ... and those of the other lanes
      mbar_wait(raw_bar(rs, pw), (it / Cfg::kRawStages) & 1);
      mbar_wait(empty_bar(st), ((it / Cfg::kStages) & 1) ^ 1);
      convert_raw(rs, st, lane, pw);
      // Orders this thread's tile stores before the wgmma reads, and its reads of raw stage rs
      // before the bulk copies that refill it (both async proxy).
      fence_proxy_async();
      mbar_arrive(full_bar(st));
      __syncwarp();  // every lane has read raw stage rs before it is refilled
      if (u_next == kBatchTiles) {
        ref = resolve_pending(pending);
        pending = load_batch(ahead, end, lane, tok);
        u_next = 0;
      }
      issue_raw(rs, ref, u_next, lane, pw);
      ++u_next;
      ptx::cp_async_commit();
      cur.advance(p, end);
    }
    ptx::cp_async_wait<0>();
  }

  // ---------------------------------------------------------------- consumers (warps 8-15)

  // Where a pair's output goes: its request i and query token sq, and for a split pair the slot
  // of this CTA's partial rows.
  struct PairOut {
    int i, sq, slot, grow0;
    bool split, slot_ok;
  };
  // The plan's split of a pair. The 64-row consumers read it at the pair's first tile, so that the
  // load completes during the pair's tiles instead of on the chain from its last tile to the next
  // pair's first (sm90_notes.md, variant 121); the narrow ones in their epilogue.
  struct PairSplit {
    int first_part, nsplit, slot;
  };
  __device__ PairSplit load_split(const TileCursor<kT>& cur) const {
    const PairInfo* info = p.pairs + cur.pr;
    return PairSplit{info->first_part, info->nsplit, info->slot};
  }
  __device__ PairOut pair_out(const TileCursor<kT>& cur, const PairSplit& ps) const {
    PairOut po;
    pair_coords(p, cur.id, &po.i, &po.sq);
    po.split = ps.nsplit > 1;
    po.slot = ps.slot + (part - ps.first_part);
    po.slot_ok = po.slot >= 0 && po.slot < p.max_slots;
    po.grow0 = (p.dense ? grp * p.rows_per_group : 0) + row0;
    return po;
  }
  // The sink logit of query row r of the CTA, 0 without sinks or for a padding row. The same for
  // every pair (sparse rows are heads, a dense group's rows repeat its heads), so the single-S
  // consumer reads it once.
  __device__ float row_sink(int r) const {
    if (p.sink == nullptr || r >= nrows) return 0.f;
    int s, head;
    row_coords(row0 + r, 0, &s, &head);
    return p.sink[head * p.sink_stride];
  }
  // At a pair's last tile in this CTA: the next pair's plan entry into L1, which the cursor reads
  // at the pair change, on the consumers' chain.
  __device__ void prefetch_next_pair(const TileCursor<kT>& cur) const {
    if (cur.pr + 1 < p.num_pairs) ptx::prefetch_l1(p.pairs + cur.pr + 1);
  }

  // A pair's softmax state, once its Q has landed.
  __device__ void start_pair(const TileCursor<kT>& cur, int r_lo, float (&m)[2], float (&l)[2],
                             int (&lim)[2]) const {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      m[rr] = -INFINITY;
      l[rr] = 0.f;
      lim[rr] = 0x7fffffff;
      if (p.dense && p.causal) lim[rr] = cur.len - p.s_q + (row0 + r_lo + 8 * rr) / p.hpk;
    }
    mbar_wait(q_full_bar(), cur.seg & 1);
  }

  // A consumer's dims [d0, d1) (multiples of 64) of the causal tail's V in stage st made finite
  // before its P V (hidden_tail), once every Q K^T read of the tile is done: `synced` where a
  // barrier already says so (consumer 1 after kPReadyBarrier, narrow consumer 0 after its P^T
  // barrier), else barrier `bar` (the warpgroup's 128 threads) first. Only chunks that change are
  // written, and only their writers fence them for the async proxy (wgmma) before the barrier
  // after. A token row is 128 contiguous bytes in each 64-dim block: the swizzle does not matter.
  __device__ void clean_tail(const TileCursor<kT>& cur, int st, int d0, int d1, int wt, int bar,
                             bool synced) const {
    if constexpr (!kCausalTail) return;
    const int2 tail = hidden_tail(p, cur.len, cur.k * kT, kT);
    if (tail.x >= tail.y) return;
    if (!synced) ptx::named_barrier(bar, 128);
    const int token_chunks = (d1 - d0) / 8;
    bool wrote = false;
#pragma unroll 1
    for (int u = wt; u < (tail.y - tail.x) * token_chunks; u += 128) {
      const int t = tail.x + u / token_chunks, c = d0 / 8 + u % token_chunks;
      uint4* chunk = reinterpret_cast<uint4*>(tile_smem(st) + (c / 8) * Cfg::kBlockBytes +
                                              t * 128 + (c % 8) * 16);
      const uint4 v = *chunk, f = finite_or_zero<kHalf>(v);
      if (f.x != v.x || f.y != v.y || f.z != v.z || f.w != v.w) {
        *chunk = f;
        wrote = true;
      }
    }
    if (wrote) fence_proxy_async();
    ptx::named_barrier(bar, 128);
  }

  // A B^T over the d_qk dims, both operands K-major in 64-dim blocks of kABlock / kBBlock bytes:
  // S = Q K^T, or for narrow CTAs S^T = K Q^T.
  template <bool kF16, int kN, int kABlock, int kBBlock>
  __device__ static void dqk_product(float (&d)[kN / 2], uint64_t a_desc, uint64_t b_desc) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Cfg::kDqk / 16; ++ks) {
      const uint32_t a_off = (ks >> 2) * kABlock + (ks & 3) * 32;
      const uint32_t b_off = (ks >> 2) * kBBlock + (ks & 3) * 32;
      wgmma_m64nk_kk<kF16, kN>(d, desc_add(a_desc, a_off), desc_add(b_desc, b_off), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
  }

  // S = Q K^T for stage st's tile, once that tile has landed.
  __device__ void compute_s(float (&s)[kT / 2], int it, uint32_t q_addr) const {
    const int st = it % Cfg::kStages;
    mbar_wait(full_bar(st), (it / Cfg::kStages) & 1);
    fence_proxy_async();
    const uint64_t q_desc = sw128_desc(q_addr, 0, 1024);
    const uint64_t t_desc = sw128_desc(ptx::smem_addr(tile_smem(st)), 0, 1024);
    dqk_product<kHalf, kT, Cfg::kQBlockBytes, Cfg::kBlockBytes>(s, q_desc, t_desc);
  }

  // Masks S (invalid tokens, causal limit) and returns the thread's rows' maxima over the quad (a
  // row's values of one S sit in one quad) in base 2: the scale is positive, so the maximum is
  // scaled once instead of every value (exp_rows scales them inside its FMA).
  __device__ void mask_and_max(float (&s)[kT / 2], const TileCursor<kT>& cur, int st, int lane,
                               const int (&lim)[2], float (&mx)[2]) const {
    using Bits = std::conditional_t<(kT > 32), uint64_t, uint32_t>;
    constexpr int kWarps = Cfg::kProducerWarps;
    const uint8_t* mk = mask_smem(st);
    Bits vmask = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      vmask |= static_cast<Bits>(mk[w]) << (w * Cfg::kTokensPerWarp);
    }
    const int pos0 = cur.k * kT;
    mx[0] = mx[1] = -INFINITY;
    if (all_tokens_visible<kT>(vmask, pos0, lim)) {
#pragma unroll
      for (int e = 0; e < kT / 2; ++e) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
    } else {
#pragma unroll
      for (int j = 0; j < kT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = j * 8 + 2 * (lane & 3) + (e & 1);
          if (!token_visible(vmask, col, pos0, lim, e)) s[4 * j + e] = -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
      mx[rr] *= p.scale_log2;
    }
  }

  // S -> 2^(scale_log2 S - m_use); each row's sum is added to l after rescaling it by alpha.
  __device__ void exp_rows(float (&s)[kT / 2], const float (&m_use)[2], const float (&alpha)[2],
                           float (&l)[2]) const {
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < kT / 2; ++e) {
      s[e] = ptx::exp2_approx(fmaf(s[e], p.scale_log2, -m_use[(e >> 1) & 1]));
      sum[(e >> 1) & 1] += s[e];
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) l[rr] = l[rr] * alpha[rr] + sum[rr];
  }

  // Single S: P as the A operand of the P V wgmma, one k-step of 16 tokens a row of pf, in
  // the S accumulators' layout.
  using PFrag = uint32_t[kT / 16][4];
  __device__ static void p_fragments(const float (&s)[kT / 2], PFrag& pf) {
#pragma unroll
    for (int kk = 0; kk < kT / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pf[kk][i] = ptx::pack2<kHalf>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
      }
    }
  }
  // Consumer 1's thread wt takes the fragments of consumer 0's thread wt (same rows and columns),
  // 16 bytes a thread and k-step: conflict-free.
  __device__ uint4* p_exchange(int kk, int wt) const {
    return reinterpret_cast<uint4*>(p_smem()) + kk * 128 + wt;
  }

  // Sum over the 4 lanes of a quad (the threads that hold one accumulator row).
  __device__ static float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
  }

  // Single S, consumer 0 (warps 8-11): S = Q K^T over the whole tile, the softmax of all 64
  // rows, P and the rescale factors into shared memory for consumer 1, and O[:, 0, kDimsS) with
  // P from its registers.
  // While it computes the next tile's S and softmax, consumer 1 accumulates this tile's
  // O[:, kDimsS, 512), so the tensor cores have work through the softmax.
  __device__ void consumer_s() {
    const int wt = threadIdx.x & 127;  // thread within the warpgroup
    const int lane = wt & 31;
    const int r_lo = (wt >> 5) * 16 + (lane >> 2);  // this thread's rows: r_lo, r_lo + 8
    const uint32_t q_addr = ptx::smem_addr(q_smem());
    float* alpha = exch(kAlpha);

    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;
    cur.init(p, part, end);
    float o[kDimsS / 2];
    float m[2], l[2];
    int lim[2];
    const float sink[2] = {row_sink(r_lo), row_sink(r_lo + 8)};
    PairSplit ps{};
    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      if (cur.first()) {
        ps = load_split(cur);
        start_pair(cur, r_lo, m, l, lim);
      }
      if (cur.last()) prefetch_next_pair(cur);
      float s[kT / 2];
      compute_s(s, it, q_addr);
      if (cur.last() && wt == 0) mbar_arrive(q_empty_bar());

      float mx[2];
      mask_and_max(s, cur, st, lane, lim, mx);
      float row_alpha[2], m_use[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const float m_new = next_max(m[rr], mx[rr]);
        // A row that has seen no valid token keeps m = -inf and uses 0 as its reference.
        m_use[rr] = m_new == -INFINITY ? 0.f : m_new;
        row_alpha[rr] = ptx::exp2_approx(m[rr] - m_use[rr]);
        m[rr] = m_new;
      }
      exp_rows(s, m_use, row_alpha, l);
      PFrag pf;
      p_fragments(s, pf);

      // P and the rows' rescale factors into shared memory, once consumer 1 has taken the
      // previous tile's.
      if (it > 0) mbar_wait(p_free_bar(), (it - 1) & 1);
#pragma unroll
      for (int kk = 0; kk < kT / 16; ++kk) {
        *p_exchange(kk, wt) = make_uint4(pf[kk][0], pf[kk][1], pf[kk][2], pf[kk][3]);
      }
      if ((lane & 3) == 0) {
        alpha[r_lo] = row_alpha[0];
        alpha[r_lo + 8] = row_alpha[1];
      }
      ptx::named_barrier_arrive(kPReadyBarrier, 256);
      clean_tail(cur, st, 0, kDimsS, wt, kTailBarrier0, false);

      rescale_o(cur, o, row_alpha);
      const uint32_t t_addr = ptx::smem_addr(tile_smem(st));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kT / 16; ++kk) {
        pv_step(o, pf[kk], 0, kk, t_addr, kk > 0 || !cur.first());
      }
      wgmma_commit();
      wgmma_wait<0>();
      // One arrival for the warpgroup: the other warps' reads of the stage's valid bits precede
      // their kPReadyBarrier arrival, which consumer 1 waits on before its own release of the
      // stage (empty_bar needs both). compute-sanitizer racecheck does not follow that chain.
      if (wt == 0) mbar_arrive(empty_bar(st));
      if (cur.last()) {
        float l_row[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) l_row[rr] = quad_sum(l[rr]);
        epilogue(cur, ps, 0, wt, r_lo, o, m, l_row, sink);
      }
      cur.advance(p, end);
    }
  }

  // Single S, consumer 1 (warps 12-15): O[:, kDimsS, 512) from consumer 0's P and rescale
  // factors.
  __device__ void consumer_pv() {
    const int wt = threadIdx.x & 127;
    const int lane = wt & 31;
    const int r_lo = (wt >> 5) * 16 + (lane >> 2);
    const float* alpha = exch(kAlpha);

    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;
    cur.init(p, part, end);
    float o[(kDV - kDimsS) / 2];
    const float none[2] = {0.f, 0.f};  // softmax state and sinks: consumer 0's
    PairSplit ps{};
    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      if (cur.first()) ps = load_split(cur);
      if (cur.last()) prefetch_next_pair(cur);
      mbar_wait(full_bar(st), (it / Cfg::kStages) & 1);
      fence_proxy_async();
      ptx::named_barrier(kPReadyBarrier, 256);
      clean_tail(cur, st, kDimsS, kDV, wt, kTailBarrier1, true);
      const float row_alpha[2] = {alpha[r_lo], alpha[r_lo + 8]};
      rescale_o(cur, o, row_alpha);
      // P one k-step at a time into registers (all kT / 16 would not fit next to the 192
      // accumulators): a k-step's registers are free again once its wgmma group has completed.
      const uint32_t t_addr = ptx::smem_addr(tile_smem(st));
#pragma unroll
      for (int kk = 0; kk < kT / 16; ++kk) {
        const uint4 v = *p_exchange(kk, wt);
        const uint32_t a[4] = {v.x, v.y, v.z, v.w};
        wgmma_fence();
        pv_step(o, a, kDimsS, kk, t_addr, kk > 0 || !cur.first());
        wgmma_commit();
        if (kk > 0) wgmma_wait<1>();
      }
      // P and alpha have been read: consumer 0 may write the next tile's, except after a pair's
      // last tile: consumer 1 reads the pair's output factors in its epilogue first (consumer 0
      // writes the next pair's only after this barrier).
      const bool pair_end = cur.last();
      if (!pair_end) mbar_arrive(p_free_bar());
      wgmma_wait<0>();
      if (wt == 0) mbar_arrive(empty_bar(st));
      if (pair_end) epilogue(cur, ps, kDimsS, wt, r_lo, o, none, none, none);
      cur.advance(p, end);
      if (pair_end && cur.valid(p)) mbar_arrive(p_free_bar());
    }
  }

  // The epilogues run their rows in loops, not unrolled: the smaller code made the narrow and
  // 16-bit kernels faster, selects included (variant 173); only the narrow stores, whose row
  // addresses are worked out once a row, read faster unrolled. v[j] for j known only at run time
  // (the narrow rows' columns): selects keep v in registers, where indexing would move it to
  // local memory.
  template <int kN>
  __device__ static float select(const float (&v)[kN], int j) {
    float x = v[0];
#pragma unroll
    for (int k = 1; k < kN; ++k) x = j == k ? v[k] : x;
    return x;
  }
  // Accumulator e of row rr (run time) of the thread's two rows: o[e + 2 rr].
  template <int kRegs>
  __device__ static float row_elem(const float (&o)[kRegs], int e, int rr) {
    return rr ? o[e + 2] : o[e];
  }

  // A 16-bit output row from the accumulator layout, where lane q of a quad holds columns
  // 8 j + 2 q and 8 j + 2 q + 1 of the quad's row for every j: the quad exchanges its words so
  // that lane q holds 8-column block 4 g + q of blocks 4 g .. 4 g + 3, and one 16-byte store a
  // lane writes 64 contiguous bytes of the row for the quad. A word a lane and j took four times
  // the store instructions, which held up the load/store unit, and with it the producers'
  // shared-memory traffic, for thousands of cycles at every pair's end (sm90_notes.md,
  // variant 121). Every lane of the warp must call; `store` (the same in a quad) says whether
  // the quad's row is written.
  // f16: fp16 values whatever the output's type (the fp16 partials).
  template <int kRegs>
  __device__ static void store_row_16bit(uint16_t* row, const float (&o)[kRegs], int rr,
                                         float factor, int lane, bool store, bool f16) {
    static_assert(kRegs % 16 == 0, "whole groups of four 8-column blocks");
    const int q = lane & 3;
    const bool odd = q & 1, hi = q & 2;
    // The row's two halves in a loop (variant 173).
    constexpr int kHalves = (kRegs / 16) % 2 == 0 ? 2 : 1, kGroups = kRegs / 16 / kHalves;
#pragma unroll 1
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int gh = 0; gh < kGroups; ++gh) {
        const int g = gh + kGroups * h;
        uint32_t w[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int e = 4 * (4 * gh + c);
          const float y0 = h ? row_elem(o, e + kRegs / 2, rr) : row_elem(o, e, rr);
          const float y1 = h ? row_elem(o, e + 1 + kRegs / 2, rr) : row_elem(o, e + 1, rr);
          const float v0 = y0 * factor, v1 = y1 * factor;
          w[c] = kHalf || f16 ? ptx::pack2<true>(v0, v1) : ptx::pack2<false>(v0, v1);
        }
        // Lanes q and q ^ 1 swap the blocks of the other one's parity: each then holds blocks
        // odd and odd + 2 for rows q and q ^ 1.
        const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? w[0] : w[1], 1);
        const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? w[2] : w[3], 1);
        const uint32_t a = odd ? w[1] : w[0], b = odd ? w[3] : w[2];
        // Lanes q and q ^ 2 swap what the other one's block needs: u[t] is then row q ^ t of
        // block q.
        const uint32_t s0 = __shfl_xor_sync(0xffffffffu, hi ? a : b, 2);
        const uint32_t s1 = __shfl_xor_sync(0xffffffffu, hi ? r0 : r1, 2);
        const uint32_t u[4] = {hi ? b : a, hi ? r1 : r0, s0, s1};
        // Word k of the block is row k's: u[k ^ q].
        const uint32_t x0 = odd ? u[1] : u[0], x1 = odd ? u[0] : u[1];
        const uint32_t x2 = odd ? u[3] : u[2], x3 = odd ? u[2] : u[3];
        if (store) {
          *reinterpret_cast<uint4*>(row + 8 * (4 * g + q)) =
              hi ? make_uint4(x2, x3, x0, x1) : make_uint4(x0, x1, x2, x3);
        }
      }
    }
  }

  // The thread's two rows of output dims [d0, d0 + 2 kRegs) of a pair, scaled by their factors:
  // 16-bit output rows, or a split pair's partial rows. Every lane of the warp must call.
  //
  // fp16 partials (FP8 pages, sm90_fp16_partials): a row's values of this lane are scaled by a
  // power of two 2^-k that puts their largest magnitude in [2^14, 2^15), so that fp16 keeps 11
  // bits of every value within 28 binades of it, and k (int8) goes to part_exp for the combine;
  // the lane's own maximum needs no exchange. They leave through the output rows' store path,
  // the type chosen per element: a second copy of that path for the partials made the attention
  // kernel slower than fp32 partials (variant 152).
  template <int kRegs>
  __device__ void store_rows(const PairOut& po, int d0, int r_lo, int lane, const float (&o)[kRegs],
                             const float (&row_factor)[2]) const {
    // Padding rows (r >= nrows) take part in the quads' exchanges but store nothing.
#pragma unroll 1
    for (int rr = 0; rr < 2; ++rr) {
      const int r = r_lo + 8 * rr;
      const bool live = r < nrows;
      if (po.split && !kPart16) {
        // fp32 partials: a float2 a lane and j already fills the quad's 32-byte sectors; the
        // exchange would cost more than the stores it saves (variant 121).
        if (!po.slot_ok || !live) continue;
        const int64_t prow = static_cast<int64_t>(po.slot) * p.rows_per_pair + po.grow0 + r;
        float* dst = p.part_out + prow * kDV + d0 + 2 * (lane & 3);
        const float factor = rr ? row_factor[1] : row_factor[0];
#pragma unroll
        for (int j = 0; j < kRegs / 4; ++j) {
          *reinterpret_cast<float2*>(dst + j * 8) =
              make_float2(row_elem(o, 4 * j, rr) * factor, row_elem(o, 4 * j + 1, rr) * factor);
        }
        continue;
      }
      if (!__any_sync(0xffffffffu, live)) continue;  // the same for the warp
      uint16_t* dst;
      float factor = rr ? row_factor[1] : row_factor[0];
      bool store = live;
      int8_t* exp_dst = nullptr;
      int exp_k = 0;
      if (kPart16 && po.split) {
        const int64_t prow = static_cast<int64_t>(po.slot) * p.rows_per_pair + po.grow0 + r;
        // max |v| in 4 independent chains (fmaxf drops NaN, which the factor keeps NaN).
        constexpr int kChains = kRegs / 4 < 4 ? kRegs / 4 : 4;
        float m[kChains];
#pragma unroll
        for (int j = 0; j < kRegs / 4; ++j) {
          const float v = fmaxf(fabsf(row_elem(o, 4 * j, rr)), fabsf(row_elem(o, 4 * j + 1, rr)));
          m[j % kChains] = j < kChains ? v : fmaxf(m[j % kChains], v);
        }
#pragma unroll
        for (int w = 1; w < kChains; w *= 2) {
#pragma unroll
          for (int j = 0; j + w < kChains; j += 2 * w) m[j] = fmaxf(m[j], m[j + w]);
        }
        // The scaled maximum in [2^e, 2^(e + 1)): k = e - 14, at least -126 so that 2^-k stays
        // a float (zero and subnormal rows); inf and NaN give e = 128, k = 114.
        exp_k = max((__float_as_int(m[0] * factor) >> 23) - 127 - 14, -126);
        exp_dst = p.part_exp + prow * 8 + (d0 == 0 ? 0 : 4) + (lane & 3);
        store = live && po.slot_ok;
        dst = p.part_out16 + prow * kDV + d0;
        factor *= fmt::exp2i(-exp_k);
      } else {
        int s, head;
        row_coords(row0 + r, po.sq, &s, &head);
        dst = p.out + po.i * p.out_stride[0] + s * p.out_stride[1] + head * p.out_stride[2] + d0;
      }
      store_row_16bit(dst, o, rr, factor, lane, store, kPart16 && po.split);
      // After the row's stores: before them, the exponent's address spilled registers.
      if (exp_dst != nullptr && store) *exp_dst = static_cast<int8_t>(exp_k);
    }
  }

  // Row r's output factor from its maximum m (base 2) and sum l; with `store`, also writes its
  // lse: a split pair's normalized partial gets the base-2 lse for the combine, any other row the
  // natural-log lse and, with a sink, the sink's share in its factor. A row without a valid token
  // gets factor 0 and lse +inf (a partial's -inf), sink or not.
  __device__ float finish_row(float m, float l, int r, const PairOut& po, bool store,
                              float sink) const {
    float factor, lse;
    if (l == 0.f) {
      factor = 0.f;
      lse = po.split ? -INFINITY : INFINITY;
    } else if (po.split) {
      factor = 1.f / l;
      lse = m + log2f(l);
    } else {
      lse = (m + log2f(l)) * 0.693147180559945309f;
      factor = 1.f / l;
      if (p.sink != nullptr && r < nrows) factor *= 1.f / (1.f + expf(sink - lse));
    }
    if (store && r < nrows) {
      if (po.split) {
        const int64_t prow = static_cast<int64_t>(po.slot) * p.rows_per_pair + po.grow0 + r;
        if (po.slot_ok) p.part_lse[prow] = lse;
      } else {
        int s, head;
        row_coords(row0 + r, po.sq, &s, &head);
        p.lse[po.i * p.lse_stride[0] + head * p.lse_stride[1] + s * p.lse_stride[2]] = lse;
      }
    }
    return factor;
  }

  // ---------------------------------------------------------------- narrow consumers (16 rows)
  //
  // S^T = K Q^T over the tile: M its 64 tokens, N the 16 query rows. A thread's accumulators are
  // tokens tok_lo and tok_lo + 8 (tok_lo = 16 warp + lane / 4) of rows (columns) 8 j + 2 (lane % 4)
  // + c, at s[4 j + 2 rr + c]; the thread's four rows are jc = 2 j + c. The softmax runs down the
  // columns: a row's maximum over the tile from the warp's lanes and, through shared memory, the
  // four warps; its sum stays per thread until the pair's end. P^T goes to shared memory as the
  // K-major B operand of O^T = V^T P^T (a row of 64 tokens a query row), which both consumers
  // read; O^T[dim, row] has the same layout with dims as M, 64 a wgmma.
  static constexpr int kNarrowCols = 4;  // query rows a thread holds
  __device__ static int narrow_col(int lane, int jc) {
    return 8 * (jc >> 1) + 2 * (lane & 3) + (jc & 1);
  }
  __device__ static int narrow_jc(int e) { return 2 * (e >> 2) + (e & 1); }
  // The four warps' column maxima of a tile (two tiles' worth), the rows' O rescale factors, their
  // output factors, and the warps' row sums at a pair's end (exch: 16 x kRows floats).
  __device__ float* narrow_max(int buf, int warp) const { return exch(4 * buf + warp); }
  __device__ float* narrow_alpha() const { return exch(8); }
  __device__ float* narrow_factor() const { return exch(9); }
  __device__ float* narrow_sums(int warp) const { return exch(12 + warp); }

  // Max (or sum) over the 8 lanes that hold the same columns (lanes equal mod 4).
  __device__ static float column_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
  }
  __device__ static float column_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    return v + __shfl_xor_sync(0xffffffffu, v, 16);
  }

  // O^T += V^T P^T for output dims [d0, d0 + 64 kBlocks) of stage st's tile.
  template <int kBlocks>
  __device__ void narrow_pv(float (&o)[kBlocks][8], int d0, int st, bool overwrite) const {
    const uint32_t t_addr = ptx::smem_addr(tile_smem(st));
    const uint64_t pt_desc = sw128_desc(ptx::smem_addr(p_smem()), 0, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kT / 16; ++kk) {
#pragma unroll
      for (int bb = 0; bb < kBlocks; ++bb) {
        const uint64_t v_desc = sw128_desc(
            t_addr + (d0 / 64 + bb) * Cfg::kBlockBytes + kk * 16 * 128, Cfg::kBlockBytes, 1024);
        // A: a 64-dim block of V, MN-major (its rows are the tokens, K); B: the P^T rows.
        wgmma_m64n16<1>(o[bb], v_desc, desc_add(pt_desc, kk * 32), kk > 0 || !overwrite);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
  }

  template <int kBlocks>
  __device__ static void narrow_rescale(const TileCursor<kT>& cur, float (&o)[kBlocks][8],
                                        const float (&alpha)[kNarrowCols]) {
    bool moved = false;
#pragma unroll
    for (int jc = 0; jc < kNarrowCols; ++jc) moved |= alpha[jc] != 1.f;
    if (!cur.first() && __any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int bb = 0; bb < kBlocks; ++bb) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[bb][e] *= alpha[narrow_jc(e)];
      }
    }
  }

  // Narrow consumer 0 (warps 8-11): S^T, the softmax, P^T and the rows' rescale factors into
  // shared memory, and O^T for dims [0, kDimsS).
  __device__ void consumer_narrow_s() {
    const int wt = threadIdx.x & 127, lane = wt & 31, warp = wt >> 5;
    const int tok_lo = 16 * warp + (lane >> 2);
    const uint32_t q_addr = ptx::smem_addr(q_smem());
    uint16_t* pt = reinterpret_cast<uint16_t*>(p_smem());

    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;
    cur.init(p, part, end);
    float o[kDimsS / 64][8];
    float m[kNarrowCols], l[kNarrowCols];
    int lim[kNarrowCols];
    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      if (cur.first()) {
#pragma unroll
        for (int jc = 0; jc < kNarrowCols; ++jc) {
          m[jc] = -INFINITY;
          l[jc] = 0.f;
          lim[jc] = 0x7fffffff;
          if (p.dense && p.causal)
            lim[jc] = cur.len - p.s_q + (row0 + narrow_col(lane, jc)) / p.hpk;
        }
        mbar_wait(q_full_bar(), cur.seg & 1);
      }
      float s[kRows / 2];
      mbar_wait(full_bar(st), (it / Cfg::kStages) & 1);
      fence_proxy_async();
      const uint64_t t_desc = sw128_desc(ptx::smem_addr(tile_smem(st)), 0, 1024);
      const uint64_t q_desc = sw128_desc(q_addr, 0, 1024);
      dqk_product<false, kRows, Cfg::kBlockBytes, Cfg::kQBlockBytes>(s, t_desc, q_desc);
      if (cur.last() && wt == 0) mbar_arrive(q_empty_bar());

      // Mask (absent tokens, causal limits) and the columns' maxima over the tile.
      const uint8_t* mk = mask_smem(st);
      const int pos0 = cur.k * kT;
      bool present[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int t = tok_lo + 8 * rr;
        present[rr] = (mk[t / Cfg::kTokensPerWarp] >> (t % Cfg::kTokensPerWarp)) & 1;
      }
      float mx[kNarrowCols];
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) mx[jc] = -INFINITY;
#pragma unroll
      for (int e = 0; e < kRows / 2; ++e) {
        const int rr = (e >> 1) & 1, jc = narrow_jc(e);
        if (!present[rr] || pos0 + tok_lo + 8 * rr > lim[jc]) s[e] = -INFINITY;
        mx[jc] = fmaxf(mx[jc], s[e]);
      }
      float* mine = narrow_max(it & 1, warp);
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) {
        mx[jc] = column_max(mx[jc]);
        if (lane < 4) mine[narrow_col(lane, jc)] = mx[jc];
      }
      ptx::named_barrier(kNarrowBarrier, 128);
      float alpha[kNarrowCols], m_use[kNarrowCols];
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) {
        const int col = narrow_col(lane, jc);
        float tile_max = narrow_max(it & 1, 0)[col];
#pragma unroll
        for (int w = 1; w < 4; ++w) tile_max = fmaxf(tile_max, narrow_max(it & 1, w)[col]);
        const float m_new = next_max(m[jc], tile_max * p.scale_log2);
        // A row that has seen no valid token keeps m = -inf and uses 0 as its reference.
        m_use[jc] = m_new == -INFINITY ? 0.f : m_new;
        alpha[jc] = ptx::exp2_approx(m[jc] - m_use[jc]);
        m[jc] = m_new;
      }
      float sum[kNarrowCols] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int e = 0; e < kRows / 2; ++e) {
        const int jc = narrow_jc(e);
        s[e] = ptx::exp2_approx(fmaf(s[e], p.scale_log2, -m_use[jc]));
        sum[jc] += s[e];
      }
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) l[jc] = l[jc] * alpha[jc] + sum[jc];

      // P^T and the rescale factors into shared memory, once consumer 1 has read the previous
      // tile's (and consumer 0's own O^T wgmma of it has completed, below).
      if (it > 0) mbar_wait(p_free_bar(), (it - 1) & 1);
#pragma unroll
      for (int e = 0; e < kRows / 2; ++e) {
        const int n = narrow_col(lane, narrow_jc(e)), t = tok_lo + 8 * ((e >> 1) & 1);
        const uint32_t off = n * 128 + (((t >> 3) ^ (n & 7)) << 4) + (t & 7) * 2;
        pt[off / 2] = static_cast<uint16_t>(ptx::pack2<false>(s[e], 0.f));
      }
      if (warp == 0 && lane < 4) {
#pragma unroll
        for (int jc = 0; jc < kNarrowCols; ++jc) narrow_alpha()[narrow_col(lane, jc)] = alpha[jc];
      }
      fence_proxy_async();
      ptx::named_barrier(kNarrowBarrier, 128);  // all of P^T written before this warpgroup's wgmma
      ptx::named_barrier_arrive(kPReadyBarrier, 256);
      clean_tail(cur, st, 0, kDimsS, wt, kTailBarrier0, true);

      narrow_rescale(cur, o, alpha);
      narrow_pv(o, 0, st, cur.first());
      if (wt == 0) mbar_arrive(empty_bar(st));
      if (cur.last()) narrow_epilogue<0>(cur, wt, o, m, l);
      cur.advance(p, end);
    }
  }

  // Narrow consumer 1 (warps 12-15): O^T for dims [kDimsS, 512) from consumer 0's P^T.
  __device__ void consumer_narrow_pv() {
    const int wt = threadIdx.x & 127, lane = wt & 31;
    const PartStart end = p.parts[part + 1];
    TileCursor<kT> cur;
    cur.init(p, part, end);
    float o[(kDV - kDimsS) / 64][8];
    float none[kNarrowCols] = {0.f, 0.f, 0.f, 0.f};  // softmax state: consumer 0's
    for (int it = 0; cur.valid(p); ++it) {
      const int st = it % Cfg::kStages;
      mbar_wait(full_bar(st), (it / Cfg::kStages) & 1);
      fence_proxy_async();
      ptx::named_barrier(kPReadyBarrier, 256);
      clean_tail(cur, st, kDimsS, kDV, wt, kTailBarrier1, true);
      float alpha[kNarrowCols];
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) alpha[jc] = narrow_alpha()[narrow_col(lane, jc)];
      narrow_rescale(cur, o, alpha);
      narrow_pv(o, kDimsS, st, cur.first());
      // P^T has been read (its wgmma completed): consumer 0 may write the next tile's, except
      // after a pair's last tile, where consumer 1 reads the output factors first.
      const bool pair_end = cur.last();
      if (!pair_end) mbar_arrive(p_free_bar());
      if (wt == 0) mbar_arrive(empty_bar(st));
      if (pair_end) narrow_epilogue<kDimsS>(cur, wt, o, none, none);
      cur.advance(p, end);
      if (pair_end && cur.valid(p)) mbar_arrive(p_free_bar());
    }
  }

  // Where column jc's accumulator of row half rr lies in an 8-value block (jc known at compile
  // time: the store loop is unrolled).
  __device__ static constexpr int narrow_reg(int jc, int rr) {
    return 4 * (jc >> 1) + 2 * rr + (jc & 1);
  }

  // Narrow: the pair's output. Consumer 0 (kD0 == 0) sums the rows' l over its warps, writes the
  // lse and each row's output factor; each consumer writes its dims [kD0, kD0 + 64 kBlocks).
  template <int kD0, int kBlocks>
  __device__ void narrow_epilogue(const TileCursor<kT>& cur, int wt, float (&o)[kBlocks][8],
                                  const float (&m)[kNarrowCols], float (&l)[kNarrowCols]) {
    const int lane = wt & 31, warp = wt >> 5;
    const PairOut po = pair_out(cur, load_split(cur));
    float* factors = narrow_factor();
    if constexpr (kD0 == 0) {
#pragma unroll
      for (int jc = 0; jc < kNarrowCols; ++jc) {
        l[jc] = column_sum(l[jc]);
        if (lane < 4) narrow_sums(warp)[narrow_col(lane, jc)] = l[jc];
      }
      ptx::named_barrier(kNarrowBarrier, 128);
      if (warp == 0 && lane < 4) {
#pragma unroll 1
        for (int jc = 0; jc < kNarrowCols; ++jc) {
          const int n = narrow_col(lane, jc);
          float sum_l = narrow_sums(0)[n];
#pragma unroll
          for (int w = 1; w < 4; ++w) sum_l += narrow_sums(w)[n];
          factors[n] = finish_row(select(m, jc), sum_l, n, po, true, row_sink(n));
        }
      }
      ptx::named_barrier(kNarrowBarrier, 128);  // warp 0's factors, for consumer 0's other warps
      ptx::named_barrier_arrive(kEpilogueBarrier, 256);
    } else {
      ptx::named_barrier(kEpilogueBarrier, 256);
    }
    // Row addresses once a row: the stores then differ by constant offsets.
    const int dim0 = kD0 + 16 * warp + (lane >> 2);
#pragma unroll
    for (int jc = 0; jc < kNarrowCols; ++jc) {
      const int n = narrow_col(lane, jc);
      if (n >= nrows) continue;
      const float factor = factors[n];
      if (po.split) {
        if (!po.slot_ok) continue;
        float* row = p.part_out +
                     (static_cast<int64_t>(po.slot) * p.rows_per_pair + po.grow0 + n) * kDV + dim0;
#pragma unroll
        for (int bb = 0; bb < kBlocks; ++bb) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            row[64 * bb + 8 * rr] = o[bb][narrow_reg(jc, rr)] * factor;
          }
        }
      } else {
        int s = 0, head = 0;
        row_coords(row0 + n, po.sq, &s, &head);
        uint16_t* row = p.out + po.i * p.out_stride[0] + s * p.out_stride[1] +
                        head * p.out_stride[2] + dim0;
#pragma unroll
        for (int bb = 0; bb < kBlocks; ++bb) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const float v = o[bb][narrow_reg(jc, rr)] * factor;
            row[64 * bb + 8 * rr] = static_cast<uint16_t>(ptx::pack2<false>(v, 0.f));
          }
        }
      }
    }
  }

  // O = alpha O, unless the pair starts (its first P V overwrites O). Once the row maxima
  // settle, most tiles leave them unchanged (alpha exactly 1): skip the multiplies unless a row
  // of the warp moved.
  template <int kRegs>
  __device__ static void rescale_o(const TileCursor<kT>& cur, float (&o)[kRegs],
                                   const float (&alpha)[2]) {
    if (!cur.first() && __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int e = 0; e < kRegs; ++e) o[e] *= alpha[(e >> 1) & 1];
    }
  }

  // O[:, d0, d0 + 2 kRegs) += P V for k-step kk (16 tokens) of the tile at t_addr, P from
  // registers: kRegs / 64 wgmma m64n128. accumulate == 0 overwrites O.
  template <int kRegs>
  __device__ static void pv_step(float (&o)[kRegs], const uint32_t (&a)[4], int d0, int kk,
                                 uint32_t t_addr, int accumulate) {
    const uint64_t v_desc =
        sw128_desc(t_addr + (d0 / 64) * Cfg::kBlockBytes, Cfg::kBlockBytes, 1024);
    const uint64_t v = desc_add(v_desc, kk * 16 * 128);
    wgmma_m64n128_rs<kHalf, 0>(o, a, v, accumulate);
    if constexpr (kRegs > 64) {
      wgmma_m64n128_rs<kHalf, 64>(o, a, desc_add(v, 2 * Cfg::kBlockBytes), accumulate);
    }
    if constexpr (kRegs > 128) {
      wgmma_m64n128_rs<kHalf, 128>(o, a, desc_add(v, 4 * Cfg::kBlockBytes), accumulate);
    }
  }

  // Single S: the pair's output. Consumer 0 (d0 == 0), given the row maxima m and the rows'
  // full sums l, writes the lse and each row's output factor; each consumer writes its dims
  // [d0, d0 + 2 kRegs).
  template <int kRegs>
  __device__ void epilogue(const TileCursor<kT>& cur, const PairSplit& ps, int d0, int wt,
                           int r_lo, float (&o)[kRegs], const float (&m)[2], const float (&l)[2],
                           const float (&sink)[2]) {
    const int lane = wt & 31;
    float* factors = exch(kFactor);
    const PairOut po = pair_out(cur, ps);
    float row_factor[2];
    if (d0 == 0) {
#pragma unroll 1
      for (int rr = 0; rr < 2; ++rr) {
        const int r = r_lo + 8 * rr;
        const float f = finish_row(rr ? m[1] : m[0], rr ? l[1] : l[0], r, po, (lane & 3) == 0,
                                   rr ? sink[1] : sink[0]);
        if (rr) {
          row_factor[1] = f;
        } else {
          row_factor[0] = f;
        }
        if ((lane & 3) == 0) factors[r] = f;
      }
    }
    // Consumer 0 goes on at once: it writes the next factors only after consumer 1 has read
    // these (consumer 1 arrives at p_free_bar after its epilogue).
    if (d0 == 0) {
      ptx::named_barrier_arrive(kEpilogueBarrier, 256);
    } else {
      ptx::named_barrier(kEpilogueBarrier, 256);
      row_factor[0] = factors[r_lo];
      row_factor[1] = factors[r_lo + 8];
    }
    store_rows(po, d0, r_lo, lane, o, row_factor);
  }
};

#endif  // SPARSE_MLA_SM90_DEVICE

template <Fmt F, int kRowsArg, bool kCausalTail>
__global__ void __launch_bounds__(Sm90Config<F, kRowsArg>::kThreads, 1)
    sm90_decode_kernel(const __grid_constant__ DecodeParams p,
                       const __grid_constant__ CUtensorMap kv_map, int kv_tma) {
#if SPARSE_MLA_SM90_DEVICE
  // The combine kernel may start launching now; it waits for this grid before reading partials.
  ptx::launch_dependent_grids();
  using Cfg = Sm90Config<F, kRowsArg>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = ptx::smem_addr(smem_raw);
  uint8_t* smem = smem_raw + ((1024 - (base & 1023)) & 1023);
  Sm90Cta<F, kRowsArg, kCausalTail> cta{p, smem};
  cta.kv_map = kv_tma ? &kv_map : nullptr;
  cta.kv_policy = ptx::l2_policy(p.rows_per_group <= Cfg::kRows);
  // sm90_grid: row blocks along x, parts along y.
  cta.part = blockIdx.y;
  const int row_block = blockIdx.x;
  cta.grp = 0;
  int rb = row_block;
  if (p.dense) {
    cta.grp = row_block / p.blocks_per_group;
    rb = row_block % p.blocks_per_group;
  }
  cta.row0 = rb * Cfg::kRows;
  cta.nrows = min(Cfg::kRows, p.rows_per_group - cta.row0);
  cta.hidden_len = p.dense && p.causal ? p.s_q - 1 - (cta.row0 + cta.nrows - 1) / p.hpk : 0;
  if (threadIdx.x == 0) {
    for (int st = 0; st < Cfg::kStages; ++st) {
      // Staged producers arrive once (their copies landed before the conversion); the others
      // twice (stores, then copies).
      mbar_init(cta.full_bar(st), (Cfg::kStaged ? 1 : 2) * Cfg::kProducerThreads);
      mbar_init(cta.empty_bar(st), 2);
    }
    mbar_init(cta.q_full_bar(), Cfg::kProducerThreads);
    mbar_init(cta.q_empty_bar(), 1);  // consumer 0 reads Q
    mbar_init(cta.p_free_bar(), 128);                       // consumer 1's threads
    for (int b = 0; b < Cfg::kRawStages * Cfg::kProducerWarps; ++b) {
      mbar_init(cta.raw_bar(b / Cfg::kProducerWarps, b % Cfg::kProducerWarps), 1);
    }
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < Cfg::kProducerThreads) {
    regs_dec<Cfg::kProducerRegs>();
    if constexpr (Cfg::kStaged) {
      cta.producer_staged();
    } else {
      cta.producer();
    }
  } else {
    // Consumer 0 computes S (narrow: S^T), consumer 1 accumulates its share of P V.
    if (threadIdx.x < Cfg::kProducerThreads + 128) {
      regs_inc<Cfg::kSRegs>();
      if constexpr (Cfg::kNarrow) {
        cta.consumer_narrow_s();
      } else {
        cta.consumer_s();
      }
    } else {
      regs_inc<Cfg::kPVRegs>();
      if constexpr (Cfg::kNarrow) {
        cta.consumer_narrow_pv();
      } else {
        cta.consumer_pv();
      }
    }
  }
#endif
}

}  // namespace sparse_mla::cuda::sm90
