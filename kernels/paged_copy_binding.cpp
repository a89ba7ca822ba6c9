// Thin torch binding over raykv_paged_copy: stream, device guard, and the two CUDA runtime
// queries the Python side needs (the UVA pointer of pinned host memory, peer access).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "paged_copy.h"

namespace {

// segs: int64 [S, 4] (RaykvSegment rows) and block_ids: int64 [N], both on the copy's device.
// rows_ptr: device-usable address of the contiguous rows (device, peer or mapped host memory).
void paged_copy(const torch::Tensor& segs, const torch::Tensor& block_ids, int64_t rows_ptr,
                int64_t row_bytes, bool gather, int64_t num_ctas) {
  TORCH_CHECK(segs.is_cuda() && segs.scalar_type() == torch::kInt64 && segs.is_contiguous() &&
                  segs.dim() == 2 && segs.size(1) == 4,
              "raykv paged_copy: segs must be a contiguous CUDA int64 [S, 4] tensor");
  TORCH_CHECK(block_ids.is_cuda() && block_ids.scalar_type() == torch::kInt64 &&
                  block_ids.is_contiguous() && block_ids.get_device() == segs.get_device(),
              "raykv paged_copy: block_ids must be contiguous int64 on the segments' device");
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaError_t err = static_cast<cudaError_t>(raykv_paged_copy(
      reinterpret_cast<const RaykvSegment*>(segs.data_ptr<int64_t>()),
      static_cast<int>(segs.size(0)), block_ids.data_ptr<int64_t>(), block_ids.numel(),
      reinterpret_cast<void*>(rows_ptr), row_bytes, gather ? 1 : 0,
      static_cast<int>(num_ctas), c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(err == cudaSuccess, "raykv paged_copy launch failed: ", cudaGetErrorString(err));
}

// Device address of pinned (page-locked, mapped) host memory, 0 where it has none.
int64_t mapped_pointer(int64_t host_ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(host_ptr)) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later launches do not report it
    return 0;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return 0;
  // Whether the runtime reports the allocation's base or the queried address, the offset of
  // host_ptr from hostPointer carries over to the device mapping (0 on UVA, where they match).
  const int64_t offset =
      attr.hostPointer ? host_ptr - reinterpret_cast<int64_t>(attr.hostPointer) : 0;
  return reinterpret_cast<int64_t>(attr.devicePointer) + offset;
}

// Lets kernels on `device` dereference `peer`'s memory; false where the hardware cannot.
bool enable_peer_access(int64_t device, int64_t peer) {
  if (device == peer) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, static_cast<int>(device), static_cast<int>(peer)) !=
          cudaSuccess ||
      !can) {
    cudaGetLastError();
    return false;
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaError_t err = cudaDeviceEnablePeerAccess(static_cast<int>(peer), 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  return err == cudaSuccess || err == cudaErrorPeerAccessAlreadyEnabled;
}

// The benchmark's baseline (how vLLM's swap_blocks moved blocks): one cudaMemcpyAsync per
// (block, entry) span on the current stream. dst/src/sizes: CPU int64 tensors of equal length.
void memcpy_loop(const torch::Tensor& dst_ptrs, const torch::Tensor& src_ptrs,
                 const torch::Tensor& sizes) {
  TORCH_CHECK(!dst_ptrs.is_cuda() && !src_ptrs.is_cuda() && !sizes.is_cuda() &&
                  dst_ptrs.scalar_type() == torch::kInt64 &&
                  src_ptrs.scalar_type() == torch::kInt64 &&
                  sizes.scalar_type() == torch::kInt64 && dst_ptrs.is_contiguous() &&
                  src_ptrs.is_contiguous() && sizes.is_contiguous() &&
                  dst_ptrs.numel() == src_ptrs.numel() && sizes.numel() == src_ptrs.numel(),
              "raykv memcpy_loop: pass three contiguous CPU int64 tensors of one length");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t* dst = dst_ptrs.data_ptr<int64_t>();
  const int64_t* src = src_ptrs.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  for (int64_t i = 0; i < sizes.numel(); ++i) {
    const cudaError_t err =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                        static_cast<size_t>(size[i]), cudaMemcpyDefault, stream);
    TORCH_CHECK(err == cudaSuccess, "raykv memcpy_loop: ", cudaGetErrorString(err));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_copy", &paged_copy, "gather (rows <- paged) or scatter (paged <- rows)");
  m.def("mapped_pointer", &mapped_pointer, "UVA device pointer of pinned host memory, or 0");
  m.def("enable_peer_access", &enable_peer_access, "enable peer access device -> peer");
  m.def("memcpy_loop", &memcpy_loop, "one cudaMemcpyAsync per span (benchmark baseline)");
}
