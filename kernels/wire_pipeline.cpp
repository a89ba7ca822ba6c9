// A collective batch's pipeline (raykv.transport.collective) enqueued in one host call: the
// paged gather of each chunk with its wire sums, then that chunk's ncclSend, while the next
// chunk is gathered; on the receiver every chunk's ncclRecv posted at once and each chunk
// scattered (its sums recomputed) as soon as it is in. From Python every chunk cost the host
// a kernel launch and an NCCL call through torch (~100 us each on a busy host, longer than a
// chunk's time on NVLink); here a whole batch costs one call.
//
// NCCL itself is the library torch already loaded: ncclSend / ncclRecv are looked up in it at
// run time, so building raykv needs no NCCL headers and links nothing new. The communicator is
// the one torch's ProcessGroupNCCL made for the pair (its _comm_ptr()); aborting that group
// aborts anything enqueued here.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "paged_copy.h"

namespace {

// ncclResult_t nccl{Send,Recv}(void* buff, size_t count, ncclDataType_t type, int peer,
//                              ncclComm_t comm, cudaStream_t stream)
using P2p = int (*)(void*, size_t, int, int, void*, cudaStream_t);
constexpr int kNcclUint8 = 1;  // ncclUint8 in nccl.h's ncclDataType_t

struct Nccl {
  P2p send = nullptr;
  P2p recv = nullptr;
};

const Nccl& nccl() {
  static const Nccl lib = [] {
    Nccl n;
    for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
      void* handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);  // only the one already loaded
      if (handle == nullptr) continue;
      n.send = reinterpret_cast<P2p>(dlsym(handle, "ncclSend"));
      n.recv = reinterpret_cast<P2p>(dlsym(handle, "ncclRecv"));
      if (n.send != nullptr && n.recv != nullptr) break;
    }
    return n;
  }();
  return lib;
}

void check_nccl(int result, const char* what) {
  TORCH_CHECK(result == 0, "raykv wire pipeline: ", what, " failed with ncclResult_t ", result);
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// This thread's event `slot` on the current device, created once and reused batch after batch:
// a wait takes the event's state when it is enqueued, so a later record cannot change it.
cudaEvent_t reusable_event(int slot) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<std::pair<int, int>, cudaEvent_t> events;
  cudaEvent_t& ev = events[{device, slot}];
  if (ev == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

constexpr int kOrderSlot = -1;

// `waiter` waits for everything enqueued on `done` so far.
void order(cudaStream_t done, cudaStream_t waiter) {
  const cudaEvent_t ev = reusable_event(kOrderSlot);
  C10_CUDA_CHECK(cudaEventRecord(ev, done));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
}

void copy(const torch::Tensor& segs, const int64_t* ids, int64_t count, char* rows,
          int64_t width, bool gather, int64_t ctas, int64_t* sums, cudaStream_t stream) {
  const cudaError_t err = static_cast<cudaError_t>(raykv_paged_copy(
      reinterpret_cast<const RaykvSegment*>(segs.data_ptr<int64_t>()),
      static_cast<int>(segs.size(0)), ids, count, rows, width, gather ? 1 : 0,
      static_cast<int>(ctas), reinterpret_cast<unsigned long long*>(sums), stream));
  TORCH_CHECK(err == cudaSuccess, "raykv paged_copy launch failed: ", cudaGetErrorString(err));
}

bool available() { return nccl().send != nullptr && nccl().recv != nullptr; }

// A batch's block ids, checked (every id a block of the pool; distinct where they are written)
// before anything is enqueued: ValueError naming the id and the pool's size otherwise.
void check_ids(const std::vector<int64_t>& ids, int64_t num_blocks, bool distinct,
               const char* what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_blocks, what, ": block id ", ids[i],
                      " (position ", i, ") is outside the pool's ", num_blocks,
                      " blocks; ids must lie in [0, ", num_blocks - 1, "]");
  }
  if (!distinct) return;
  std::vector<int64_t> sorted(ids);
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(twice == sorted.end(), what, ": block id ", *twice,
                    " appears more than once; each block can receive only one row");
}

// The ids on the device for kernels on the current stream: staged in pinned memory from torch's
// caching host allocator (its copy_ records the stream, so the staging is not reused before the
// upload ran) and allocated for the current stream (freed in stream order behind the copies).
torch::Tensor upload_ids(const std::vector<int64_t>& ids, const torch::Device& device) {
  const auto n = static_cast<int64_t>(ids.size());
  torch::Tensor host = torch::empty({n}, torch::dtype(torch::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), ids.data(), n * sizeof(int64_t));
  torch::Tensor on_device = torch::empty({n}, torch::dtype(torch::kLong).device(device));
  on_device.copy_(host, /*non_blocking=*/true);
  return on_device;
}

int64_t covered(const std::vector<int64_t>& counts, int64_t n) {
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  TORCH_CHECK(total == n, "raykv wire pipeline: chunks cover ", total, " of ", n, " rows");
  return total;
}

