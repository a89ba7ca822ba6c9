// Device memory another process can map (raykv.transport.peer_memory): a pool's KV allocated
// with the CUDA driver's virtual memory API (cuMemCreate), exportable as a POSIX file
// descriptor. A process on the same host that receives the descriptor (over a Unix socket)
// imports it and maps it into its own address space with read access for its own GPU, so its
// kernels read the owner's blocks over NVLink directly. This works between processes that each
// see only their own GPU (CUDA_VISIBLE_DEVICES under Ray), where torch's CUDA IPC handles do not.
//
// The driver entry points are looked up in the libcuda the CUDA runtime already loaded (like
// wire_pipeline.cpp's NCCL): building raykv links nothing new.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <torch/extension.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "raykv_errors.h"

namespace {

struct Driver {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    void* lib = nullptr;
    for (const char* name : {"libcuda.so.1", "libcuda.so"}) {
      lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) return x;
    auto get = [lib](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    x.ok = get(x.granularity, "cuMemGetAllocationGranularity") && get(x.create, "cuMemCreate") &&
           get(x.release, "cuMemRelease") && get(x.reserve, "cuMemAddressReserve") &&
           get(x.address_free, "cuMemAddressFree") && get(x.map, "cuMemMap") &&
           get(x.unmap, "cuMemUnmap") && get(x.set_access, "cuMemSetAccess") &&
           get(x.export_handle, "cuMemExportToShareableHandle") &&
           get(x.import_handle, "cuMemImportFromShareableHandle");
    return x;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) raykv::fail(std::string(what) + " failed with CUresult " + std::to_string(r));
}

const Driver& need_driver() {
  const Driver& d = driver();
  raykv::require(d.ok, "peer memory: the CUDA driver's virtual memory API was not found");
  return d;
}

CUmemAllocationProp props(int device) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

// Maps `handle` (size bytes) into a fresh address range with read-write access for `device`;
// the tensor's deleter unmaps it and drops this process's reference (the memory itself lives
// until every process that maps it has let go), and closes `fd` when it is >= 0.
torch::Tensor mapped(CUmemGenericAllocationHandle handle, size_t size, int64_t nbytes, int device,
                     int fd) {
  const Driver& d = need_driver();
  CUdeviceptr ptr = 0;
  CUresult r = d.reserve(&ptr, size, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = d.map(ptr, size, 0, handle, 0);
    if (r != CUDA_SUCCESS) d.address_free(ptr, size);
  }
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(ptr, size, &access, 1);
    if (r != CUDA_SUCCESS) {
      d.unmap(ptr, size);
      d.address_free(ptr, size);
    }
  }
  if (r != CUDA_SUCCESS) {
    d.release(handle);
    if (fd >= 0) close(fd);
    check(r, "peer memory: mapping (cuMemAddressReserve / cuMemMap / cuMemSetAccess)");
  }
  auto free_all = [handle, size, ptr, fd](void*) {
    const Driver& dd = driver();
    dd.unmap(ptr, size);
    dd.address_free(ptr, size);
    dd.release(handle);
    if (fd >= 0) close(fd);
  };
  return torch::from_blob(reinterpret_cast<void*>(ptr), {nbytes}, free_all,
                          torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, device));
}

size_t rounded(int64_t nbytes, int device) {
  const Driver& d = need_driver();
  CUmemAllocationProp p = props(device);
  size_t g = 0;
  check(d.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  return ((static_cast<size_t>(nbytes) + g - 1) / g) * g;
}

// (tensor of nbytes zeros on the current device, its file descriptor): the descriptor stays
// open in this process as long as the tensor lives (send it to as many peers as needed).
std::tuple<torch::Tensor, int64_t> exportable_zeros(int64_t nbytes) {
  raykv::require(nbytes > 0, "peer memory: nbytes must be positive");
  const int device = c10::cuda::current_device();
  const Driver& d = need_driver();
  const size_t size = rounded(nbytes, device);
  CUmemAllocationProp p = props(device);
  CUmemGenericAllocationHandle handle = 0;
  check(d.create(&handle, size, &p, 0), "peer memory: cuMemCreate");
  int fd = -1;
  const CUresult r = d.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    d.release(handle);
    check(r, "peer memory: cuMemExportToShareableHandle");
  }
  torch::Tensor t = mapped(handle, size, nbytes, device, fd);
  t.zero_();
  return {t, fd};
}

// The memory behind `fd` (a descriptor exportable_zeros gave out, received by this process,
// which now owns it) mapped for the current device: nbytes of it as a uint8 tensor.
torch::Tensor import_fd(int64_t fd, int64_t nbytes) {
  raykv::require(fd >= 0 && nbytes > 0, "peer memory: pass a received descriptor and its size");
  const int device = c10::cuda::current_device();
  const Driver& d = need_driver();
  const size_t size = rounded(nbytes, device);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = d.import_handle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    close(static_cast<int>(fd));
    check(r, "peer memory: cuMemImportFromShareableHandle");
  }
  close(static_cast<int>(fd));  // the imported handle holds the memory from here on
  return mapped(handle, size, nbytes, device, -1);
}

