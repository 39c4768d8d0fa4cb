// Kernel-span timing: the GPU time from the start of a call's first kernel to the end of its last
// kernel, read from CUPTI's kernel activity records. This is how a profiler times a call, and how
// targets.md timed FlashMLA's s_q = 2 rows; CUDA events (GpuTimer) also count the time from the
// start event to the first kernel. The tracing is built where CMake finds CUPTI
// (SPARSE_MLA_WITH_CUPTI); the bookkeeping of its records in every build.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sparse_mla/status.h"
#include "tools/timing.h"

namespace sparse_mla::tools {

// One traced activity: a kernel, or a memset (the L2 flush that starts every timed run); ns.
struct TracedActivity {
  bool memset;
  uint64_t start, end;
};

// Splits the records of `runs` runs into runs at the memsets (stream order is time order; records
// before the first memset are left out) and appends each run's span in microseconds to *us. Every
// run must hold the same number of kernels: *kernels_per_call, 0 on entry when not yet known.
Status append_run_spans(std::vector<TracedActivity> log, int runs, std::vector<double>* us,
                        int* kernels_per_call);

#if SPARSE_MLA_WITH_CUDA

// Whether this build can time kernel spans.
bool kernel_spans_supported();

// Times `plan.runs` runs of `launch` back to back as GpuTimer does (L2 flushed before each, the
// same warm-up), with kernel and memset activity tracing on, and gives each run's span in
// microseconds. The runs are enqueued whole before the GPU starts them (tracing slows the host's
// launches), so keep `plan.runs` to a batch; their records are split into runs at the flush
// memsets, and every run must hold *kernels_per_call kernels (0 on entry: whatever the first run
// holds, written back), which carries the check across calls.
Status time_kernel_spans(GpuTimer& timer, cudaStream_t stream,
                         const std::function<Status()>& launch, const TimingPlan& plan,
                         std::vector<double>* us, int* kernels_per_call);

#endif  // SPARSE_MLA_WITH_CUDA

}  // namespace sparse_mla::tools
