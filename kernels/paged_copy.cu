// One launch moves many blocks of many paged tensors (all layers, K and V) to or from
// contiguous rows. A persistent grid walks (row, segment) work items in row-major order, so
// the contiguous side (often pinned host memory written over PCIe) is touched sequentially.
// Each group of kGroup threads (a quarter CTA) copies one item with the widest vector the
// addresses and size allow (16 bytes for any realistic KV block), several independent loads
// per thread in flight before the stores, and fetches its next item's segment and block id
// before it copies this one. A whole CTA per item, each item's addresses read only after the
// last one's copy, left the copy waiting on latency: on an H200 (two CTAs per SM, the ids'
// upload and the sums' reset included) a gather with sums of 512 scattered 64 KiB rows of
// 8 KiB spans took 40-43 us where this takes 31-32, of 4096 rows 200 us against 149-155; one
// contiguous copy of the same bytes takes 21 / 129 us.
#include "paged_copy.h"
#include "row_sum.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread: 4 x 16 B, 16 KiB per CTA
constexpr int kGroup = 64;  // threads per item in paged_copy_kernel: two warps
constexpr int kGroupsPerCta = kThreads / kGroup;  // items a paged_copy_kernel CTA copies at once

// A row's sum (kernels/row_sum.h, raykv.ops.reference.row_sums) is the wrapping sum of one
// term per 64-bit word; this is the terms of one loaded vector whose first word is word `word`.
template <typename T>
__device__ __forceinline__ uint64_t weighted(const T& v, uint64_t word) {
  if constexpr (sizeof(T) == 16) {
    const uint4 u = reinterpret_cast<const uint4&>(v);
    const uint64_t lo = (static_cast<uint64_t>(u.y) << 32) | u.x;
    const uint64_t hi = (static_cast<uint64_t>(u.w) << 32) | u.z;
    const uint64_t key = raykv_word_key(word);
    return raykv_word_mix(lo, key) + raykv_word_mix(hi, key + RAYKV_ROW_SUM_KEY_MUL);
  } else {
    static_assert(sizeof(T) == 8, "sums need whole 64-bit words");
    const uint2 u = reinterpret_cast<const uint2&>(v);
    return raykv_word_term((static_cast<uint64_t>(u.y) << 32) | u.x, word);
  }
}

// Copies `bytes`; with kSum also returns this thread's part of the wire sum of the bytes moved
// (the span's first word is word `word0` of its row). Without kStore it only reads and sums.
// The item is copied by `G` threads (G divides kThreads, whole warps), this one `lane` of them.
template <typename T, bool kSum, bool kStore = true, int G = kThreads>
__device__ __forceinline__ uint64_t copy_span(char* __restrict__ dst, const char* __restrict__ src,
                                              int64_t bytes, uint64_t word0, int lane) {
  constexpr int kWords = sizeof(T) / 8;  // 64-bit words per element (sums only)
  const T* __restrict__ s = reinterpret_cast<const T*>(src);
  T* __restrict__ d = reinterpret_cast<T*>(dst);
  uint64_t acc = 0;
  // Segments are split on the host to at most RAYKV_MAX_SEGMENT_BYTES, so 32-bit indices suffice.
  const int n = static_cast<int>(bytes / static_cast<int64_t>(sizeof(T)));
  int k = lane;
  // Full tiles: kUnroll independent loads issued before the first store, no bounds checks.
#pragma unroll 1
  for (; k + (kUnroll - 1) * G < n; k += kUnroll * G) {
    T r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[k + u * G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kStore) d[k + u * G] = r[u];
    }
    if constexpr (kSum) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        acc += weighted(r[u], word0 + static_cast<uint64_t>(k + u * G) * kWords);
    }
  }
  // The rest (all of a span under 16 KiB, e.g. one layer's K of a 16-token block): the same
  // tile with bounds checks, so its loads are still all in flight before the first store.
#pragma unroll 1
  for (; k < n; k += kUnroll * G) {
    T r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (k + u * G < n) r[u] = s[k + u * G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (k + u * G < n) {
        if constexpr (kStore) d[k + u * G] = r[u];
        if constexpr (kSum)
          acc += weighted(r[u], word0 + static_cast<uint64_t>(k + u * G) * kWords);
      }
    }
  }
  return acc;
}

