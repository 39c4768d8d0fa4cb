// The portable decode kernel (sm_80+): sparse (index lists over one or two FP8 caches) and dense
// (block tables over bf16/fp16/FP8 pages) decode share this mainloop; they differ only in where a
// tile's token rows come from (load_raw / resolve) and in which query rows share a token list.
// Tile constants and the shared-memory plan: config.h. Work split: params.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "src/cuda/common/fp8.cuh"
#include "src/cuda/common/ptx.cuh"
#include "src/cuda/smxx/decode/config.h"
#include "src/cuda/smxx/decode/params.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda::smxx::decode {

// A gathered token: its data row and (MODEL1) footer scales; row == nullptr means "no token".
struct RowRef {
  const uint8_t* row;
  const uint8_t* scale;
};

// 16-byte chunk `chunk` of row `row` in a tile whose rows hold `row_chunks` chunks plus one chunk
// of padding: the odd pitch puts the 8 rows an ldmatrix reads in 8 different bank groups, and
// unlike an XOR swizzle keeps every address "lane base + constant", so the unrolled loops need
// no per-step address registers.
__device__ __forceinline__ int swz(int row, int chunk, int row_chunks) {
  return row * (row_chunks + 1) + chunk;
}

// The maximum a row's P is taken against (base-2 units) moves only when a tile's exceeds it by
// more than kMaxSlack, so P stays below 2^kMaxSlack (the same relative rounding in bf16 or fp16
// and far from their limits), the sums do not change, and once a row's maximum is near its final
// value the tiles skip the O rescale (alpha == 1). Both the portable and the Hopper kernels.
inline constexpr float kMaxSlack = 8.f;
__device__ __forceinline__ float next_max(float m, float tile_max) {
  // The difference, not m + kMaxSlack (which rounds up by more than the slack for |m| >= 2^27);
  // from m = -inf any finite or +inf tile maximum moves it, and NaN never does.
  return tile_max - m > kMaxSlack ? tile_max : m;
}

// The scores of a tile of N tokens from pos0 on (bit i of vmask: token i is present) need no
// mask when every token is present and below both rows' causal limits: most tiles only scale.
template <int N, typename Bits>
__device__ __forceinline__ bool all_tokens_visible(Bits vmask, int pos0, const int (&lim)[2]) {
  constexpr Bits kAll = N == 8 * sizeof(Bits) ? ~Bits{0} : (Bits{1} << N) - 1;
  return vmask == kAll && pos0 + N - 1 <= min(lim[0], lim[1]);
}

// Whether column col of a thread's accumulator fragment, in row (e >> 1) of its pair of rows,
// is a present token at or below that row's causal limit.
template <typename Bits>
__device__ __forceinline__ bool token_visible(Bits vmask, int col, int pos0, const int (&lim)[2],
                                              int e) {
  return ((vmask >> col) & 1u) && pos0 + col <= lim[e >> 1];
}

// Causal dense decode: the last s_q - 1 tokens of a request (from len - s_q + 1 on) are hidden
// from its first query tokens, whose P is 0 there, but 0 * V is NaN where V is inf or NaN. So
// before a tile's P V, the V values of those tokens that are not finite are set to 0; the query
// tokens that see such a token keep its non-finite logit (Q K^T has read the tile by then). The
// tile's tokens [x, y) to clean: empty (x >= y) for all other tiles and calls.
__device__ __forceinline__ int2 hidden_tail(const DecodeParams& p, int len, int pos0, int tile) {
  if (!(p.dense && p.causal)) return make_int2(0, 0);
  return make_int2(max(len - p.s_q + 1, pos0) - pos0, min(len, pos0 + tile) - pos0);
}

