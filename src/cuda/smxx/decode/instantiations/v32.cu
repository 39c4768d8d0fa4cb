// The v32 decode kernels, one per tile configuration (one file per format: parallel builds).
#include "src/cuda/smxx/decode/decode_kernel.cuh"
#include "src/cuda/smxx/decode/launch.h"

namespace sparse_mla::cuda::smxx::decode {
namespace {

template <TileCfg C>
KernelEntry entry() {
  using Cfg = Config<Fmt::kV32, C>;
  return KernelEntry{reinterpret_cast<const void*>(&decode_kernel<Fmt::kV32, C>), Cfg::kThreads,
                     Cfg::kSmemBytes, Cfg::kT, Cfg::kHB};
}

}  // namespace

KernelEntry kernel_entry_v32(TileCfg cfg) {
  switch (cfg) {
    case TileCfg::kH64T32: return entry<TileCfg::kH64T32>();
    case TileCfg::kH32T32: return entry<TileCfg::kH32T32>();
    case TileCfg::kH16T32: return entry<TileCfg::kH16T32>();
    case TileCfg::kH16T16: return entry<TileCfg::kH16T16>();
  }
  return KernelEntry{};
}

}  // namespace sparse_mla::cuda::smxx::decode
