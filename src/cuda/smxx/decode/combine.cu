// Combine: merges the partials of every split pair (fp32, or fp16 with power-of-two exponents
// from the Hopper kernel's 64-row CTAs on FP8 pages) in a fixed order (deterministic),
// converts the base-2 lse to natural log and applies the sink once. The grid covers every pair
// (which pairs are split is only known on the device); CTAs of unsplit pairs exit at once.
//
// A CTA owns kRows * kRW query rows x kDims output dims of one pair; each row gets kW warps that
// take interleaved parts (warp g: parts g, g + kW, ...) and are summed in shared memory in warp
// order.
// The host picks the layout from the shapes alone (pick_layout): the warps of a row follow the
// expected split (a few parts each); a long request split into hundreds of parts gets wide
// layouts, 8 warps a row and down to 128 dims a CTA, spreading it over many SMs with many loads
// in flight; with many pairs (DeepSeek-V4 batches: a split pair has 2-4 parts) one warp walks
// all parts of a row, the cheapest there.
//
// Launched as a programmatic dependent of the attention kernel (sm_90+): CTAs of unsplit pairs
// exit without waiting, the others wait for the attention grid before reading its partials.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "src/cuda/common/check.h"
#include "src/cuda/common/ptx.cuh"
#include "src/cuda/smxx/decode/launch.h"
#include "src/cuda/smxx/decode/params.h"
#include "src/kv/format.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;

// kW: warps per query row; kVec: float4s per lane per part (a CTA covers 128 * kVec dims).
struct CombineLayout {
  int warps_per_row;
  int vec;
  const char* name;  // for the SPARSE_MLA_COMBINE_LAYOUT test hook
};
// Widest first. Fewer than 8 warps a row only with whole rows (kVec 4): those layouts serve
// many short splits, where splitting dims would only multiply CTAs. The last one, for pairs
// split in two at most, loads 2 parts a batch (room for 3 CTAs an SM) and gives each warp 2
// rows (half the CTAs): H200, MODEL1 b=128 (s_q 1 and 2, h_q 64 and 128), 1-3% faster calls
// than w1d512 (sm90_notes.md, session 29).
constexpr CombineLayout kLayouts[] = {{8, 1, "w8d128"},    {8, 2, "w8d256"}, {8, 4, "w8d512"},
                                      {4, 4, "w4d512"},    {2, 4, "w2d512"}, {1, 4, "w1d512"},
                                      {1, 4, "w1d512b2r2"}};
constexpr int kNumLayouts = sizeof(kLayouts) / sizeof(kLayouts[0]);
// Measured on H200 (MODEL1 s_q 2, b 2: a pair split into 11-17 parts): 2-4 warps a row beat 8
// by 1.5-2 us. Dims are split (several CTAs a row) only while the grid needs at most kMaxWideCtas
// CTAs (about two waves at 2 CTAs per SM on H100/H200).
constexpr double kPartsPerWarp = 2.5;
constexpr int64_t kMaxWideCtas = 512;

// Four partial values from 8 bytes of fp16 ones.
__device__ __forceinline__ float4 unpack4(uint2 v) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// 2^k for an exponent byte k of part_exp (-126 <= k <= 114).
__device__ __forceinline__ float exp_byte(uint32_t word, int byte) {
  return fmt::exp2i(static_cast<int8_t>(word >> (8 * byte)));
}

