// One launch moves many blocks of many paged tensors (all layers, K and V) to or from
// contiguous rows. A persistent grid walks (row, segment) work items in row-major order, so
// the contiguous side (often pinned host memory written over PCIe) is touched sequentially.
// Each CTA copies one item with the widest vector the addresses and size allow (16 bytes for
// any realistic KV block), several independent loads per thread in flight before the stores.
#include "paged_copy.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread: 4 x 16 B, 16 KiB per CTA

template <typename T>
__device__ __forceinline__ void copy_span(char* __restrict__ dst, const char* __restrict__ src,
                                          int64_t bytes) {
  const T* __restrict__ s = reinterpret_cast<const T*>(src);
  T* __restrict__ d = reinterpret_cast<T*>(dst);
  // Segments are split on the host to at most RAYKV_MAX_SEGMENT_BYTES, so 32-bit indices suffice.
  const int n = static_cast<int>(bytes / static_cast<int64_t>(sizeof(T)));
  int k = threadIdx.x;
  // Full tiles: kUnroll independent loads issued before the first store, no bounds checks.
#pragma unroll 1
  for (; k + (kUnroll - 1) * kThreads < n; k += kUnroll * kThreads) {
    T r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[k + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[k + u * kThreads] = r[u];
  }
#pragma unroll 1
  for (; k < n; k += kThreads) d[k] = s[k];
}

template <bool kGather>
__global__ void __launch_bounds__(kThreads)
    paged_copy_kernel(const RaykvSegment* __restrict__ segs, int num_segs,
                      const int64_t* __restrict__ block_ids, int64_t num_rows, char* rows,
                      int64_t row_bytes) {
  const int total = static_cast<int>(num_rows) * num_segs;  // < 2^31: checked by the launcher
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const int i = w / num_segs;
    const RaykvSegment seg = segs[w - i * num_segs];
    char* paged = reinterpret_cast<char*>(seg.paged_base) + block_ids[i] * seg.block_stride;
    char* row = rows + int64_t{i} * row_bytes + seg.row_offset;
    char* dst = kGather ? row : paged;
    const char* src = kGather ? paged : row;
    // The width is uniform across the CTA (one item per CTA at a time): no divergence.
    const uint64_t misalign = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                              static_cast<uint64_t>(seg.bytes);
    if ((misalign & 15) == 0) {
      copy_span<uint4>(dst, src, seg.bytes);
    } else if ((misalign & 7) == 0) {
      copy_span<uint2>(dst, src, seg.bytes);
    } else if ((misalign & 3) == 0) {
      copy_span<uint32_t>(dst, src, seg.bytes);
    } else if ((misalign & 1) == 0) {
      copy_span<uint16_t>(dst, src, seg.bytes);
    } else {
      copy_span<uint8_t>(dst, src, seg.bytes);
    }
  }
}

// Resident CTAs per SM x SMs, per device, computed once (device attributes cost a driver call).
int full_grid(int device, bool gather) {
  static int cached[2][64] = {};
  if (device < 0 || device >= 64) return 1024;
  int& slot = cached[gather ? 1 : 0][device];
  if (slot == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (gather) {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, paged_copy_kernel<true>, kThreads, 0);
    } else {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, paged_copy_kernel<false>, kThreads, 0);
    }
    slot = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  }
  return slot;
}

}  // namespace

extern "C" int raykv_paged_copy(const RaykvSegment* segs, int num_segs, const int64_t* block_ids,
                                int64_t num_rows, void* rows, int64_t row_bytes, int gather,
                                int num_ctas, cudaStream_t stream) {
  const int64_t total = num_rows * num_segs;
  if (total <= 0) return cudaSuccess;
  if (total > INT32_MAX) return cudaErrorInvalidValue;
  if (num_ctas <= 0) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    num_ctas = full_grid(device, gather != 0);
  }
  const unsigned grid = static_cast<unsigned>(total < num_ctas ? total : num_ctas);
  char* row_base = static_cast<char*>(rows);
  if (gather) {
    paged_copy_kernel<true><<<grid, kThreads, 0, stream>>>(segs, num_segs, block_ids, num_rows,
                                                            row_base, row_bytes);
  } else {
    paged_copy_kernel<false><<<grid, kThreads, 0, stream>>>(segs, num_segs, block_ids, num_rows,
                                                             row_base, row_bytes);
  }
  return cudaGetLastError();
}