// `acc` of every thread added to *out (wrapping, any order: the sum is commutative): one atomic
// per warp, no barrier, so the CTA's warps move on to their next item independently.
__device__ __forceinline__ void add_block_total(uint64_t acc, unsigned long long* out) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
}

// The part of a row's wire sum this thread takes while it copies `bytes` from src to dst (only
// reads src without kStore); the span's first word is word row_offset / 8 of its row. Every span
// and row is 8-byte aligned here (the launchers check), so 16- or 8-byte vectors.
template <bool kStore, int G = kThreads>
__device__ __forceinline__ uint64_t copy_summed(char* dst, const char* src, int64_t bytes,
                                                int64_t row_offset, int lane) {
  // The width is uniform across the G threads (one item at a time): no divergence in a warp.
  const uint64_t misalign = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                            static_cast<uint64_t>(bytes);
  const uint64_t word0 = static_cast<uint64_t>(row_offset) / 8;
  return (misalign & 15) == 0 ? copy_span<uint4, true, kStore, G>(dst, src, bytes, word0, lane)
                              : copy_span<uint2, true, kStore, G>(dst, src, bytes, word0, lane);
}

// One work item: `bytes` from src to dst with the widest vector the addresses and size allow;
// with kSum the item's wire sum is added to *sum (its first word is word row_offset / 8 of its
// row).
template <bool kSum, int G>
__device__ __forceinline__ void copy_item(char* dst, const char* src, int64_t bytes,
                                          int64_t row_offset, unsigned long long* sum, int lane) {
  const uint64_t misalign = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                            static_cast<uint64_t>(bytes);
  if constexpr (kSum) {
    add_block_total(copy_summed<true, G>(dst, src, bytes, row_offset, lane), sum);
  } else if ((misalign & 15) == 0) {
    copy_span<uint4, false, true, G>(dst, src, bytes, 0, lane);
  } else if ((misalign & 7) == 0) {
    copy_span<uint2, false, true, G>(dst, src, bytes, 0, lane);
  } else if ((misalign & 3) == 0) {
    copy_span<uint32_t, false, true, G>(dst, src, bytes, 0, lane);
  } else if ((misalign & 1) == 0) {
    copy_span<uint16_t, false, true, G>(dst, src, bytes, 0, lane);
  } else {
    copy_span<uint8_t, false, true, G>(dst, src, bytes, 0, lane);
  }
}

template <bool kGather, bool kSum>
__global__ void __launch_bounds__(kThreads)
    paged_copy_kernel(const RaykvSegment* __restrict__ segs, int num_segs,
                      const int64_t* __restrict__ block_ids, int64_t num_rows, char* rows,
                      int64_t row_bytes, unsigned long long* __restrict__ sums) {
  const int total = static_cast<int>(num_rows) * num_segs;  // < 2^31: checked by the launcher
  const int stride = static_cast<int>(gridDim.x) * kGroupsPerCta;
  const int lane = threadIdx.x % kGroup;
  int w = blockIdx.x * kGroupsPerCta + threadIdx.x / kGroup;
  if (w >= total) return;
  int i = w / num_segs;
  RaykvSegment seg = segs[w - i * num_segs];
  int64_t id = block_ids[i];
  while (true) {
    // the next item's addresses are read now, so their latency hides behind this copy
    const int64_t next = int64_t{w} + stride;  // total < 2^31, w + stride may not be
    int next_i = 0;
    RaykvSegment next_seg{};
    int64_t next_id = 0;
    if (next < total) {
      const int n = static_cast<int>(next);
      next_i = n / num_segs;
      next_seg = segs[n - next_i * num_segs];
      next_id = block_ids[next_i];
    }
    char* paged = reinterpret_cast<char*>(seg.paged_base) + id * seg.block_stride;
    char* row = rows + int64_t{i} * row_bytes + seg.row_offset;
    char* dst = kGather ? row : paged;
    const char* src = kGather ? paged : row;
    copy_item<kSum, kGroup>(dst, src, seg.bytes, seg.row_offset, kSum ? sums + i : nullptr,
                            lane);
    if (next >= total) return;
    w = static_cast<int>(next);
    i = next_i;
    seg = next_seg;
    id = next_id;
  }
}