// One row of the pair at place blockIdx.x of the cost line (pair info.id, split into n =
// info.nsplit parts), dims block blockIdx.z: kW warps of the CTA, kU parts a batch (kU * kVec
// float4 loads in flight per lane).
template <bool kFP16, bool kPart16, int kW, int kVec, int kU>
__device__ __forceinline__ void combine_row(const DecodeParams& p, const PairInfo& info, int row) {
  constexpr int kDims = 128 * kVec;
  static_assert(32 % kU == 0, "a batch never straddles a block of 32 weights");
  const int n = info.nsplit;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = warp % kW;
  const bool live = row < p.rows_per_pair;
  // This warp's parts: g + kW * j for j < cnt.
  const int cnt = live && n > g ? (n - g + kW - 1) / kW : 0;
  const int64_t stride = p.rows_per_pair;
  const int64_t first = (static_cast<int64_t>(info.slot) + g) * stride + (live ? row : 0);
  const float* lse_w = p.part_lse + first;
  const int64_t lse_step = kW * stride;
  // Lane l's 4 values of each 128-dim block: one float4, or 8 bytes of fp16 partials.
  using Raw = std::conditional_t<kPart16, uint2, float4>;
  const int64_t out0 = first * kDV + blockIdx.z * kDims + 4 * lane;
  const Raw* out_w = kPart16 ? reinterpret_cast<const Raw*>(p.part_out16 + out0)
                             : reinterpret_cast<const Raw*>(p.part_out + out0);
  const int64_t out_step = lse_step * (kDV / 4);  // in Raw
  // fp16 partials: the 8 exponent bytes of a part's row (part_exp), two words.
  const uint2* exp_w = reinterpret_cast<const uint2*>(p.part_exp) + first;

  // Lane v*32 + lane of a part: coalesced loads; loads past cnt are never issued.
  Raw x[kU][kVec];
  auto load_batch = [&](int j0) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        x[u][v] = j0 + u < cnt ? __ldcs(out_w + (j0 + u) * out_step + v * 32) : Raw{};
      }
    }
  };

  // The first 32 lse of the warp's parts stay in the lanes; the first batch of partial rows is
  // requested before the max is known (it does not depend on it).
  const float l0 = lane < cnt ? lse_w[lane * lse_step] : -INFINITY;
  uint2 k0 = kPart16 && lane < cnt ? exp_w[lane * lse_step] : uint2{0, 0};
  load_batch(0);
  float mx = fmaxf(-INFINITY, l0);  // fmaxf drops NaN: NaN is tracked on its own
  bool nan = l0 != l0;
  for (int j = lane + 32; j < cnt; j += 32) {
    const float v = lse_w[j * lse_step];
    mx = fmaxf(mx, v);
    nan |= v != v;
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  nan = __any_sync(0xffffffffu, nan);
  if constexpr (kW > 1) {
    __shared__ float s_max[kCombineWarps];
    __shared__ int s_nan[kCombineWarps];
    if (lane == 0) {
      s_max[warp] = mx;
      s_nan[warp] = nan;
    }
    __syncthreads();
    const int w0 = warp - g;
    mx = s_max[w0];
    nan = s_nan[w0] != 0;
#pragma unroll
    for (int k = 1; k < kW; ++k) {
      mx = fmaxf(mx, s_max[w0 + k]);
      nan |= s_nan[w0 + k] != 0;
    }
  }
  // Every warp of a row now holds the same mx and nan, so they take the same branch below.

  // Unnormalized weights 2^(lse - mx) <= 1; their sum w_sum >= 1 divides at the end. Each warp
  // adds its parts in index order. Where every part is empty or of -inf logits only (mx -inf)
  // the weights are 0 and so is w_sum: out is then sum 0 * partial row, 0 or the NaN of a
  // partial's 0 * inf V values (docs/semantics.md).
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float acc[kVec][4];
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc[v][0] = acc[v][1] = acc[v][2] = acc[v][3] = 0.f;
  float w_sum = 0.f;
  if (!nan) {
    // The weights of 32 parts at a time: lane j works out part j's into the warp's records,
    // which every lane then reads by broadcast, a load a part. A record holds the weight e last
    // (fp32 partials: alone). fp16 partials: dims 4 lane .. 4 lane + 3 of a 128-dim block came
    // from quad lanes 2 (lane & 1) and the next one, under word 0 (dims < 128) or 1 of part_exp,
    // so the record starts with e 2^k for word w's exponent of quad lane 2 p + b at 4 p + 2 w + b:
    // the four a lane needs in one 16-byte load. Shuffled a part at a time, with the exponents
    // taken apart in the loop, they made the fp16 combine 0.7-1.2 us slower than the fp32 one at
    // 8 warps a row (H200; the compiler guarded each shuffle there with a divergence branch;
    // sm90_notes.md, variant 157).
    constexpr int kRec = kPart16 ? 12 : 1;
    __shared__ __align__(16) float s_rec[kCombineWarps][32][kRec];
    float(&rec)[32][kRec] = s_rec[warp];
    auto weights = [&](int j0, float l, uint2 k) {
      const float e = j0 + lane < cnt ? ptx::exp2_approx(l - m_use) : 0.f;
      __syncwarp();  // the records of the previous 32 parts have been read
      if constexpr (kPart16) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          rec[lane][i] = e * exp_byte((i >> 1) & 1 ? k.y : k.x, 2 * (i >> 2) + (i & 1));
        }
      }
      rec[lane][kRec - 1] = e;
      __syncwarp();
    };
    weights(0, l0, k0);
    for (int j0 = 0; j0 < cnt; j0 += kU) {
      if (j0 > 0) {
        if ((j0 & 31) == 0) {
          const int j = j0 + lane;
          weights(j0, j < cnt ? lse_w[j * lse_step] : -INFINITY,
                  kPart16 && j < cnt ? exp_w[j * lse_step] : uint2{0, 0});
        }
        load_batch(j0);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const float* r = rec[(j0 + u) & 31];  // part j0 + u's weights, 0 past cnt
        w_sum += r[kRec - 1];
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          if constexpr (kPart16) {
            const float4 w = reinterpret_cast<const float4*>(r)[lane & 1];
            const bool word0 = blockIdx.z * kVec + v == 0;
            const float ea = word0 ? w.x : w.z, eb = word0 ? w.y : w.w;
            const float4 y = unpack4(x[u][v]);
            acc[v][0] += ea * y.x;
            acc[v][1] += ea * y.y;
            acc[v][2] += eb * y.z;
            acc[v][3] += eb * y.w;
          } else {
            const float e = r[0];
            acc[v][0] += e * x[u][v].x;
            acc[v][1] += e * x[u][v].y;
            acc[v][2] += e * x[u][v].z;
            acc[v][3] += e * x[u][v].w;
          }
        }
      }
    }
  }

  if constexpr (kW > 1) {
    // Warps 1..kW-1 of a row hand their sums to warp 0, which adds them in warp order.
    __shared__ float4 s_acc[kCombineWarps][kVec][32];
    __shared__ float s_sum[kCombineWarps];
    if (g > 0) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        s_acc[warp][v][lane] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
      }
      if (lane == 0) s_sum[warp] = w_sum;
    }
    __syncthreads();
    if (g > 0) return;