// A 16-byte chunk of 16-bit values (fp16 where kHalf, else bf16) with the inf and NaN ones
// set to 0.
template <bool kHalf>
__device__ __forceinline__ uint4 finite_or_zero(uint4 v) {
  constexpr uint32_t kExp = kHalf ? 0x7c007c00u : 0x7f807f80u;  // two all-ones exponents
  const auto fix = [](uint32_t w) { return w & ~__vcmpeq2(w & kExp, kExp); };
  return make_uint4(fix(v.x), fix(v.y), fix(v.z), fix(v.w));
}

// A CTA's walk over its part [begin, end) of the cost line, shared by the portable and Hopper
// kernels: whether the part holds tile `tile` of the pair at place `pr` of the line, and the end of
// its tiles of that pair.
__device__ __forceinline__ bool part_holds(const PartStart& end, int pr, int tile) {
  return pr < end.pair || (pr == end.pair && tile < end.tile);
}
__device__ __forceinline__ int part_pair_end(const PartStart& end, int pr, int ntiles) {
  return pr == end.pair ? min(end.tile, ntiles) : ntiles;
}
// The start of a part, its pair place within [0, num_pairs] and its tile not negative.
__device__ __forceinline__ PartStart part_begin(const DecodeParams& p, int part) {
  PartStart begin = p.parts[part];
  begin.pair = min(max(begin.pair, 0), p.num_pairs);
  begin.tile = max(begin.tile, 0);
  return begin;
}
// The lengths and index of the pair at place pr: the part's first pair takes them from the part
// table, so that a CTA's first index loads need no pairs[] read. Held to this call's bounds (an
// id outside them makes the pair empty).
__device__ __forceinline__ PairInfo part_pair_info(const DecodeParams& p, const PartStart& begin,
                                                   int pr) {
  PairInfo info{};
  if (pr != begin.pair) {
    info = p.pairs[pr];
  } else {
    info.n_main = begin.n_main;
    info.len = begin.len;
    info.id = begin.id;
  }
  const bool known = info.id >= 0 && info.id < p.num_pairs;
  info.id = known ? info.id : 0;
  info.n_main = known ? min(max(info.n_main, 0), p.max_main) : 0;
  info.len = known ? min(max(info.len, info.n_main), info.n_main + p.max_extra) : 0;
  return info;
}

// Where a pair's raw values live: its index rows (sparse: main and extra cache) or its block
// table row (dense, in `main`).
struct PairRows {
  const int32_t* main;
  const int32_t* extra;
};

__device__ __forceinline__ PairRows pair_rows(const DecodeParams& p, int i, int sq) {
  if (p.dense) return PairRows{p.block_table + i * p.block_table_stride[0], nullptr};
  return PairRows{p.indices + i * p.indices_stride[0] + sq * p.indices_stride[1],
                  p.extra_indices == nullptr
                      ? nullptr
                      : p.extra_indices + i * p.extra_indices_stride[0] +
                            sq * p.extra_indices_stride[1]};
}

// The raw value behind token `pos` of a pair: a slot (sparse) or a page id (dense); -1 past the end.
__device__ __forceinline__ int load_raw(const DecodeParams& p, const PairInfo& info,
                                        const PairRows& rows, int pos) {
  if (pos >= info.len) return -1;
  if (p.dense) {
    return rows.main[static_cast<int64_t>(p.kv.page_div.quotient(pos)) * p.block_table_stride[1]];
  }
  if (pos < info.n_main) return rows.main[static_cast<int64_t>(pos) * p.indices_stride[2]];
  return rows.extra[static_cast<int64_t>(pos - info.n_main) * p.extra_indices_stride[2]];
}

__device__ __forceinline__ int load_raw(const DecodeParams& p, const PairInfo& info, int i, int sq,
                                        int pos) {
  return load_raw(p, info, pair_rows(p, i, sq), pos);
}