// Block to block between two pools of one layout (a peer's pool mapped into this process, and
// this process's own): row i's span s moves from block ids.src[i] of src_segs[s] to block
// ids.dst[i] of dst_segs[s], no rows in between, and its part of the row's wire sum (as a gather
// of the source takes it) is added to scratch[i]. The ids come in the launch's parameters
// (__grid_constant__: read in place), so nothing is uploaded before the copy. The grid's last CTA
// to finish hands every row's sum to the host (out_sums[i], then out_done[i] = 1: mapped pinned
// memory, so nothing is copied back) and leaves scratch zero for the next launch, so nothing is
// zeroed before one either: one fence per thread and one ticket per CTA, at its end (a fence
// per item stalled each warp's next loads: 2 x the copy's time on one H100). Without kStore
// (dst_segs unused) it only sums the source's rows.
template <bool kStore>
__global__ void __launch_bounds__(kThreads)
    pool_copy_kernel(const RaykvSegment* __restrict__ src_segs,
                     const RaykvSegment* __restrict__ dst_segs, int num_segs,
                     const __grid_constant__ RaykvPoolIds ids, int num_rows,
                     unsigned long long* __restrict__ scratch, int64_t* __restrict__ out_sums,
                     int64_t* __restrict__ out_done) {
  const int total = num_rows * num_segs;  // < 2^31: checked by the launcher
  for (int w = blockIdx.x; w < total; w += gridDim.x) {
    const int i = w / num_segs;
    const int s = w - i * num_segs;
    const RaykvSegment seg = src_segs[s];
    const char* src =
        reinterpret_cast<const char*>(seg.paged_base) + int64_t{ids.src[i]} * seg.block_stride;
    char* dst = nullptr;
    if constexpr (kStore) {
      const RaykvSegment out = dst_segs[s];
      dst = reinterpret_cast<char*>(out.paged_base) + int64_t{ids.dst[i]} * out.block_stride;
    }
    add_block_total(copy_summed<kStore>(dst, src, seg.bytes, seg.row_offset, threadIdx.x),
                    scratch + i);
  }
  // CUDA's threadFenceReduction pattern: every add ordered before this CTA's ticket, every
  // ticket before the last CTA's reads.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  unsigned long long* tickets = scratch + RAYKV_POOL_BATCH_ROWS;
  if (threadIdx.x == 0) last = atomicAdd(tickets, 1ull) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < num_rows; i += kThreads) {
    out_sums[i] = static_cast<int64_t>(atomicExch(scratch + i, 0ull));
    out_done[i] = 1;
  }
  if (threadIdx.x == 0) atomicExch(tickets, 0ull);
}

// The grid for `total` CTAs of work of `kKernel`: `num_ctas`, or where that is <= 0 every CTA
// that fits at once (resident CTAs per SM x SMs, per device and kernel variant, computed
// once: device attributes cost a driver call). 0 with the error where the device is unknown.
template <auto kKernel>
cudaError_t grid_for(int num_ctas, int64_t total, unsigned& grid) {
  if (num_ctas <= 0) {
    static int cached[64] = {};
    int device = 0;
    const cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    int& slot = cached[device >= 0 && device < 64 ? device : 0];
    if (slot == 0) {
      int sms = 0, per_sm = 0;
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0);
      slot = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
    }
    num_ctas = slot;
  }
  grid = static_cast<unsigned>(total < num_ctas ? total : num_ctas);
  return cudaSuccess;
}