#pragma unroll
    for (int k = 1; k < kW; ++k) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float4 y = s_acc[warp + k][v][lane];
        acc[v][0] += y.x;
        acc[v][1] += y.y;
        acc[v][2] += y.z;
        acc[v][3] += y.w;
      }
      w_sum += s_sum[warp + k];
    }
  }
  // An id outside this call's pairs comes from a plan made for other shapes (params.h).
  if (!live || static_cast<uint32_t>(info.id) >= static_cast<uint32_t>(p.num_pairs)) return;

  int i, s, head;
  if (p.dense) {
    i = info.id;
    const int grp = row / p.rows_per_group, lr = row % p.rows_per_group;
    s = lr / p.hpk;
    head = grp * p.hpk + lr % p.hpk;
  } else {
    i = info.id / p.s_q;
    s = info.id % p.s_q;
    head = row;
  }

  float lse = INFINITY;  // every part empty: out 0, lse +inf
  float f = 0.f;
  if (nan) {
    lse = NAN;
    f = NAN;
  } else if (mx != -INFINITY) {
    lse = (mx + log2f(w_sum)) * 0.693147180559945309f;
    f = 1.f / w_sum;
    if (p.sink != nullptr) f *= 1.f / (1.f + expf(p.sink[head * p.sink_stride] - lse));
  }

  uint16_t* dst = p.out + i * p.out_stride[0] + s * p.out_stride[1] + head * p.out_stride[2] +
                  blockIdx.z * kDims + lane * 4;
  // f is NaN for a NaN row and 0 for an empty one.
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    uint2 o;
    o.x = ptx::pack2<kFP16>(acc[v][0] * f, acc[v][1] * f);
    o.y = ptx::pack2<kFP16>(acc[v][2] * f, acc[v][3] * f);
    *reinterpret_cast<uint2*>(dst + v * 128) = o;
  }
  if (lane == 0 && blockIdx.z == 0) {
    p.lse[i * p.lse_stride[0] + head * p.lse_stride[1] + s * p.lse_stride[2]] = lse;
  }
}

