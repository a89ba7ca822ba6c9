// A collective batch's pipeline (raykv.transport.collective) enqueued in one host call, and a
// peer read's block-to-block batch (raykv.transport.peer_read, pool_read below) likewise: the
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
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "paged_copy.h"
#include "raykv_errors.h"

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

// Failures are raykv_errors.h's (never torch's TORCH_CHECK or c10::str in this extension).
using raykv::check_cuda;

[[noreturn]] void fail(const std::string& message) { raykv::fail("wire pipeline: " + message); }

void check_nccl(int result, const char* what) {
  if (result != 0) fail(std::string(what) + " failed with ncclResult_t " + std::to_string(result));
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// This thread's event `slot` on the current device, created once and reused batch after batch:
// a wait takes the event's state when it is enqueued, so a later record cannot change it.
cudaEvent_t reusable_event(int slot) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  thread_local std::map<std::pair<int, int>, cudaEvent_t> events;
  cudaEvent_t& ev = events[{device, slot}];
  if (ev == nullptr) {
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  return ev;
}

constexpr int kOrderSlot = -1;

// `waiter` waits for everything enqueued on `done` so far.
void order(cudaStream_t done, cudaStream_t waiter) {
  const cudaEvent_t ev = reusable_event(kOrderSlot);
  check_cuda(cudaEventRecord(ev, done), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(waiter, ev, 0), "cudaStreamWaitEvent");
}

void copy(const torch::Tensor& segs, const int64_t* ids, int64_t count, char* rows,
          int64_t width, bool gather, int64_t ctas, int64_t* sums, cudaStream_t stream) {
  const cudaError_t err = static_cast<cudaError_t>(raykv_paged_copy(
      reinterpret_cast<const RaykvSegment*>(segs.data_ptr<int64_t>()),
      static_cast<int>(segs.size(0)), ids, count, rows, width, gather ? 1 : 0,
      static_cast<int>(ctas), reinterpret_cast<unsigned long long*>(sums), stream));
  check_cuda(err, "paged_copy launch");
}

bool available() { return nccl().send != nullptr && nccl().recv != nullptr; }

// What `pinned_ids` found wrong with a batch's ids: none, or this reason at `position`. The
// pipeline returns `position * kBadIdReasons + reason` to Python, which words the message
// (raykv.transport.collective.collective.pipeline_call): nothing is formatted or thrown here
// for bad input. (A first version threw TORCH_CHECK_VALUE, a second returned a message built
// with c10::str: both took the process down with a segmentation fault on the device's H100
// host, 2 x H100, torch 2.11, instead of reaching Python; this one returned every code there.)
enum BadId : int64_t { kIdOk = 0, kIdNotInt = 1, kIdOutside = 2, kIdTwice = 3 };
constexpr int64_t kBadIdReasons = 4;

// A batch's block ids, read straight from the caller's Python sequence into `out` (pinned
// memory) in one pass, each checked as it is read: an int, a block of the pool, and where the
// ids are written (`distinct`) not seen before in the batch. Returns how many there were;
// `bad` is set to the code of the first bad id (else -1; a `seq` that is no sequence: position
// 0, not an int), before anything is enqueued. `capacity`: the most `out` holds.
int64_t read_ids(const pybind11::handle& seq, int64_t* out, int64_t capacity, int64_t num_blocks,
                 bool distinct, int64_t& bad) {
  bad = -1;
  PyObject* fast = PySequence_Fast(seq.ptr(), "block ids must be a sequence of ints");
  if (fast == nullptr) {
    PyErr_Clear();
    bad = kIdNotInt;  // position 0
    return -1;
  }
  const pybind11::object items = pybind11::reinterpret_steal<pybind11::object>(fast);
  const int64_t n = PySequence_Fast_GET_SIZE(fast);
  if (n > capacity) {
    fail(std::to_string(n) + " ids where " + std::to_string(capacity) + " fit");
  }
  PyObject** item = PySequence_Fast_ITEMS(fast);
  // distinct: one bit per block of the pool, set as ids are read and cleared again before
  // returning (this thread's, so a batch costs O(n), not a sort)
  thread_local std::vector<uint64_t> seen;
  if (distinct && seen.size() * 64 < static_cast<size_t>(num_blocks)) {
    seen.resize((num_blocks + 63) / 64, 0);
  }
  int64_t i = 0;
  for (; i < n; ++i) {
    const long long id = PyLong_AsLongLong(item[i]);
    int64_t reason = kIdOk;
    if (id == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      reason = kIdNotInt;
    } else if (id < 0 || id >= num_blocks) {
      reason = kIdOutside;
    } else if (distinct && (seen[id >> 6] >> (id & 63) & 1ULL)) {
      reason = kIdTwice;
    }
    if (reason != kIdOk) {
      bad = i * kBadIdReasons + reason;
      break;
    }
    if (distinct) seen[id >> 6] |= 1ULL << (id & 63);
    out[i] = id;
  }
  for (int64_t j = 0; distinct && j < i; ++j) seen[out[j] >> 6] &= ~(1ULL << (out[j] & 63));
  return n;
}

torch::Tensor pinned(int64_t count) {
  return torch::empty({count}, torch::dtype(torch::kLong).pinned_memory(true));
}

// `read_ids` into fresh pinned memory (`extra` more int64 slots behind the ids), from torch's
// caching host allocator (a few us; a std::vector and a torch copy_ cost ~20 us more per batch
// and end); an empty tensor where `bad` is set.
torch::Tensor pinned_ids(const pybind11::handle& seq, int64_t extra, int64_t num_blocks,
                         bool distinct, int64_t& bad) {
  const Py_ssize_t n = PySequence_Check(seq.ptr()) ? PySequence_Size(seq.ptr()) : -1;
  if (n < 0) {
    PyErr_Clear();
    bad = kIdNotInt;
    return {};
  }
  torch::Tensor host = pinned(n + extra);
  read_ids(seq, host.data_ptr<int64_t>(), n, num_blocks, distinct, bad);
  return bad < 0 ? host : torch::Tensor();
}

// Enqueue the copy of `host`'s first `n` ids to `on_device` on `stream`.
void upload(const torch::Tensor& host, int64_t n, int64_t* on_device, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(on_device, host.data_ptr<int64_t>(), n * sizeof(int64_t),
                             cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync");
}

// `host` is kept from reuse until everything enqueued on `stream` so far has run (the caching
// host allocator's event, what torch's own copy_ records).
void keep_until_done(const torch::Tensor& host, cudaStream_t stream, c10::DeviceIndex device) {
  at::getHostAllocator(at::kCUDA)->record_event(
      host.data_ptr(), host.storage().data_ptr().get_context(),
      c10::cuda::getStreamFromExternal(stream, device).unwrap());
}

void check_covered(const std::vector<int64_t>& counts, int64_t n) {
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  if (total != n) {
    fail("chunks cover " + std::to_string(total) + " of " + std::to_string(n) + " rows");
  }
}

// Sender. The batch buffer is [rows: n x width | sums: n x int64] at rows_ptr. gather: gather
// each chunk on the current stream (taking its sums), else the rows are already there. Every
// message goes out on `wire` (rows chunks in order, the last with the sums behind its rows),
// each behind its gather. The ids are checked against the pool's num_blocks first: -1, or the
// first bad one's code (`BadId`) with nothing enqueued.
int64_t send(int64_t comm, int64_t peer, const torch::Tensor& segs, const pybind11::handle& ids,
             int64_t num_blocks, int64_t rows_ptr, int64_t width,
             const std::vector<int64_t>& counts, bool gather, int64_t ctas, int64_t wire_handle) {
  if (!available()) fail("ncclSend/ncclRecv not found in this process");
  int64_t bad = -1;
  const torch::Tensor host_ids = pinned_ids(ids, 0, num_blocks, false, bad);
  if (bad >= 0) return bad;
  const int64_t n = host_ids.size(0);
  check_covered(counts, n);
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaStream_t compute = c10::cuda::getCurrentCUDAStream().stream();
  const cudaStream_t wire = as_stream(wire_handle);
  char* rows = reinterpret_cast<char*>(rows_ptr);
  int64_t* sums = reinterpret_cast<int64_t*>(rows + n * width);
  torch::Tensor device_ids;
  if (gather) {  // allocated for `compute`: freed in its order, behind the gathers
    device_ids = torch::empty({n}, torch::dtype(torch::kLong).device(segs.device()));
    upload(host_ids, n, device_ids.data_ptr<int64_t>(), compute);
    keep_until_done(host_ids, compute, segs.device().index());
    check_cuda(cudaMemsetAsync(sums, 0, n * sizeof(int64_t), compute), "cudaMemsetAsync");
  } else {
    order(compute, wire);  // the rows are there; with gathers, each one orders its message
  }
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
  return -1;
}

// Receiver, into the same buffer layout: every message posted on `wire` at once; each chunk
// scattered on `compute` (after what the caller's current stream holds so far; its sums
// recomputed) once it is in, and passed on to each forward communicator (rank 1 there) on
// `forward` as it arrives. Then the count of leading rows whose recomputed sums equal the
// received ones goes to the returned pinned int64 [1]. `compute` ends after all of that. The
// ids are checked (in the pool, distinct) first: the first bad one's code (an int, `BadId`)
// is returned instead.
pybind11::object recv(int64_t comm, int64_t peer, const torch::Tensor& segs,
                      const pybind11::handle& ids, int64_t num_blocks, int64_t rows_ptr,
                      int64_t width, const std::vector<int64_t>& counts, int64_t ctas,
                      int64_t compute_handle, int64_t wire_handle,
                      const std::vector<int64_t>& forward_comms, int64_t forward_handle) {
  if (!available()) fail("ncclSend/ncclRecv not found in this process");
  // [ids | the count of intact rows], pinned
  int64_t bad = -1;
  const torch::Tensor host = pinned_ids(ids, 1, num_blocks, true, bad);
  if (bad >= 0) return pybind11::int_(bad);
  const int64_t n = host.size(0) - 1;
  check_covered(counts, n);
  const c10::cuda::CUDAGuard guard(segs.device());
  const cudaStream_t compute = as_stream(compute_handle);
  const cudaStream_t wire = as_stream(wire_handle);
  const cudaStream_t forward = as_stream(forward_handle);
  const cudaStream_t pool = c10::cuda::getCurrentCUDAStream().stream();
  // Every message is posted first: the sender's data can flow while the host prepares the
  // scatters (the receiver's host is on a batch's critical path: one at a time, its post
  // came ~30 us later than the sender's). The buffer was allocated on the pool's stream, so
  // the wire waits for the pool's work so far.
  order(pool, wire);
  char* rows = reinterpret_cast<char*>(rows_ptr);
  const int64_t sum_bytes = n * static_cast<int64_t>(sizeof(int64_t));
  std::vector<int64_t> message_bytes;
  int64_t start = 0;
  for (size_t k = 0; k < counts.size(); ++k) {  // the last message brings the sums behind its rows
    const int64_t c = counts[k];
    const int64_t bytes = c * width + (start + c == n ? sum_bytes : 0);
    check_nccl(nccl().recv(rows + start * width, bytes, kNcclUint8, static_cast<int>(peer),
                           reinterpret_cast<void*>(comm), wire),
               "ncclRecv");
    check_cuda(cudaEventRecord(reusable_event(static_cast<int>(k)), wire), "cudaEventRecord");
    message_bytes.push_back(bytes);
    start += c;
  }
  order(pool, compute);  // the pool's work so far (the scatters write its blocks)
  // what the scatters use is allocated for `compute`: freed in its order behind them
  const c10::cuda::CUDAStreamGuard on_compute(
      c10::cuda::getStreamFromExternal(compute, segs.device().index()));
  // [ids | recomputed sums | their count of leading matches], on the device
  const torch::Tensor scratch =
      torch::empty({2 * n + 1}, torch::dtype(torch::kLong).device(segs.device()));
  int64_t* const id = scratch.data_ptr<int64_t>();
  upload(host, n, id, compute);
  keep_until_done(host, compute, segs.device().index());  // also if a later step throws
  int64_t* got = id + n;
  check_cuda(cudaMemsetAsync(got, 0, sum_bytes, compute), "cudaMemsetAsync");
  start = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    check_cuda(cudaStreamWaitEvent(compute, reusable_event(static_cast<int>(k)), 0),
               "cudaStreamWaitEvent");
    if (!forward_comms.empty()) {
      check_cuda(cudaStreamWaitEvent(forward, reusable_event(static_cast<int>(k)), 0),
                 "cudaStreamWaitEvent");
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
  check_cuda(err, "leading_matches launch");
  int64_t* good = host.data_ptr<int64_t>() + n;
  check_cuda(cudaMemcpyAsync(good, got + n, sizeof(int64_t), cudaMemcpyDeviceToHost, compute),
             "cudaMemcpyAsync");
  keep_until_done(host, compute, segs.device().index());  // and until the count is written
  if (!forward_comms.empty()) order(forward, compute);  // done once the copies went on too
  return pybind11::cast(host.narrow(0, n, 1));
}

// A peer read's batch (raykv.transport.peer_read) in one host call: the source ids (and the
// destination ids, checked distinct; dst_ids None: the sums alone) read from the Python
// sequences and checked as for the pipeline above, then the block-to-block copy with each
// row's wire sum (raykv_pool_copy) on the current stream, its ids in the launch's parameters
// and its sums written by the kernel straight into pinned memory: nothing else is enqueued
// (an upload, a zeroing and a copy back each cost the GPU a few us before or after the copy,
// and the host a call). `scratch`: the caller's device int64 [pool_batch_rows + 1], zero (the
// kernel leaves it so); `state`: the caller's CPU int64 [1], the stream the last batch with
// this scratch went to (a batch on another stream waits for it: launches sharing a scratch run
// one after the other). Returns the pinned int64 tensor [2n]: the n sums, then n flags the
// kernel sets to 1 behind each sum (valid once the stream passes this point; `done_event`,
// unless 0, a cudaEvent_t recorded behind it all), or (side, code) for the first bad id: side
// 0 the source ids, 1 the destination ids; code as wire_send's. Nothing is enqueued for bad ids.
pybind11::object pool_read(const torch::Tensor& src_segs, const torch::Tensor& dst_segs,
                           const pybind11::handle& src_ids, const pybind11::handle& dst_ids,
                           int64_t num_src, int64_t num_dst, int64_t num_ctas,
                           int64_t done_event, const torch::Tensor& scratch,
                           const torch::Tensor& state) {
  const bool store = !dst_ids.is_none();
  raykv::require(src_segs.is_cuda() && src_segs.scalar_type() == torch::kInt64 &&
                     src_segs.is_contiguous() && src_segs.dim() == 2 && src_segs.size(1) == 4 &&
                     (!store || (dst_segs.is_cuda() && dst_segs.scalar_type() == torch::kInt64 &&
                                 dst_segs.is_contiguous() && dst_segs.sizes() == src_segs.sizes())),
                 "pool_read: segment tables must be contiguous CUDA int64 [S, 4], one S");
  raykv::require(scratch.is_cuda() && scratch.scalar_type() == torch::kInt64 &&
                     scratch.is_contiguous() && scratch.numel() > RAYKV_POOL_BATCH_ROWS &&
                     scratch.device() == src_segs.device() && !state.is_cuda() &&
                     state.scalar_type() == torch::kInt64 && state.numel() >= 1,
                 "pool_read: scratch must be CUDA int64 [pool_batch_rows + 1] on the pool's "
                 "device, state CPU int64 [1]");
  raykv::require(num_src <= INT32_MAX && num_dst <= INT32_MAX,
                 "pool_read: pools of more than 2^31 blocks");
  const Py_ssize_t n = PySequence_Check(src_ids.ptr()) ? PySequence_Size(src_ids.ptr()) : -1;
  if (n < 0) {
    PyErr_Clear();
    return pybind11::make_tuple(0, static_cast<int64_t>(kIdNotInt));
  }
  // Both sides' ids read and checked before anything is enqueued (this thread's buffer).
  thread_local std::vector<int64_t> ids;
  if (ids.size() < static_cast<size_t>(2 * n)) ids.resize(2 * n);
  int64_t bad = -1;
  read_ids(src_ids, ids.data(), n, num_src, false, bad);
  if (bad >= 0) return pybind11::make_tuple(0, bad);
  if (store) {
    const int64_t got = read_ids(dst_ids, ids.data() + n, n, num_dst, true, bad);
    if (bad >= 0) return pybind11::make_tuple(1, bad);
    if (got != n) fail("pool_read: " + std::to_string(n) + " source ids but " +
                       std::to_string(got) + " destination ids");
  }
  torch::Tensor host = pinned(2 * n);
  if (n == 0) return pybind11::cast(host);
  int64_t* h = host.data_ptr<int64_t>();
  std::memset(h + n, 0, n * sizeof(int64_t));  // the flags the kernel sets
  const c10::cuda::CUDAGuard guard(src_segs.device());
  const c10::DeviceIndex device = src_segs.device().index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  int64_t* on_device = nullptr;  // the same memory as the kernel addresses it (UVA: h itself)
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&on_device), h, 0),
             "cudaHostGetDevicePointer");
  int64_t& last = *state.data_ptr<int64_t>();
  if (last != 0 && as_stream(last) != stream) order(as_stream(last), stream);
  last = reinterpret_cast<int64_t>(stream);
  RaykvPoolIds chunk;  // filled up to the rows of each launch only
  cudaError_t err = cudaSuccess;
  for (int64_t start = 0; start < n && err == cudaSuccess; start += RAYKV_POOL_BATCH_ROWS) {
    const int64_t rows = std::min<int64_t>(n - start, RAYKV_POOL_BATCH_ROWS);
    for (int64_t i = 0; i < rows; ++i) {
      chunk.src[i] = static_cast<int32_t>(ids[start + i]);
      chunk.dst[i] = store ? static_cast<int32_t>(ids[n + start + i]) : 0;
    }
    err = static_cast<cudaError_t>(raykv_pool_copy(
        reinterpret_cast<const RaykvSegment*>(src_segs.data_ptr<int64_t>()),
        store ? reinterpret_cast<const RaykvSegment*>(dst_segs.data_ptr<int64_t>()) : nullptr,
        static_cast<int>(src_segs.size(0)), &chunk, static_cast<int>(rows),
        static_cast<int>(num_ctas),
        reinterpret_cast<unsigned long long*>(scratch.data_ptr<int64_t>()), on_device + start,
        on_device + n + start, stream));
  }
  keep_until_done(host, stream, device);  // the launches made write into it, even if one failed
  check_cuda(err, "pool_copy launch");
  if (done_event != 0) {  // the caller's event (a torch.cuda.Event's cuda_event) behind it all
    check_cuda(cudaEventRecord(reinterpret_cast<cudaEvent_t>(done_event), stream),
               "cudaEventRecord");
  }
  return pybind11::cast(host);
}

