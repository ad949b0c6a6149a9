// The NVLink transport: GPU memory to GPU memory of engines on one node. It serves file
// descriptors of this engine's cuMem allocations to local peers (an abstract Unix socket named
// in the descriptor's ipc_socket) and opens one NVLink channel (nvlink_channel.h) per peer and
// local GPU. No CUDA types here: without CUDA or a device, Create reports why.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/memory_registry.h"
#include "transport/nvlink/fd_passing.h"
#include "transport/transport.h"

namespace kvferry {

struct NvlinkTransportOptions {
  // Part of the fd socket's name, which also carries the pid and a random number.
  uint16_t listen_port = 0;
  // See NvlinkChannelOptions.
  uint64_t copy_engine_threshold_bytes = 0;
  uint64_t copy_engine_min_row_bytes = 64 << 10;
  int resident_blocks = -1;
  int64_t resident_min_tiles = 2048;
  bool high_priority_streams = true;
  int copy_blocks_per_sm = 1;
  // The shared secret a peer proves before the fd socket sends it anything, and which this side
  // proves when it asks a peer's socket (fd_passing.h); empty: none.
  std::string auth_secret;
};

class NvlinkTransport : public Transport {
 public:
  // `registry` (not owned) outlives the transport. Errors: kUnimplemented (no CUDA in this
  // build), kFailedPrecondition (no device), kUnavailable (the fd socket).
  static StatusOr<std::unique_ptr<NvlinkTransport>> Create(const NvlinkTransportOptions& options,
                                                           MemoryRegistry* registry);

  const TransportCapabilities& capabilities() const override { return capabilities_; }
  void Describe(SegmentDescriptor* self) const override;
  // Reaches a peer that offers NVLink (the engine checks it is on this node).
  bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const override;
  StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) override;

 private:
  explicit NvlinkTransport(const NvlinkTransportOptions& options);

  NvlinkTransportOptions options_;
  TransportCapabilities capabilities_;
  std::unique_ptr<FdServer> fd_server_;
};

}  // namespace kvferry
