// The machine a benchmark runs on: CPU and GPU descriptions, roofline ceilings, git commit, date.
#pragma once

#include <string>

#include "tools/bench_report.h"

namespace sparse_mla::tools::bench {

// Measures the CPU's ceilings: fp32 FMA throughput on all threads and parallel copy bandwidth
// (read + write counted), each the best of a few short runs (about a second in all).
Ceilings measure_cpu_ceilings();
DeviceInfo cpu_info();

#if SPARSE_MLA_WITH_CUDA
// Known ceilings for the device (targets.md's measured H200 figures), else zero (unknown).
DeviceInfo gpu_info(int device);
#endif

std::string git_commit();            // SPARSE_MLA_COMMIT if set, else git in the working directory
std::string utc_now(bool for_file);  // "2026-11-29T10:12:00Z", or "20261129-1012" for file names
std::string host_name();
// Lower-case [a-z0-9-] only, e.g. "NVIDIA H200" -> "nvidia-h200".
std::string slug(const std::string& s);

}  // namespace sparse_mla::tools::bench
