// Tile plan of the portable decode kernel (sm_80+, mma.sync m16n8k16, fp32 accumulation).
//
// One CTA owns kHB query rows (heads of one query token for sparse decode; (query token, head)
// pairs of one KV head for dense decode) and walks the tokens of its work item in tiles of kT.
// Per tile: gather the rows with cp.async into a raw stage, dequantize FP8 once into a bf16 tile
// shared by all kHB rows, S = Q K^T, online softmax (base 2), O += P V.
//
// Warps: kMW row groups of 16 (the mma M) x kDW slices of the head dim. A warp computes a partial
// S over its d_qk slice; the kDW partials of a row group are summed through shared memory in a
// fixed order (so every warp of the group holds the same S, bit for bit), and the warp then owns
// O[16 rows, 512 / kDW dims]. This keeps O at 128 (kDW 2) or 64 (kDW 4) fp32 registers a thread.
#pragma once

#include <cstdint>

namespace sparse_mla::cuda::smxx::decode {

enum class Fmt : int { kModel1 = 0, kV32 = 1, kBF16 = 2, kFP16 = 3 };
inline constexpr int kNumFmts = 4;

// Whether the Hopper kernel's CTAs of rows_per_cta query rows write a split pair's partial rows
// in fp16 with power-of-two exponents (half the bytes of fp32; sm90_notes.md, variant 152): its
// 64-row CTAs on FP8 pages. 16-bit pages keep fp32, where fp16 partials made the imbalanced h_q
// 16 batch 18% slower; the narrow CTAs write fp32.
constexpr bool sm90_fp16_partials(Fmt f, int rows_per_cta) {
  return rows_per_cta == 64 && (f == Fmt::kModel1 || f == Fmt::kV32);
}

template <Fmt F>
struct FormatTraits;

// MODEL1: staged row = the 576-byte data row (448 e4m3 + 64 bf16); the 8 footer scale bytes are
// staged separately. d_qk = d_v = 512, V includes the rope dims.
template <>
struct FormatTraits<Fmt::kModel1> {
  static constexpr bool kFP8 = true;
  static constexpr bool kFP16 = false;
  static constexpr int kDqk = 512;
  static constexpr int kRowBytes = 576;
  static constexpr int kRowChunks = 36;   // 16-byte chunks of a staged row
  static constexpr int kScaleBytes = 8;   // footer bytes staged per token
  static constexpr int kFP8Chunks = 28;   // 448 e4m3 values
  static constexpr int kConvUnits = 36;   // per token: 28 e4m3 chunks + 8 rope chunks
};

// V32: staged row = the whole 656-byte row (512 e4m3, 4 fp32 scales at 512, 64 bf16 rope at 528).
// d_qk = 576, V = the first 512 (dequantized nope) dims.
template <>
struct FormatTraits<Fmt::kV32> {
  static constexpr bool kFP8 = true;
  static constexpr bool kFP16 = false;
  static constexpr int kDqk = 576;
  static constexpr int kRowBytes = 656;
  static constexpr int kRowChunks = 41;
  static constexpr int kScaleBytes = 0;
  static constexpr int kFP8Chunks = 32;
  static constexpr int kConvUnits = 40;  // 32 e4m3 chunks + 8 rope chunks (the scale chunk is read)
};

// Dense bf16/fp16 pages: one head's 576 values are copied straight into the swizzled tile.
template <>
struct FormatTraits<Fmt::kBF16> {
  static constexpr bool kFP8 = false;
  static constexpr bool kFP16 = false;
  static constexpr int kDqk = 576;
  static constexpr int kRowBytes = 1152;
  static constexpr int kRowChunks = 72;
  static constexpr int kScaleBytes = 0;
  static constexpr int kFP8Chunks = 0;
  static constexpr int kConvUnits = 0;
};

template <>
struct FormatTraits<Fmt::kFP16> : FormatTraits<Fmt::kBF16> {
  static constexpr bool kFP16 = true;
};

// The tile configurations a launch can pick (see choose_config in launch.h).
enum class TileCfg : int {
  kH64T32 = 0,  // 64 rows: h_q = 64/128 (DeepSeek-V4 without TP); needs ~150-171 KB smem
  kH32T32 = 1,  // 32 rows: TP-sharded heads
  kH16T32 = 2,  // 16 rows (h_q <= 16, padded to the mma M); 2 CTAs per SM on H100
  kH16T16 = 3,  // 16 rows, 16-token tiles: fits the ~99 KB of sm_86/89/120
};
inline constexpr int kNumTileCfgs = 4;

template <TileCfg C>
struct TileShape;
template <>
struct TileShape<TileCfg::kH64T32> {
  static constexpr int kHB = 64, kT = 32;
};
template <>
struct TileShape<TileCfg::kH32T32> {
  static constexpr int kHB = 32, kT = 32;
};
template <>
struct TileShape<TileCfg::kH16T32> {
  static constexpr int kHB = 16, kT = 32;
};
template <>
struct TileShape<TileCfg::kH16T16> {
  static constexpr int kHB = 16, kT = 16;
};

inline constexpr int kDV = 512;
inline constexpr int kRing = 4;  // slots of the per-tile row-pointer / validity rings

template <Fmt F, TileCfg C>
struct Config {
  using Traits = FormatTraits<F>;
  static constexpr int kHB = TileShape<C>::kHB;
  static constexpr int kT = TileShape<C>::kT;
  static constexpr int kMW = kHB / 16;
  // 64 rows: 4 row groups x 2 dim halves = 8 warps, O is 16 x 256 per warp. Fewer rows: split the
  // dim in 4 so that a CTA still has 4-8 warps to hide latency; d_qk / 4 = 144 for V32 is 9 k-steps.
  static constexpr int kDW = kHB == 64 ? 2 : 4;
  static constexpr int kWarps = kMW * kDW;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDqk = Traits::kDqk;
  static constexpr int kQKSlice = kDqk / kDW;   // d_qk dims per warp in S = Q K^T
  static constexpr int kQKSteps = kQKSlice / 16;
  static constexpr int kPVSlice = kDV / kDW;    // output dims per warp
  static constexpr int kPVTiles = kPVSlice / 8;  // n8 tiles of O per warp
  static constexpr int kSTiles = kT / 8;        // n8 tiles of S per warp
  static constexpr int kTileChunks = kDqk / 8;  // 16-byte chunks of a bf16 row (64 or 72)
  // FP8: the stage is converted right after it lands, so the next-but-one tile can be in flight
  // while the current one is computed. bf16/fp16 tiles are used in place: one tile ahead.
  static constexpr int kPD = Traits::kFP8 ? 2 : 1;
  static constexpr int kStages = 2;

