// Hopper (sm_90a) primitives of the wgmma decode kernel: mbarriers, proxy fences, register
// reallocation and the warpgroup MMA shapes it uses, with their shared-memory descriptors.
// Only compiled into sm_90a code (callers are guarded by SPARSE_MLA_SM90_DEVICE).
#pragma once

#include <cstdint>

#include "src/cuda/common/ptx.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPARSE_MLA_SM90_DEVICE 1
#else
#define SPARSE_MLA_SM90_DEVICE 0
#endif

namespace sparse_mla::cuda::sm90 {

#if SPARSE_MLA_SM90_DEVICE

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ptx::smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(ptx::smem_addr(bar))
               : "memory");
}

// One arrival on `bar` by this thread, made when its earlier cp.async copies have landed (the
// barrier's count includes it: .noinc).
__device__ __forceinline__ void mbar_arrive_on_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(ptx::smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(ptx::smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Adds `bytes` to the transactions the barrier's current phase waits for (the TMA copies below
// complete them); no arrival.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(
                   ptx::smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// TMA: one box of the 4-d tensor `map` at coordinates c0..c3 (innermost first) into shared
// memory at `dst`, completing its bytes on `bar`, under L2 policy `policy` (ptx::l2_policy).
// Coordinates outside the tensor read zeros.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, uint64_t* bar, int c0,
                                            int c1, int c2, int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(ptx::smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(ptx::smem_addr(bar)), "l"(policy)
      : "memory");
}

// One arrival on `bar` that also adds `bytes` to the transactions its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   ptx::smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory
// with the bulk-copy engine, completing them on `bar`, under L2 policy `policy`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(ptx::smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(ptx::smem_addr(bar)), "l"(policy)
      : "memory");
}

// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Descriptor of a 128-byte-swizzled operand in shared memory: rows of 128 bytes (64 16-bit
// values) whose 16-byte chunks are XOR-ed with (row % 8), in 1024-byte atoms of 8 rows.
// lead: byte stride between 64-value blocks along M/N (MN-major operands; unused for K-major);
// stride: byte stride between groups of 8 rows.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_byte_addr, uint32_t lead,
                                               uint32_t stride) {
  uint64_t d = (smem_byte_addr & 0x3FFFFu) >> 4;
  d |= static_cast<uint64_t>((lead & 0x3FFFFu) >> 4) << 16;
  d |= static_cast<uint64_t>((stride & 0x3FFFFu) >> 4) << 32;
  d |= 1ull << 62;  // 128-byte swizzle
  return d;
}

// The descriptor of the operand `bytes` further on: the address field (bits 0-13, address / 16)
// takes the offset without a carry, since shared-memory addresses stay below 256 KB (offsets and
// bases are multiples of 16). One add instead of building each k-step's descriptor from its
// address with a mask and a shift.
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// D[64 x 16] (fp32) += A[64 x 16] * B[16 x 16] in bf16, both from shared memory, B K-major and
// A K-major (kTransA 0) or MN-major (1). accumulate == 0 overwrites D.
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n16(float (&d)[8], uint64_t a, uint64_t b,
                                             int accumulate) {
  asm volatile(
      "{\n.reg .pred acc;\nsetp.ne.b32 acc, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, "
      "%9, acc, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

// D[64 x N] (fp32) += A[64 x 16] * B[16 x N], the S tiles of the decode kernel: N = 48 (FP8
// pages) in bf16, 64 (16-bit pages) in bf16 or fp16, and a narrow CTA's S^T (N = 16 query rows,
// bf16); A and B from shared memory, both K-major. accumulate == 0 overwrites D.
template <bool kHalf, int N>
__device__ __forceinline__ void wgmma_m64nk_kk(float (&d)[N / 2], uint64_t a, uint64_t b,
                                              int accumulate) {
  static_assert(((N == 16 || N == 48) && !kHalf) || N == 64,
                "the S tile widths of the decode kernel");
  if constexpr (N == 16) {
    wgmma_m64n16<0>(d, a, b, accumulate);
  } else if constexpr (N == 48) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %26, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, acc, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "l"(a), "l"(b), "r"(accumulate));
  } else if constexpr (N == 64 && kHalf) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, acc, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, acc, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
  }
}

