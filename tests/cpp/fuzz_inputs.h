// The inputs that the tests feed the fuzz targets (fuzz/targets.h): the committed seeds and crash
// reproducers (fuzz/corpus/<target>/, fuzz/regressions/<target>/) and seeded random byte strings.
// Shared by the CPU replay (test_fuzz_regressions.cpp) and the GPU one (cuda/test_cuda_fuzz.cpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/test_seed.h"

namespace sparse_mla::fuzz_inputs {

namespace fs = std::filesystem;

struct Input {
  std::string name;  // the file, or "random input <k>"
  std::vector<uint8_t> bytes;
};

// The repository root: from this file's path where the tree was built, else the working directory
// (a test binary built elsewhere runs from the root of a copied tree).
inline fs::path repo_root() {
  const fs::path built = fs::path(__FILE__).parent_path().parent_path().parent_path();
  return fs::is_directory(built / "fuzz") ? built : fs::current_path();
}

// Every file under <root>/<folder>/<target>/ (none if the folder does not exist).
inline std::vector<Input> committed(const char* folder, const char* target) {
  std::vector<Input> inputs;
  const fs::path dir = repo_root() / folder / target;
  if (!fs::is_directory(dir)) return inputs;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream f(entry.path(), std::ios::binary);
    inputs.push_back({entry.path().string(), {std::istreambuf_iterator<char>(f), {}}});
  }
  return inputs;
}

// `count` byte strings of 0-599 random bytes from `seed`.
inline std::vector<Input> random(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::vector<Input> inputs;
  for (int k = 0; k < count; ++k) {
    Input in{"random input " + std::to_string(k), std::vector<uint8_t>(rng() % 600)};
    for (uint8_t& byte : in.bytes) byte = static_cast<uint8_t>(rng());
    inputs.push_back(std::move(in));
  }
  return inputs;
}

// A target's committed seeds and reproducers, then `random_count` random inputs from `seed`: what
// the GPU replays run (the decode target on its wide shapes, DecodeRunner::wide).
inline std::vector<Input> target_inputs(const char* target, uint64_t seed, int random_count) {
  std::vector<Input> inputs = committed("fuzz/corpus", target);
  for (Input& in : committed("fuzz/regressions", target)) inputs.push_back(std::move(in));
  for (Input& in : random(seed, random_count)) inputs.push_back(std::move(in));
  return inputs;
}

}  // namespace sparse_mla::fuzz_inputs