bool available() { return driver().ok; }

// NCCL windows (NCCL >= 2.28): the holder's pool mapped into the reader through the pair's
// own communicator. ncclCommWindowRegister maps every rank's registered memory into one flat
// address range per rank where NCCL finds the GPUs can load from each other (its "LSA team":
// NVLink or PCIe peer access); elsewhere it only registers the buffer locally. The peer's
// address is in the window's device-side record (NCCL's ncclWindow_vidmem: NCCL hands it to
// device code, ncclGetLsaPointer; its first fields, read here, are the same in 2.28 and 2.29,
// the versions this accepts). Registration is collective: both ranks of the pair call this
// together. The mapping lives as long as the communicator (an abort unmaps it).
struct WindowRecord {  // the head of ncclWindow_vidmem (nccl_device/impl/core__types.h)
  void* win_host;
  char* lsa_flat_base;  // rank 0's window in the flat range; rank r's is stride4G << 32 on
  int lsa_rank;
  int world_rank;
  uint32_t stride4G;
};

using WindowRegister = int (*)(void*, void*, size_t, void**, int);
using Version = int (*)(int*);

void* nccl_symbol(const char* name) {
  for (const char* lib : {"libnccl.so.2", "libnccl.so"}) {
    void* handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);  // only the one torch loaded
    if (handle == nullptr) continue;
    if (void* fn = dlsym(handle, name)) return fn;
  }
  return nullptr;
}

// The NCCL version windows work with here (0: none: no NCCL loaded, or one outside 2.28-2.29).
int64_t nccl_window_version() {
  auto version = reinterpret_cast<Version>(nccl_symbol("ncclGetVersion"));
  int v = 0;
  if (version == nullptr || nccl_symbol("ncclCommWindowRegister") == nullptr || version(&v) != 0) {
    return 0;
  }
  return (v >= 22800 && v < 23000) ? v : 0;
}

// Registers `memory` (this rank's pool: one allocation of the driver's virtual memory API) as a
// window of the 2-rank communicator `comm` (torch's ncclComm_t) and returns the peer rank's
// registered memory as seen from this GPU (uint8, as many bytes as `memory`), or an empty tensor
// and why not (NCCL found no peer access: the window is only a local registration).
std::tuple<torch::Tensor, std::string> nccl_window(int64_t comm, torch::Tensor memory,
                                                   int64_t rank) {
  raykv::require(memory.is_cuda() && memory.is_contiguous() && memory.numel() > 0,
                 "nccl window: pass the pool's contiguous CUDA allocation");
  raykv::require(rank == 0 || rank == 1, "nccl window: a pair's rank is 0 or 1");
  const torch::Tensor none;
  if (nccl_window_version() == 0) return {none, "NCCL 2.28 or 2.29 is not loaded"};
  auto reg = reinterpret_cast<WindowRegister>(nccl_symbol("ncclCommWindowRegister"));
  c10::cuda::CUDAGuard guard(memory.device());
  void* win = nullptr;
  const int r = reg(reinterpret_cast<void*>(comm), memory.data_ptr(),
                    static_cast<size_t>(memory.numel()), &win, 0);
  if (r != 0) return {none, "ncclCommWindowRegister failed with ncclResult_t " + std::to_string(r)};
  // a symmetric window's record is device memory; a local registration's handle is not
  cudaPointerAttributes attr = {};
  if (win == nullptr || cudaPointerGetAttributes(&attr, win) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();  // clear a failed query
    return {none, "NCCL mapped no window between these GPUs (no peer access)"};
  }
  WindowRecord rec = {};
  raykv::check_cuda(cudaMemcpy(&rec, win, sizeof(rec), cudaMemcpyDeviceToHost),
                    "nccl window: reading the window record");
  if (rec.world_rank != rank || rec.lsa_rank != rank || rec.stride4G == 0 ||
      rec.lsa_flat_base == nullptr) {
    return {none, "the window record is not as NCCL " + std::to_string(nccl_window_version()) +
                      " lays it out (rank " + std::to_string(rec.world_rank) + ")"};
  }
  const int64_t peer = 1 - rank;
  char* at = rec.lsa_flat_base + peer * (static_cast<int64_t>(rec.stride4G) << 32);
  return {torch::from_blob(at, {memory.numel()}, memory.options()), ""};
}

}  // namespace

void register_peer_memory(pybind11::module& m) {
  m.def("peer_memory_available", &available, "the CUDA driver's virtual memory API is there");
  m.def("exportable_zeros", &exportable_zeros, py::arg("nbytes"),
        "zeros on the current GPU that another process can map: (tensor, descriptor)");
  m.def("import_fd", &import_fd, py::arg("fd"), py::arg("nbytes"),
        "map memory exportable_zeros made elsewhere (a received descriptor) for this GPU");
  m.def("nccl_window_version", &nccl_window_version,
        "the loaded NCCL's version where raykv can use its windows, else 0");
  m.def("nccl_window", &nccl_window, py::arg("comm"), py::arg("memory"), py::arg("rank"),
        "register memory as a window of a 2-rank NCCL communicator: (the peer's memory, why not)");
}
