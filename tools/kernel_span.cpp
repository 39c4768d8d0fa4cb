#include "tools/kernel_span.h"

#if SPARSE_MLA_WITH_CUDA

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#if SPARSE_MLA_WITH_CUPTI
#include <cupti.h>
#endif

namespace sparse_mla::tools {

#if SPARSE_MLA_WITH_CUPTI

namespace {

// CUPTI hands records over in buffers through two C callbacks, so the kernels seen since the last
// read are kept here.
struct KernelLog {
  std::mutex mu;
  uint64_t first_start = UINT64_MAX, last_end = 0;
  int kernels = 0;
};
KernelLog g_log;

constexpr size_t kBufferBytes = 1 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_log.mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    g_log.first_start = std::min<uint64_t>(g_log.first_start, k->start);
    g_log.last_end = std::max<uint64_t>(g_log.last_end, k->end);
    ++g_log.kernels;
  }
  std::free(buffer);
}

Status cupti_check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::Ok();
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return Status::DeviceError(std::string(what) + ": " + (msg ? msg : "CUPTI error"));
}

// Reads and clears the kernels recorded since the last call; the stream must be idle.
Status take_kernels(int* kernels, double* span_us) {
  SPARSE_MLA_RETURN_IF_ERROR(cupti_check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED),
                                         "cuptiActivityFlushAll"));
  std::lock_guard<std::mutex> lock(g_log.mu);
  *kernels = g_log.kernels;
  *span_us = g_log.kernels ? static_cast<double>(g_log.last_end - g_log.first_start) * 1e-3 : 0;
  g_log.first_start = UINT64_MAX;
  g_log.last_end = 0;
  g_log.kernels = 0;
  return Status::Ok();
}

// Holds the stream until the host has enqueued a whole run: traced launches take the host tens of
// microseconds each, and a kernel that reached the GPU late would lengthen the span.
class HostGate {
 public:
  Status close(cudaStream_t stream) {
    open_.store(false, std::memory_order_relaxed);
    return cuda_check(cudaLaunchHostFunc(stream, wait, this), "cudaLaunchHostFunc");
  }
  void open() { open_.store(true, std::memory_order_release); }

 private:
  static void CUDART_CB wait(void* gate) {
    const auto* g = static_cast<const HostGate*>(gate);
    while (!g->open_.load(std::memory_order_acquire)) std::this_thread::yield();
  }
  std::atomic<bool> open_{true};
};

// One run: the L2 flush and the call, enqueued behind a closed gate, then waited for.
Status gated_run(HostGate& gate, GpuTimer& timer, cudaStream_t stream,
                 const std::function<Status()>& launch) {
  SPARSE_MLA_RETURN_IF_ERROR(gate.close(stream));
  Status st = timer.flush();
  if (st.ok()) st = launch();
  gate.open();
  Status done = cuda_check(cudaStreamSynchronize(stream), "timed run");
  return st.ok() ? done : st;
}

Status traced_runs(GpuTimer& timer, cudaStream_t stream, const std::function<Status()>& launch,
                   const TimingPlan& plan, std::vector<double>* us, int* kernels_per_call) {
  int kernels = 0;
  double span = 0;
  HostGate gate;
  for (int i = 0; i < plan.warmup; ++i) {
    SPARSE_MLA_RETURN_IF_ERROR(gated_run(gate, timer, stream, launch));
  }
  SPARSE_MLA_RETURN_IF_ERROR(take_kernels(&kernels, &span));
  *kernels_per_call = 0;
  for (int i = 0; i < plan.runs; ++i) {
    SPARSE_MLA_RETURN_IF_ERROR(gated_run(gate, timer, stream, launch));
    SPARSE_MLA_RETURN_IF_ERROR(take_kernels(&kernels, &span));
    if (kernels == 0 || (i > 0 && kernels != *kernels_per_call)) {
      return Status::DeviceError("kernel trace: run " + std::to_string(i) + " recorded " +
                                 std::to_string(kernels) + " kernels, expected " +
                                 (i ? std::to_string(*kernels_per_call) : std::string(">= 1")) +
                                 " (is another profiler attached?)");
    }
    *kernels_per_call = kernels;
    us->push_back(span);
  }
  return Status::Ok();
}

}  // namespace

bool kernel_spans_supported() { return true; }

Status time_kernel_spans(GpuTimer& timer, cudaStream_t stream,
                         const std::function<Status()>& launch, const TimingPlan& plan,
                         std::vector<double>* us, int* kernels_per_call) {
  us->clear();
  static const CUptiResult registered =
      cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  SPARSE_MLA_RETURN_IF_ERROR(cupti_check(registered, "cuptiActivityRegisterCallbacks"));
  SPARSE_MLA_RETURN_IF_ERROR(cupti_check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                                         "cuptiActivityEnable"));
  Status st = traced_runs(timer, stream, launch, plan, us, kernels_per_call);
  // Tracing stays off outside this pass, so the event-timed runs are not traced.
  Status off = cupti_check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                           "cuptiActivityDisable");
  int kernels = 0;
  double span = 0;
  Status drained = take_kernels(&kernels, &span);
  if (!st.ok()) return st;
  return off.ok() ? drained : off;
}

#else

bool kernel_spans_supported() { return false; }

Status time_kernel_spans(GpuTimer&, cudaStream_t, const std::function<Status()>&, const TimingPlan&,
                         std::vector<double>* us, int* kernels_per_call) {
  us->clear();
  *kernels_per_call = 0;
  return Status::Unsupported("kernel spans: this build has no CUPTI (CMake did not find it)");
}

#endif  // SPARSE_MLA_WITH_CUPTI

}  // namespace sparse_mla::tools

#endif  // SPARSE_MLA_WITH_CUDA