// Row pointers of token `pos`; values outside the cache are never turned into an address.
template <Fmt F>
__device__ __forceinline__ RowRef resolve(const DecodeParams& p, const PairInfo& info, int grp,
                                          int pos, int raw) {
  RowRef r{nullptr, nullptr};
  if (raw < 0 || pos >= info.len) return r;
  const bool main = p.dense || pos < info.n_main;
  const CacheRef& c = main ? p.kv : p.extra;
  // pos and raw are in [0, 2^31) here, the range of the divider.
  int64_t page, off;
  if (p.dense) {
    if (raw >= c.num_pages) return r;
    page = raw;
    off = c.page_div.remainder(pos, c.page_div.quotient(pos));
  } else {
    if (raw >= c.num_slots) return r;
    const uint32_t q = c.page_div.quotient(raw);
    page = q;
    off = c.page_div.remainder(raw, q);
  }
  const uint8_t* pg = c.base + page * c.page_stride;
  if constexpr (F == Fmt::kModel1) {
    r.row = pg + off * kModel1RowBytes;
    r.scale = pg + fmt::model1_scale_offset(c.page_size, off);
  } else if constexpr (F == Fmt::kV32) {
    r.row = pg + off * kV32BytesPerToken;
  } else {
    r.row = pg + (off * p.h_kv + grp) * (kDenseHeadDim * 2);
  }
  return r;
}

template <Fmt F, TileCfg C>
struct DecodeCta {
  using Cfg = Config<F, C>;
  using Tr = FormatTraits<F>;
  static constexpr int kT = Cfg::kT, kHB = Cfg::kHB, kDW = Cfg::kDW, kPD = Cfg::kPD;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kTC = Cfg::kTileChunks;
  static constexpr bool kHalf = Tr::kFP16;

  const DecodeParams& p;
  uint8_t* smem;
  int tid, lane, warp, mt, dw;
  int grp, row0, nrows;

  __device__ uint8_t* q_smem() const { return smem + Cfg::kQOff; }
  __device__ uint8_t* tile_smem() const { return smem + Cfg::kTileOff; }
  __device__ uint8_t* stage_smem(int t) const {
    return smem + Cfg::kStageOff + (t % Cfg::kStages) * Cfg::kStageBytes;
  }
  __device__ float4* red_smem() const { return reinterpret_cast<float4*>(smem + Cfg::kRedOff); }
  __device__ RowRef* rows_smem(int t) const {
    return reinterpret_cast<RowRef*>(smem + Cfg::kRowInfoOff) + (t % kRing) * kT;
  }
  __device__ uint32_t* mask_smem() const { return reinterpret_cast<uint32_t*>(smem + Cfg::kMaskOff); }

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

  __device__ void load_q(int i, int sq) {
    for (int u = tid; u < kHB * kTC; u += kThreads) {
      const int r = u / kTC, c = u % kTC;
      uint4* dst = reinterpret_cast<uint4*>(q_smem()) + swz(r, c, kTC);
      if (r < nrows) {
        int s, head;
        row_coords(row0 + r, sq, &s, &head);
        const uint16_t* src = p.q + i * p.q_stride[0] + s * p.q_stride[1] + head * p.q_stride[2];
        ptx::cp_async_16(dst, src + c * 8);
      } else {
        *dst = make_uint4(0, 0, 0, 0);
      }
    }
  }

