#include "tools/kernel_span.h"

#include <algorithm>
#include <string>

#if SPARSE_MLA_WITH_CUDA
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>
#endif

#if SPARSE_MLA_WITH_CUPTI
#include <cupti.h>
#endif

namespace sparse_mla::tools {

Status append_run_spans(std::vector<TracedActivity> log, int runs, std::vector<double>* us,
                        int* kernels_per_call) {
  std::sort(log.begin(), log.end(),
            [](const TracedActivity& a, const TracedActivity& b) { return a.start < b.start; });
  int run = -1, kernels = 0;
  uint64_t first = 0, last = 0;
  auto close_run = [&]() -> Status {
    if (run < 0) return Status::Ok();
    if (kernels == 0 || (*kernels_per_call && kernels != *kernels_per_call)) {
      return Status::DeviceError("kernel trace: a run recorded " + std::to_string(kernels) +
                                 " kernels, expected " +
                                 (*kernels_per_call ? std::to_string(*kernels_per_call) : ">= 1") +
                                 " (is another profiler attached?)");
    }
    *kernels_per_call = kernels;
    us->push_back(static_cast<double>(last - first) * 1e-3);
    return Status::Ok();
  };
  for (const TracedActivity& a : log) {
    if (a.memset) {
      SPARSE_MLA_RETURN_IF_ERROR(close_run());
      ++run;
      kernels = 0;
    } else if (run >= 0) {
      first = kernels ? std::min(first, a.start) : a.start;
      last = kernels ? std::max(last, a.end) : a.end;
      ++kernels;
    }
  }
  SPARSE_MLA_RETURN_IF_ERROR(close_run());
  if (run + 1 != runs) {
    return Status::DeviceError("kernel trace: " + std::to_string(run + 1) +
                               " L2 flushes recorded for " + std::to_string(runs) + " runs");
  }
  return Status::Ok();
}

#if SPARSE_MLA_WITH_CUDA

#if SPARSE_MLA_WITH_CUPTI

namespace {

// CUPTI hands records over in buffers through two C callbacks, so what it recorded since the last
// read is kept here: kernels, and the memsets that start each run (the L2 flush).
std::mutex g_mu;
std::vector<TracedActivity> g_log;

constexpr size_t kBufferBytes = 1 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      g_log.push_back({false, k->start, k->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      g_log.push_back({true, m->start, m->end});
    }
  }
  std::free(buffer);
}

Status cupti_check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::Ok();
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return Status::DeviceError(std::string(what) + ": " + (msg ? msg : "CUPTI error"));
}

// Reads and clears what was recorded since the last call; the stream must be idle.
Status take_activities(std::vector<TracedActivity>* out) {
  SPARSE_MLA_RETURN_IF_ERROR(cupti_check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED),
                                         "cuptiActivityFlushAll"));
  std::lock_guard<std::mutex> lock(g_mu);
  out->swap(g_log);
  g_log.clear();
  return Status::Ok();
}

// Holds the stream until the host has enqueued a batch of runs: traced launches are slow on the
// host, and a kernel that reached the GPU late would lengthen the span (ungated, small calls read
// ~55 us). Runs of a batch then follow each other on the GPU as in the event-timed pass (with a
// synchronization after every run, 3 ms calls were 5% slower, traced or not).
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

// `n` runs (L2 flush, call) enqueued behind a closed gate, then waited for.
Status gated_batch(int n, GpuTimer& timer, cudaStream_t stream,
                   const std::function<Status()>& launch) {
  HostGate gate;
  SPARSE_MLA_RETURN_IF_ERROR(gate.close(stream));
  Status st;
  for (int i = 0; i < n && st.ok(); ++i) {
    st = timer.flush();
    if (st.ok()) st = launch();
  }
  gate.open();
  Status done = cuda_check(cudaStreamSynchronize(stream), "timed runs");
  return st.ok() ? done : st;
}

Status traced_runs(GpuTimer& timer, cudaStream_t stream, const std::function<Status()>& launch,
                   const TimingPlan& plan, std::vector<double>* us, int* kernels_per_call) {
  std::vector<TracedActivity> log;
  SPARSE_MLA_RETURN_IF_ERROR(gated_batch(plan.warmup, timer, stream, launch));
  SPARSE_MLA_RETURN_IF_ERROR(take_activities(&log));
  SPARSE_MLA_RETURN_IF_ERROR(gated_batch(plan.runs, timer, stream, launch));
  SPARSE_MLA_RETURN_IF_ERROR(take_activities(&log));
  return append_run_spans(std::move(log), plan.runs, us, kernels_per_call);
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
  const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                      CUPTI_ACTIVITY_KIND_MEMSET};
  Status st;
  for (CUpti_ActivityKind k : kinds) {
    if (st.ok()) st = cupti_check(cuptiActivityEnable(k), "cuptiActivityEnable");
  }
  if (st.ok()) st = traced_runs(timer, stream, launch, plan, us, kernels_per_call);
  // Tracing stays off outside this pass, so the event-timed runs are not traced.
  for (CUpti_ActivityKind k : kinds) {
    Status off = cupti_check(cuptiActivityDisable(k), "cuptiActivityDisable");
    if (st.ok()) st = off;
  }
  std::vector<TracedActivity> rest;
  Status drained = take_activities(&rest);
  return st.ok() ? drained : st;
}

#else

bool kernel_spans_supported() { return false; }

Status time_kernel_spans(GpuTimer&, cudaStream_t, const std::function<Status()>&, const TimingPlan&,
                         std::vector<double>* us, int*) {
  us->clear();
  return Status::Unsupported("kernel spans: this build has no CUPTI (CMake did not find it)");
}

#endif  // SPARSE_MLA_WITH_CUPTI

#endif  // SPARSE_MLA_WITH_CUDA

}  // namespace sparse_mla::tools