// CTAs an SM that batches of kU parts x kVec float4 loads a lane leave room for (registers).
constexpr int combine_ctas_per_sm(int parts, int vec) { return parts * vec <= 8 ? 3 : 2; }

// kRW rows a warp, one after the other. A combine's time is mostly waves of CTAs waiting on
// their loads: on the H200 it grows with the number of CTAs.
template <bool kFP16, bool kPart16, int kW, int kVec, int kU, int kRW>
__global__ void __launch_bounds__(kCombineThreads, combine_ctas_per_sm(kU, kVec))
    combine_kernel(const __grid_constant__ DecodeParams p) {
  static_assert(kW == 1 || kRW == 1, "several rows a warp only without shared-memory sums");
  constexpr int kRows = kCombineWarps / kW;
  const PairInfo info = p.pairs[blockIdx.x];
  const int n = info.nsplit;
  if (n <= 1) return;
  if (info.slot < 0 || static_cast<int64_t>(info.slot) + n > p.max_slots) return;
  // The plan was complete before the attention kernel started; its partials are not yet.
  ptx::wait_primary_grids();
  const int warp = threadIdx.x >> 5;
  for (int rw = 0; rw < kRW; ++rw) {
    combine_row<kFP16, kPart16, kW, kVec, kU>(p, info,
                                              (blockIdx.y * kRW + rw) * kRows + warp / kW);
  }
}

template <bool kFP16, bool kPart16, int kW, int kVec, int kU, int kRW = 1>
cudaError_t launch_layout(const DecodeShape& shape, const DecodeParams& params,
                          cudaStream_t stream) {
  constexpr int kRows = kCombineWarps / kW * kRW;
  const dim3 grid(static_cast<unsigned>(shape.num_pairs),
                  static_cast<unsigned>((shape.rows_per_pair + kRows - 1) / kRows),
                  static_cast<unsigned>(4 / kVec));
  // A programmatic dependent of the attention kernel where the GPU supports it: its launch
  // overlaps the attention kernel's tail.
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = shape.dependent_launch ? 1 : 0;
  return cudaLaunchKernelEx(&config, combine_kernel<kFP16, kPart16, kW, kVec, kU, kRW>, params);
}