  // Gathers tile t's rows into its stage (FP8: raw rows + scales; dense: the swizzled tile).
  __device__ void issue_tile(int t) {
    uint8_t* st = stage_smem(t);
    const RowRef* rows = rows_smem(t);
    // Unit u = chunk c of token j; (j, c) advance by (kThreads / R, kThreads % R) with one carry
    // instead of a division a unit. Absent rows are zero-filled (never NaN), without a branch.
    constexpr int R = Tr::kRowChunks, kUnits = kT * R;
    static_assert(!Tr::kFP8 || Tr::kRowBytes == 16 * R, "FP8 stages hold rows back to back");
    const uint8_t* never_read = reinterpret_cast<const uint8_t*>(p.q);
    int j = tid / R, c = tid % R;
#pragma unroll 1
    for (int u = tid; u < kUnits; u += kThreads) {
      const uint8_t* row = rows[j].row;
      uint8_t* dst = Tr::kFP8 ? st + u * 16 : st + swz(j, c, kTC) * 16;
      ptx::cp_async_16_zfill(dst, row != nullptr ? row + c * 16 : never_read, row != nullptr);
      c += kThreads % R;
      j += kThreads / R;
      if (c >= R) {
        c -= R;
        ++j;
      }
    }
    if constexpr (Tr::kScaleBytes > 0) {
      for (int j = tid; j < kT; j += kThreads) {
        uint8_t* dst = st + Cfg::kStageRowBytes + j * Tr::kScaleBytes;
        const uint8_t* scale = rows[j].scale;
        ptx::cp_async_8_zfill(dst, scale != nullptr ? scale : never_read, scale != nullptr);
      }
    }
  }

  // FP8 stage -> bf16 tile (scales applied; rope copied). Thread tid owns token tid / kTPT and
  // its chunks tid % kTPT + kTPT * k: no division, and one 8-byte footer load a token.
  __device__ void convert_tile(int t) {
    static_assert(kThreads % kT == 0 && (kThreads / kT) % 4 == 0, "whole 4-chunk scale groups");
    constexpr int kTPT = kThreads / kT;
    const uint8_t* st = stage_smem(t);
    uint4* tile = reinterpret_cast<uint4*>(tile_smem());
    const int j = tid / kTPT, sub = tid % kTPT;
    const uint8_t* row = st + j * Tr::kRowBytes;
    uint2 scales{};
    if constexpr (F == Fmt::kModel1) {
      scales = *reinterpret_cast<const uint2*>(st + Cfg::kStageRowBytes + j * 8);
    }
#pragma unroll
    for (int k = 0; k < (Tr::kConvUnits + kTPT - 1) / kTPT; ++k) {
      const int c = sub + kTPT * k;
      if (c < Tr::kFP8Chunks) {
        const uint4 raw = *reinterpret_cast<const uint4*>(row + c * 16);
        uint4 lo, hi;
        if constexpr (F == Fmt::kModel1) {
          const int b = c / 4;  // scale byte of this chunk's 64 dims
          const uint32_t word = b < 4 ? scales.x : scales.y;
          e4m3x16_to_bf16(raw, ue8m0_to_bf16x2(static_cast<uint8_t>(word >> (8 * (b % 4)))), lo,
                          hi);
        } else {
          e4m3x16_to_bf16(raw,
                          *reinterpret_cast<const float*>(row + fmt::kV32ScaleOffset + 4 * (c / 8)),
                          lo, hi);
        }
        tile[swz(j, 2 * c, kTC)] = lo;
        tile[swz(j, 2 * c + 1, kTC)] = hi;
      } else if (c < Tr::kConvUnits) {
        // rope: MODEL1 chunks 28..35 -> tile chunks 56..63; V32 chunks 33..40 -> 64..71
        const int src = F == Fmt::kModel1 ? c : c + 1;
        const int dst = F == Fmt::kModel1 ? c + 28 : c + 32;
        tile[swz(j, dst, kTC)] = *reinterpret_cast<const uint4*>(row + src * 16);
      }
    }
  }

  // Resolves the rows of tile t (tokens of pair `info` from segment tile k0) into the rings;
  // called by whole warps, lanes j < kT own token j.
  __device__ void store_tile_rows(int t, int j, bool active, RowRef ref) {
    const uint32_t bal = __ballot_sync(0xffffffffu, active && ref.row != nullptr);
    if (!active) return;
    rows_smem(t)[j] = ref;
    if (j == 0) {
      const uint32_t bits = kT == 32 ? bal : (bal >> (lane & 16)) & ((1u << (kT % 32)) - 1u);
      mask_smem()[t % kRing] = bits;
    }
  }