// How many leading rows of a pool_read result `got` (int64 [2n]: the sums, then the flags; read
// once its batch has passed) came back with the sum `sent` states for them (an int64 buffer, one
// per row compared: the first min(n, len(sent)) rows). One pass without temporaries: numpy's
// compare, mask and search took ~12 us of host time per 512-row read after its copy.
int64_t pool_leading(const torch::Tensor& got, const pybind11::buffer& sent) {
  const pybind11::buffer_info want = sent.request();
  raykv::require(!got.is_cuda() && got.scalar_type() == torch::kInt64 && got.is_contiguous() &&
                     want.ndim == 1 && want.itemsize == 8 &&
                     (want.format == "l" || want.format == "q") && want.strides[0] == 8,
                 "pool_leading: a pool_read result and a contiguous int64 array of sums");
  const int64_t n = got.numel() / 2;
  const int64_t m = std::min<int64_t>(n, want.shape[0]);
  const int64_t* g = got.data_ptr<int64_t>();
  const int64_t* s = static_cast<const int64_t*>(want.ptr);
  int64_t i = 0;
  while (i < m && g[n + i] != 0 && g[i] == s[i]) ++i;
  return i;
}

}  // namespace

void register_wire_pipeline(pybind11::module& m) {
  m.def("wire_available", &available, "ncclSend/ncclRecv found in this process");
  m.def("wire_send", &send,
        "enqueue a collective batch's gather + sends (one host call); -1, or the first bad id's "
        "position * 4 + reason (1 not an int, 2 outside the pool, 3 twice)");
  m.def("wire_recv", &recv,
        "enqueue a collective batch's receives + scatters (one host call): the pinned count of "
        "intact rows, or the first bad id's code as wire_send returns it");
  m.def("pool_read", &pool_read, py::arg("src_segs"), py::arg("dst_segs"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("num_src"), py::arg("num_dst"), py::arg("num_ctas"),
        py::arg("done_event"), py::arg("scratch"), py::arg("state"),
        "enqueue a peer read's block-to-block copy with sums (one host call): pinned memory "
        "[2n], the n sums then n flags set behind them, or (side, code) of the first bad id");
  m.attr("pool_batch_rows") = RAYKV_POOL_BATCH_ROWS;
  m.def("pool_leading", &pool_leading, py::arg("got"), py::arg("sent"),
        "how many leading rows of a pool_read result came back with the stated sums");
}