  // Shared memory plan (bytes, every region a multiple of 16).
  // Q, the bf16 tile and dense stages use rows of kDqk * 2 bytes plus 16 bytes of padding.
  static constexpr int kPitch = (kTileChunks + 1) * 16;
  static constexpr int kQBytes = kHB * kPitch;  // Q, reused for the 16-bit output rows
  static constexpr int kTileBytes = Traits::kFP8 ? kT * kPitch : 0;  // dequantized K/V tile
  static constexpr int kStageRowBytes = Traits::kFP8 ? kT * Traits::kRowBytes : kT * kPitch;
  static constexpr int kStageBytes = kStageRowBytes + kT * Traits::kScaleBytes;
  static constexpr int kRedBytes = kMW * kDW * kT * 64;  // S partials: [warp][n8 tile][lane] float4
  static constexpr int kRowInfoBytes = kRing * kT * 16;  // row + scale pointers per token
  static constexpr int kMaskBytes = 16;

  static constexpr int kQOff = 0;
  static constexpr int kTileOff = kQOff + kQBytes;
  static constexpr int kStageOff = kTileOff + kTileBytes;
  static constexpr int kRedOff = kStageOff + kStages * kStageBytes;
  static constexpr int kRowInfoOff = kRedOff + kRedBytes;
  static constexpr int kMaskOff = kRowInfoOff + kRowInfoBytes;
  static constexpr int kSmemBytes = kMaskOff + kMaskBytes;

  static_assert(kHB % 16 == 0 && kT % 16 == 0 && kT <= 32, "mma tiles; one 32-bit mask per tile");
  static_assert(kQKSlice % 16 == 0 && kPVSlice % 16 == 0, "whole k16 steps and n16 pairs");
  static_assert(kThreads >= (kPD + 1) * kT, "the prologue resolves kPD + 1 tiles at once");
};

}  // namespace sparse_mla::cuda::smxx::decode