  // `info` needs only the lengths and index (n_main, len, id); the epilogue reads the rest from
  // the plan.
  __device__ void segment(int pr, int k0, int k1, const PairInfo& info) {
    const int i = p.dense ? info.id : info.id / p.s_q;
    const int sq = p.dense ? 0 : info.id % p.s_q;
    const int n = k1 - k0;
    if (tid == 0) ptx::prefetch_l2(p.pairs + pr);  // for the epilogue

    // ---- prologue: rows of tiles 0..kPD, Q, copies of tiles 0..kPD-1 ----
    // The index loads go out before the Q copies, which would otherwise queue ahead of them:
    // at small batches this chain (indices, then rows) is most of a CTA's time.
    constexpr int kPrologueThreads = ((kPD + 1) * kT + 31) / 32 * 32;
    const int pk = tid / kT, pj = tid % kT;  // prologue thread: token pj of tile pk
    const bool prologue = tid < kPrologueThreads && pk <= kPD && pk < n;
    const int ppos = (k0 + pk) * kT + pj;
    const int praw = prologue ? load_raw(p, info, i, sq, ppos) : -1;
    int pending = -1;  // raw value of this lane's token in the next tile to resolve
    if (warp == 0 && lane < kT && kPD + 1 < n) {
      pending = load_raw(p, info, i, sq, (k0 + kPD + 1) * kT + lane);
    }
    load_q(i, sq);
    if (tid < kPrologueThreads) {
      RowRef ref{nullptr, nullptr};
      if (prologue) ref = resolve<F>(p, info, grp, ppos, praw);
      store_tile_rows(pk, pj, pk <= kPD, ref);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kPD; ++k) {
      if (k < n) issue_tile(k);
      ptx::cp_async_commit();
    }

    // Row limits of this thread's two rows (causal dense decode), for the mask.
    int lim[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      lim[rr] = 0x7fffffff;
      if (p.dense && p.causal) {
        const int lr = row0 + mt * 16 + (lane >> 2) + 8 * rr;
        lim[rr] = info.len - p.s_q + lr / p.hpk;
      }
    }

    float o[Cfg::kPVTiles][4];
#pragma unroll
    for (int nt = 0; nt < Cfg::kPVTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};

    for (int t = 0; t < n; ++t) {
      ptx::cp_async_wait<kPD - 1>();
      __syncthreads();
      if constexpr (Tr::kFP8) convert_tile(t);
      if (warp == 0) {
        const int tn = t + kPD + 1;
        RowRef ref{nullptr, nullptr};
        if (lane < kT && tn < n) ref = resolve<F>(p, info, grp, (k0 + tn) * kT + lane, pending);
        store_tile_rows(tn, lane, lane < kT, ref);
        pending = -1;
        if (lane < kT && tn + 1 < n) pending = load_raw(p, info, i, sq, (k0 + tn + 1) * kT + lane);
      }
      if constexpr (Tr::kFP8) __syncthreads();
      if (t + kPD < n) issue_tile(t + kPD);
      ptx::cp_async_commit();
      compute_tile(t, (k0 + t) * kT, info.len, lim, o, m, l);
    }

    epilogue(pr, i, sq, p.pairs[pr], o, m, l);
    __syncthreads();  // Q / staging / rings are reused by the next segment
  }

