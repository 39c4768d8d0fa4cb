#include "src/api/validate.h"

#include <cstdint>
#include <string>

namespace sparse_mla::validate {

namespace {

std::string dtypes_string(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) {
    if (!s.empty()) s += " or ";
    s += dtype_name(d);
  }
  return s;
}

std::string expected_shape(const TensorSpec& spec) {
  std::string s = "[";
  int i = 0;
  for (int64_t e : spec.shape) {
    if (i++) s += ", ";
    s += e == kAny ? "*" : std::to_string(e);
  }
  return s + "]";
}

}  // namespace

std::string shape_of(const TensorView& t) { return t.shape_string(); }

Status check_tensor(const TensorView& t, const TensorSpec& spec) {
  const std::string name(spec.name);
  const int rank = static_cast<int>(spec.shape.size());
  if (t.ndim != rank) {
    const bool representable = t.ndim >= 0 && t.ndim <= kMaxDims;
    return Status::InvalidArgument(name + ": rank " + std::to_string(t.ndim) +
                                   (representable ? " (shape " + shape_of(t) + ")" : "") +
                                   ", expected " + std::to_string(rank) + " " + spec.shape_doc);
  }
  bool dtype_ok = false;
  for (DType d : spec.dtypes) dtype_ok |= (d == t.dtype);
  if (!dtype_ok) {
    return Status::InvalidArgument(name + ": dtype " + dtype_name(t.dtype) + ", expected " +
                                   dtypes_string(spec.dtypes));
  }
  int dim = 0;
  for (int64_t e : spec.shape) {
    if (t.shape[dim] < 0 || t.shape[dim] > kMaxExtent) {
      return Status::InvalidArgument(name + ": dim " + std::to_string(dim) + " is " +
                                     std::to_string(t.shape[dim]) + ", expected 0.." +
                                     std::to_string(kMaxExtent));
    }
    if (e != kAny && t.shape[dim] != e) {
      return Status::InvalidArgument(name + ": shape " + shape_of(t) + ", expected " +
                                     expected_shape(spec) + " " + spec.shape_doc + " (dim " +
                                     std::to_string(dim) + " should be " + std::to_string(e) +
                                     ")");
    }
    ++dim;
  }
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  const size_t align = spec.alignment ? spec.alignment : static_cast<size_t>(elem);
  bool empty = false;  // any zero extent; no product, so nothing can overflow
  for (int d = 0; d < rank; ++d) empty |= t.shape[d] == 0;
  if (!empty && t.data == nullptr) {
    return Status::InvalidArgument(name + ": data pointer is null for shape " + shape_of(t));
  }
  if (reinterpret_cast<uintptr_t>(t.data) % align != 0) {
    return Status::InvalidArgument(name + ": data pointer is not " + std::to_string(align) +
                                   "-byte aligned");
  }
  // Largest element offset must fit comfortably; strides must be non-negative where they step
  // (a dim of extent 0 or 1 only ever has index 0, so its stride is never used).
  int64_t max_offset = 0;
  for (int d = 0; d < rank; ++d) {
    if (t.shape[d] > 1 && t.strides[d] < 0) {
      return Status::InvalidArgument(name + ": stride " + std::to_string(d) + " is " +
                                     std::to_string(t.strides[d]) + ", expected >= 0");
    }
    if (t.shape[d] > 1) {
      if (t.strides[d] > (INT64_MAX / 4) / t.shape[d]) {
        return Status::InvalidArgument(name + ": stride " + std::to_string(d) + " (" +
                                       std::to_string(t.strides[d]) + ") times extent overflows");
      }
      max_offset += (t.shape[d] - 1) * t.strides[d];
      if (max_offset > (INT64_MAX / 4) / elem) {
        return Status::InvalidArgument(name + ": addressed range overflows 64-bit offsets");
      }
    }
  }
  // An empty tensor addresses nothing, so its strides need no layout (numpy 2 gives them all 0).
  if (spec.last_dim_contiguous && !empty && rank > 0 && t.shape[rank - 1] > 1 &&
      t.strides[rank - 1] != 1) {
    return Status::InvalidArgument(name + ": last dim stride " +
                                   std::to_string(t.strides[rank - 1]) +
                                   ", expected 1 (contiguous rows)");
  }
  if (align > static_cast<size_t>(elem) && !empty) {
    for (int d = 0; d + 1 < rank; ++d) {
      if (t.shape[d] > 1 && (t.strides[d] * elem) % static_cast<int64_t>(align) != 0) {
        return Status::InvalidArgument(name + ": stride " + std::to_string(d) + " is " +
                                       std::to_string(t.strides[d] * elem) +
                                       " bytes, expected a multiple of " + std::to_string(align));
      }
    }
  }
  return Status::Ok();
}

