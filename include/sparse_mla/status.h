// Status: how every library call reports failure. The library never throws, exits or aborts.
#pragma once

#include <string>
#include <utility>

namespace sparse_mla {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // a caller error: wrong shape, dtype, stride, value
  kUnsupported,      // valid request that no selected backend can run (names what is missing)
  kDeviceError,      // CUDA runtime error, launch failure, unsupported device
  kInternal,         // a bug of ours
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status DeviceError(std::string m) { return {StatusCode::kDeviceError, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: k_cache: last dim 580, expected 584 (MODEL1) or 656 (V32)"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace sparse_mla

// Propagates a failed Status to the caller.
#define SPARSE_MLA_RETURN_IF_ERROR(expr)          \
  do {                                            \
    ::sparse_mla::Status status_ = (expr);        \
    if (!status_.ok()) return status_;            \
  } while (0)
