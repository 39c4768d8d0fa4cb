// CUDA KV-cache tools: quantize-and-store, dequantize and page repack (sm_80+).
// Bytes written are identical to the CPU backend's: both go through src/kv/format.h, and every
// floating-point step here (max, multiplication by a power of two) is exact or correctly rounded.
// Values inside device tensors (slots, block tables, lengths) are never trusted: anything out of
// range is skipped before an address is formed from it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "src/cuda/common/block_scan.cuh"
#include "src/cuda/common/check.h"
#include "src/cuda/common/divider.h"
#include "src/cuda/cuda_backend.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Source and destination element access.

// Raw storage of one source element and its conversions, as the CPU backend does them: bf16
// rope values are copied bit for bit, float32 ones rounded once.
template <DType kDType>
struct Elem;
template <>
struct Elem<DType::kBFloat16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t b) { return fmt::bf16_to_float(b); }
  static __device__ __forceinline__ uint16_t to_bf16(uint16_t b) { return b; }
};
template <>
struct Elem<DType::kFloat32> {
  using Storage = float;
  static __device__ __forceinline__ float to_float(float f) { return f; }
  static __device__ __forceinline__ uint16_t to_bf16(float f) { return fmt::float_to_bf16(f); }
};

// Loads N consecutive elements of a row starting at column col0. kVec: the row is 16-byte aligned
// at col0 and N * sizeof(T) is a multiple of 16.
template <typename T, int N, bool kVec>
__device__ __forceinline__ void load_elems(const T* row, int col0, T (&v)[N]) {
  if constexpr (kVec) {
    static_assert((N * sizeof(T)) % 16 == 0);
    const uint4* p = reinterpret_cast<const uint4*>(row + col0);
    uint4 tmp[N * sizeof(T) / 16];
#pragma unroll
    for (int i = 0; i < static_cast<int>(N * sizeof(T) / 16); ++i) tmp[i] = __ldg(p + i);
    memcpy(v, tmp, sizeof(v));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = row[col0 + i];
  }
}

template <DType kOut>
using OutStorage = std::conditional_t<kOut == DType::kFloat32, float, uint16_t>;

// Stores N values to columns [col0, col0 + N) of an output row (float32 raw, bf16 RNE).
template <DType kOut, int N, bool kVec>
__device__ __forceinline__ void store_values(OutStorage<kOut>* row, int col0, const float (&v)[N]) {
  OutStorage<kOut> o[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (kOut == DType::kFloat32) {
      o[i] = v[i];
    } else {
      o[i] = fmt::float_to_bf16(v[i]);
    }
  }
  if constexpr (kVec) {
    static_assert((N * sizeof(o[0])) % 16 == 0);
    uint4 tmp[N * sizeof(o[0]) / 16];
    memcpy(tmp, o, sizeof(tmp));
    uint4* p = reinterpret_cast<uint4*>(row + col0);
#pragma unroll
    for (int i = 0; i < static_cast<int>(N * sizeof(o[0]) / 16); ++i) p[i] = tmp[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) row[col0 + i] = o[i];
  }
}

// e4m3 value times its scale. A NaN operand is passed through unchanged (sign included), as the
// CPU's scalar multiply does; the GPU's multiply would return a canonical NaN instead.
__device__ __forceinline__ float scaled(float x, float scale) {
  if (isnan(x)) return x;
  if (isnan(scale)) return scale;
  return x * scale;
}

__device__ __forceinline__ bool slot_valid(int64_t slot, int64_t num_slots) {
  return slot >= 0 && slot < num_slots;
}

// ---------------------------------------------------------------------------------------------
// Quantize-and-store. A warp stores kTokens consecutive source rows. A row is cut into 16-byte
// groups (8 bf16 or 4 float32 values); lane l owns groups l, l + 32, l + 64, ... so every load and
// store instruction of the warp covers one contiguous span. The warp issues the slot and source
// loads of all its rows before any arithmetic, so the memory system always has several rows per
// warp in flight instead of one row behind a dependent slot load.

struct QuantizeParams {
  const void* src;         // [n, d_qk] row stride src_row_stride elements, last dim contiguous
  int64_t src_row_stride;  // elements
  const int32_t* slots;    // [n], stride slot_stride
  int64_t slot_stride;
  int64_t n;
  uint8_t* cache;
  int64_t page_size, page_stride, num_slots;
  SlotDivider page_div;
};

