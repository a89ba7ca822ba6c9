// Paged KV gather / scatter between a pool of paged blocks and contiguous rows.
// Plain C interface so paged_copy.cu builds standalone with nvcc (no torch headers).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One contiguous span of every block of one paged tensor (an entry, or a piece of one when its
// blocks are large). Block b of the span starts at paged_base + b * block_stride; in a row the
// span lives at row_offset. All values in bytes; 32 bytes, so a torch int64 [S, 4] table maps 1:1.
#define RAYKV_MAX_SEGMENT_BYTES (1 << 20)  // the host splits larger spans (32-bit indexing)

typedef struct RaykvSegment {
  uint64_t paged_base;
  int64_t block_stride;
  int64_t bytes;
  int64_t row_offset;
} RaykvSegment;

// Copies, for every i < num_rows and every segment s, the bytes of block block_ids[i] of s
// to (gather != 0) or from (gather == 0) rows + i * row_bytes + s.row_offset.
// segs and block_ids must be readable by the current device; rows may be device memory, a peer
// GPU's memory (peer access enabled) or mapped pinned host memory (its UVA device pointer).
// num_ctas <= 0 picks a full persistent grid. Returns the launch's cudaError_t
// (cudaErrorInvalidValue where num_rows * num_segs >= 2^31). Each segment must be at most
// RAYKV_MAX_SEGMENT_BYTES (the caller splits larger spans).
// sums (nullable, device memory, num_rows entries): each row's sum (row_sum.h, the checksum
// raykv uses everywhere; raykv.ops.reference.row_sums) is ADDED to sums[i] while the row is copied, so
// zero it first. Needs every span, row and row_bytes 8-byte aligned (cudaErrorInvalidValue
// where row_bytes is not; the caller checks the spans).
int raykv_paged_copy(const RaykvSegment* segs, int num_segs, const int64_t* block_ids,
                     int64_t num_rows, void* rows, int64_t row_bytes, int gather, int num_ctas,
                     unsigned long long* sums, cudaStream_t stream);

// out[0] = the number of leading i < n with got[i] == sent[i] (n where all match): how many
// leading rows of a collective batch arrived intact
// (raykv.transport.collective.wire.leading_matches is the torch reference). All three device
// memory; one small launch on `stream`.
int raykv_leading_matches(const int64_t* got, const int64_t* sent, int64_t n, int64_t* out,
                          cudaStream_t stream);

// Rows of one pool-copy launch: their ids travel in the launch's parameters (RaykvPoolIds, 8 KiB
// where the CUDA runtime takes parameters up to 32 KiB, since 12.1; 3.75 KiB under the 4 KiB
// limit before). A larger batch is several launches.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
#define RAYKV_POOL_BATCH_ROWS 1024
#else
#define RAYKV_POOL_BATCH_ROWS 480
#endif

typedef struct RaykvPoolIds {
  int32_t src[RAYKV_POOL_BATCH_ROWS];
  int32_t dst[RAYKV_POOL_BATCH_ROWS];
} RaykvPoolIds;

// Block to block between two pools of one layout (src_segs and dst_segs: the same spans, row
// offsets and sizes, each over its own pool; the source may be a peer GPU's pool mapped into this
// process): for every i < num_rows (at most RAYKV_POOL_BATCH_ROWS) and segment s, the bytes of
// block ids->src[i] of src_segs[s] go to block ids->dst[i] of dst_segs[s]; each row's wire sum,
// exactly as raykv_paged_copy's gather takes it, is written to out_sums[i] and then out_done[i]
// is set to 1 (both mapped pinned host memory, device addresses; spans 8-byte aligned).
// dst_segs == nullptr: nothing is written to a pool, only the source rows' sums are taken.
// scratch: device memory of RAYKV_POOL_BATCH_ROWS + 1 uint64 (each row's running sum, the
// grid's count of finished CTAs), zero before the launch and left zero by it; launches that
// share one scratch must run one after the other (one stream, or ordered). num_ctas <= 0 picks
// a full persistent grid.
int raykv_pool_copy(const RaykvSegment* src_segs, const RaykvSegment* dst_segs, int num_segs,
                    const RaykvPoolIds* ids, int num_rows, int num_ctas,
                    unsigned long long* scratch, int64_t* out_sums, int64_t* out_done,
                    cudaStream_t stream);

#ifdef __cplusplus
}
#endif
