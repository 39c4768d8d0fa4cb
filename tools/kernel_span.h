// Kernel-span timing: the GPU time from the start of a call's first kernel to the end of its last
// kernel, read from CUPTI's kernel activity records. This is how a profiler times a call, and how
// targets.md timed FlashMLA's s_q = 2 rows; CUDA events (GpuTimer) also count the time from the
// start event to the first kernel. Built where CMake finds CUPTI (SPARSE_MLA_WITH_CUPTI).
#pragma once

#include <functional>
#include <vector>

#include "sparse_mla/status.h"
#include "tools/timing.h"

namespace sparse_mla::tools {

#if SPARSE_MLA_WITH_CUDA

// Whether this build can time kernel spans.
bool kernel_spans_supported();

// Times `plan.runs` runs of `launch` as GpuTimer does (L2 flushed before each, the same warm-up,
// batches of 10 runs back to back), with kernel and memset activity tracing on, and gives each
// run's span in microseconds. A batch is enqueued whole before the GPU starts it (tracing slows
// the host's launches), and its records are split into runs at the flush memsets; every run must
// hold the same number of kernels, which goes to *kernels_per_call.
Status time_kernel_spans(GpuTimer& timer, cudaStream_t stream,
                         const std::function<Status()>& launch, const TimingPlan& plan,
                         std::vector<double>* us, int* kernels_per_call);

#endif  // SPARSE_MLA_WITH_CUDA

}  // namespace sparse_mla::tools