// fp16 partials at 128 dims a CTA take batches of 8 parts, which fit in 64 registers: 4 CTAs an
// SM, so that a grid of 512 CTAs runs in one wave on the H200. There, dense MODEL1 h_q 128 b=1
// (512 CTAs), the combine 5.6 us against 7.4 with batches of 16 (2 CTAs an SM; 3, forced, were
// as slow: still two waves; sm90_notes.md, variants 160, 166). Smaller batches at the other
// layouts were slower (163, 164), as were batches of 8 for fp32 partials (160b).
template <bool kFP16, bool kPart16>
cudaError_t launch_fmt(int layout, const DecodeShape& shape, const DecodeParams& params,
                cudaStream_t stream) {
  switch (layout) {
    case 0: return launch_layout<kFP16, kPart16, 8, 1, kPart16 ? 8 : 16>(shape, params, stream);
    case 1: return launch_layout<kFP16, kPart16, 8, 2, 8>(shape, params, stream);
    case 2: return launch_layout<kFP16, kPart16, 8, 4, 4>(shape, params, stream);
    case 3: return launch_layout<kFP16, kPart16, 4, 4, 4>(shape, params, stream);
    case 4: return launch_layout<kFP16, kPart16, 2, 4, 4>(shape, params, stream);
    case 5: return launch_layout<kFP16, kPart16, 1, 4, 4>(shape, params, stream);
    default:
      return launch_layout<kFP16, kPart16, 1, 4, 2, 2>(shape, params, stream);
  }
}

// From the shapes alone. Whole rows (512 dims) with as many warps a row as give each warp about
// kPartsPerWarp parts of the expected split (more warps only add a shared-memory reduction);
// with 8 warps a row, the widest layout whose grid stays within kMaxWideCtas.
int pick_layout(const DecodeShape& shape) {
  // Test hook: SPARSE_MLA_COMBINE_LAYOUT=w8d128|w8d256|w8d512|w4d512|w2d512|w1d512|w1d512b2r2
  // forces one.
  if (const char* env = std::getenv("SPARSE_MLA_COMBINE_LAYOUT")) {
    for (int c = 0; c < kNumLayouts; ++c) {
      if (std::strcmp(env, kLayouts[c].name) == 0) return c;
    }
  }
  const double parts_per_pair = static_cast<double>(shape.busy_parts) / shape.num_pairs;
  int warps = 1;
  while (warps < 8 && parts_per_pair >= 2 * warps * kPartsPerWarp) warps *= 2;
  // One warp a row: batches of 2 parts where a pair rarely spans more (parts no shorter than
  // the average pair), else 4. Pairs of 64 rows or more take the 2-part batches up to 2 parts a
  // pair (H200, MODEL1 rows of 1.03 and 1.78 parts a pair: 0-4% faster); narrower ones keep 4
  // there (tensor-parallel C3 h_q 16 / 32 b=64: 2-5% slower with 2).
  const double two_part_limit = shape.rows_per_pair >= 64 ? 2.0 : 1.0;
  if (warps == 1) return parts_per_pair <= two_part_limit ? kNumLayouts - 1 : kNumLayouts - 2;
  for (int c = 0; c < kNumLayouts - 2; ++c) {
    const CombineLayout& l = kLayouts[c];
    if (l.warps_per_row != warps) continue;
    const int64_t rows = kCombineWarps / l.warps_per_row;
    const int64_t ctas = static_cast<int64_t>(shape.num_pairs) *
                         ((shape.rows_per_pair + rows - 1) / rows) * (4 / l.vec);
    if (ctas <= kMaxWideCtas || l.vec == 4) return c;
  }
  return kNumLayouts - 2;
}

}  // namespace

Status launch_combine(const DecodeShape& shape, const DecodeParams& params, bool fp16_out,
                      cudaStream_t stream) {
  const int layout = pick_layout(shape);
  cudaError_t err;
  if (shape.part16) {
    err = fp16_out ? launch_fmt<true, true>(layout, shape, params, stream)
                   : launch_fmt<false, true>(layout, shape, params, stream);
  } else {
    err = fp16_out ? launch_fmt<true, false>(layout, shape, params, stream)
                   : launch_fmt<false, false>(layout, shape, params, stream);
  }
  if (err != cudaSuccess) return cuda_status(err, "sparse_mla decode combine");
  return check_launch("sparse_mla decode combine");
}

}  // namespace sparse_mla::cuda::smxx::decode
