// The UCX transport: host and GPU memory to engines on other nodes over whatever UCX finds
// (InfiniBand or RoCE verbs, tcp, ...). Each engine has one UCX context and `lanes` workers,
// each with its own progress thread (ucx_worker.h); their addresses travel in the engine's
// segment descriptor, so peers learn them only through the authenticated handshake. A channel
// to a peer has an endpoint per lane, from this engine's worker i to the peer's worker
// i (modulo the peer's count), and spreads requests (cut into slices) over them by bytes: over
// transports that emulate RMA in software (tcp) both sides then move bytes on several threads
// and connections. Regions with remote
// access are mapped with UCX once, when registered (MemoryRegistry's observer), and their
// packed rkeys travel in the descriptor; unregistering unmaps them. Channels (ucx_channel.h)
// move WRITE and READ items; notifications stay on the TCP control channel.
//
// GPU memory: when the UCX loaded at run time moves CUDA memory, GPU regions are mapped with
// it and GPU requests go straight to UCX (GPUDirect RDMA where the NIC and driver allow);
// otherwise (or with UcxTransportOptions::gpu_bounce) GPU requests go through pinned host
// bounce buffers (gpu_bounce_channel.h) over a UCX channel. RouteText and the log say which.
//
// Settings come from UCX's own UCX_* variables; kvferry's defaults (ucx_worker.h) apply where
// none is set. No UCX types here: without UCX in the build, Create reports why.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "transport/memory_registry.h"
#include "transport/transport.h"

namespace kvferry {

struct UcxTransportOptions {
  static constexpr uint64_t kAmThresholdWithoutRdma = 128ull << 10;
  static constexpr uint64_t kAmEagerWithoutRdma = 256ull << 10;

  // Reach peers on this engine's node too (the transport was forced); otherwise only peers on
  // other nodes, where UCX is preferred over TCP.
  bool same_node = false;
  // UCX workers of this engine, each with a progress thread, and endpoints per peer (one per
  // worker), range 1..64; the engine passes EngineOptions::ucx_lanes_per_peer.
  int lanes = 4;
  // Requests longer than this are cut into slices of this size, spread over the lanes.
  // Default 1 MiB, at least 4 KiB (EngineOptions::ucx_slice_bytes).
  uint64_t slice_bytes = 1ull << 20;
  // GPU memory this engine sends or fetches goes through pinned host bounce buffers even when
  // UCX moves CUDA memory (KVFERRY_UCX_GPU=bounce): where UCX would stage it through host
  // memory itself (no transport that reaches the peer's GPU memory directly), kvferry's
  // pipelined bounce buffers are faster (docs/perf/ucx.md). Its own GPU regions are still
  // mapped with UCX, so that peers may reach them directly.
  bool gpu_bounce = false;
  // How long each worker's progress thread polls after its last work before it sleeps on
  // UCX's event fd (KVFERRY_UCX_SPIN_US). Default 0: on a loaded machine the polling threads
  // (one per lane, on both sides) took the cores the transfer needed (docs/perf/ucx.md).
  std::chrono::microseconds idle_spin{0};
  // Rows of at least this many bytes between host memory go as UCX active messages with
  // rendezvous instead of put / get (KVFERRY_UCX_AM_THRESHOLD; 0: never). Where UCX emulates
  // put and get in software (tcp) that saves the sender's copy in user space, and the target
  // checks each request against its registered memory (docs/perf/ucx.md); with RDMA one-sided
  // put and get leave the target's CPU out. Unset: 128 KiB on hosts without RDMA devices
  // (/sys/class/infiniband empty or absent: UCX reaches other nodes over tcp only), else 0.
  std::optional<uint64_t> am_threshold_bytes;
  // WRITE rows of such active messages up to this many bytes go eager: the bytes with the
  // request, no rendezvous handshake (KVFERRY_UCX_AM_EAGER; 0: never). Over tcp a row that fits
  // one receive segment (kvferry's UCX_TCP_RX_SEG_SIZE default, 512K) then costs two messages
  // instead of four, and the target copies it out of the segment as it does a rendezvous's
  // fragments; with RDMA eager would copy where a rendezvous does not. Unset: 256 KiB on hosts
  // without RDMA devices, else 0.
  std::optional<uint64_t> am_eager_bytes;
};

// Whether this build has the UCX transport.
bool UcxBuilt();

// Starts UCX and registers with `registry` (not owned; it outlives the transport) as its
// region observer. Errors: kInvalidArgument (lanes or slice_bytes out of range),
// kUnimplemented (built without UCX), kUnavailable (UCX could not start: its reason).
StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options,
                                                        MemoryRegistry* registry);

}  // namespace kvferry
