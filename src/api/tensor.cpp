#include "sparse_mla/tensor.h"

#include <cstdint>

namespace sparse_mla {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return 1;
    case DType::kFloat8E4M3: return 1;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kFloat32: return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kFloat32: return "float32";
  }
  return "unknown";
}

std::string device_name(Device device) {
  // A CPU index other than 0 is named, so that a mismatch on it reads as one.
  if (device.type == DeviceType::kCPU) {
    return device.index == 0 ? "cpu" : "cpu:" + std::to_string(device.index);
  }
  return "cuda:" + std::to_string(device.index);
}

// a * b clamped to the int64 range: default strides of absurd shapes saturate (validation then
// rejects the view) instead of overflowing.
static int64_t saturating_mul(int64_t a, int64_t b) {
  const __int128 p = static_cast<__int128>(a) * b;
  if (p > INT64_MAX) return INT64_MAX;
  if (p < INT64_MIN) return INT64_MIN;
  return static_cast<int64_t>(p);
}

TensorView TensorView::contiguous(void* data, DType dtype, Device device,
                                  std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size() > kMaxDims ? kMaxDims : shape.size());
  int i = 0;
  for (int64_t s : shape) {
    if (i == t.ndim) break;
    t.shape[i++] = s;
  }
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride = saturating_mul(stride, t.shape[d]);
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, Device device,
                               std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides) {
  TensorView t = contiguous(data, dtype, device, shape);
  int i = 0;
  for (int64_t s : strides) {
    if (i == t.ndim) break;
    t.strides[i++] = s;
  }
  return t;
}

// Helpers below read at most kMaxDims entries, whatever ndim claims (validation rejects the rest).
static int clamped_rank(int ndim) { return ndim < 0 ? 0 : (ndim > kMaxDims ? kMaxDims : ndim); }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < clamped_rank(ndim); ++d) {
    if (shape[d] <= 0) return 0;
    if (n > INT64_MAX / shape[d]) return INT64_MAX;  // saturate instead of overflowing
    n *= shape[d];
  }
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = clamped_rank(ndim) - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride = saturating_mul(stride, shape[d]);
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < clamped_rank(ndim); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[d]);
  }
  return s + "]";
}

}  // namespace sparse_mla
