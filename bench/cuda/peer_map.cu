// What mapping a peer GPU's allocation costs, step by step: a cuMem allocation on GPU 1
// (POSIX file descriptor handle, as kvferry's pools), exported and imported again, then
// reserved, mapped and made accessible to GPU 0 (cuMemAddressReserve, cuMemMap,
// cuMemSetAccess), whole or with access granted piece by piece; and the same bytes as separate
// allocations of one piece each; and a cudaMalloc allocation opened through cudaIpcOpenMemHandle
// in a second process (how pools a framework allocated arrive). A diagnostic, not a kvferry figure
// (docs/perf/nvlink-h100.md, "The first rooms waited for peer access").
// Build:
//   nvcc -O2 -arch=sm_90 -cudart static -o peer_map bench/cuda/peer_map.cu \
//     -L/usr/local/cuda/lib64/stubs -lcuda
// Run on a machine with two GPUs joined by NVLink: ./peer_map [GiB] [piece GiB]
// (`./peer_map ipc FILE` is the second process of the last part.)
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_check.h"

#define CU(x)                             \
  do {                                    \
    CUresult cu_error_ = (x);             \
    if (cu_error_ != CUDA_SUCCESS) {      \
      const char* text = nullptr;         \
      cuGetErrorString(cu_error_, &text); \
      std::printf("%s: %s\n", #x, text);  \
      std::exit(1);                       \
    }                                     \
  } while (0)

namespace {

double Ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// A pinned allocation of `bytes` on GPU 1, exported as a file descriptor.
int ExportedAllocation(size_t bytes, CUmemGenericAllocationHandle* handle) {
  CUmemAllocationProp prop = Prop(1);
  CU(cuMemCreate(handle, bytes, &prop, 0));
  int fd = -1;
  auto t = std::chrono::steady_clock::now();
  CU(cuMemExportToShareableHandle(&fd, *handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  std::printf("export of %zu MiB: %.2f ms\n", bytes >> 20, Ms(t));
  return fd;
}

// Writes 1 MiB from GPU 0 at `ptr` (an address mapped for GPU 0) and reads it back.
void Probe(CUdeviceptr ptr) {
  const size_t n = 1 << 20;
  std::vector<unsigned char> in(n, 0x5a), out(n, 0);
  CK(cudaMemcpy(reinterpret_cast<void*>(ptr), in.data(), n, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(out.data(), reinterpret_cast<void*>(ptr), n, cudaMemcpyDeviceToHost));
  if (out != in) {
    std::printf("probe at %llx: bytes differ\n", static_cast<unsigned long long>(ptr));
    std::exit(1);
  }
}

}  // namespace

// The second process of the IPC part: opens the handle in `path` on GPU 0.
int OpenIpc(const char* path) {
  cudaIpcMemHandle_t handle;
  size_t bytes = 0;
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr || std::fread(&handle, sizeof(handle), 1, f) != 1 ||
      std::fread(&bytes, sizeof(bytes), 1, f) != 1) {
    std::printf("cannot read %s\n", path);
    return 1;
  }
  std::fclose(f);
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  auto t = std::chrono::steady_clock::now();
  void* ptr = nullptr;
  CK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  const double open_ms = Ms(t);
  t = std::chrono::steady_clock::now();
  Probe(reinterpret_cast<CUdeviceptr>(ptr) + bytes - (1 << 20));
  const double probe_ms = Ms(t);
  t = std::chrono::steady_clock::now();
  CK(cudaIpcCloseMemHandle(ptr));
  std::printf(
      "cudaMalloc of %zu GiB opened in another process: cudaIpcOpenMemHandle %.2f ms, "
      "first probe %.2f, close %.2f\n",
      bytes >> 30, open_ms, probe_ms, Ms(t));
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "ipc") return OpenIpc(argv[2]);
  const size_t gib = size_t{1} << 30;
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 40) * gib;
  const size_t piece = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2) * gib;
  CK(cudaSetDevice(1));
  CK(cudaFree(nullptr));
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

  for (int whole = 1; whole >= 0; --whole) {
    CK(cudaSetDevice(1));
    CUmemGenericAllocationHandle owner = 0;
    int fd = ExportedAllocation(bytes, &owner);
    CK(cudaSetDevice(0));
    auto t = std::chrono::steady_clock::now();
    CUmemGenericAllocationHandle h = 0;
    CU(cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    const double import_ms = Ms(t);
    t = std::chrono::steady_clock::now();
    CUdeviceptr ptr = 0;
    CU(cuMemAddressReserve(&ptr, bytes, 0, 0, 0));
    const double reserve_ms = Ms(t);
    t = std::chrono::steady_clock::now();
    CU(cuMemMap(ptr, bytes, 0, h, 0));
    const double map_ms = Ms(t);
    if (whole) {
      t = std::chrono::steady_clock::now();
      CU(cuMemSetAccess(ptr, bytes, &access, 1));
      const double access_ms = Ms(t);
      t = std::chrono::steady_clock::now();
      Probe(ptr + bytes - (1 << 20));
      std::printf(
          "one allocation of %zu GiB: import %.2f ms, reserve %.2f, map %.2f, access %.2f, "
          "first probe %.2f\n",
          bytes / gib, import_ms, reserve_ms, map_ms, access_ms, Ms(t));
    } else {
      std::printf(
          "one allocation of %zu GiB, access by pieces of %zu GiB: import %.2f ms, "
          "reserve %.2f, map %.2f; access per piece (ms):",
          bytes / gib, piece / gib, import_ms, reserve_ms, map_ms);
      for (size_t off = 0; off < bytes; off += piece) {
        t = std::chrono::steady_clock::now();
        const CUresult r = cuMemSetAccess(ptr + off, piece, &access, 1);
        if (r != CUDA_SUCCESS) {
          const char* text = nullptr;
          cuGetErrorString(r, &text);
          std::printf(" refused at %zu GiB: %s; then the whole range:", off / gib, text);
          t = std::chrono::steady_clock::now();
          CU(cuMemSetAccess(ptr, bytes, &access, 1));
          std::printf(" %.2f", Ms(t));
          break;
        }
        std::printf(" %.2f", Ms(t));
        if (off == 0) Probe(ptr);  // the first piece is usable before the others
      }
      std::printf("\n");
      Probe(ptr + bytes - (1 << 20));
    }
    t = std::chrono::steady_clock::now();
    CU(cuMemUnmap(ptr, bytes));
    CU(cuMemAddressFree(ptr, bytes));
    CU(cuMemRelease(h));
    std::printf("  unmap and release %.2f ms\n", Ms(t));
    CK(cudaSetDevice(1));
    CU(cuMemRelease(owner));
    close(fd);
  }

  // The same bytes as allocations of one piece each, imported and mapped one after another
  // into one reservation.
  const size_t pieces = bytes / piece;
  std::vector<CUmemGenericAllocationHandle> owners(pieces), imported(pieces);
  std::vector<int> fds(pieces);
  CK(cudaSetDevice(1));
  for (size_t i = 0; i < pieces; ++i) fds[i] = ExportedAllocation(piece, &owners[i]);
  CK(cudaSetDevice(0));
  CUdeviceptr ptr = 0;
  CU(cuMemAddressReserve(&ptr, bytes, 0, 0, 0));
  std::printf("%zu allocations of %zu GiB, import + map + access per piece (ms):", pieces,
              piece / gib);
  auto all = std::chrono::steady_clock::now();
  for (size_t i = 0; i < pieces; ++i) {
    auto t = std::chrono::steady_clock::now();
    CU(cuMemImportFromShareableHandle(&imported[i],
                                      reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i])),
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CU(cuMemMap(ptr + i * piece, piece, 0, imported[i], 0));
    CU(cuMemSetAccess(ptr + i * piece, piece, &access, 1));
    std::printf(" %.2f", Ms(t));
  }
  std::printf("; all %.2f\n", Ms(all));
  Probe(ptr + bytes - (1 << 20));
  for (size_t i = 0; i < pieces; ++i) {
    CU(cuMemUnmap(ptr + i * piece, piece));
    CU(cuMemRelease(imported[i]));
  }
  CU(cuMemAddressFree(ptr, bytes));
  CK(cudaSetDevice(1));
  for (size_t i = 0; i < pieces; ++i) {
    CU(cuMemRelease(owners[i]));
    close(fds[i]);
  }

  // cudaMalloc on GPU 1, opened by a second process on GPU 0.
  void* buffer = nullptr;
  CK(cudaMalloc(&buffer, bytes));
  cudaIpcMemHandle_t handle;
  CK(cudaIpcGetMemHandle(&handle, buffer));
  const std::string path = "/tmp/peer_map_ipc." + std::to_string(getpid());
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(&handle, sizeof(handle), 1, f);
  std::fwrite(&bytes, sizeof(bytes), 1, f);
  std::fclose(f);
  const std::string child = std::string(argv[0]) + " ipc " + path;
  const int rc = std::system(child.c_str());
  std::remove(path.c_str());
  CK(cudaFree(buffer));
  return rc == 0 ? 0 : 1;
}