// D[64 x 128] (fp32) += A[64 x 16] * B[16 x 128], A from registers, B from shared memory
// MN-major; D is d[kOff, kOff + 64). (m64n128 rather than n256: an instruction's 128 accumulators
// would not fit the 128-register cap of a 512-thread kernel.) a[] holds the thread's four 16-bit
// pairs of the 64 x 16 A tile in the accumulator layout of an m64n16 wgmma (rows lane / 4 and
// lane / 4 + 8 of the warp's 16, columns 2 (lane % 4) and 8 + 2 (lane % 4)). accumulate == 0
// overwrites D.
template <bool kHalf, int kOff, int kN>
__device__ __forceinline__ void wgmma_m64n128_rs(float (&d)[kN], const uint32_t (&a)[4], uint64_t b,
                                                 int accumulate) {
  static_assert(kOff + 64 <= kN, "the accumulators lie within d");
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, acc, 1, 1, 1;\n}\n"
        : "+f"(d[kOff+0]), "+f"(d[kOff+1]), "+f"(d[kOff+2]), "+f"(d[kOff+3]), "+f"(d[kOff+4]), "+f"(d[kOff+5]), "+f"(d[kOff+6]), "+f"(d[kOff+7]), "+f"(d[kOff+8]), "+f"(d[kOff+9]), "+f"(d[kOff+10]), "+f"(d[kOff+11]), "+f"(d[kOff+12]), "+f"(d[kOff+13]), "+f"(d[kOff+14]), "+f"(d[kOff+15]), "+f"(d[kOff+16]), "+f"(d[kOff+17]), "+f"(d[kOff+18]), "+f"(d[kOff+19]), "+f"(d[kOff+20]), "+f"(d[kOff+21]), "+f"(d[kOff+22]), "+f"(d[kOff+23]), "+f"(d[kOff+24]), "+f"(d[kOff+25]), "+f"(d[kOff+26]), "+f"(d[kOff+27]), "+f"(d[kOff+28]), "+f"(d[kOff+29]), "+f"(d[kOff+30]), "+f"(d[kOff+31]), "+f"(d[kOff+32]), "+f"(d[kOff+33]), "+f"(d[kOff+34]), "+f"(d[kOff+35]), "+f"(d[kOff+36]), "+f"(d[kOff+37]), "+f"(d[kOff+38]), "+f"(d[kOff+39]), "+f"(d[kOff+40]), "+f"(d[kOff+41]), "+f"(d[kOff+42]), "+f"(d[kOff+43]), "+f"(d[kOff+44]), "+f"(d[kOff+45]), "+f"(d[kOff+46]), "+f"(d[kOff+47]), "+f"(d[kOff+48]), "+f"(d[kOff+49]), "+f"(d[kOff+50]), "+f"(d[kOff+51]), "+f"(d[kOff+52]), "+f"(d[kOff+53]), "+f"(d[kOff+54]), "+f"(d[kOff+55]), "+f"(d[kOff+56]), "+f"(d[kOff+57]), "+f"(d[kOff+58]), "+f"(d[kOff+59]), "+f"(d[kOff+60]), "+f"(d[kOff+61]), "+f"(d[kOff+62]), "+f"(d[kOff+63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred acc;\nsetp.ne.b32 acc, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, acc, 1, 1, 1;\n}\n"
        : "+f"(d[kOff+0]), "+f"(d[kOff+1]), "+f"(d[kOff+2]), "+f"(d[kOff+3]), "+f"(d[kOff+4]), "+f"(d[kOff+5]), "+f"(d[kOff+6]), "+f"(d[kOff+7]), "+f"(d[kOff+8]), "+f"(d[kOff+9]), "+f"(d[kOff+10]), "+f"(d[kOff+11]), "+f"(d[kOff+12]), "+f"(d[kOff+13]), "+f"(d[kOff+14]), "+f"(d[kOff+15]), "+f"(d[kOff+16]), "+f"(d[kOff+17]), "+f"(d[kOff+18]), "+f"(d[kOff+19]), "+f"(d[kOff+20]), "+f"(d[kOff+21]), "+f"(d[kOff+22]), "+f"(d[kOff+23]), "+f"(d[kOff+24]), "+f"(d[kOff+25]), "+f"(d[kOff+26]), "+f"(d[kOff+27]), "+f"(d[kOff+28]), "+f"(d[kOff+29]), "+f"(d[kOff+30]), "+f"(d[kOff+31]), "+f"(d[kOff+32]), "+f"(d[kOff+33]), "+f"(d[kOff+34]), "+f"(d[kOff+35]), "+f"(d[kOff+36]), "+f"(d[kOff+37]), "+f"(d[kOff+38]), "+f"(d[kOff+39]), "+f"(d[kOff+40]), "+f"(d[kOff+41]), "+f"(d[kOff+42]), "+f"(d[kOff+43]), "+f"(d[kOff+44]), "+f"(d[kOff+45]), "+f"(d[kOff+46]), "+f"(d[kOff+47]), "+f"(d[kOff+48]), "+f"(d[kOff+49]), "+f"(d[kOff+50]), "+f"(d[kOff+51]), "+f"(d[kOff+52]), "+f"(d[kOff+53]), "+f"(d[kOff+54]), "+f"(d[kOff+55]), "+f"(d[kOff+56]), "+f"(d[kOff+57]), "+f"(d[kOff+58]), "+f"(d[kOff+59]), "+f"(d[kOff+60]), "+f"(d[kOff+61]), "+f"(d[kOff+62]), "+f"(d[kOff+63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
}

#endif  // SPARSE_MLA_SM90_DEVICE

}  // namespace sparse_mla::cuda::sm90
