// The target side of `kvferry bench`: a process whose engine registers one buffer and serves
// the initiator's WRITEs and READs into it.
//
// The initiator normally spawns the target itself (TargetProcess re-executes /proc/self/exe
// with the hidden `bench-target` subcommand); `kvferry bench --serve` runs the same code by
// hand, so the two sides can live on two machines. Either way the target announces itself with
// one line on stdout (FormatTargetLine) once its buffer is registered.
//
// Thread-safety: HostBuffer and TargetProcess are used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kvferry/memory.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
class DeviceAllocation;
}  // namespace kvferry::cuda

namespace kvferry::tools {

// Page-aligned anonymous host memory, every page touched at allocation so that page faults
// do not land inside a timed loop. Move-only; unmapped on destruction.
class HostBuffer {
 public:
  // Errors: kResourceExhausted when mmap fails.
  static StatusOr<HostBuffer> Allocate(uint64_t size_bytes);
  // The same size in GPU memory of `device` (kvferry's cuMem allocation; data() is a device
  // pointer). Errors: "no CUDA device", kResourceExhausted.
  static StatusOr<HostBuffer> AllocateOnDevice(uint64_t size_bytes, int device);
  // Host memory, or the GPU holding the buffer.
  MemoryLocation location() const { return location_; }

  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  MemoryLocation location_;
  std::shared_ptr<cuda::DeviceAllocation> device_memory_;  // set for GPU buffers
};

// What a target announces: where to connect and which region to use.
struct TargetInfo {
  std::string address;  // "host:port" of the target's engine
  uint64_t base = 0;    // address of the registered buffer in the target process
  uint64_t length_bytes = 0;
};

// "kvferry-bench-target address=127.0.0.1:41234 base=0x7f3a00000000 length_bytes=1048576"
std::string FormatTargetLine(const TargetInfo& info);
// Inverse of FormatTargetLine. Errors: kInvalidArgument quoting the line.
StatusOr<TargetInfo> ParseTargetLine(const std::string& line);

struct TargetOptions {
  std::string transport = "auto";
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;  // 0 picks a free port
  uint64_t buffer_bytes = 0;
  std::string device = "cpu";  // "cuda": the buffer lives on GPU `gpu`
  int gpu = 0;
  // true: serve until stdin reaches end of file (spawned by an initiator, which closes the
  // pipe to stop it). false: serve until SIGINT or SIGTERM (`kvferry bench --serve`).
  bool until_stdin_closes = false;
  // The shared secret initiators must prove (empty: KVFERRY_AUTH_TOKEN, else none); a spawned
  // target receives it in its environment, never on its command line.
  std::string auth_secret;
  bool insecure = false;  // listen on a non-loopback host without a secret
};

// Creates the engine, registers a buffer, prints the target line, serves, returns the exit
// status (0 after a clean stop; 1 with a message on stderr when setup fails).
// Blocks for the life of the target.
int RunBenchTarget(const TargetOptions& options);

// A target spawned as a child process: `/proc/self/exe bench-target ...`.
class TargetProcess {
 public:
  // Forks and executes the child, then blocks up to `startup_timeout` for its target line.
  // The child gets SIGKILL if this process dies first (PR_SET_PDEATHSIG). Safe in a threaded
  // process: between fork and exec the child makes only async-signal-safe calls.
  // Errors: kInternal (fork/pipe failed), kUnavailable (the child exited or stayed silent;
  // its stderr, inherited from this process, says why).
  static StatusOr<std::unique_ptr<TargetProcess>> Spawn(const TargetOptions& options,
                                                        std::chrono::milliseconds startup_timeout);
  // Stops the child if Stop() was not called.
  ~TargetProcess();

  const TargetInfo& info() const { return info_; }
  pid_t pid() const { return pid_; }

  // Closes the child's stdin (its cue to exit), waits up to 2 s, SIGKILLs it if it is still
  // there, and reaps it. Returns kInternal when the child had already failed (a non-zero exit
  // or a signal it did not get from here). Later calls return OK and do nothing.
  Status Stop();

 private:
  TargetProcess() = default;

  pid_t pid_ = -1;
  int stdin_fd_ = -1;   // write end of the child's stdin
  int stdout_fd_ = -1;  // read end of the child's stdout
  TargetInfo info_;
};

}  // namespace kvferry::tools
