// libFuzzer entry point for one target of fuzz/targets.h, chosen at compile time
// (SPARSE_MLA_FUZZ_TARGET=<index into kTargets>). A violated property aborts with its
// description, so libFuzzer saves the input as a crash reproducer.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/targets.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // One OpenMP thread: executions per second matter more than parallelism here, and results are
  // deterministic per input (rows that race by the caller's design are checked loosely anyway).
  setenv("OMP_NUM_THREADS", "1", 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& target = sparse_mla::fuzz::kTargets[SPARSE_MLA_FUZZ_TARGET];
  const std::string finding = target.fn(data, size);
  if (!finding.empty()) {
    std::fprintf(stderr, "\nfuzz target '%s' found: %s\n", target.name, finding.c_str());
    std::abort();
  }
  return 0;
}