  __device__ void compute_tile(int t, int pos0, int len, const int (&lim)[2],
                               float (&o)[Cfg::kPVTiles][4], float (&m)[2], float (&l)[2]) {
    uint8_t* kt = Tr::kFP8 ? tile_smem() : stage_smem(t);  // (the causal tail is cleaned below)
    const uint8_t* qs = q_smem();

    // S partial over this warp's d_qk slice.
    float s[Cfg::kSTiles][4];
#pragma unroll
    for (int j = 0; j < Cfg::kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < Cfg::kQKSteps; ++ks) {
      const int c0 = (dw * Cfg::kQKSlice + ks * 16) / 8;
      uint32_t a[4];
      ptx::ldmatrix_x4(a, qs + swz(mt * 16 + (lane & 15), c0 + (lane >> 4), kTC) * 16);
#pragma unroll
      for (int nb = 0; nb < kT / 16; ++nb) {
        uint32_t b[4];
        ptx::ldmatrix_x4(
            b, kt + swz(nb * 16 + (lane & 7) + ((lane >> 4) << 3), c0 + ((lane >> 3) & 1), kTC) * 16);
        ptx::mma_16816<kHalf>(s[2 * nb], a, b[0], b[1]);
        ptx::mma_16816<kHalf>(s[2 * nb + 1], a, b[2], b[3]);
      }
    }

    // Sum the kDW partials of this row group in a fixed order: identical S in every warp.
    float4* red = red_smem() + (mt * kDW) * Cfg::kSTiles * 32 + lane;
#pragma unroll
    for (int j = 0; j < Cfg::kSTiles; ++j) {
      red[(dw * Cfg::kSTiles + j) * 32] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    }
    ptx::named_barrier(1 + mt, kDW * 32);
#pragma unroll
    for (int j = 0; j < Cfg::kSTiles; ++j) {
      float4 acc = dw == 0 ? make_float4(s[j][0], s[j][1], s[j][2], s[j][3]) : red[j * 32];
#pragma unroll
      for (int d = 1; d < kDW; ++d) {
        const float4 v =
            d == dw ? make_float4(s[j][0], s[j][1], s[j][2], s[j][3]) : red[(d * Cfg::kSTiles + j) * 32];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      s[j][0] = acc.x;
      s[j][1] = acc.y;
      s[j][2] = acc.z;
      s[j][3] = acc.w;
    }

    // Mask (invalid tokens, causal limit) and scale to base 2.
    const uint32_t vmask = mask_smem()[t % kRing];
    if (all_tokens_visible<kT>(vmask, pos0, lim)) {
#pragma unroll
      for (int j = 0; j < Cfg::kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
      }
    } else {
#pragma unroll
      for (int j = 0; j < Cfg::kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = j * 8 + 2 * (lane & 3) + (e & 1);
          s[j][e] = token_visible(vmask, col, pos0, lim, e) ? s[j][e] * p.scale_log2 : -INFINITY;
        }
      }
    }

    // Online softmax; a row that has seen no valid token yet keeps m = -inf and uses 0 as its
    // reference so that exp2 never sees inf - inf.
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < Cfg::kSTiles; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * rr], s[j][2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = next_max(m[rr], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[rr] = ptx::exp2_approx(m[rr] - m_use);
      m[rr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < Cfg::kSTiles; ++j) {
        s[j][2 * rr] = ptx::exp2_approx(s[j][2 * rr] - m_use);
        s[j][2 * rr + 1] = ptx::exp2_approx(s[j][2 * rr + 1] - m_use);
        sum += s[j][2 * rr] + s[j][2 * rr + 1];
      }
      l[rr] = l[rr] * alpha[rr] + sum;
    }
    // Once the row maxima settle, most tiles leave them unchanged (alpha exactly 1): skip the
    // multiplies unless a row of the warp moved.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int nt = 0; nt < Cfg::kPVTiles; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
      }
    }

    const int2 tail = hidden_tail(p, len, pos0, kT);
    if (tail.x < tail.y) {
      __syncthreads();  // every warp's Q K^T has read the tile
      constexpr int kVChunks = kDV / 8;
      for (int u = tid; u < (tail.y - tail.x) * kVChunks; u += kThreads) {
        uint4* chunk = reinterpret_cast<uint4*>(kt) + swz(tail.x + u / kVChunks, u % kVChunks, kTC);
        *chunk = finite_or_zero<kHalf>(*chunk);
      }
      __syncthreads();
    }

    // O += P V over this warp's output slice; V = the first 512 dims of the tile.
