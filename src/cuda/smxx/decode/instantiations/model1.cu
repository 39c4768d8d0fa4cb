// The model1 decode kernels, one per tile configuration.
#include "src/cuda/smxx/decode/instantiations/entry.cuh"

namespace sparse_mla::cuda::smxx::decode {

KernelEntry kernel_entry_model1(TileCfg cfg) { return kernel_entry_of<Fmt::kModel1>(cfg); }

}  // namespace sparse_mla::cuda::smxx::decode