// Sender. The batch buffer is [rows: n x width | sums: n x int64] at rows_ptr. gather: gather
// each chunk on the current stream (taking its sums), else the rows are already there. Every
// message goes out on `wire` (rows chunks in order, the last with the sums behind its rows),
// each behind its gather. The ids are checked against the pool's num_blocks first.
void send(int64_t comm, int64_t peer, const torch::Tensor& segs, const std::vector<int64_t>& ids,
          int64_t num_blocks, int64_t rows_ptr, int64_t width, const std::vector<int64_t>& counts,
          bool gather, int64_t ctas, int64_t wire_handle) {
  TORCH_CHECK(available(), "raykv wire pipeline: ncclSend/ncclRecv not found in this process");
  const int64_t n = static_cast<int64_t>(ids.size());
  check_ids(ids, num_blocks, false, "collective send");
  covered(counts, n);
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaStream_t compute = c10::cuda::getCurrentCUDAStream().stream();
  const cudaStream_t wire = as_stream(wire_handle);
  char* rows = reinterpret_cast<char*>(rows_ptr);
  int64_t* sums = reinterpret_cast<int64_t*>(rows + n * width);
  torch::Tensor device_ids;
  if (gather) {
    device_ids = upload_ids(ids, segs.device());
    C10_CUDA_CHECK(cudaMemsetAsync(sums, 0, n * sizeof(int64_t), compute));
  }
  order(compute, wire);
  int64_t start = 0;
  for (const int64_t c : counts) {
    if (gather) {
      copy(segs, device_ids.data_ptr<int64_t>() + start, c, rows + start * width, width, true,
           ctas, sums + start, compute);
      order(compute, wire);
    }
    const bool last = start + c == n;  // its sums are complete: every chunk is gathered
    const int64_t bytes = c * width + (last ? n * static_cast<int64_t>(sizeof(int64_t)) : 0);
    check_nccl(nccl().send(rows + start * width, bytes, kNcclUint8, static_cast<int>(peer),
                           reinterpret_cast<void*>(comm), wire),
               "ncclSend");
    start += c;
  }
}

// Receiver, into the same buffer layout: every message posted on `wire` at once; each chunk
// scattered on `compute` (after what the caller's current stream holds so far; its sums
// recomputed) once it is in, and passed on to each forward communicator (rank 1 there) on
// `forward` as it arrives. Then the count of leading rows whose recomputed sums equal the
// received ones goes to the returned pinned int64 [1]. `compute` ends after all of that. The
// ids are checked (in the pool, distinct) first.
torch::Tensor recv(int64_t comm, int64_t peer, const torch::Tensor& segs,
                   const std::vector<int64_t>& ids, int64_t num_blocks, int64_t rows_ptr,
                   int64_t width, const std::vector<int64_t>& counts, int64_t ctas,
                   int64_t compute_handle, int64_t wire_handle,
                   const std::vector<int64_t>& forward_comms, int64_t forward_handle) {
  TORCH_CHECK(available(), "raykv wire pipeline: ncclSend/ncclRecv not found in this process");
  const int64_t n = static_cast<int64_t>(ids.size());
  check_ids(ids, num_blocks, true, "collective receive");
  covered(counts, n);
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaStream_t compute = as_stream(compute_handle);
  const cudaStream_t wire = as_stream(wire_handle);
  const cudaStream_t forward = as_stream(forward_handle);
  order(c10::cuda::getCurrentCUDAStream().stream(), compute);  // the pool's work so far
  // what the scatters use is allocated for `compute`: freed in its order behind them
  const c10::cuda::CUDAStreamGuard on_compute(
      c10::cuda::getStreamFromExternal(compute, segs.device().index()));
  const torch::Tensor device_ids = upload_ids(ids, segs.device());
  const torch::Tensor got_t = torch::empty({n + 1}, torch::dtype(torch::kLong).device(segs.device()));
  torch::Tensor good = torch::empty({1}, torch::dtype(torch::kLong).pinned_memory(true));
  char* rows = reinterpret_cast<char*>(rows_ptr);
  const int64_t sum_bytes = n * static_cast<int64_t>(sizeof(int64_t));
  int64_t* got = got_t.data_ptr<int64_t>();
  const int64_t* id = device_ids.data_ptr<int64_t>();
  C10_CUDA_CHECK(cudaMemsetAsync(got, 0, sum_bytes, compute));
  order(compute, wire);  // the buffer is free to land in
  std::vector<int64_t> message_bytes;
  int64_t start = 0;
  for (size_t k = 0; k < counts.size(); ++k) {  // the last message brings the sums behind its rows
    const int64_t c = counts[k];
    const int64_t bytes = c * width + (start + c == n ? sum_bytes : 0);
    check_nccl(nccl().recv(rows + start * width, bytes, kNcclUint8, static_cast<int>(peer),
                           reinterpret_cast<void*>(comm), wire),
               "ncclRecv");
    C10_CUDA_CHECK(cudaEventRecord(reusable_event(static_cast<int>(k)), wire));
    message_bytes.push_back(bytes);
    start += c;
  }
  start = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(compute, reusable_event(static_cast<int>(k)), 0));
    if (!forward_comms.empty()) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(forward, reusable_event(static_cast<int>(k)), 0));
      for (const int64_t f : forward_comms) {
        check_nccl(nccl().send(rows + start * width, message_bytes[k], kNcclUint8, 1,
                               reinterpret_cast<void*>(f), forward),
                   "ncclSend (forward)");
      }
    }
    copy(segs, id + start, counts[k], rows + start * width, width, false, ctas, got + start,
         compute);
    start += counts[k];
  }
  const cudaError_t err = static_cast<cudaError_t>(raykv_leading_matches(
      got, reinterpret_cast<const int64_t*>(rows + n * width), n, got + n, compute));
  TORCH_CHECK(err == cudaSuccess, "raykv leading_matches launch failed: ",
              cudaGetErrorString(err));
  C10_CUDA_CHECK(cudaMemcpyAsync(good.data_ptr<int64_t>(), got + n, sizeof(int64_t),
                                 cudaMemcpyDeviceToHost, compute));
  if (!forward_comms.empty()) order(forward, compute);  // done once the copies went on too
  return good;
}

}  // namespace

void register_wire_pipeline(pybind11::module& m) {
  m.def("wire_available", &available, "ncclSend/ncclRecv found in this process");
  m.def("wire_send", &send, "enqueue a collective batch's gather + sends (one host call)");
  m.def("wire_recv", &recv, "enqueue a collective batch's receives + scatters (one host call)");
}