// Compile-time shape of one token for a cache format and source dtype.
template <KVFormat kFormat, DType kSrc>
struct QuantLayout {
  using T = typename Elem<kSrc>::Storage;
  static constexpr bool kModel1 = kFormat == KVFormat::kModel1;
  static constexpr int kG = 16 / static_cast<int>(sizeof(T));  // values per 16-byte group
  static constexpr int kNope = kModel1 ? kModel1NopeDims : kV32NopeDims;
  static constexpr int kTile = kModel1 ? kModel1ScaleTile : kV32ScaleTile;
  static constexpr int kGroups = (kNope + kRopeDims) / kG;
  static constexpr int kNopeGroups = kNope / kG;
  static constexpr int kSteps = (kGroups + kWarp - 1) / kWarp;  // groups per lane, some partial
  static constexpr int kNopeSteps = (kNopeGroups + kWarp - 1) / kWarp;
  static constexpr int kTileLanes = kTile / kG;  // lanes sharing one scale within a step
  static constexpr int kRowBytes = kModel1 ? kModel1RowBytes : kV32BytesPerToken;
  static constexpr int kRopeOffset = kModel1 ? kModel1NopeDims : fmt::kV32RopeOffset;
  // Rows per warp: about 2 KB of source in flight per warp for either dtype.
  static constexpr int kTokens = sizeof(T) == 2 ? 2 : 1;
  static_assert(kWarp % kTileLanes == 0 && kNopeGroups % kTileLanes == 0,
                "a scale tile must not straddle two steps or the nope/rope boundary");
};

// Group g of a source row (16 bytes). kVec: the row is 16-byte aligned; otherwise element loads.
// The source is read once: streaming loads keep it from pushing the cache pages out of L2.
template <typename T, bool kVec>
__device__ __forceinline__ uint4 load_group(const T* row, int g) {
  if constexpr (kVec) {
    return __ldcs(reinterpret_cast<const uint4*>(row) + g);
  } else {
    constexpr int kG = 16 / sizeof(T);
    T v[kG];
#pragma unroll
    for (int i = 0; i < kG; ++i) v[i] = row[kG * g + i];
    uint4 r;
    memcpy(&r, v, 16);
    return r;
  }
}

template <DType kSrc>
__device__ __forceinline__ void group_values(
    const uint4& raw, float (&x)[16 / sizeof(typename Elem<kSrc>::Storage)]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kSrc == DType::kBFloat16) {
      x[2 * i] = fmt::bits_float(w[i] << 16);
      x[2 * i + 1] = fmt::bits_float(w[i] & 0xffff0000u);
    } else {
      x[i] = fmt::bits_float(w[i]);
    }
  }
}

// Max of |x| over `group` adjacent lanes (group a power of two); NaN is ignored like std::fmax.
template <int kGroup>
__device__ __forceinline__ float group_amax(float a) {
#pragma unroll
  for (int o = 1; o < kGroup; o <<= 1) a = fmaxf(a, __shfl_xor_sync(kFullMask, a, o));
  return a;
}

// Two e4m3 codes (a in the low byte), round to nearest even saturating to +-448 like
// fmt::float_to_e4m3, except that a NaN may come out with the wrong sign (fixed by the caller).
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(b), "f"(a));
  return packed;
#else
  return fmt::float_to_e4m3(a) | (static_cast<uint32_t>(fmt::float_to_e4m3(b)) << 8);
#endif
}