#pragma unroll
    for (int kk = 0; kk < kT / 16; ++kk) {
      uint32_t a[4];
      a[0] = ptx::pack2<kHalf>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = ptx::pack2<kHalf>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = ptx::pack2<kHalf>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = ptx::pack2<kHalf>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      const int token = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
      for (int nd = 0; nd < Cfg::kPVSlice / 16; ++nd) {
        const int c0 = (dw * Cfg::kPVSlice + nd * 16) / 8;
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, kt + swz(token, c0 + (lane >> 4), kTC) * 16);
        ptx::mma_16816<kHalf>(o[2 * nd], a, b[0], b[1]);
        ptx::mma_16816<kHalf>(o[2 * nd + 1], a, b[2], b[3]);
      }
    }
  }

  __device__ void epilogue(int pr, int i, int sq, const PairInfo& info,
                           float (&o)[Cfg::kPVTiles][4], const float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    }
    const int r_base = mt * 16 + (lane >> 2);  // this thread's rows: r_base, r_base + 8

    if (info.nsplit <= 1) {
      // Final output: normalize, apply the sink, stage as 16-bit rows in the Q region (only
      // this row group's warps read those Q rows, and they are past the last S = Q K^T).
      float factor[2], lse[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = r_base + 8 * rr;
        if (l[rr] == 0.f) {  // no valid token: out 0, lse +inf, sink or not
          factor[rr] = 0.f;
          lse[rr] = INFINITY;
        } else {
          lse[rr] = (m[rr] + log2f(l[rr])) * 0.693147180559945309f;
          float f = 1.f / l[rr];
          if (p.sink != nullptr && r < nrows) {
            int s, head;
            row_coords(row0 + r, sq, &s, &head);
            f *= 1.f / (1.f + expf(p.sink[head * p.sink_stride] - lse[rr]));
          }
          factor[rr] = f;
        }
      }
      uint8_t* os = q_smem();
#pragma unroll
      for (int nt = 0; nt < Cfg::kPVTiles; ++nt) {
        const int col = dw * Cfg::kPVSlice + nt * 8 + 2 * (lane & 3);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int r = r_base + 8 * rr;
          *reinterpret_cast<uint32_t*>(os + swz(r, col / 8, kTC) * 16 + (col % 8) * 2) =
              ptx::pack2<kHalf>(o[nt][2 * rr] * factor[rr], o[nt][2 * rr + 1] * factor[rr]);
        }
      }
      if (dw == 0 && (lane & 3) == 0) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int r = r_base + 8 * rr;
          if (r < nrows) {
            int s, head;
            row_coords(row0 + r, sq, &s, &head);
            p.lse[i * p.lse_stride[0] + head * p.lse_stride[1] + s * p.lse_stride[2]] = lse[rr];
          }
        }
      }
      __syncthreads();
      constexpr int kOutChunks = kDV / 8;
      for (int u = tid; u < kHB * kOutChunks; u += kThreads) {
        const int r = u / kOutChunks, c = u % kOutChunks;
        if (r < nrows) {
          int s, head;
          row_coords(row0 + r, sq, &s, &head);
          uint16_t* dst = p.out + i * p.out_stride[0] + s * p.out_stride[1] + head * p.out_stride[2];
          *reinterpret_cast<uint4*>(dst + c * 8) =
              *reinterpret_cast<const uint4*>(os + swz(r, c, kTC) * 16);
        }
      }
    } else {
      // Partial output of a split pair: normalized fp32 rows + base-2 lse for the combine.
      const int slot = info.slot + (static_cast<int>(blockIdx.x) - info.first_part);
      if (slot < 0 || slot >= p.max_slots) return;
      const int grow0 = (p.dense ? grp * p.rows_per_group : 0) + row0;
      float inv[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = r_base + 8 * rr;
        const bool empty = l[rr] == 0.f;
        inv[rr] = empty ? 0.f : 1.f / l[rr];
        if (r < nrows && dw == 0 && (lane & 3) == 0) {
          p.part_lse[static_cast<int64_t>(slot) * p.rows_per_pair + grow0 + r] =
              empty ? -INFINITY : m[rr] + log2f(l[rr]);
        }
      }
      // The rows go out through shared memory so that each store writes whole 128-byte lines
      // (a fragment store touches 8 rows): kCC columns a round, staged in this warp's share of
      // its row group's Q rows, which no warp reads after the group's last S reduction barrier.
      constexpr int kCC = kDW == 2 ? 64 : 32;
      constexpr int kSP = kCC + 8;      // staging pitch (floats): rows 8 banks apart
      constexpr int kLPR = kCC / 4;     // lanes a row on the way out, a float4 each
      constexpr int kRPI = 32 / kLPR;   // rows a store instruction
      static_assert(kDW * 16 * kSP * 4 <= 16 * Cfg::kPitch, "staging fits the group's Q rows");
      float* stage = reinterpret_cast<float*>(q_smem() + mt * 16 * Cfg::kPitch) + dw * 16 * kSP;
      const int lr = lane >> 2;  // this thread's rows in the group: lr, lr + 8
#pragma unroll
      for (int rnd = 0; rnd < Cfg::kPVSlice / kCC; ++rnd) {
#pragma unroll
        for (int t8 = 0; t8 < kCC / 8; ++t8) {
          const int nt = rnd * (kCC / 8) + t8;
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            *reinterpret_cast<float2*>(stage + (lr + 8 * rr) * kSP + t8 * 8 + 2 * (lane & 3)) =
                make_float2(o[nt][2 * rr] * inv[rr], o[nt][2 * rr + 1] * inv[rr]);
          }
        }
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 16 / kRPI; ++it) {
          const int r = it * kRPI + lane / kLPR;
          const int c = 4 * (lane % kLPR);
          if (mt * 16 + r < nrows) {
            const int64_t prow = static_cast<int64_t>(slot) * p.rows_per_pair + grow0 + mt * 16 + r;
            *reinterpret_cast<float4*>(p.part_out + prow * kDV + dw * Cfg::kPVSlice + rnd * kCC + c) =
                *reinterpret_cast<const float4*>(stage + r * kSP + c);
          }
        }
        __syncwarp();
      }
    }
  }
};

