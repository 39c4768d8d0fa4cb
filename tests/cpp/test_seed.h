// The seed of a test's random data: fresh on every run; SPARSE_MLA_TEST_SEED=<n> replays a failing
// run (tests print the seed they used in their failure messages).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>

namespace sparse_mla::test_support {

inline uint64_t test_seed() {
  if (const char* s = std::getenv("SPARSE_MLA_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}();
}

}  // namespace sparse_mla::test_support
