// The fuzz targets, by name. Each entry function takes one input and returns "" or the first
// property it found violated; memory errors and undefined behaviour are left to the sanitizers.
// fuzz/fuzz_main.cpp wraps one of them for libFuzzer; tests/cpp/test_fuzz_regressions.cpp
// replays the committed corpora and reproducers through the same functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/decode_target.h"
#include "fuzz/format_target.h"
#include "fuzz/kv_ops_target.h"
#include "fuzz/validation_target.h"

namespace sparse_mla::fuzz {

using TargetFn = std::string (*)(const uint8_t* data, size_t size);

struct Target {
  const char* name;  // also the folder under fuzz/corpus/ and fuzz/regressions/
  TargetFn fn;
};

inline constexpr Target kTargets[] = {
    {"validation", fuzz_validation},
    {"format", fuzz_format},
    {"kv_ops", fuzz_kv_ops},
    {"decode", fuzz_decode},
};

}  // namespace sparse_mla::fuzz