template <Fmt F, TileCfg C>
__global__ void __launch_bounds__(Config<F, C>::kThreads, 1)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  // The combine kernel may start launching now; it waits for this grid before reading partials.
  ptx::launch_dependent_grids();
  extern __shared__ __align__(128) uint8_t smem[];
  using Cta = DecodeCta<F, C>;
  Cta cta{p, smem};
  cta.tid = threadIdx.x;
  cta.lane = threadIdx.x & 31;
  cta.warp = threadIdx.x >> 5;
  cta.mt = cta.warp / Cta::kDW;
  cta.dw = cta.warp % Cta::kDW;
  cta.grp = 0;
  int rb = blockIdx.y;
  if (p.dense) {
    cta.grp = blockIdx.y / p.blocks_per_group;
    rb = blockIdx.y % p.blocks_per_group;
  }
  cta.row0 = rb * Cta::kHB;
  cta.nrows = min(Cta::kHB, p.rows_per_group - cta.row0);

  const PartStart begin = part_begin(p, blockIdx.x);
  const PartStart end = p.parts[blockIdx.x + 1];
  int pr = begin.pair, k0 = begin.tile;
  while (pr < p.num_pairs && part_holds(end, pr, k0)) {
    const PairInfo info = part_pair_info(p, begin, pr);
    const int k1 = part_pair_end(end, pr, pair_tiles(info.len, Cta::kT));
    if (k0 < k1) cta.segment(pr, k0, k1, info);
    ++pr;
    k0 = 0;
  }
}

}  // namespace sparse_mla::cuda::smxx::decode
