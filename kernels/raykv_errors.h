// Failures of raykv's extension: std::runtime_error (RuntimeError in Python), its message built
// by plain string concatenation. Never torch's TORCH_CHECK / C10_CUDA_CHECK / c10::str in this
// extension: on the device machine's image (2 x H100, torch 2.11 + CUDA 13, the extension built
// there by torch.utils.cpp_extension) a message formatted with c10::str, a failed TORCH_CHECK
// and a failed TORCH_CHECK_VALUE each took the process down with a segmentation fault instead
// of raising, where a std::runtime_error reached Python (a probe extension, one call each).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace raykv {

[[noreturn]] inline void fail(const std::string& message) {
  throw std::runtime_error("raykv: " + message);
}

// A constant message: nothing is built unless `ok` is false.
inline void require(bool ok, const char* message) {
  if (!ok) fail(message);
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) fail(std::string(what) + " failed: " + cudaGetErrorString(err));
}

}  // namespace raykv
