// Torch binding over raykv_paged_copy: stream, device guard, the staged (pipelined) copy
// between host rows and the paged tensors, and the two CUDA runtime queries the Python side
// needs (the UVA pointer of pinned host memory, peer access). The collective batch pipeline
// over NCCL (wire_pipeline.cpp) registers itself here too.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "paged_copy.h"
#include "raykv_errors.h"

namespace {

// segs: int64 [S, 4] (RaykvSegment rows) and block_ids: int64 [N], both on the copy's device.
// rows_ptr: device-usable address of the contiguous rows (device, peer or mapped host memory).
// sums_ptr: 0, or an int64 [N] on the device each row's wire sum is added to (zeroed first).
// first, count: copy only block_ids[first .. first + count) (count < 0: to the end); rows_ptr
// and sums_ptr then point at that slice's first row and sum. One call per chunk of a pipelined
// batch, no tensor views on the host.
void paged_copy(const torch::Tensor& segs, const torch::Tensor& block_ids, int64_t rows_ptr,
                int64_t row_bytes, bool gather, int64_t num_ctas, int64_t sums_ptr,
                int64_t first, int64_t count) {
  raykv::require(segs.is_cuda() && segs.scalar_type() == torch::kInt64 &&
                     segs.is_contiguous() && segs.dim() == 2 && segs.size(1) == 4,
                 "paged_copy: segs must be a contiguous CUDA int64 [S, 4] tensor");
  raykv::require(block_ids.is_cuda() && block_ids.scalar_type() == torch::kInt64 &&
                     block_ids.is_contiguous() && block_ids.get_device() == segs.get_device(),
                 "paged_copy: block_ids must be contiguous int64 on the segments' device");
  const int64_t total = block_ids.numel();
  if (count < 0) count = total - first;
  if (first < 0 || count < 0 || first + count > total) {
    raykv::fail("paged_copy: rows [" + std::to_string(first) + ", " +
                std::to_string(first + count) + ") outside the " + std::to_string(total) +
                " block ids");
  }
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaError_t err = static_cast<cudaError_t>(raykv_paged_copy(
      reinterpret_cast<const RaykvSegment*>(segs.data_ptr<int64_t>()),
      static_cast<int>(segs.size(0)), block_ids.data_ptr<int64_t>() + first, count,
      reinterpret_cast<void*>(rows_ptr), row_bytes, gather ? 1 : 0, static_cast<int>(num_ctas),
      reinterpret_cast<unsigned long long*>(sums_ptr), c10::cuda::getCurrentCUDAStream().stream()));
  raykv::check_cuda(err, "paged_copy launch");
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
  raykv::require(!dst_ptrs.is_cuda() && !src_ptrs.is_cuda() && !sizes.is_cuda() &&
                     dst_ptrs.scalar_type() == torch::kInt64 &&
                     src_ptrs.scalar_type() == torch::kInt64 &&
                     sizes.scalar_type() == torch::kInt64 && dst_ptrs.is_contiguous() &&
                     src_ptrs.is_contiguous() && sizes.is_contiguous() &&
                     dst_ptrs.numel() == src_ptrs.numel() && sizes.numel() == src_ptrs.numel(),
                 "memcpy_loop: pass three contiguous CPU int64 tensors of one length");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t* dst = dst_ptrs.data_ptr<int64_t>();
  const int64_t* src = src_ptrs.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  for (int64_t i = 0; i < sizes.numel(); ++i) {
    const cudaError_t err =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                        static_cast<size_t>(size[i]), cudaMemcpyDefault, stream);
    raykv::check_cuda(err, "memcpy_loop: cudaMemcpyAsync");
  }
}

// --- staged mode: host rows through two device chunks, the whole pipeline from one call -------
//
// The caller's ("compute") stream runs the kernels, a side stream per device and direction the
// copy engine's chunk copies; events hand each chunk across and each buffer back. The side
// stream first waits for the compute stream, and the compute stream finally waits for the side
// stream, so the call is ordered like one op on the compute stream, and the buffers (allocated
// on it) may go back to torch's caching allocator as soon as the pipeline is enqueued.

