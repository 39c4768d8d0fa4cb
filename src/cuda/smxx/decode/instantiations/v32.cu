// The v32 decode kernels, one per tile configuration.
#include "src/cuda/smxx/decode/instantiations/entry.cuh"

namespace sparse_mla::cuda::smxx::decode {

KernelEntry kernel_entry_v32(TileCfg cfg) { return kernel_entry_of<Fmt::kV32>(cfg); }

}  // namespace sparse_mla::cuda::smxx::decode