template <bool kGather, bool kSum>
cudaError_t launch(int num_ctas, cudaStream_t stream, const RaykvSegment* segs, int num_segs,
                   const int64_t* block_ids, int64_t num_rows, char* rows, int64_t row_bytes,
                   unsigned long long* sums) {
  unsigned grid = 0;
  const cudaError_t err = grid_for<paged_copy_kernel<kGather, kSum>>(
      num_ctas, (num_rows * num_segs + kGroupsPerCta - 1) / kGroupsPerCta, grid);
  if (err != cudaSuccess) return err;
  paged_copy_kernel<kGather, kSum>
      <<<grid, kThreads, 0, stream>>>(segs, num_segs, block_ids, num_rows, rows, row_bytes, sums);
  return cudaGetLastError();
}

// One CTA: the smallest i with got[i] != sent[i] (n where none differs) to *out.
__global__ void __launch_bounds__(kThreads)
    leading_matches_kernel(const int64_t* __restrict__ got, const int64_t* __restrict__ sent,
                           int64_t n, int64_t* __restrict__ out) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = static_cast<unsigned long long>(n);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    if (got[i] != sent[i]) {  // this thread's later rows cannot come first
      atomicMin(&first, static_cast<unsigned long long>(i));
      break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *out = static_cast<int64_t>(first);
}

}  // namespace

extern "C" int raykv_leading_matches(const int64_t* got, const int64_t* sent, int64_t n,
                                     int64_t* out, cudaStream_t stream) {
  leading_matches_kernel<<<1, kThreads, 0, stream>>>(got, sent, n, out);
  return cudaGetLastError();
}

extern "C" int raykv_paged_copy(const RaykvSegment* segs, int num_segs, const int64_t* block_ids,
                                int64_t num_rows, void* rows, int64_t row_bytes, int gather,
                                int num_ctas, unsigned long long* sums, cudaStream_t stream) {
  const int64_t total = num_rows * num_segs;
  if (total <= 0) return cudaSuccess;
  if (total > INT32_MAX) return cudaErrorInvalidValue;
  if (sums != nullptr && (row_bytes & 7) != 0) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(rows);
  if (sums != nullptr) {
    return gather ? launch<true, true>(num_ctas, stream, segs, num_segs, block_ids, num_rows, base,
                                       row_bytes, sums)
                  : launch<false, true>(num_ctas, stream, segs, num_segs, block_ids, num_rows,
                                        base, row_bytes, sums);
  }
  return gather ? launch<true, false>(num_ctas, stream, segs, num_segs, block_ids, num_rows, base,
                                      row_bytes, nullptr)
                : launch<false, false>(num_ctas, stream, segs, num_segs, block_ids, num_rows,
                                       base, row_bytes, nullptr);
}

namespace {

template <bool kStore>
cudaError_t launch_pool(int num_ctas, cudaStream_t stream, const RaykvSegment* src_segs,
                        const RaykvSegment* dst_segs, int num_segs, const RaykvPoolIds& ids,
                        int num_rows, unsigned long long* scratch, int64_t* out_sums,
                        int64_t* out_done) {
  unsigned grid = 0;
  const cudaError_t err = grid_for<pool_copy_kernel<kStore>>(
      num_ctas, static_cast<int64_t>(num_rows) * num_segs, grid);
  if (err != cudaSuccess) return err;
  pool_copy_kernel<kStore><<<grid, kThreads, 0, stream>>>(
      src_segs, dst_segs, num_segs, ids, num_rows, scratch, out_sums, out_done);
  return cudaGetLastError();
}

}  // namespace

extern "C" int raykv_pool_copy(const RaykvSegment* src_segs, const RaykvSegment* dst_segs,
                               int num_segs, const RaykvPoolIds* ids, int num_rows, int num_ctas,
                               unsigned long long* scratch, int64_t* out_sums, int64_t* out_done,
                               cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (num_rows > RAYKV_POOL_BATCH_ROWS || ids == nullptr || scratch == nullptr ||
      out_sums == nullptr || out_done == nullptr ||
      static_cast<int64_t>(num_rows) * num_segs > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  return dst_segs == nullptr
             ? launch_pool<false>(num_ctas, stream, src_segs, nullptr, num_segs, *ids, num_rows,
                                  scratch, out_sums, out_done)
             : launch_pool<true>(num_ctas, stream, src_segs, dst_segs, num_segs, *ids, num_rows,
                                 scratch, out_sums, out_done);
}
