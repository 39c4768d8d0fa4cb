// Argument checks shared by every operation. Each returns a Status whose message names the
// argument, the expected and the actual value.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "sparse_mla/kv_cache.h"
#include "sparse_mla/status.h"
#include "sparse_mla/tensor.h"

namespace sparse_mla::validate {

// Largest extent or element offset we accept: keeps every index computation inside int64 and
// every per-dimension count inside int32 (GPU grids, int32 slot numbers).
inline constexpr int64_t kMaxExtent = (int64_t{1} << 31) - 1;

// Expected extent of one dimension; kAny accepts any extent >= 0.
inline constexpr int64_t kAny = -1;

struct TensorSpec {
  const char* name;
  std::initializer_list<DType> dtypes;
  std::initializer_list<int64_t> shape;  // kAny entries match anything; rank = shape.size()
  const char* shape_doc;                 // "[b, s_q, h_q, d_qk]"
  bool last_dim_contiguous = false;
  size_t alignment = 0;  // bytes required of the data pointer and of every outer stride; 0 = dtype size
};

// Checks rank, shape, dtype, strides (non-negative, last dim contiguous if asked, alignment) and
// that every addressed element offset fits. Does not look at the data.
Status check_tensor(const TensorView& t, const TensorSpec& spec);
Status check_same_device(const TensorView& t, const char* name, Device expected,
                         const char* expected_from);
// The format is one of KVFormat's values (checked before any format-specific rule).
Status check_kv_format(const KVCache& kv, const char* name);
Status check_kv_cache(const KVCache& kv, const char* name);
Status check_workspace(const void* ptr, size_t have, size_t need, const char* name);

std::string shape_of(const TensorView& t);

}  // namespace sparse_mla::validate