Status check_same_device(const TensorView& t, const char* name, Device expected,
                         const char* expected_from) {
  if (t.device == expected) return Status::Ok();
  return Status::InvalidArgument(std::string(name) + ": on " + device_name(t.device) +
                                 ", expected " + device_name(expected) + " (the device of " +
                                 expected_from + ")");
}

Status check_kv_format(const KVCache& kv, const char* arg) {
  const int value = static_cast<int>(kv.format);  // the enum is unsigned
  if (value > static_cast<int>(KVFormat::kFP16)) {
    return Status::InvalidArgument(std::string(arg) + ": format value " + std::to_string(value) +
                                   ", expected MODEL1, V32, BF16 or FP16");
  }
  return Status::Ok();
}

Status check_kv_cache(const KVCache& kv, const char* arg) {
  const std::string name(arg);
  SPARSE_MLA_RETURN_IF_ERROR(check_kv_format(kv, arg));
  if (kv.num_heads < 1 || (kv_format_is_fp8(kv.format) && kv.num_heads != 1) ||
      kv.num_heads > 128) {
    return Status::InvalidArgument(name + ": num_heads " + std::to_string(kv.num_heads) +
                                   (kv_format_is_fp8(kv.format) ? ", expected 1 for FP8 formats"
                                                                : ", expected 1..128"));
  }
  if (kv.page_size < 1 || kv.page_size > kMaxExtent) {
    return Status::InvalidArgument(name + ": page_size " + std::to_string(kv.page_size) +
                                   ", expected 1.." + std::to_string(kMaxExtent));
  }
  if (kv.num_pages < 0 || kv.num_pages > kMaxExtent) {
    return Status::InvalidArgument(name + ": num_pages " + std::to_string(kv.num_pages) +
                                   ", expected 0.." + std::to_string(kMaxExtent));
  }
  const int64_t min_stride = kv.page_size * kv.bytes_per_token();
  if (kv.page_stride < min_stride) {
    return Status::InvalidArgument(name + ": page_stride " + std::to_string(kv.page_stride) +
                                   " bytes, expected >= page_size * bytes_per_token = " +
                                   std::to_string(kv.page_size) + " * " +
                                   std::to_string(kv.bytes_per_token()) + " = " +
                                   std::to_string(min_stride));
  }
  if (kv.page_stride % 16 != 0) {
    return Status::InvalidArgument(name + ": page_stride " + std::to_string(kv.page_stride) +
                                   " bytes, expected a multiple of 16");
  }
  if (kv.num_pages > 0 && kv.page_stride > (INT64_MAX / 4) / kv.num_pages) {
    return Status::InvalidArgument(name + ": num_pages * page_stride overflows 64-bit offsets");
  }
  if (kv.num_pages > 0 && kv.data == nullptr) {
    return Status::InvalidArgument(name + ": data pointer is null with " +
                                   std::to_string(kv.num_pages) + " pages");
  }
  if (reinterpret_cast<uintptr_t>(kv.data) % 16 != 0) {
    return Status::InvalidArgument(name + ": data pointer is not 16-byte aligned");
  }
  return Status::Ok();
}

Status check_workspace(const void* ptr, size_t have, size_t need, const char* name) {
  if (need == 0) return Status::Ok();
  if (have < need) {
    return Status::InvalidArgument(std::string(name) + ": " + std::to_string(have) +
                                   " bytes, expected at least " + std::to_string(need) +
                                   " (see the *_workspace_size query)");
  }
  if (ptr == nullptr) {
    return Status::InvalidArgument(std::string(name) + ": null, expected " +
                                   std::to_string(need) + " bytes of device memory");
  }
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    return Status::InvalidArgument(std::string(name) + ": pointer is not 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace sparse_mla::validate
