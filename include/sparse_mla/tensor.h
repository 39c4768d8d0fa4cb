// TensorView: a non-owning description of an array, laid out like a DLPack tensor
// (data pointer, dtype, device, shape, strides in elements).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace sparse_mla {

enum class DType : uint8_t { kUInt8, kInt32, kFloat32, kBFloat16, kFloat16, kFloat8E4M3 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  bool operator==(const Device&) const = default;
};

std::string device_name(Device device);  // "cpu", "cuda:0"

inline constexpr int kMaxDims = 5;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, like DLPack

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, Device device,
                               std::initializer_list<int64_t> shape);
  // A view with explicit strides (in elements).
  static TensorView strided(void* data, DType dtype, Device device,
                            std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides);

  int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 1, 64, 512]"
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

}  // namespace sparse_mla
