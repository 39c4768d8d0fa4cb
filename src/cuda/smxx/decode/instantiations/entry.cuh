// The kernel entries of one format, one per tile configuration. Each format's kernels are
// instantiated in a file of their own (bf16.cu, fp16.cu, model1.cu, v32.cu): parallel builds.
#pragma once

#include "src/cuda/smxx/decode/decode_kernel.cuh"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda::smxx::decode {

template <Fmt F, TileCfg C>
KernelEntry make_kernel_entry() {
  using Cfg = Config<F, C>;
  return KernelEntry{reinterpret_cast<const void*>(&decode_kernel<F, C>), Cfg::kThreads,
                     Cfg::kSmemBytes, Cfg::kT, Cfg::kHB};
}

template <Fmt F>
KernelEntry kernel_entry_of(TileCfg cfg) {
  switch (cfg) {
    case TileCfg::kH64T32: return make_kernel_entry<F, TileCfg::kH64T32>();
    case TileCfg::kH32T32: return make_kernel_entry<F, TileCfg::kH32T32>();
    case TileCfg::kH16T32: return make_kernel_entry<F, TileCfg::kH16T32>();
    case TileCfg::kH16T16: return make_kernel_entry<F, TileCfg::kH16T16>();
  }
  return KernelEntry{};
}

}  // namespace sparse_mla::cuda::smxx::decode