// The side streams: two per device for the process, one per direction, so that a store
// (gather: device -> host) and a load (scatter: host -> device) issued on two caller streams
// overlap on the link's two directions. With one side stream per device the load's chunk copies
// queued behind the store's, and behind whatever the store's caller stream waited for. Two copies
// of one direction still share a side stream (they share that direction of the link anyway).
// Created here rather than taken from torch's stream pool, which hands its 32 streams out
// round-robin and so would sooner or later give a caller's torch.cuda.Stream() the same stream.
// Never destroyed (they outlive interpreter exit, like the events).
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device, bool gather) {
  static std::mutex mu;
  static std::unordered_map<c10::DeviceIndex, std::vector<c10::cuda::CUDAStream>> streams;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it == streams.end()) {
    const c10::cuda::CUDAGuard guard(device);
    std::vector<c10::cuda::CUDAStream> both;
    for (int i = 0; i < 2; ++i) {
      cudaStream_t raw = nullptr;
      raykv::check_cuda(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags");
      both.push_back(c10::cuda::getStreamFromExternal(raw, device));
    }
    it = streams.emplace(device, std::move(both)).first;
  }
  return it->second[gather ? 0 : 1];
}

// Timing-free events, reused across calls (an event may be recorded again once every wait on
// its previous record is enqueued). Taken and given back with the device current.
class EventPool {
 public:
  cudaEvent_t take(c10::DeviceIndex device) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[device];
      if (!free.empty()) {
        const cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    raykv::check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                      "cudaEventCreateWithFlags");
    return event;
  }
  void give(c10::DeviceIndex device, cudaEvent_t event) {
    const std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(event);
  }

 private:
  std::mutex mu_;
  std::unordered_map<c10::DeviceIndex, std::vector<cudaEvent_t>> free_;
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool();  // never destroyed: events outlive interpreter exit
  return *pool;
}