// e4m3 codes of x / 2^e, kN a multiple of 4, as little-endian words. x * 2^-e is the same
// correctly rounded real as the CPU's x / 2^e, also for e = 127 (2^-127 is an exact subnormal and
// the multiply does not flush). NaN codes are rare: a cheap byte test finds them, and only then
// are their signs restored (the CPU's division keeps a NaN's sign, the GPU's paths may not).
template <int kN>
__device__ __forceinline__ void quantize_values(const float (&x)[kN], int e,
                                                uint32_t (&w)[kN / 4]) {
  const float inv = e <= 126 ? fmt::exp2i(-e) : fmt::bits_float(0x00400000u);
  uint32_t nan_bytes = 0;
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) {
    w[i] = e4m3x2(x[4 * i] * inv, x[4 * i + 1] * inv) |
           (e4m3x2(x[4 * i + 2] * inv, x[4 * i + 3] * inv) << 16);
    // A code is NaN iff its low 7 bits are all set, i.e. its byte of ~w & 0x7f7f7f7f is zero;
    // the usual zero-byte test says whether the word has one.
    const uint32_t v = ~w[i] & 0x7f7f7f7fu;
    nan_bytes |= (v - 0x01010101u) & ~v & 0x80808080u;
  }
  if (nan_bytes != 0) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (isnan(x[i])) {
        const uint32_t code = fmt::float_bits(x[i]) >> 31 ? 0xffu : 0x7fu;
        const int shift = 8 * (i % 4);
        w[i / 4] = (w[i / 4] & ~(0xffu << shift)) | (code << shift);
      }
    }
  }
}

// Stores one token (its source groups already in registers) at a valid slot.
template <KVFormat kFormat, DType kSrc>
__device__ __forceinline__ void store_token(const QuantizeParams& p, int64_t slot,
                                            const uint4 (&raw)[QuantLayout<kFormat, kSrc>::kSteps],
                                            int lane) {
  using L = QuantLayout<kFormat, kSrc>;
  constexpr int kG = L::kG;
  const uint32_t s = static_cast<uint32_t>(slot);  // valid slots are int32 values >= 0
  const uint32_t page = p.page_div.quotient(s);
  const uint32_t t = p.page_div.remainder(s, page);
  uint8_t* base = p.cache + static_cast<int64_t>(page) * p.page_stride;
  uint8_t* data = base + static_cast<int64_t>(t) * L::kRowBytes;

  int e[L::kNopeSteps];
#pragma unroll
  for (int step = 0; step < L::kSteps; ++step) {
    const int g = kWarp * step + lane;
    if (step < L::kNopeSteps) {
      // Uniform over the warp: every lane takes part in the shuffles, rope lanes with amax 0.
      float x[kG];
      group_values<kSrc>(raw[step], x);
      const bool nope = g < L::kNopeGroups;
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < kG; ++i) amax = fmaxf(amax, fabsf(x[i]));
      amax = group_amax<L::kTileLanes>(nope ? amax : 0.f);
      e[step] = fmt::scale_exponent(amax);
      if (nope) {
        uint32_t w[kG / 4];
        quantize_values<kG>(x, e[step], w);
        if constexpr (kG == 8) {
          __stcs(reinterpret_cast<uint2*>(data) + g, make_uint2(w[0], w[1]));
        } else {
          __stcs(reinterpret_cast<unsigned int*>(data) + g, w[0]);
        }
        continue;
      }
    }
    if (g >= L::kNopeGroups && g < L::kGroups) {
      const int r = g - L::kNopeGroups;
      if constexpr (kSrc == DType::kBFloat16) {
        __stcs(reinterpret_cast<uint4*>(data + L::kRopeOffset) + r, raw[step]);  // bits as they are
      } else {
        const uint32_t lo =
            fmt::float_to_bf16(fmt::bits_float(raw[step].x)) |
            (static_cast<uint32_t>(fmt::float_to_bf16(fmt::bits_float(raw[step].y))) << 16);
        const uint32_t hi =
            fmt::float_to_bf16(fmt::bits_float(raw[step].z)) |
            (static_cast<uint32_t>(fmt::float_to_bf16(fmt::bits_float(raw[step].w))) << 16);
        __stcs(reinterpret_cast<uint2*>(data + L::kRopeOffset) + r, make_uint2(lo, hi));
      }
    }
  }

  // Lane j < number of tiles fetches tile j's exponent: step (j * kTileLanes) / 32, lane
  // (j * kTileLanes) % 32. One shuffle per step, every lane taking part.
  const int first = lane * L::kTileLanes;
  int ej = 0;
