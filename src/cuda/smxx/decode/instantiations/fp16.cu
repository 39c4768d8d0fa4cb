// The fp16 decode kernels, one per tile configuration.
#include "src/cuda/smxx/decode/instantiations/entry.cuh"

namespace sparse_mla::cuda::smxx::decode {

KernelEntry kernel_entry_fp16(TileCfg cfg) { return kernel_entry_of<Fmt::kFP16>(cfg); }

}  // namespace sparse_mla::cuda::smxx::decode