// `waiter` runs its later work only after everything enqueued on `signaller` so far.
void order(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event) {
  raykv::check_cuda(cudaEventRecord(event, signaller), "cudaEventRecord");
  raykv::check_cuda(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
}

// One staged gather (paged -> device chunk -> host rows) or scatter (host rows -> device chunk
// -> paged). Constructing it allocates the chunk buffers and orders the side stream after the
// compute stream; a scatter may send its first `prefill` chunks to the device right away (they
// write only the buffers, never the paged tensors), so the copy engine starts while the caller
// still validates. run() enqueues everything else; cancel() (or destruction) drops a copy that
// never ran, leaving the paged tensors untouched.
class StagedCopy {
 public:
  StagedCopy(torch::Tensor rows, int64_t device, std::vector<int64_t> counts, bool gather,
             int64_t prefill)
      : rows_(std::move(rows)),
        counts_(std::move(counts)),
        device_(static_cast<c10::DeviceIndex>(device)),
        gather_(gather),
        compute_(c10::cuda::getCurrentCUDAStream(device_)),
        side_(side_stream(device_, gather)) {
    raykv::require(rows_.device().is_cpu() && rows_.scalar_type() == torch::kUInt8 &&
                       rows_.dim() == 2 && rows_.is_contiguous(),
                   "StagedCopy: rows must be a contiguous uint8 [N, W] host tensor");
    int64_t total = 0, biggest = 0;
    for (const int64_t count : counts_) {
      raykv::require(count > 0, "StagedCopy: chunk row counts must be positive");
      starts_.push_back(total);
      total += count;
      biggest = std::max(biggest, count);
    }
    if (counts_.empty() || total != rows_.size(0)) {
      raykv::fail("StagedCopy: the chunks must cover the " + std::to_string(rows_.size(0)) +
                  " rows");
    }
    const c10::cuda::CUDAGuard guard(device_);
    const int64_t slots = std::min<int64_t>(2, static_cast<int64_t>(counts_.size()));
    // one allocation, each chunk 256-byte aligned (odd row widths keep wide vectors and DMA)
    const int64_t chunk_bytes = biggest * rows_.size(1), stride = (chunk_bytes + 255) / 256 * 256;
    buffers_ = torch::empty({slots * stride},
                            torch::dtype(torch::kUInt8).device(torch::kCUDA, device_));
    for (int64_t s = 0; s < slots; ++s) {
      chunks_.push_back(buffers_.narrow(0, s * stride, chunk_bytes).view({biggest, rows_.size(1)}));
    }
    for (cudaEvent_t* event : {&sync_, &handed_[0], &handed_[1], &released_[0], &released_[1]}) {
      *event = event_pool().take(device_);
    }
    try {
      // everything queued before on the compute stream (writes to the paged tensors, to or
      // reads of the host rows) happens before any chunk copy
      order(side_, compute_, sync_);
      for (; !gather_ && static_cast<int64_t>(sent_) < std::min(prefill, slots); ++sent_) {
        send(sent_);
      }
    } catch (...) {
      finish();
      throw;
    }
  }

  StagedCopy(const StagedCopy&) = delete;
  StagedCopy& operator=(const StagedCopy&) = delete;

  ~StagedCopy() {
    if (!finished_) {
      try {
        cancel();
      } catch (...) {  // never throw from a destructor; the CUDA error resurfaces on next use
      }
    }
  }

  // segs: int64 [S, 4] on the device; block_ids: int64 [N] on the host or the device.
  // sums_ptr: 0, or an int64 [N] on the device that receives each row's sum (row_sum.h), taken
  // by the kernel from the device chunk it fills (a gather) or empties (a scatter): the host
  // never reads the bytes to checksum them.
  void run(const torch::Tensor& segs, const torch::Tensor& block_ids, int64_t num_ctas,
           int64_t sums_ptr) {
    raykv::require(!finished_, "StagedCopy: run() after run() or cancel()");
    raykv::require(segs.is_cuda() && segs.get_device() == device_ &&
                       segs.scalar_type() == torch::kInt64 && segs.is_contiguous() &&
                       segs.dim() == 2 && segs.size(1) == 4,
                   "StagedCopy: segs must be a contiguous int64 [S, 4] tensor on the device");
    raykv::require(block_ids.scalar_type() == torch::kInt64 && block_ids.dim() == 1 &&
                       block_ids.numel() == rows_.size(0),
                   "StagedCopy: block_ids must be int64 [N], one per row");
    const c10::cuda::CUDAGuard guard(device_);
    try {
      // uploaded on the compute stream (a scatter's first chunks are already on their way)
      const torch::Tensor ids =
          block_ids.to(buffers_.device(), torch::kInt64, /*non_blocking=*/true).contiguous();
      const auto* table = reinterpret_cast<const RaykvSegment*>(segs.data_ptr<int64_t>());
      const int num_segs = static_cast<int>(segs.size(0));
      const int64_t* id = ids.data_ptr<int64_t>();
      auto* sums = reinterpret_cast<unsigned long long*>(sums_ptr);
      if (sums != nullptr) {  // the kernel adds each row's terms to its sum
        raykv::check_cuda(cudaMemsetAsync(sums, 0, sizeof(*sums) * rows_.size(0), compute_),
                          "StagedCopy: zeroing the sums");
      }
      for (size_t i = 0; i < counts_.size(); ++i) {
        unsigned long long* chunk_sums = sums == nullptr ? nullptr : sums + starts_[i];
        const size_t slot = i % 2;
        if (gather_) {
          if (i >= 2) wait(compute_, released_[slot]);  // its last chunk has left for the host
          launch(table, num_segs, id + starts_[i], counts_[i], slot, num_ctas, chunk_sums);
          order(side_, compute_, handed_[slot]);
          host_copy(i);
          raykv::check_cuda(cudaEventRecord(released_[slot], side_), "cudaEventRecord");
        } else {
          if (i >= sent_) send(i);
          wait(compute_, handed_[slot]);
          launch(table, num_segs, id + starts_[i], counts_[i], slot, num_ctas, chunk_sums);
          raykv::check_cuda(cudaEventRecord(released_[slot], compute_), "cudaEventRecord");
        }
      }
    } catch (...) {
      finish();
      throw;
    }
    finish();
  }

  // Drops a copy that never ran: the side stream's chunk copies complete into the buffers,
  // the compute stream is ordered after them, nothing else is touched.
  void cancel() {
    if (finished_) return;
    const c10::cuda::CUDAGuard guard(device_);
    finish();
  }

 private:
  // Scatter: chunk i from the host rows into its buffer on the side stream, then handed over.
  void send(size_t i) {
    const size_t slot = i % 2;
    if (i >= 2) wait(side_, released_[slot]);  // the kernel reading its last chunk is done
    host_copy(i);
    raykv::check_cuda(cudaEventRecord(handed_[slot], side_), "cudaEventRecord");
  }

  // Chunk i between the host rows and its buffer, on the side stream (torch's copy_, so a
  // pinned block of torch's host allocator is not reused before the copy engine is done).
  void host_copy(size_t i) {
    const c10::cuda::CUDAStreamGuard on_side(side_);
    torch::Tensor device_part = chunks_[i % 2].narrow(0, 0, counts_[i]);
    torch::Tensor host_part = rows_.narrow(0, starts_[i], counts_[i]);
    if (gather_) {
      host_part.copy_(device_part, /*non_blocking=*/true);
    } else {
      device_part.copy_(host_part, /*non_blocking=*/true);
    }
  }

  void launch(const RaykvSegment* table, int num_segs, const int64_t* ids, int64_t count,
              size_t slot, int64_t num_ctas, unsigned long long* sums) {
    void* chunk = chunks_[slot].data_ptr();
    const cudaError_t err = static_cast<cudaError_t>(
        raykv_paged_copy(table, num_segs, ids, count, chunk, rows_.size(1), gather_ ? 1 : 0,
                         static_cast<int>(num_ctas), sums, compute_.stream()));
    raykv::check_cuda(err, "paged_copy launch");
  }

  static void wait(const c10::cuda::CUDAStream& stream, cudaEvent_t event) {
    raykv::check_cuda(cudaStreamWaitEvent(stream.stream(), event, 0), "cudaStreamWaitEvent");
  }

  // Later work on the compute stream sees every byte moved; the buffers and events go back
  // (the buffers to torch's allocator, in the compute stream's order, which is now after every
  // use on the side stream).
  void finish() {
    finished_ = true;
    cudaError_t err = cudaEventRecord(sync_, side_);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(compute_, sync_, 0);
    for (cudaEvent_t event : {sync_, handed_[0], handed_[1], released_[0], released_[1]}) {
      event_pool().give(device_, event);
    }
    chunks_.clear();
    buffers_ = torch::Tensor();
    rows_ = torch::Tensor();
    raykv::check_cuda(err, "StagedCopy: ordering the compute stream after the copies");
  }

  torch::Tensor rows_, buffers_;
  std::vector<torch::Tensor> chunks_;  // [biggest, W] views of buffers_, one per slot
  std::vector<int64_t> counts_, starts_;
  c10::DeviceIndex device_;
  bool gather_, finished_ = false;
  c10::cuda::CUDAStream compute_, side_;
  cudaEvent_t sync_ = nullptr, handed_[2] = {}, released_[2] = {};
  size_t sent_ = 0;  // scatter: chunks already sent to the device
};

}  // namespace