#pragma unroll
  for (int step = 0; step < L::kNopeSteps; ++step) {
    const int v = __shfl_sync(kFullMask, e[step], first % kWarp);
    if (first / kWarp == step) ej = v;
  }
  if constexpr (L::kModel1) {
    // 7 UE8M0 bytes and the unused zero byte: one store instruction, eight lanes, one sector.
    // Kept at normal L2 priority: the footers of four neighbouring tokens share a sector.
    if (lane < kModel1ScaleBytes) {
      base[fmt::model1_scale_offset(p.page_size, t) + lane] =
          lane < kModel1NopeDims / kModel1ScaleTile ? static_cast<uint8_t>(ej + 127) : 0;
    }
  } else {
    if (lane < kV32NopeDims / kV32ScaleTile) {
      __stcs(reinterpret_cast<float*>(data + fmt::kV32ScaleOffset) + lane, fmt::exp2i(ej));
    }
  }
}

// Vectorized rows: at most 48 registers (5 blocks, 40 warps per SM on sm_90): the V32 bf16
// variant would otherwise take 53 and fit only 4 blocks; 40 would make it spill. The unaligned-row
// fallback gets 4 blocks: at 48 registers its V32 bf16 variant spilled 8 bytes on sm_80.
template <KVFormat kFormat, DType kSrc, bool kVec>
__global__ void __launch_bounds__(256, kVec ? 5 : 4) quantize_store_kernel(QuantizeParams p) {
  using L = QuantLayout<kFormat, kSrc>;
  using T = typename L::T;
  const int lane = threadIdx.x % kWarp;
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int64_t row0 = warp * L::kTokens;
  if (row0 >= p.n) return;  // whole warp

  // Every load first: slots (the same address in all lanes) and the source groups. Source rows
  // below n always exist, so they are read before their slot is known to be valid.
  int64_t slot[L::kTokens];
  uint4 raw[L::kTokens][L::kSteps];
#pragma unroll
  for (int k = 0; k < L::kTokens; ++k) {
    const int64_t row = row0 + k;
    slot[k] = -1;
    if (row < p.n) {  // uniform
      slot[k] = __ldg(p.slots + row * p.slot_stride);
      const T* src = static_cast<const T*>(p.src) + row * p.src_row_stride;
#pragma unroll
      for (int step = 0; step < L::kSteps; ++step) {
        const int g = kWarp * step + lane;
        raw[k][step] = g < L::kGroups ? load_group<T, kVec>(src, g) : make_uint4(0, 0, 0, 0);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < L::kTokens; ++k) {
    // slot is uniform over the warp, so the shuffles inside see every lane.
    if (slot_valid(slot[k], p.num_slots)) store_token<kFormat, kSrc>(p, slot[k], raw[k], lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantize: one warp per output row.

struct DequantizeParams {
  const uint8_t* cache;
  int64_t page_size, page_stride, num_slots;
  int64_t bytes_per_token;  // dense formats: all heads of a token
  const int32_t* slots;
  int64_t slot_stride;
  int64_t n;
  void* out;
  int64_t out_row_stride;  // elements
};

__device__ __forceinline__ void unpack_bf16(const uint4 (&v)[2], float (&x)[16]) {
  uint16_t h[16];
  memcpy(h, v, 32);
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = fmt::bf16_to_float(h[i]);
}

template <KVFormat kFormat, DType kOut, bool kVec>
__global__ void __launch_bounds__(256) dequantize_kernel(DequantizeParams p) {
  using O = OutStorage<kOut>;
  constexpr int d = kFormat == KVFormat::kModel1 ? kDV : kDenseHeadDim;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  if (row >= p.n) return;
  O* out = static_cast<O*>(p.out) + row * p.out_row_stride;
  const int64_t slot = p.slots[row * p.slot_stride];
  if (!slot_valid(slot, p.num_slots)) {
    const float zero[2] = {0.f, 0.f};
    for (int c = 2 * lane; c < d; c += 2 * kWarp) store_values<kOut, 2, false>(out, c, zero);
    return;
  }
  const int64_t page = slot / p.page_size;
  const int64_t t = slot - page * p.page_size;
  const uint8_t* base = p.cache + page * p.page_stride;

  if constexpr (kFormat == KVFormat::kModel1) {
    const uint8_t* data = base + fmt::model1_row_offset(t);
    float x[16];
    if (lane < kModel1NopeDims / 16) {
      const uint4 codes = __ldg(reinterpret_cast<const uint4*>(data) + lane);
      const float scale =
          fmt::ue8m0_to_float(__ldg(base + fmt::model1_scale_offset(p.page_size, t) + lane / 4));
      uint8_t c[16];
      memcpy(c, &codes, 16);
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = scaled(fmt::e4m3_to_float(c[i]), scale);
    } else {
      const uint4* rope = reinterpret_cast<const uint4*>(data + kModel1NopeDims) + 2 * (lane - 28);
      const uint4 v[2] = {__ldg(rope), __ldg(rope + 1)};
      unpack_bf16(v, x);
    }
    store_values<kOut, 16, kVec>(out, 16 * lane, x);
  } else if constexpr (kFormat == KVFormat::kV32) {
    const uint8_t* data = base + t * kV32BytesPerToken;
    const uint4 codes = __ldg(reinterpret_cast<const uint4*>(data) + lane);
    const float scale =
        __ldg(reinterpret_cast<const float*>(data + fmt::kV32ScaleOffset) + lane / 8);
    uint8_t c[16];
    memcpy(c, &codes, 16);
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = scaled(fmt::e4m3_to_float(c[i]), scale);
    store_values<kOut, 16, kVec>(out, 16 * lane, x);
    if (lane < kRopeDims / 8) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(data + fmt::kV32RopeOffset) + lane);
      uint16_t h[8];
      memcpy(h, &v, 16);
      float r[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] = fmt::bf16_to_float(h[i]);
      store_values<kOut, 8, kVec>(out, kV32NopeDims + 8 * lane, r);
    }
  } else {
    // Dense bf16/fp16: head 0 is the first 576 values of the token; 72 chunks of 8.
    const uint4* data = reinterpret_cast<const uint4*>(base + t * p.bytes_per_token);
    for (int c = lane; c < kDenseHeadDim / 8; c += kWarp) {
      const uint4 v = __ldg(data + c);
      uint16_t h[8];
      memcpy(h, &v, 16);
      float r[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r[i] = kFormat == KVFormat::kBF16 ? fmt::bf16_to_float(h[i]) : fmt::fp16_to_float(h[i]);
      }
      store_values<kOut, 8, kVec>(out, 8 * c, r);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Page repack. Work item = a chunk of kRepackTokens consecutive tokens below its request's
// length. The block first resolves every token of its chunk to a source and destination address
// (or skips it), then copies the chunk with 16-byte vectors spread over all threads, so pages of
// any size (2, 53, 256) keep every thread busy and a 256 -> 64 repack is one pass over the bytes
// named.

constexpr int kRepackThreads = 256;
constexpr int kRepackTokens = 64;
constexpr int kRepackUnroll = 4;  // loads in flight per thread before the matching stores

struct RepackParams {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_page_size, src_page_stride, src_num_pages;
  int64_t dst_page_size, dst_page_stride, dst_num_pages;
  const int32_t* src_table;
  int64_t src_table_s0, src_table_s1;
  const int32_t* dst_table;
  int64_t dst_table_s0, dst_table_s1;
  const int32_t* seqlens;
  int64_t seqlens_stride;
  int64_t b;
  int64_t capacity;       // min(max_src_pages * src_page_size, max_dst_pages * dst_page_size)
  int64_t row_bytes;      // bytes copied per token in the row part (MODEL1: 576; else all)
  int vectors_per_token;  // row_bytes / 16
};

// Copies tokens [t0, t0 + ntok) of request i, 0 < ntok <= kRepackTokens. Every thread calls.
// Token rows are 16-byte multiples in every format: MODEL1 576, V32 656, dense h_kv * 1152.
template <KVFormat kFormat, int kVPT>
__device__ __forceinline__ void repack_chunk(const RepackParams& p, int64_t i, int64_t t0,
                                             int ntok) {
  __shared__ int64_t src_row[kRepackTokens];  // byte offset of the token's row; -1: skip
  __shared__ int64_t dst_row[kRepackTokens];
  __shared__ int64_t src_scale[kRepackTokens];  // MODEL1 footer offsets
  __shared__ int64_t dst_scale[kRepackTokens];
  const int vpt = kVPT > 0 ? kVPT : p.vectors_per_token;
  if (threadIdx.x < ntok) {
    const int64_t t = t0 + threadIdx.x;
    const int64_t sp = t / p.src_page_size, st = t - sp * p.src_page_size;
    const int64_t dp = t / p.dst_page_size, dt = t - dp * p.dst_page_size;
    const int64_t src_page = p.src_table[i * p.src_table_s0 + sp * p.src_table_s1];
    const int64_t dst_page = p.dst_table[i * p.dst_table_s0 + dp * p.dst_table_s1];
    const bool ok =
        src_page >= 0 && src_page < p.src_num_pages && dst_page >= 0 && dst_page < p.dst_num_pages;
    src_row[threadIdx.x] = ok ? src_page * p.src_page_stride + st * p.row_bytes : -1;
    dst_row[threadIdx.x] = dst_page * p.dst_page_stride + dt * p.row_bytes;
    if constexpr (kFormat == KVFormat::kModel1) {
      src_scale[threadIdx.x] =
          src_page * p.src_page_stride + fmt::model1_scale_offset(p.src_page_size, st);
      dst_scale[threadIdx.x] =
          dst_page * p.dst_page_stride + fmt::model1_scale_offset(p.dst_page_size, dt);
    }
  }
  __syncthreads();

  const int total = ntok * vpt;
  for (int base = threadIdx.x; base < total; base += kRepackThreads * kRepackUnroll) {
    uint4 v[kRepackUnroll];
    int64_t to[kRepackUnroll];
#pragma unroll
    for (int u = 0; u < kRepackUnroll; ++u) {
      const int k = base + u * kRepackThreads;
      to[u] = -1;
      if (k < total) {
        const int tok = k / vpt;
        const int chunk = k - tok * vpt;
        const int64_t from = src_row[tok];
        if (from >= 0) {
          v[u] = __ldcs(reinterpret_cast<const uint4*>(p.src + from) + chunk);
          to[u] = dst_row[tok] + 16 * static_cast<int64_t>(chunk);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kRepackUnroll; ++u) {
      if (to[u] >= 0) __stcs(reinterpret_cast<uint4*>(p.dst + to[u]), v[u]);
    }
  }
  if constexpr (kFormat == KVFormat::kModel1) {
    if (threadIdx.x < ntok && src_row[threadIdx.x] >= 0) {
      const uint2 s = __ldcs(reinterpret_cast<const uint2*>(p.src + src_scale[threadIdx.x]));
      __stcs(reinterpret_cast<uint2*>(p.dst + dst_scale[threadIdx.x]), s);
    }
  }
  __syncthreads();  // the next chunk rewrites the shared tables
}

template <KVFormat kFormat, int kVPT>
__global__ void __launch_bounds__(kRepackThreads) repack_kernel(RepackParams p) {
  // The work items of the call (chunks below their request's length) in request order are
  // numbered 0, 1, ...; block x takes items x, x + gridDim.x, ... Each block reads the lengths
  // kRepackThreads requests at a time and numbers their items by a prefix sum, so the work is the
  // tokens copied plus b / kRepackThreads windows a block, whatever the block tables' widths
  // (zero-stride tables may be 2^31 entries wide).
  __shared__ int64_t items_end[kRepackThreads];  // inclusive prefix of the window's item counts
  __shared__ int32_t window_len[kRepackThreads];
  int64_t before = 0;         // items of the windows before this one
  int64_t next = blockIdx.x;  // the next item this block takes
  for (int64_t w = 0; w < p.b; w += kRepackThreads) {
    const int64_t r = w + threadIdx.x;
    int64_t len = 0;
    if (r < p.b) {
      len = min(max(static_cast<int64_t>(p.seqlens[r * p.seqlens_stride]), int64_t{0}), p.capacity);
    }
    const int64_t n = (len + kRepackTokens - 1) / kRepackTokens;
    int64_t window = 0;
    items_end[threadIdx.x] = block_exclusive_scan<kRepackThreads>(n, &window) + n;
    window_len[threadIdx.x] = static_cast<int32_t>(len);
    __syncthreads();
    for (; next < before + window; next += gridDim.x) {
      // The item's request: the first in the window whose items_end passes it.
      const int64_t k = next - before;
      int lo = 0, hi = kRepackThreads - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (items_end[mid] > k) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const int64_t t0 = (k - (lo == 0 ? 0 : items_end[lo - 1])) * kRepackTokens;
      const int ntok = static_cast<int>(min(int64_t{kRepackTokens}, window_len[lo] - t0));
      repack_chunk<kFormat, kVPT>(p, w + lo, t0, ntok);
    }
    before += window;
    __syncthreads();  // the next window rewrites items_end and window_len
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The current device's SM count and whether our kernels can run on it.
Status current_device(int* sm_count) {
  int dev = 0;
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  int major = 0;
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8) {
    int minor = 0;
    SPARSE_MLA_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return Status::DeviceError("the cuda backend needs sm_80 or newer, running on sm_" +
                               std::to_string(major * 10 + minor));
  }
  SPARSE_MLA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, dev));
  return Status::Ok();
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Rows of a [n, d] view can be read/written with 16-byte vectors.
bool rows_vectorizable(const TensorView& t) {
  const int64_t row_bytes = t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  return aligned16(t.data) && (t.shape[0] <= 1 || row_bytes % 16 == 0);
}

// Rows per launch: one warp each, 8 warps per block.
constexpr int kRowThreads = 256;
constexpr int kRowsPerBlock = kRowThreads / kWarp;

template <KVFormat kFormat, DType kSrc>
void launch_quantize(const QuantizeParams& p, bool vec, cudaStream_t stream) {
  constexpr int64_t kRows = int64_t{kRowsPerBlock} * QuantLayout<kFormat, kSrc>::kTokens;
  const unsigned grid = static_cast<unsigned>((p.n + kRows - 1) / kRows);
  if (vec) {
    quantize_store_kernel<kFormat, kSrc, true><<<grid, kRowThreads, 0, stream>>>(p);
  } else {
    quantize_store_kernel<kFormat, kSrc, false><<<grid, kRowThreads, 0, stream>>>(p);
  }
}

template <KVFormat kFormat>
void launch_dequantize(const DequantizeParams& p, DType out, bool vec, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((p.n + kRowsPerBlock - 1) / kRowsPerBlock);
  if (out == DType::kFloat32) {
    if (vec) {
      dequantize_kernel<kFormat, DType::kFloat32, true><<<grid, kRowThreads, 0, stream>>>(p);
    } else {
      dequantize_kernel<kFormat, DType::kFloat32, false><<<grid, kRowThreads, 0, stream>>>(p);
    }
  } else {
    if (vec) {
      dequantize_kernel<kFormat, DType::kBFloat16, true><<<grid, kRowThreads, 0, stream>>>(p);
    } else {
      dequantize_kernel<kFormat, DType::kBFloat16, false><<<grid, kRowThreads, 0, stream>>>(p);
    }
  }
}

}  // namespace

Status quantize_store(const QuantizeStoreArgs& args, void* stream) {
  const int64_t n = args.src.shape[0];
  if (n == 0) return Status::Ok();
  int sms = 0;
  SPARSE_MLA_RETURN_IF_ERROR(current_device(&sms));
  QuantizeParams p;
  p.src = args.src.data;
  p.src_row_stride = args.src.strides[0];
  p.slots = args.slots.ptr<const int32_t>();
  p.slot_stride = args.slots.strides[0];
  p.n = n;
  p.cache = static_cast<uint8_t*>(args.kv.data);
  p.page_size = args.kv.page_size;
  p.page_stride = args.kv.page_stride;
  p.num_slots = args.kv.num_slots();
  p.page_div = SlotDivider::make(args.kv.page_size);
  const bool vec = rows_vectorizable(args.src);
  auto s = static_cast<cudaStream_t>(stream);
  const bool model1 = args.kv.format == KVFormat::kModel1;
  if (args.src.dtype == DType::kBFloat16) {
    model1 ? launch_quantize<KVFormat::kModel1, DType::kBFloat16>(p, vec, s)
           : launch_quantize<KVFormat::kV32, DType::kBFloat16>(p, vec, s);
  } else if (args.src.dtype == DType::kFloat32) {
    model1 ? launch_quantize<KVFormat::kModel1, DType::kFloat32>(p, vec, s)
           : launch_quantize<KVFormat::kV32, DType::kFloat32>(p, vec, s);
  } else {
    return Status::Internal(std::string("cuda::quantize_store: src dtype ") +
                            dtype_name(args.src.dtype) + " reached the kernel");
  }
  return check_launch("quantize_store_kernel");
}

Status dequantize(const DequantizeArgs& args, void* stream) {
  const int64_t n = args.slots.shape[0];
  if (n == 0) return Status::Ok();
  int sms = 0;
  SPARSE_MLA_RETURN_IF_ERROR(current_device(&sms));
  DequantizeParams p;
  p.cache = static_cast<const uint8_t*>(args.kv.data);
  p.page_size = args.kv.page_size;
  p.page_stride = args.kv.page_stride;
  p.num_slots = args.kv.num_slots();
  p.bytes_per_token = args.kv.bytes_per_token();
  p.slots = args.slots.ptr<const int32_t>();
  p.slot_stride = args.slots.strides[0];
  p.n = n;
  p.out = args.out.data;
  p.out_row_stride = args.out.strides[0];
  const bool vec = rows_vectorizable(args.out);
  auto s = static_cast<cudaStream_t>(stream);
  switch (args.kv.format) {
    case KVFormat::kModel1:
      launch_dequantize<KVFormat::kModel1>(p, args.out.dtype, vec, s);
      break;
    case KVFormat::kV32:
      launch_dequantize<KVFormat::kV32>(p, args.out.dtype, vec, s);
      break;
    case KVFormat::kBF16:
      launch_dequantize<KVFormat::kBF16>(p, args.out.dtype, vec, s);
      break;
    case KVFormat::kFP16:
      launch_dequantize<KVFormat::kFP16>(p, args.out.dtype, vec, s);
      break;
  }
  return check_launch("dequantize_kernel");
}

Status repack_pages(const RepackArgs& args, void* stream) {
  const int64_t b = args.seqlens.shape[0];
  const int64_t max_src_pages = args.src_block_table.shape[1];
  const int64_t max_dst_pages = args.dst_block_table.shape[1];
  const int64_t capacity =
      std::min(max_src_pages * args.src.page_size, max_dst_pages * args.dst.page_size);
  if (b == 0 || capacity == 0) return Status::Ok();
  int sms = 0;
  SPARSE_MLA_RETURN_IF_ERROR(current_device(&sms));
  const KVFormat format = args.src.format;
  RepackParams p;
  p.src = static_cast<const uint8_t*>(args.src.data);
  p.dst = static_cast<uint8_t*>(args.dst.data);
  p.src_page_size = args.src.page_size;
  p.src_page_stride = args.src.page_stride;
  p.src_num_pages = args.src.num_pages;
  p.dst_page_size = args.dst.page_size;
  p.dst_page_stride = args.dst.page_stride;
  p.dst_num_pages = args.dst.num_pages;
  p.src_table = args.src_block_table.ptr<const int32_t>();
  p.src_table_s0 = args.src_block_table.strides[0];
  p.src_table_s1 = args.src_block_table.strides[1];
  p.dst_table = args.dst_block_table.ptr<const int32_t>();
  p.dst_table_s0 = args.dst_block_table.strides[0];
  p.dst_table_s1 = args.dst_block_table.strides[1];
  p.seqlens = args.seqlens.ptr<const int32_t>();
  p.seqlens_stride = args.seqlens.strides[0];
  p.b = b;
  // Lengths are int32, so tokens past 2^31 - 1 are never named.
  p.capacity = std::min<int64_t>(capacity, INT32_MAX);
  p.row_bytes = format == KVFormat::kModel1 ? kModel1RowBytes : args.src.bytes_per_token();
  p.vectors_per_token = static_cast<int>(p.row_bytes / 16);
  // Enough resident blocks to cover the memory latency; blocks past the call's items only read
  // the lengths.
  const int64_t chunks = (p.capacity + kRepackTokens - 1) / kRepackTokens;
  const int64_t grid = std::min<int64_t>(b * chunks, int64_t{sms} * 16);
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned g = static_cast<unsigned>(grid);
  switch (format) {
    case KVFormat::kModel1:
      repack_kernel<KVFormat::kModel1, kModel1RowBytes / 16><<<g, kRepackThreads, 0, s>>>(p);
      break;
    case KVFormat::kV32:
      repack_kernel<KVFormat::kV32, kV32BytesPerToken / 16><<<g, kRepackThreads, 0, s>>>(p);
      break;
    case KVFormat::kBF16:
    case KVFormat::kFP16:
      repack_kernel<KVFormat::kBF16, 0><<<g, kRepackThreads, 0, s>>>(p);
      break;
  }
  return check_launch("repack_kernel");
}

}  // namespace sparse_mla::cuda