void register_wire_pipeline(pybind11::module& m);  // wire_pipeline.cpp
void register_peer_memory(pybind11::module& m);    // peer_memory.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_wire_pipeline(m);
  register_peer_memory(m);
  m.def("paged_copy", &paged_copy, "gather (rows <- paged) or scatter (paged <- rows)",
        py::arg("segs"), py::arg("block_ids"), py::arg("rows_ptr"), py::arg("row_bytes"),
        py::arg("gather"), py::arg("num_ctas"), py::arg("sums_ptr") = 0, py::arg("first") = 0,
        py::arg("count") = -1);
  m.def("mapped_pointer", &mapped_pointer, "UVA device pointer of pinned host memory, or 0");
  m.def("enable_peer_access", &enable_peer_access, "enable peer access device -> peer");
  m.def("memcpy_loop", &memcpy_loop, "one cudaMemcpyAsync per span (benchmark baseline)");
  py::class_<StagedCopy>(m, "StagedCopy")
      .def(py::init<torch::Tensor, int64_t, std::vector<int64_t>, bool, int64_t>(),
           py::arg("rows"), py::arg("device"), py::arg("counts"), py::arg("gather"),
           py::arg("prefill"), "set up a staged copy (a scatter sends `prefill` chunks now)")
      .def("run", &StagedCopy::run, py::arg("segs"), py::arg("block_ids"), py::arg("num_ctas"),
           py::arg("sums_ptr") = 0, "enqueue the whole pipeline (with each row's sum)")
      .def("cancel", &StagedCopy::cancel, "drop a copy that never ran");
}
